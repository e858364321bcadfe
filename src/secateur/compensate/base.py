"""Common interface of the post-pruning compensators.

A compensator repairs a residual-writing projection (``o_proj`` / ``down_proj``, weight ``W0`` of shape
``[out, in]``) after structured column pruning. It is a pure function of

* ``w0``     the dense weight ``[d_out, d_in]`` (never modified),
* ``stats``  :class:`InputStats` of the projection's calibration inputs: ``C = E[x x^T]``
             (``[d_in, d_in]``, float64), ``mu = E[x]`` and the token count ``n`` - build it with
             :meth:`InputStats.from_gram` from a :class:`secateur.calib.stats.Gram`,
* ``kept``   the kept input-column indices ``K`` (any order; the new weight's columns follow it,
             so slice the producer rows in the same order - sorted ascending is recommended),
* ``bias``   the existing output bias ``[d_out]`` or ``None``,
* options (keyword arguments specific to each method),

and returns a :class:`Compensation`: the new weight ``[d_out, |K|]``, an optional new (full, not
delta) bias ``[d_out]`` (``None`` = leave the bias as it is) and a diagnostics dict.

Every diagnostics dict has ``recon_before`` / ``recon_after``: the relative calibration reconstruction
error of slice-only pruning and of the compensated layer,

    err(W~, b~) = E||W0 x + b - W~ x_K - b~||^2 / E||W0 x||^2
                = [tr(D C D^T) - 2 db^T D mu + ||db||^2] / tr(W0 C W0^T),

with ``D = W0 - W~ P_K`` (W~ scattered back into the kept columns) and ``db = b~ - b``, computed from
the statistics only (no stored tokens; COEC Eq. in Sec. 3.1 extended with the bias term).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from secateur.calib.stats import Gram
from secateur.errors import SecateurError
from secateur.linalg import det_sum

__all__ = ["InputStats", "Compensation", "Compensator", "as_stats", "as_index", "pruned_index",
           "recon_error", "relative_recon_error", "output_energy", "slice_only", "ReconError"]


@dataclass(frozen=True)
class InputStats:
    """Calibration statistics of a projection's inputs.

    second_moment: ``C = E[x x^T]`` (``[d, d]``, float64, uncentered).
    mean: ``mu = E[x]`` (``[d]``) or None when unknown (then bias-aware methods refuse).
    n: number of calibration tokens behind the averages (CORP's shrinkage rule needs it).
    """

    second_moment: torch.Tensor
    mean: torch.Tensor | None = None
    n: int = 0

    def __post_init__(self) -> None:
        c = self.second_moment
        if c.dim() != 2 or c.shape[0] != c.shape[1]:
            raise SecateurError(f"second moment must be square [d, d], got {tuple(c.shape)}")
        if self.mean is not None and self.mean.shape != (c.shape[0],):
            raise SecateurError(f"mean must be [{c.shape[0]}], got {tuple(self.mean.shape)}")

    @classmethod
    def from_gram(cls, g: Gram) -> InputStats:
        if g.n <= 0:
            raise SecateurError("the Gram accumulator saw no tokens")
        return cls(second_moment=g.second_moment, mean=g.mean, n=int(g.n))

    @classmethod
    def from_samples(cls, x: torch.Tensor) -> InputStats:
        """Reference constructor from raw samples ``x[..., d]`` (tests and small experiments)."""
        x = x.reshape(-1, x.shape[-1]).to(torch.float64)
        return cls(second_moment=x.T @ x / x.shape[0], mean=x.mean(0), n=x.shape[0])

    @property
    def dim(self) -> int:
        return self.second_moment.shape[0]

    @property
    def cov(self) -> torch.Tensor:
        """Population covariance ``C - mu mu^T``."""
        if self.mean is None:
            raise SecateurError("the covariance needs the input mean; build InputStats with mean=")
        mu = self.mean.to(self.second_moment)
        return self.second_moment - torch.outer(mu, mu)

    def to(self, device: torch.device | str, dtype: torch.dtype = torch.float64) -> InputStats:
        return InputStats(self.second_moment.to(device, dtype),
                          None if self.mean is None else self.mean.to(device, dtype), self.n)


def as_stats(stats: InputStats | Gram) -> InputStats:
    if isinstance(stats, InputStats):
        return stats
    if isinstance(stats, Gram):
        return InputStats.from_gram(stats)
    raise SecateurError(f"expected InputStats or Gram statistics, got {type(stats).__name__}")


@dataclass
class Compensation:
    """Result of a compensator.

    weight: new weight ``[d_out, |K|]`` (columns in the order of ``kept``), in ``w0``'s dtype.
    bias: new full output bias ``[d_out]`` or None (keep the existing bias, possibly none).
    kept: the kept indices (LongTensor, as given).
    diagnostics: at least ``method``, ``recon_before``, ``recon_after``; method-specific extras.
    """

    weight: torch.Tensor
    bias: torch.Tensor | None
    kept: torch.Tensor
    diagnostics: dict[str, Any] = field(default_factory=dict)
    #: the error evaluator of this projection (``W0 C`` formed once): callers score variants with it (the
    #: weights as cast to the model dtype, the no-worse guard), then drop it with the rest of the solve
    recon: ReconError | None = field(default=None, repr=False, compare=False)


class Compensator(Protocol):
    def __call__(self, w0: torch.Tensor, stats: InputStats | Gram, kept: torch.Tensor | Sequence[int], *,
                 bias: torch.Tensor | None = None, **options: Any) -> Compensation: ...


def as_index(kept: torch.Tensor | Sequence[int], d_in: int, device: torch.device | str | None = None
             ) -> torch.Tensor:
    """Validate ``kept`` (unique, in range) and return it as a LongTensor (order preserved)."""
    k = torch.as_tensor(kept, dtype=torch.long).flatten()
    if k.numel() and (int(k.min()) < 0 or int(k.max()) >= d_in):
        raise SecateurError(f"kept indices must lie in [0, {d_in}), got [{int(k.min())}, {int(k.max())}]")
    if torch.unique(k).numel() != k.numel():
        raise SecateurError("kept indices must be unique")
    return k.to(device) if device is not None else k


def pruned_index(kept: torch.Tensor, d_in: int) -> torch.Tensor:
    """Complement of ``kept`` in ``range(d_in)``, ascending."""
    mask = torch.ones(d_in, dtype=torch.bool, device=kept.device)
    mask[kept] = False
    return mask.nonzero().flatten()


def check_shapes(w0: torch.Tensor, stats: InputStats, bias: torch.Tensor | None) -> None:
    if w0.dim() != 2:
        raise SecateurError(f"weight must be [out, in], got {tuple(w0.shape)}")
    if stats.dim != w0.shape[1]:
        raise SecateurError(f"statistics are for {stats.dim} inputs but the weight has {w0.shape[1]}")
    if bias is not None and bias.shape != (w0.shape[0],):
        raise SecateurError(f"bias must be [{w0.shape[0]}], got {tuple(bias.shape)}")
    if not bool(torch.isfinite(w0).all()):
        raise SecateurError("the weight contains NaN/Inf")
    if not bool(torch.isfinite(stats.second_moment).all()):
        raise SecateurError("the input second moment contains NaN/Inf")


def output_energy(w0: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``tr(W0 C W0^T)`` = E||W0 x||^2 (``||Y||^2`` of COEC up to the token count), summed in a fixed order."""
    return det_sum((w0 @ c) * w0)


class ReconError:
    """The calibration error of candidate weights for one projection, from its statistics (float64):

        err(W~, db) = E||W0 x + b - W~ x_K - b~||^2
                    = Y - 2 <W~, (W0 C)[:, K]> + <W~ C_KK, W~> - 2 db^T (W0 mu - W~ mu_K) + ||db||^2,
        Y = tr(W0 C W0^T) = <W0 C, W0>,

    the expansion of ``tr(D C D^T) - 2 db^T D mu + ||db||^2`` with ``D = W0 - W~ P_K`` (module docstring).
    ``W0 C`` (one ``d_out x d x d`` product) is formed once and shared by every candidate, each of which then
    costs one ``d_out x k x k`` product; the direct form costs ``d_out x d x d`` per candidate, plus as much
    again for ``Y`` (at 7B widths the direct form took 146 of 271 s of a 2-block Wanda-sp + LS prune,
    cProfile; results/speed/scale.md). The slice-only
    error is taken directly from the pruned columns: ``tr(W0_P C_PP W0_P^T)``.
    Rounding: each inner product is a sum of float64 products in :func:`secateur.linalg.det_sum`'s fixed order
    (the result does not depend on the thread count); the expansion cancels terms of size <= about ``Y`` when
    ``W~`` is a reconstruction, so the relative error carries an absolute rounding error of a few ``d eps``
    (``eps`` = 2.2e-16), far below any difference a decision (the no-worse guard) is made on.
    """

    def __init__(self, w0: torch.Tensor, stats: InputStats) -> None:
        self.c = stats.second_moment.to(w0.device, torch.float64)
        self.mean = None if stats.mean is None else stats.mean.to(w0.device, torch.float64)
        self.w = w0.to(torch.float64)
        self.w0c = self.w @ self.c  # W0 C: [d_out, d]
        self.energy = float(det_sum(self.w0c * self.w))

    def before(self, kept: torch.Tensor) -> float:
        """Relative error of the plain slice ``W~ = W0[:, K]`` (bias unchanged): ``tr(W0_P C_PP W0_P^T) / Y``."""
        p = pruned_index(kept, self.w.shape[1])
        if p.numel() == 0:
            return 0.0
        wp = self.w[:, p]
        return self._relative(float(det_sum((wp @ self.c[p[:, None], p]) * wp)))

    def error(self, kept: torch.Tensor, w_new: torch.Tensor, bias_delta: torch.Tensor | None = None) -> float:
        """``err(W~, db)`` (class docstring), clamped at 0 (the expansion may round a zero error below it)."""
        wn = w_new.to(self.w.device, torch.float64)
        err = (self.energy - 2 * float(det_sum(wn * self.w0c[:, kept]))
               + float(det_sum((wn @ self.c[kept[:, None], kept]) * wn)))
        if bias_delta is not None:
            if self.mean is None:
                raise SecateurError("a bias change needs the input mean in the statistics")
            db = bias_delta.to(self.w.device, torch.float64)
            dmu = self.w @ self.mean - wn @ self.mean[kept]
            err += float(db @ db - 2 * (db @ dmu))
        return max(err, 0.0)

    def relative(self, kept: torch.Tensor, w_new: torch.Tensor, bias_delta: torch.Tensor | None = None) -> float:
        """:meth:`error` divided by ``Y`` (the error itself when ``Y`` is 0)."""
        return self._relative(self.error(kept, w_new, bias_delta))

    def _relative(self, err: float) -> float:
        return err / self.energy if self.energy > 0 else err


def recon_error(w0: torch.Tensor, stats: InputStats, kept: torch.Tensor, w_new: torch.Tensor,
                bias_delta: torch.Tensor | None = None) -> float:
    """Per-token calibration error ``E||W0 x - W~ x_K - db||^2`` from the statistics (float64):
    ``tr(D C D^T) - 2 db^T D mu + ||db||^2`` with ``D = W0 - W~ P_K`` (:class:`ReconError`)."""
    return ReconError(w0, stats).error(torch.as_tensor(kept, dtype=torch.long), w_new, bias_delta)


def relative_recon_error(w0: torch.Tensor, stats: InputStats, kept: torch.Tensor, w_new: torch.Tensor,
                         bias_delta: torch.Tensor | None = None) -> float:
    """:func:`recon_error` divided by ``tr(W0 C W0^T)`` (0 if the output energy is 0)."""
    return ReconError(w0, stats).relative(torch.as_tensor(kept, dtype=torch.long), w_new, bias_delta)


def bias_delta(old: torch.Tensor | None, new: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor | None:
    if new is None:
        return None
    old64 = torch.zeros_like(new, dtype=torch.float64) if old is None else old.to(torch.float64)
    return new.to(torch.float64) - old64.to(new.device)


def finish(w0: torch.Tensor, stats: InputStats, kept: torch.Tensor, w_new: torch.Tensor,
           new_bias: torch.Tensor | None, old_bias: torch.Tensor | None, diagnostics: dict[str, Any],
           recon: ReconError | None = None) -> Compensation:
    """Fill the common diagnostics and cast the results to the model dtype. ``recon``: the projection's
    :class:`ReconError` when the compensator formed it already; it travels with the result."""
    recon = ReconError(w0, stats) if recon is None else recon
    diagnostics.setdefault("recon_before", recon.before(kept))
    diagnostics["recon_after"] = recon.relative(kept, w_new, bias_delta(old_bias, new_bias, w0))
    out_bias = None if new_bias is None else new_bias.to(w0.dtype)
    return Compensation(weight=w_new.to(w0.dtype), bias=out_bias, kept=kept, diagnostics=diagnostics, recon=recon)


def prepare(w0: torch.Tensor, stats: InputStats | Gram, kept: torch.Tensor | Sequence[int],
            bias: torch.Tensor | None) -> tuple[InputStats, torch.Tensor]:
    st = as_stats(stats).to(w0.device)
    check_shapes(w0, st, bias)
    k = as_index(kept, w0.shape[1], w0.device)
    if k.numel() == 0:
        raise SecateurError("cannot compensate with an empty kept set")
    return st, k


def slice_only(w0: torch.Tensor, stats: InputStats | Gram, kept: torch.Tensor | Sequence[int], *,
               bias: torch.Tensor | None = None) -> Compensation:
    """No compensation: ``W~ = W0[:, K]``, bias unchanged (Wanda-sp / CoCurve default)."""
    st, k = prepare(w0, stats, kept, bias)
    return finish(w0, st, k, w0[:, k].to(torch.float64), None, bias, {"method": "none"})
