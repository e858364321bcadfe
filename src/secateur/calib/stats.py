"""Streaming statistics accumulators.

Every accumulator consumes activation chunks shaped ``[B, T, d]`` (B sequences of T tokens) and keeps
its state in float64 (or float32 where memory demands), so results are independent of the chunking
(batch-size invariant) and token-by-token matrices are never stored. Each chunk is reduced where it lives
(the engine's compute device) and only the reduced ``d`` or ``d x d`` result is moved to the state, which
stays on the CPU: a CUDA capture never mixes devices and the statistics outlive the block's visit.
Accumulators are mergeable (``merge``), which is what multi-process capture relies on: a run over several
processes (:mod:`secateur.calib.dist`) updates a :meth:`~Accumulator.fresh` accumulator with one chunk on the
chunk's rank, sends its :meth:`~Accumulator.state` to every rank and merges it there in chunk order. For every
accumulator ``a.update(x)`` and ``a.merge(fresh-updated-with-x)`` perform the same floating-point operations
(``0 + c = c`` exactly), so the merged state is bit for bit the single-process one.
"""

from __future__ import annotations

import torch

from secateur.errors import SecateurError


def check_finite(x: torch.Tensor, where: str) -> None:
    # a sum is finite only if every term is (an overflowing sum of finite terms falls through to the full
    # test): one reduction instead of a bool tensor the size of x, ~25x cheaper on a CPU
    if not torch.isfinite(x.sum()) and not torch.isfinite(x).all():
        raise SecateurError(f"non-finite (NaN/Inf) activations reached {where}; check the model and dtype")


class Accumulator:
    """Base class: ``update(x[B,T,d])`` then read the finalized properties."""

    name = "base"
    STATE: tuple[str, ...] = ()  # the fields an update changes: what one chunk's contribution carries between ranks

    def update(self, x: torch.Tensor) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def merge(self, other: Accumulator) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def fresh(self) -> Accumulator:
        """An empty accumulator of the same kind and shape (one chunk's contribution is collected in it)."""
        raise NotImplementedError(f"{type(self).__name__} cannot be split over processes")

    def state(self) -> dict:
        """The fields :meth:`update` changes (tensors, numbers, lists of tensors), as they are now."""
        return {k: getattr(self, k) for k in self.STATE}

    def with_state(self, state: dict) -> Accumulator:
        """A :meth:`fresh` accumulator holding ``state`` (another process's contribution, to :meth:`merge`)."""
        acc = self.fresh()
        acc.__dict__.update(state)
        return acc


class SumSq(Accumulator):
    """Per-feature energy. ``sumsq[j] = sum_t x_tj^2``; ``seq_mean_sumsq`` = mean over sequences of the
    per-sequence energy (Wanda's ||X_j||^2 with a scale that does not grow with the sample count).

    As in :class:`Gram`, each chunk's sum is computed in ``compute_dtype`` (float32 by default: casting a
    ``[B, T, 1536]`` chunk to float64 costs as much as the layer's matmul on a CPU; torch's reduction is
    pairwise, so the chunk's relative error stays ~1e-7) and added to the float64 state."""

    name = "sumsq"
    STATE = ("sumsq", "n_tokens", "n_seqs")

    def __init__(self, d: int, dtype: torch.dtype = torch.float64,
                 compute_dtype: torch.dtype = torch.float32) -> None:
        self.sumsq = torch.zeros(d, dtype=dtype)
        self.n_tokens = 0
        self.n_seqs = 0
        self.compute_dtype = compute_dtype

    def update(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-2], x.shape[-1]) if x.dim() == 3 else x.reshape(1, -1, x.shape[-1])
        xf = x.to(self.compute_dtype)
        self.sumsq += (xf * xf).sum(dim=(0, 1)).to(self.sumsq.device, self.sumsq.dtype)
        self.n_tokens += x.shape[0] * x.shape[1]
        self.n_seqs += x.shape[0]

    def fresh(self) -> SumSq:
        return SumSq(self.sumsq.shape[0], self.sumsq.dtype, self.compute_dtype)

    def merge(self, other: SumSq) -> None:
        self.sumsq += other.sumsq
        self.n_tokens += other.n_tokens
        self.n_seqs += other.n_seqs

    @property
    def seq_mean_sumsq(self) -> torch.Tensor:
        return self.sumsq / max(self.n_seqs, 1)

    @property
    def norm(self) -> torch.Tensor:
        """||X_j||_2 over all calibration tokens."""
        return self.sumsq.sqrt()


class MeanVar(Accumulator):
    """Per-feature mean and population variance over tokens (Chan/Welford merge, float64)."""

    name = "meanvar"
    STATE = ("n", "mean_", "m2")

    def __init__(self, d: int) -> None:
        self.n = 0
        self.mean_ = torch.zeros(d, dtype=torch.float64)
        self.m2 = torch.zeros(d, dtype=torch.float64)

    def update(self, x: torch.Tensor) -> None:
        xf = x.reshape(-1, x.shape[-1]).to(torch.float64)
        nb = xf.shape[0]
        if nb == 0:
            return
        mb = xf.mean(0)
        m2b = ((xf - mb) ** 2).sum(0)
        self._combine(nb, mb.to(self.mean_.device), m2b.to(self.m2.device))

    def _combine(self, nb: int, mb: torch.Tensor, m2b: torch.Tensor) -> None:
        n = self.n + nb
        delta = mb - self.mean_
        self.mean_ = self.mean_ + delta * (nb / n)
        self.m2 = self.m2 + m2b + delta**2 * (self.n * nb / n)
        self.n = n

    def fresh(self) -> MeanVar:
        return MeanVar(self.mean_.shape[0])

    def merge(self, other: MeanVar) -> None:
        if other.n:
            self._combine(other.n, other.mean_, other.m2)

    @property
    def mean(self) -> torch.Tensor:
        return self.mean_

    @property
    def var(self) -> torch.Tensor:
        """Population variance (divide by n)."""
        return self.m2 / max(self.n, 1)


GRAM_STRIPS = 4  # block rows of the upper-triangle Gram: (k + 1) / 2k of the full product's arithmetic (62.5%)
GRAM_MIN_WIDTH = 512  # below this width the full product is as fast (small GEMMs run below the machine's rate)


def gram(x: torch.Tensor) -> torch.Tensor:
    """``x^T x`` for ``x [n, d]``, computing only the block upper triangle (``GRAM_STRIPS`` strips of rows, each
    one GEMM ``x[:, strip]^T x[:, strip start:]``) and mirroring it: 1.5x faster than the full product at d = 4864.
    Each entry is the same dot product over the same tokens as in the full GEMM, so on the BLAS we ship it is the
    full product bit for bit (tested, with the full product's own symmetry); where a BLAS sums a sub-block in another
    order the entries move by float32 rounding of one chunk, which the float64 state absorbs as it does any chunk."""
    d = x.shape[1]
    if d < GRAM_MIN_WIDTH:
        return x.T @ x
    b = -(-d // GRAM_STRIPS)
    out = torch.empty(d, d, dtype=x.dtype, device=x.device)
    for i in range(0, d, b):
        out[i:i + b, i:] = x[:, i:i + b].T @ x[:, i:]
        out[i + b:, i:i + b] = out[i:i + b, i + b:].T  # the mirror: an exact copy
    return out


class Gram(Accumulator):
    """Uncentered Gram ``G = sum_t x_t x_t^T`` (d x d) plus the feature sum, so the mean and covariance
    are available too.

    The state is float64. Each chunk's product is computed in ``compute_dtype`` (float32 by default:
    a float64 GEMM over every calibration token costs as much as the dense forward itself on a CPU)
    and added to the float64 state, so rounding error grows with the chunk size, not the sample count.
    """

    name = "gram"
    STATE = ("G", "s", "n")

    def __init__(self, d: int, dtype: torch.dtype = torch.float64,
                 compute_dtype: torch.dtype = torch.float32) -> None:
        self.G = torch.zeros(d, d, dtype=dtype)
        self.s = torch.zeros(d, dtype=torch.float64)
        self.n = 0
        self.compute_dtype = compute_dtype

    def update(self, x: torch.Tensor) -> None:
        xf = x.reshape(-1, x.shape[-1]).to(self.compute_dtype)
        self.G += gram(xf).to(self.G.device, self.G.dtype)
        self.s += xf.sum(0).to(self.s.device, torch.float64)  # float32 chunk sum, float64 state (cheap cast)
        self.n += xf.shape[0]

    def fresh(self) -> Gram:
        return Gram(self.G.shape[0], self.G.dtype, self.compute_dtype)

    def merge(self, other: Gram) -> None:
        self.G += other.G
        self.s += other.s
        self.n += other.n

    @property
    def mean(self) -> torch.Tensor:
        return self.s / max(self.n, 1)

    @property
    def second_moment(self) -> torch.Tensor:
        """E[x x^T] (float64)."""
        return self.G.to(torch.float64) / max(self.n, 1)

    @property
    def cov(self) -> torch.Tensor:
        mu = self.mean
        return self.second_moment - torch.outer(mu, mu)


class BlockInfluence(Accumulator):
    """ShortGPT block influence ``BI = 1 - E_{x,t}[cos(x_in, x_out)]`` (baselines.md §8).

    Unlike the single-input accumulators, ``update`` takes the block's input AND output ``[B, T, d]``.
    Cosines are computed per token in float64; a zero-norm token counts as cos = 1 (no change).
    ``BI`` lies in [0, 2]; an identity block gives 0 (baselines.md B7).
    """

    name = "block_influence"
    STATE = ("sum_cos", "n")

    def __init__(self) -> None:
        self.sum_cos = 0.0
        self.n = 0

    def update(self, x_in: torch.Tensor, x_out: torch.Tensor | None = None) -> None:  # type: ignore[override]
        if x_out is None:
            raise TypeError("BlockInfluence.update needs (block input, block output)")
        a = x_in.reshape(-1, x_in.shape[-1]).to(torch.float64)
        b = x_out.reshape(-1, x_out.shape[-1]).to(torch.float64)
        na, nb = a.norm(dim=1), b.norm(dim=1)
        denom = na * nb
        cos = torch.where(denom > 0, (a * b).sum(1) / denom.clamp_min(1e-300), torch.ones_like(denom))
        self.sum_cos += float(cos.clamp(-1, 1).sum())
        self.n += a.shape[0]

    def fresh(self) -> BlockInfluence:
        return BlockInfluence()

    def merge(self, other: BlockInfluence) -> None:
        self.sum_cos += other.sum_cos
        self.n += other.n

    @property
    def bi(self) -> float:
        return 1.0 - self.sum_cos / max(self.n, 1)


class PerSampleGram(Accumulator):
    """Per-sample (per-sequence) Gram matrices of per-head activations, for CORP's exact Q/K system.

    ``update(x)`` takes ``x[B, T, n_heads * head_dim]`` (heads concatenated, Hugging Face layout; with
    ``n_heads=1`` it is one head's ``[B, T, d]``) and appends, for every sequence b of the chunk,
    ``X_{b,h}^T X_{b,h}`` (``head_dim x head_dim``) per head plus the per-sequence feature sum and token
    count. Each sequence must arrive whole in one update (a sample is one sequence); state is float64
    by default. Memory: ``n_seqs * n_heads * head_dim^2`` floats.
    """

    name = "per_sample_gram"
    STATE = ("_grams", "_sums", "_counts")

    def __init__(self, head_dim: int, n_heads: int = 1, dtype: torch.dtype = torch.float64) -> None:
        self.head_dim = head_dim
        self.n_heads = n_heads
        self.dtype = dtype
        self._grams: list[torch.Tensor] = []
        self._sums: list[torch.Tensor] = []
        self._counts: list[torch.Tensor] = []

    def update(self, x: torch.Tensor) -> None:
        if x.dim() == 2:
            x = x[None]
        if x.dim() != 3 or x.shape[-1] != self.n_heads * self.head_dim:
            raise SecateurError(f"PerSampleGram expects [B, T, {self.n_heads * self.head_dim}], got {tuple(x.shape)}")
        b, t, _ = x.shape
        xf = x.detach().to(self.dtype).reshape(b, t, self.n_heads, self.head_dim)
        self._grams.append(torch.einsum("bthi,bthj->bhij", xf, xf).cpu())
        self._sums.append(xf.sum(1).to(torch.float64).cpu())
        self._counts.append(torch.full((b,), t, dtype=torch.long))

    def fresh(self) -> PerSampleGram:
        return PerSampleGram(self.head_dim, self.n_heads, self.dtype)

    def merge(self, other: PerSampleGram) -> None:
        if (other.head_dim, other.n_heads) != (self.head_dim, self.n_heads):
            raise SecateurError("cannot merge PerSampleGram accumulators of different shapes")
        self._grams += other._grams
        self._sums += other._sums
        self._counts += other._counts

    def _cat(self, parts: list[torch.Tensor], shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.cat(parts) if parts else torch.zeros((0, *shape), dtype=dtype)

    @property
    def grams(self) -> torch.Tensor:
        """``[n_seqs, n_heads, head_dim, head_dim]``."""
        return self._cat(self._grams, (self.n_heads, self.head_dim, self.head_dim), self.dtype)

    @property
    def sums(self) -> torch.Tensor:
        """Per-sequence feature sums ``[n_seqs, n_heads, head_dim]`` (float64)."""
        return self._cat(self._sums, (self.n_heads, self.head_dim), torch.float64)

    @property
    def counts(self) -> torch.Tensor:
        return self._cat(self._counts, (), torch.long)

    @property
    def n_seqs(self) -> int:
        return int(self.counts.numel())

    @property
    def n_tokens(self) -> int:
        return int(self.counts.sum())

    def head(self, h: int) -> torch.Tensor:
        """Per-sample Grams of head h, ``[n_seqs, head_dim, head_dim]`` (float64)."""
        return self.grams[:, h].to(torch.float64)

    def mean(self, h: int) -> torch.Tensor:
        return self.sums[:, h].sum(0) / max(self.n_tokens, 1)


class InputChunks(Accumulator):
    """Keeps references to the input chunks of a group (QK-Wanda's progressive re-scoring re-reads them)."""

    name = "inputs"

    def __init__(self) -> None:
        self.chunks: list[torch.Tensor] = []

    def update(self, x: torch.Tensor) -> None:
        self.chunks.append(x.detach())

    def merge(self, other: Accumulator) -> None:
        self.chunks += other.chunks


ACCUMULATORS: dict[str, type[Accumulator]] = {"sumsq": SumSq, "meanvar": MeanVar, "gram": Gram}


def make_accumulators(kinds: set[str] | list[str], d: int) -> dict[str, Accumulator]:
    return {k: ACCUMULATORS[k](d) for k in kinds}


def update_all(accs: dict[str, Accumulator], x: torch.Tensor, where: str) -> None:
    check_finite(x, where)
    for a in accs.values():
        a.update(x)
