"""CoCurve single-unit ablation sweep and finite-ablation Fisher-Gram features (cocurve.md §3, §7-8).

For every unit ``u`` (a KV group or an FFN channel group, see :mod:`secateur.structured.units`) the
sweep computes the logits with only ``u`` removed (its ``o_proj`` / ``down_proj`` input columns zeroed,
no bias fix) at ``P`` sampled positions, and turns them into Fisher features on the dense model's top-r
support ``V_r(x,t)``, shared by all units (the paper's Proposition 3 coordinate system):

    dz_u   = z_0 - z_{-u}                          (restricted to V_r)
    p~_k   = p_0,k / sum_{k' in V_r} p_0,k'        (cocurve.md [A2]; renormalize=False keeps p_0,k)
    mu_u   = sum_k p~_k dz_u,k                     (teacher-weighted centering, [A3])
    phi_u  = sqrt(p~) * (dz_u - mu_u)              =>  phi_u^T phi_v = dz_u^T F~ dz_v
    H      = (1/P) sum_{positions} Phi^T Phi       (M x M, PSD by construction; paper "Gram estimator")

With ``r = |vocab|`` and renormalization, ``phi_u^T phi_v`` equals the exact categorical Fisher form
``dz_u^T (diag p - p p^T) dz_v`` (invariant V3). Only ``center='fisher'`` (the reading above) and
``center='none'`` (raw ``sqrt(p~) dz``, an ablation that is *not* a Fisher form) are implemented: the
spec's ``center=positions`` would average features living on different per-position supports, which
has no coordinate meaning, so it is omitted (noted for the lead).

Cost structure (cocurve.md §8 "cheap trick", made sharper):

* one dense pass per block of sequences caches the hidden state entering every layer;
* for layer ``l`` the dense staged intermediates are computed once (attention-core output ``a_l``, the
  mid-block residual ``h_mid``, the MLP activation ``m_l``);
* an FFN group ablation is exactly ``h_{l+1} - m_l[:, ch] W_down[:, ch]^T``; an attention unit ablation is
  ``h_{l+1} - y + (MLP(h_mid - y) - MLP(h_mid))`` with ``y = a_l[:, cols] W_o[:, cols]^T`` (the
  attention of layer ``l`` is not recomputed; the zero-unit case reproduces ``h_{l+1}`` bit for bit);
* only layers ``l+1 .. L-1`` are re-run (full sequences: attention needs every earlier position),
  several ablations stacked along the batch dimension, and the LM head runs only at the ``P_tok``
  sampled positions of each sequence;
* what does not depend on the ablation (the teacher's ``p_0``, ``p~``, ``sqrt(p~)``) is computed once per
  block of sequences (:class:`_Teacher`).

Exactness (issue 18): ``H`` and the single-unit KLs are bit for bit those of the sweep as of 7c3384c, whose
frozen copy ``tests/cocurve_sweep_ref.py`` is the oracle of ``tests/test_cocurve_sweep_exact.py`` (every tiny
family, several unit kinds / positions / supports / batchings, ``torch.equal``). The argument: every ablated
forward runs the same floating-point operations, in the same order, on tensors of the same shapes as before
(the same stacking of ``unit_batch`` ablations, the same full-sequence re-runs, the same head rows); the
per-block quantities are the very operations the per-ablation code ran, applied to the same tensors, so
they hold the same values. Shapes are kept on purpose: a GEMM's row can depend on how many rows it is
computed with (MKL on CPU, 2 threads: ``H`` differs between ``unit_batch`` 1 and 8), so an optimisation
that changes a product's shape is only exact where the kernels happen to agree. Tried and dropped for that
reason: running the last block's output projection, residuals and MLP on the sampled rows only (saves about
0.6 of one re-run layer per ablation; on this MKL build a product of fewer than 4 rows, or fewer than 12
with 2 threads, rounds differently, which the one-row setting of the exact test catches). Not adopted:
one ``log_softmax`` over a group's stacked logits (bit-identical here, but ``unit_batch`` times the memory
of a ``[P, V]`` float64 block for no measurable gain).

Cost floor: the re-run of layers ``l+1 .. L-1`` over full sequences is about 90% of an ablation
(``results/speed/cocurve-sweep-cost.md``), so with exact re-runs one ablation costs at least the mean re-run
depth's share of the dense layers (SmolLM2-135M, quick preset: 14.5 of 30 layers, 0.40 dense forwards).

Positions (issue 45): every position of each window by default (``positions_per_seq=None``: the features of all
``T`` positions enter ``H``; the ablated forwards already compute every position, only the LM head, the KL and the
features grow with ``P``); or the paper's subsample ``t = s j - 1`` for ``j = 1..P_tok`` with ``s = T // P_tok``
(cocurve.md §9, ``16 j - 1`` for ``T = 2048, P_tok = 128``; every position when ``P_tok >= T``). A graph from a
subsample of 512 positions was measured too noisy for its edges (split-half Pearson 0.18 on SmolLM2, issue 45).
The top-r support comes from a stable descending sort of the dense log-probabilities (ties: smaller token id
first).

Blocks of ``seqs_per_block`` consecutive sequences are the unit of work and of reduction: in round ``k`` rank
``r`` runs block ``k W + r`` (``W`` processes), then the round's blocks are added to ``H`` in block order (each
block's Gram all-reduced alone, so it arrives unchanged), so the result does not depend on the number of
processes (:mod:`secateur.calib.dist`) and only one block's features and Gram are alive at a time: the sweep's
memory does not grow with the number of windows (:func:`memory_plan` states it, term by term, before the sweep).
``H^(0)`` / ``H^(1)``, the graphs of the even- and odd-numbered windows (the split-half diagnostic of
:mod:`secateur.scoring.cocurve_graph`), are summed beside ``H`` the same way (a one-window block's Gram is its
half's term as it is; a block of several windows adds one Gram per window, over row slices of its features).

Resume: with a checkpoint active (:func:`secateur.calib.resume.current`: ``secateur prune --resume``, or
the bench's graph stage), every finished block's Gram, KL sums, support mass (and its half Grams when it holds
several windows) are saved as one piece (``<stage>-block<b>.pt``, written atomically, with its positions per
window) and a resumed sweep loads the pieces it finds instead of recomputing them (a piece of another number of
positions, or one written before pieces recorded it, is recomputed). The reduction then adds the very float64
tensors an uninterrupted run would have added, in the same block order, so ``H`` is bit-identical
(``tests/test_cocurve_resume.py``: kill after a block, resume, compare ``H``'s sha256). Blocks are keyed by
index; the checkpoint's fingerprint (tokens, options, model) is what makes an index mean the same block.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Protocol

import torch
from torch import nn

from secateur.calib import dist, engine, resume
from secateur.errors import SecateurError
from secateur.models.adapters import Adapter
from secateur.models.memory import MemoryPlan
from secateur.structured.units import ATTN_KINDS, MLP_KINDS, Inventory

CENTERS = ("fisher", "none")


@dataclass(frozen=True)
class SweepConfig:
    """Knobs of the ablation sweep: every position of each window (``positions_per_seq=None``; the paper subsamples
    ``P_tok = 128``), the paper's support r = 256."""

    positions_per_seq: int | None = None  # None: every position; an int: the evenly spaced subsample
    top_r: int = 256
    renormalize: bool = True
    center: str = "fisher"
    unit_batch: int = 8  # ablations stacked along the batch dimension per re-run of the upper layers
    seqs_per_block: int = 1  # sequences per work/reduction block (fixes the summation order of H)
    progress: bool = False
    # a diagnostic, not part of H: also the split-half Grams of the evenly spaced ``subsample_check``-position
    # subsample of the positions swept, from the same features (how the graph's agreement grows with positions)
    subsample_check: int | None = None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class SweepResult:
    """``H`` over the whole inventory (rows/columns of units that were not ablated are zero)."""

    H: torch.Tensor  # [M, M] float64
    ablated: torch.Tensor  # [M] bool
    kl_single: torch.Tensor  # [M] float64: mean full-vocabulary KL(p_0 || p_{-u}) at the sampled positions
    n_positions: int
    support_mass: float  # mean over positions of sum_{k in V_r} p_0,k
    timings: dict = field(default_factory=dict)
    halves: tuple[torch.Tensor, torch.Tensor] | None = None  # H of the even / odd windows (None: < 2 windows)
    half_positions: tuple[int, int] = (0, 0)
    # ``SweepConfig.subsample_check``: the halves of the graph built from that subsample of the positions only
    sub_halves: tuple[torch.Tensor, torch.Tensor] | None = None
    sub_positions: int = 0  # positions per window of that subsample


# --- pure feature math ------------------------------------------------------------------------------


def sample_positions(seqlen: int, per_seq: int | None) -> torch.Tensor:
    """Evenly spaced positions ``s j - 1`` (``s = T // P_tok``), or all of them when ``P_tok >= T`` or ``None``."""
    if per_seq is None:
        return torch.arange(seqlen)
    if per_seq <= 0:
        raise SecateurError("positions_per_seq must be >= 1")
    if per_seq >= seqlen:
        return torch.arange(seqlen)
    s = seqlen // per_seq
    return torch.arange(1, per_seq + 1) * s - 1


def teacher_support(logits: torch.Tensor, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-r support of the dense distribution: ``(idx [..., r], p_0 on idx [..., r])`` (float64).

    Stable descending sort of the float32 log-probabilities: ties go to the smaller token id."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    r = min(r, logp.shape[-1])
    # a copy of the first r columns: a view would keep the whole [..., V] int64 sort alive
    idx = torch.sort(logp, dim=-1, descending=True, stable=True).indices[..., :r].contiguous()
    return idx, logp.gather(-1, idx).to(torch.float64).exp()


def fisher_features(dz: torch.Tensor, p: torch.Tensor, renormalize: bool = True,
                    center: str = "fisher") -> torch.Tensor:
    """``phi = sqrt(p~) (dz - sum_k p~_k dz_k)`` along the last axis (cocurve.md §3), float64.

    ``dz [..., r]`` logit responses on the support, ``p [..., r]`` dense probabilities there (broadcast
    over leading unit axes). ``phi_u . phi_v = dz_u^T (diag p~ - p~ p~^T) dz_v``."""
    if center not in CENTERS:
        raise SecateurError(f"center must be one of {CENTERS}, not {center!r}")
    p = support_weights(p, renormalize)
    return centered_features(dz, p, p.sqrt(), center)


def support_weights(p: torch.Tensor, renormalize: bool = True) -> torch.Tensor:
    """``p~`` (float64): the dense probabilities on the support, renormalized to sum 1 per position or not."""
    p = p.to(torch.float64)
    return p / p.sum(-1, keepdim=True) if renormalize else p


def centered_features(dz: torch.Tensor, p: torch.Tensor, sqrt_p: torch.Tensor, center: str) -> torch.Tensor:
    """The last two steps of :func:`fisher_features` with ``p~`` and ``sqrt(p~)`` given (the sweep computes them
    once per block of sequences instead of once per ablation: the same values, so the same features)."""
    dz = dz.to(torch.float64)
    if center == "fisher":
        dz = dz - (p * dz).sum(-1, keepdim=True)
    return sqrt_p * dz


def gram(phi: torch.Tensor) -> torch.Tensor:
    """``Phi^T Phi`` in float64 for ``phi [rows, units]``."""
    phi = phi.to(torch.float64)
    return phi.T @ phi


# --- unit bookkeeping --------------------------------------------------------------------------------


@dataclass(frozen=True)
class _UnitSpec:
    index: int  # inventory index
    layer: int
    attn: bool
    cols: torch.Tensor  # input columns of o_proj (attention) or down_proj (MLP) owned by the unit


def unit_specs(inv: Inventory, units: torch.Tensor | None = None) -> list[_UnitSpec]:
    """Column ownership of every unit to ablate (``units``: bool mask over the inventory; default all)."""
    out = []
    m = inv.head_dim
    for p in inv.pools:
        if p.kind == "block":
            raise SecateurError("CoCurve ablates KV groups / heads and FFN groups / channels, not whole blocks")
        for u in range(p.n):
            i = p.offset + u
            if units is not None and not bool(units[i]):
                continue
            mem = p.unit_members(u)
            if p.kind in ATTN_KINDS:
                cols = (mem[:, None] * m + torch.arange(m)).reshape(-1)
                out.append(_UnitSpec(i, p.layer, True, cols))
            elif p.kind in MLP_KINDS:
                out.append(_UnitSpec(i, p.layer, False, mem.clone()))
    return out


# --- the sweep ---------------------------------------------------------------------------------------


class _Walker:
    """Dense and ablated forwards of one block of sequences: the dense pass is the calibration engine's
    block walker (:class:`secateur.calib.engine.Walk`, kept on the device), the ablated re-runs of the upper
    layers go through the adapter's staged API."""

    def __init__(self, model: nn.Module, adapter: Adapter, kw: dict, positions: torch.Tensor) -> None:
        self.model, self.a, self.kw = model, adapter, kw
        self.pos = positions
        self.head = model.get_output_embeddings()

    def dense_inputs(self, ids: torch.Tensor) -> list[torch.Tensor]:
        """Hidden states entering every layer, plus the last layer's output (``L + 1`` tensors)."""
        walk = engine.Walk(self.a, ids, ids.shape[0], store=None, kwargs=self.kw)
        hs = list(walk.hs)
        for visit in walk.blocks():
            hs.append(visit.output(0))
        return hs

    def logits_at_positions(self, h: torch.Tensor) -> torch.Tensor:
        """float32 logits ``[B, P_tok, V]`` of the final hidden states at the sampled positions only."""
        return self.head(self.a.final_hidden(h[:, self.pos])).float()

    def run_from(self, start: int, h: torch.Tensor) -> torch.Tensor:
        return engine.run_blocks(self.a, h, self.kw, start)

    def layer_parts(self, li: int, h_in: torch.Tensor) -> dict:
        """Dense staged intermediates of layer ``li`` (computed once per block and layer)."""
        a, layer = self.a, self.a.layers[li]
        refs = a.role_refs(layer)
        att = a.attn_core(layer, a.attn_norm(layer, h_in), a.layer_kwargs(li, self.kw))
        o_out = a.out_module(layer, "attn_out")(att)
        h_mid = a.attn_residual(layer, h_in, o_out)
        mlp_act = a.mlp_core(layer, a.mlp_norm(layer, h_mid))
        return {"att": att, "h_in": h_in, "o_out": o_out, "h_mid": h_mid, "mlp_act": mlp_act,
                "mlp_out": a.out_module(layer, "mlp_out")(mlp_act),
                "w_o": refs["o"].weight, "w_down": refs["down"].weight, "layer": layer}

    def mlp(self, layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
        a = self.a
        return a.out_module(layer, "mlp_out")(a.mlp_core(layer, a.mlp_norm(layer, h)))

    def ablated_output(self, parts: dict, h_next: torch.Tensor, spec: _UnitSpec) -> torch.Tensor:
        """Output of layer ``spec.layer`` with only ``spec``'s columns removed (see module docstring)."""
        a, layer = self.a, parts["layer"]
        if spec.attn:
            y = parts["att"][..., spec.cols] @ parts["w_o"][:, spec.cols].T
            if a.plain_residual:
                return h_next - y + (self.mlp(layer, parts["h_mid"] - y) - parts["mlp_out"])
            h_mid = a.attn_residual(layer, parts["h_in"], parts["o_out"] - y)  # Gemma: post-norms, recompute
            return a.mlp_residual(layer, h_mid, self.mlp(layer, h_mid))
        y = parts["mlp_act"][..., spec.cols] @ parts["w_down"][:, spec.cols].T
        if a.plain_residual:
            return h_next - y
        return a.mlp_residual(layer, parts["h_mid"], parts["mlp_out"] - y)


@dataclass
class _Plan:
    """The units to ablate: their specs by layer, their column in ``Phi`` and the ablated mask."""

    M: int
    specs: list[_UnitSpec]
    ablated: torch.Tensor
    col_of: dict[int, int]
    by_layer: dict[int, list[_UnitSpec]]

    @classmethod
    def build(cls, inv: Inventory, units: torch.Tensor | None) -> _Plan:
        specs = unit_specs(inv, units)
        if not specs:
            raise SecateurError("no unit to ablate")
        ablated = torch.zeros(len(inv), dtype=torch.bool)
        ablated[[s.index for s in specs]] = True
        by_layer: dict[int, list[_UnitSpec]] = {}
        for s in specs:
            by_layer.setdefault(s.layer, []).append(s)
        return cls(len(inv), specs, ablated, {s.index: j for j, s in enumerate(specs)}, by_layer)

    @classmethod
    def of_units(cls, M: int, layer_of: torch.Tensor, units: torch.Tensor | None) -> _Plan:
        """The plan of a :func:`source_sweep`: units by index only (the source knows how to ablate them)."""
        idx = range(M) if units is None else torch.nonzero(units).flatten().tolist()
        specs = [_UnitSpec(int(i), int(layer_of[i]), False, torch.zeros(0, dtype=torch.long)) for i in idx]
        if not specs:
            raise SecateurError("no unit to ablate")
        ablated = torch.zeros(M, dtype=torch.bool)
        ablated[[s.index for s in specs]] = True
        by_layer: dict[int, list[_UnitSpec]] = {}
        for s in specs:
            by_layer.setdefault(s.layer, []).append(s)
        return cls(M, specs, ablated, {s.index: j for j, s in enumerate(specs)}, by_layer)


class _Teacher:
    """The dense logits of one block of sequences at the sampled positions and their top-r support.

    Everything that does not depend on the ablation is computed here once per block of sequences and reused by
    every ablation: ``p_0 = exp(log p_0)`` (the KL's weights), ``p~`` and ``sqrt(p~)`` (the features' weights).
    Each is the same operation on the same tensor as the per-ablation recomputation it replaces, so the features
    and KLs are bit for bit those of the earlier sweep (``tests/test_cocurve_sweep_exact.py``)."""

    def __init__(self, z0: torch.Tensor, cfg: SweepConfig) -> None:
        self.shape = z0.shape  # [B, P, V]
        self.center = cfg.center
        self.logp0 = torch.log_softmax(z0.double(), dim=-1)  # float64: KL of weak units is tiny
        self.p0 = self.logp0.exp()
        self.idx, self.p_sup = teacher_support(z0, cfg.top_r)
        self.z0_sup = z0.gather(-1, self.idx)
        self.p_tilde = support_weights(self.p_sup, cfg.renormalize)
        self.sqrt_p = self.p_tilde.sqrt()

    def response(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Fisher features (``[B, P, r]``) and full-vocabulary KL(p_0 || p_{-u}) sum of one ablation's logits."""
        dz = self.z0_sup - z.gather(-1, self.idx)
        f = centered_features(dz, self.p_tilde, self.sqrt_p, self.center)
        logq = torch.log_softmax(z.double(), dim=-1)
        # p0 * (log p0 - log q) computed in logq's buffer: the same elementwise operations (a product is
        # commutative in IEEE arithmetic), one [B, P, V] float64 transient fewer
        return f, torch.sub(self.logp0, logq, out=logq).mul_(self.p0).sum()


def _check_sweep(adapter: Adapter, ids: torch.Tensor, cfg: SweepConfig) -> None:
    if ids.dim() != 2:
        raise SecateurError(f"calibration ids must be [N, T], got {tuple(ids.shape)}")
    if cfg.top_r < 1 or cfg.unit_batch < 1 or cfg.seqs_per_block < 1:
        raise SecateurError("top_r, unit_batch and seqs_per_block must be >= 1")
    if cfg.center not in CENTERS:
        raise SecateurError(f"center must be one of {CENTERS}, not {cfg.center!r}")
    if cfg.subsample_check is not None and cfg.subsample_check < 1:
        raise SecateurError("subsample_check must be >= 1 (or None: no subsample diagnostic)")
    adapter.check_calibration_length(ids.shape[1])


def _ablate_layer(walker: _Walker, plan: _Plan, teacher: _Teacher, li: int, hs: list[torch.Tensor],
                  cfg: SweepConfig, phi: torch.Tensor, kl: torch.Tensor) -> int:
    """Every planned unit of layer ``li``, ``unit_batch`` ablations per re-run of the upper layers; fills their
    columns of ``phi`` and entries of ``kl``. Returns the number of ablations."""
    parts = walker.layer_parts(li, hs[li])
    todo = plan.by_layer[li]
    for c in range(0, len(todo), cfg.unit_batch):
        group = todo[c:c + cfg.unit_batch]
        h = torch.cat([walker.ablated_output(parts, hs[li + 1], sp) for sp in group])
        h = walker.run_from(li + 1, h)
        z = walker.logits_at_positions(h).view(len(group), *teacher.shape)
        for k, sp in enumerate(group):
            f, kl[sp.index] = teacher.response(z[k])
            phi[:, plan.col_of[sp.index]] = f.reshape(-1)
        del h, z, f  # freed before the next group's logits are computed (memory_plan counts one group's)
    return len(todo)


def subsample_index(pos: torch.Tensor, seqlen: int, cfg: SweepConfig) -> torch.Tensor | None:
    """Indices into the swept positions ``pos`` of ``cfg.subsample_check``'s evenly spaced subsample (None: no
    diagnostic asked, or it would be every swept position)."""
    if cfg.subsample_check is None:
        return None
    idx = torch.nonzero(torch.isin(pos.cpu(), sample_positions(seqlen, cfg.subsample_check))).flatten()
    return idx if 0 < idx.numel() < pos.numel() else None


def _window_grams(phi: torch.Tensor, n: int, first: int, n_specs: int, rows: torch.Tensor | None = None,
                  sizes: list[int] | None = None) -> list[torch.Tensor | None]:
    """The Grams of the even / odd windows of a block (``phi``'s rows are ``[window, position, support]``);
    ``rows``: only these rows of each window; ``sizes``: the rows of each window when they differ (a source sweep's
    windows score different numbers of positions; default: ``phi``'s rows split evenly). A parity with no window of
    the block is None."""
    if sizes is None:
        sizes = [phi.shape[0] // n] * n
    starts = [sum(sizes[:j]) for j in range(n)]
    parts = [torch.zeros(n_specs, n_specs, dtype=torch.float64) for _ in range(2)]
    for j in range(n):
        w = phi[starts[j]:starts[j] + sizes[j]]
        parts[(first + j) % 2] += gram(w if rows is None else w[rows])
    return [h if any((first + j) % 2 == k for j in range(n)) else None for k, h in enumerate(parts)]


def _sweep_block(walker: _Walker, plan: _Plan, x: torch.Tensor, cfg: SweepConfig, clock: dict[str, float],
                 first: int = 0, sub: torch.Tensor | None = None) -> dict:
    """One block of sequences (``first``: the index of its first window) -> its ``M x M`` Gram, per-unit KL sums,
    support mass sum and the Grams of its even / odd windows (``halves``; ``None`` for a one-window block: its Gram
    is its half's term); adds to ``clock``."""
    t0 = time.perf_counter()
    hs = walker.dense_inputs(x)
    teacher = _Teacher(walker.logits_at_positions(hs[-1]), cfg)
    clock["dense"] += time.perf_counter() - t0
    phi = torch.zeros(teacher.idx.numel(), len(plan.specs), dtype=torch.float64)
    kl = torch.zeros(plan.M, dtype=torch.float64)
    t1 = time.perf_counter()
    for li in sorted(plan.by_layer):
        clock["n_abl"] += _ablate_layer(walker, plan, teacher, li, hs, cfg, phi, kl)
    t2 = time.perf_counter()
    del hs
    piece = _piece(plan, phi, kl, teacher, x.shape[0], first)
    sel = torch.tensor([sp.index for sp in plan.specs])
    n = x.shape[0]
    if sub is not None:  # the subsample's rows of each window: positions sub, every support entry
        r = teacher.idx.shape[-1]
        rows = (sub[:, None] * r + torch.arange(r)[None, :]).flatten()
        piece["sub_halves"] = [None if h is None else _embed(h, sel, plan.M)
                               for h in _window_grams(phi, n, first, len(sel), rows)]
    clock["abl"] += t2 - t1
    clock["gram"] += time.perf_counter() - t2
    return piece


def _piece(plan: _Plan, phi: torch.Tensor, kl: torch.Tensor, teacher: _Teacher, n: int, first: int,
           sizes: list[int] | None = None) -> dict:
    """One block's reduction piece: its ``M x M`` Gram, KL sums, support mass sum and (``n > 1`` windows) the Grams
    of its even / odd windows (``sizes``: rows of ``phi`` per window when they differ)."""
    sel = torch.tensor([sp.index for sp in plan.specs])
    full = _embed(gram(phi), sel, plan.M)
    halves = None
    if n > 1:  # one Gram per window over its rows of phi (contiguous: rows are [window, position, support])
        halves = [None if h is None else _embed(h, sel, plan.M)
                  for h in _window_grams(phi, n, first, len(sel), sizes=sizes)]
    return {"gram": full, "kl": kl, "mass": teacher.p_sup.sum(-1).to(torch.float64).sum().reshape(1),
            "halves": halves}


def _embed(g: torch.Tensor, sel: torch.Tensor, M: int) -> torch.Tensor:
    full = torch.zeros(M, M, dtype=torch.float64)
    full[sel[:, None], sel[None, :]] = g
    return full


class _Fold:
    """Block-ordered sums over the processes, added as the blocks finish (see the module docstring): ``H`` (and the
    KL sums, the support mass) get ``0 + block`` for every block in block order, the very additions of
    :func:`secateur.calib.dist.ordered_block_sum` over all the blocks at the end."""

    def __init__(self, M: int) -> None:
        self.M = M
        self.H = torch.zeros(M, M, dtype=torch.float64)
        self.kl = torch.zeros(M, dtype=torch.float64)
        self.mass = torch.zeros(1, dtype=torch.float64)
        self.halves = [torch.zeros(M, M, dtype=torch.float64) for _ in range(2)]
        self.missing = torch.zeros(1, dtype=torch.float64)  # blocks whose half Grams are unknown (old pieces)
        self.sub_halves = [torch.zeros(M, M, dtype=torch.float64) for _ in range(2)]
        self.sub_missing = torch.zeros(1, dtype=torch.float64)  # blocks without the subsample's half Grams

    def add(self, piece: dict | None, first: int, n_seqs: int) -> None:
        """Add one block (``piece``: this rank's, or None when another rank ran it; every rank calls alike)."""
        M = self.M

        def block(t: torch.Tensor | None, shape: tuple[int, ...]) -> torch.Tensor:
            return dist.ordered_block_sum({} if t is None else {0: t}, 1, shape)

        own = piece is not None
        self.H += block(piece["gram"] if own else None, (M, M))
        self.kl += block(piece["kl"] if own else None, (M,))
        self.mass += block(piece["mass"] if own else None, (1,))
        halves = piece.get("halves") if own else None
        if own and n_seqs == 1:
            halves = [piece["gram"] if first % 2 == k else None for k in range(2)]
        missing = own and halves is None
        self.missing += block(torch.ones(1, dtype=torch.float64) if missing else None, (1,))
        for k in range(2):
            t = halves[k] if own and halves is not None else None
            self.halves[k] += block(t, (M, M))
        sub = piece.get("sub_halves") if own else None
        self.sub_missing += block(torch.ones(1, dtype=torch.float64) if own and sub is None else None, (1,))
        for k in range(2):
            self.sub_halves[k] += block(sub[k] if sub is not None else None, (M, M))


def _finish(fold: _Fold, plan: _Plan, n_blocks: int, n_pos: int, half_pos: tuple[int, int], clock: dict[str, float],
            extra: dict, sub_half_pos: tuple[int, int] | None = None) -> SweepResult:
    """The folded sums -> :class:`SweepResult` (``H`` and its halves normalized and symmetrized, timings)."""

    def finish(H: torch.Tensor, n: int) -> torch.Tensor:
        H = H / n
        return 0.5 * (H + H.T)  # exact symmetry (Phi^T Phi is symmetric up to GEMM rounding)

    H = finish(fold.H, n_pos)
    halves = None
    if min(half_pos) > 0 and float(fold.missing[0]) == 0:
        halves = (finish(fold.halves[0], half_pos[0]), finish(fold.halves[1], half_pos[1]))
    sub_halves = None
    if sub_half_pos is not None and min(sub_half_pos) > 0 and float(fold.sub_missing[0]) == 0:
        sub_halves = (finish(fold.sub_halves[0], sub_half_pos[0]), finish(fold.sub_halves[1], sub_half_pos[1]))
    times = dist.sum_floats([clock["dense"], clock["abl"], clock["gram"], float(clock["n_abl"])])
    dense_per_block = times[0] / n_blocks
    per_abl = times[1] / max(times[3], 1.0)
    timings = {"dense_s": times[0], "ablations_s": times[1], "gram_s": times[2], "n_ablations": int(times[3]),
               "per_ablation_s": per_abl, "dense_forward_per_block_s": dense_per_block,
               "ablation_over_dense": per_abl / dense_per_block if dense_per_block > 0 else None} | extra
    return SweepResult(H=H, ablated=plan.ablated, kl_single=fold.kl / n_pos, n_positions=n_pos,
                       support_mass=float(fold.mass[0]) / n_pos, timings=timings, halves=halves,
                       half_positions=half_pos, sub_halves=sub_halves,
                       sub_positions=0 if sub_half_pos is None else extra["subsample_positions_per_window"])


def ablation_sweep(model: nn.Module, adapter: Adapter, inv: Inventory, ids: torch.Tensor,
                   cfg: SweepConfig | None = None, units: torch.Tensor | None = None) -> SweepResult:
    """Single-unit ablation sweep over the calibration set ``ids [N, T]`` -> :class:`SweepResult`.

    ``units``: bool mask of the units to ablate (default: all); the others get zero rows/columns in
    ``H``. Runs the blocks assigned to this process when ``torch.distributed`` is initialized and
    reduces the result in block order (identical ``H`` for any number of processes).
    """
    cfg = cfg or SweepConfig()
    _check_sweep(adapter, ids, cfg)
    plan = _Plan.build(inv, units)
    device = adapter.device
    N, T = ids.shape
    pos = sample_positions(T, cfg.positions_per_seq).to(device)
    P = int(pos.numel())
    sub = subsample_index(pos, T, cfg)
    _, kw = adapter.capture_inputs(ids[:1])
    walker = _Walker(model, adapter, kw, pos)

    def run_block(s: int, e: int, clock: dict) -> dict:  # looked up at call time: tests replace _sweep_block
        return _sweep_block(walker, plan, ids[s:e].to(device), cfg, clock, s, sub)

    fold, clock, blocks, n_resumed = _fold_blocks(run_block, N, plan, cfg, lambda s, e: P)
    world = dist.rank_world()[1]
    extra = {"world_size": world, "n_blocks": len(blocks), "tokens_per_block": cfg.seqs_per_block * T,
             "positions_per_window": P, "resumed_blocks": n_resumed}
    half_pos = ((N + 1) // 2 * P, N // 2 * P)
    sub_half_pos = None
    if sub is not None:
        Ps = int(sub.numel())
        extra["subsample_positions_per_window"] = Ps
        sub_half_pos = ((N + 1) // 2 * Ps, N // 2 * Ps)
    return _finish(fold, plan, len(blocks), N * P, half_pos, clock, extra, sub_half_pos)


def _fold_blocks(run_block, N: int, plan: _Plan, cfg: SweepConfig, positions_of) -> tuple:
    """The sweep's block loop (module docstring: rounds of ``W`` blocks, block-ordered fold, resumable pieces):
    ``run_block(s, e, clock)`` computes the piece of windows ``s .. e-1``; ``positions_of(s, e)`` is what a saved
    piece must have recorded to be reused. Returns ``(fold, clock, blocks, resumed blocks)``."""
    rank, world = dist.rank_world()
    blocks = [(b, s, min(s + cfg.seqs_per_block, N)) for b, s in enumerate(range(0, N, cfg.seqs_per_block))]
    fold = _Fold(plan.M)
    clock = {"dense": 0.0, "abl": 0.0, "gram": 0.0, "n_abl": 0}
    ck = resume.current()
    stage = ck.stage("sweep") if ck is not None else ""
    resumed = 0
    with torch.no_grad():
        for r0 in range(0, len(blocks), world):
            round_ = blocks[r0:r0 + world]
            piece = None
            if rank < len(round_):
                b, s, e = round_[rank]
                name = f"{stage}-block{b}.pt"
                saved = ck.load(name) if ck is not None and ck.has(name) else None
                P = positions_of(s, e)
                if saved is not None and saved.get("positions") == P:
                    piece = saved
                    for k in clock:
                        clock[k] += saved["clock"][k]
                    resumed += 1
                else:
                    before = dict(clock)
                    piece = run_block(s, e, clock)
                    if ck is not None:
                        ck.save(name, {**piece, "positions": P, "clock": {k: clock[k] - before[k] for k in clock}})
                    if cfg.progress:
                        print(f"[cocurve] rank {rank} block {b + 1}/{len(blocks)}: dense {clock['dense']:.1f}s "
                              f"ablations {clock['abl']:.1f}s", flush=True)
            for j, (_, s, e) in enumerate(round_):
                fold.add(piece if j == rank else None, s, e - s)
    return fold, clock, blocks, int(dist.sum_floats([float(resumed)])[0])


class AblationSource(Protocol):
    """Where a :func:`source_sweep`'s model and loss come from: any model whose units can be ablated one at a time
    (a vision-language model's two towers, :mod:`secateur.vlm_joint`) and whose scored positions it chooses (a
    caption's tokens). Rows of the logits are window-major: window ``s``'s scored positions, then ``s + 1``'s, ..."""

    def positions(self, i: int) -> int:
        """Scored positions of window ``i``."""

    def dense_logits(self, s: int, e: int) -> torch.Tensor:
        """float32 logits ``[R, V]`` of the dense model at the scored positions of windows ``s .. e-1``."""

    def ablated_logits(self, s: int, e: int, units: list[int]) -> torch.Tensor:
        """float32 logits ``[len(units), R, V]``: the same rows with each unit alone removed."""


def _source_block(source: AblationSource, plan: _Plan, s: int, e: int, cfg: SweepConfig,
                  clock: dict[str, float]) -> dict:
    """:func:`_sweep_block` for a source: the dense logits and each ablation's logits come from ``source``; the
    teacher, Fisher features, KLs and the block's piece are the very code of the layered sweep."""
    t0 = time.perf_counter()
    teacher = _Teacher(source.dense_logits(s, e)[None], cfg)
    clock["dense"] += time.perf_counter() - t0
    phi = torch.zeros(teacher.idx.numel(), len(plan.specs), dtype=torch.float64)
    kl = torch.zeros(plan.M, dtype=torch.float64)
    t1 = time.perf_counter()
    for c in range(0, len(plan.specs), cfg.unit_batch):
        group = plan.specs[c:c + cfg.unit_batch]
        z = source.ablated_logits(s, e, [sp.index for sp in group])
        for k, sp in enumerate(group):
            f, kl[sp.index] = teacher.response(z[k][None])
            phi[:, plan.col_of[sp.index]] = f.reshape(-1)
        clock["n_abl"] += len(group)
        del z
    t2 = time.perf_counter()
    r = teacher.idx.shape[-1]
    piece = _piece(plan, phi, kl, teacher, e - s, s, [source.positions(i) * r for i in range(s, e)])
    clock["abl"] += t2 - t1
    clock["gram"] += time.perf_counter() - t2
    return piece


def source_sweep(source: AblationSource, n_windows: int, layer_of: torch.Tensor, cfg: SweepConfig | None = None,
                 units: torch.Tensor | None = None) -> SweepResult:
    """The single-unit ablation sweep of :func:`ablation_sweep` over ``n_windows`` windows of a source whose
    windows score different numbers of positions ``P_i`` (``layer_of [M]``: each unit's layer; ``units``: the units
    to ablate, default all). Same features, ``H = (1 / sum_i P_i) sum Phi^T Phi`` (the paper's Gram estimator over
    the scored positions), the same block loop, fold, split halves and resumable pieces (``positions``: the block's
    ``P_i``). Every ablation is whatever the source computes (a full forward: no upper-layer shortcut), and there is
    no memory plan and no position subsample (``positions_per_seq`` and ``subsample_check`` are refused)."""
    cfg = cfg or SweepConfig()
    if cfg.positions_per_seq is not None or cfg.subsample_check is not None:
        raise SecateurError("a source sweep scores the positions its source chooses: positions_per_seq and "
                            "subsample_check do not apply")
    if cfg.top_r < 1 or cfg.unit_batch < 1 or cfg.seqs_per_block < 1:
        raise SecateurError("top_r, unit_batch and seqs_per_block must be >= 1")
    if cfg.center not in CENTERS:
        raise SecateurError(f"center must be one of {CENTERS}, not {cfg.center!r}")
    M = int(layer_of.numel())
    plan = _Plan.of_units(M, layer_of, units)
    sizes = [int(source.positions(i)) for i in range(n_windows)]
    if min(sizes, default=0) < 1:
        raise SecateurError("every window of a source sweep needs at least one scored position")

    def run_block(s: int, e: int, clock: dict) -> dict:
        return _source_block(source, plan, s, e, cfg, clock)

    with torch.no_grad():
        fold, clock, blocks, n_resumed = _fold_blocks(run_block, n_windows, plan, cfg, lambda s, e: sizes[s:e])
    extra = {"world_size": dist.rank_world()[1], "n_blocks": len(blocks), "positions_per_window": sizes,
             "resumed_blocks": n_resumed}
    half_pos = (sum(sizes[0::2]), sum(sizes[1::2]))
    return _finish(fold, plan, len(blocks), sum(sizes), half_pos, clock, extra)


# --- memory ------------------------------------------------------------------------------------------

MEMORY_FORMULA = (
    "hidden states (L + 1) B T d e + one layer's parts B T (d_att + 3 d + F) e + teacher B P (16 V + 80 r) "
    "+ features B P r M_a 8 + one unit batch's logits g B P V 4 + its re-run g B T (3 F + 5 d) e + g B H T^2 e "
    "+ one response's KL transients 16 B P V + Grams 8 (M_a^2 + 8 M^2)")


def memory_plan(model: nn.Module, adapter: Adapter, n_units: int, n_ablated: int, seqlen: int,
                cfg: SweepConfig | None = None) -> MemoryPlan:
    """The sweep's peak memory beside the model, term by term (:data:`MEMORY_FORMULA`; ``B`` windows per block,
    ``P`` positions per window, ``r`` support, ``V`` vocabulary, ``g`` unit batch, ``e`` bytes per activation,
    ``M_a`` ablated of ``M`` units). Only one block is alive at a time (module docstring), so no term grows with the
    number of windows. The live tensors at the ablation stage, each term an upper bound:

    * ``teacher``: ``log p_0`` and ``p_0`` (float64, ``16 B P V``) and the support's index, probabilities, dense
      logits, ``p~``, ``sqrt(p~)`` and one response's feature transients (``80 B P r``); the dense pass's own peak
      (a stable sort of ``B P V`` log-probabilities, ``36 B P V``) stays below teacher + logits + KL;
    * ``features``: the per-unit Fisher features, ``B P r 8`` bytes per unit, times ``M_a``;
    * ``unit-batch logits``: one group's float32 logits at the positions (freed before the next group's);
    * ``KL transients``: one response's float64 logits and ``log q`` (the KL's product reuses ``log q``'s buffer);
    * ``re-run``: the re-run layers' activations of one group (the ``T^2`` scores only where SDPA falls back to
      its math kernel).

    The plan counts live tensors. glibc returns a freed block to the system only above its mmap threshold (at most
    32 MiB): a real model's ``[P, V]`` blocks are far above it, but on a tiny model the cycling blocks stay on the
    heap after they are freed, and the resident memory then exceeds the live tensors (measured up to +70 B P V).
    ``tests/test_cocurve_memory.py`` measures the peak resident memory with ``MALLOC_MMAP_THRESHOLD_=65536`` (every
    tensor its own mapping) and checks it against this plan."""
    cfg = cfg or SweepConfig()
    geo = adapter.geometry
    d, F, L = geo.hidden, geo.intermediate, adapter.n_layers
    d_att, heads = geo.n_heads * geo.head_dim, geo.n_heads
    V = int(model.get_output_embeddings().weight.shape[0])
    e = next(model.parameters()).element_size()
    B, T, g, M, Ma = cfg.seqs_per_block, seqlen, cfg.unit_batch, n_units, n_ablated
    P = int(sample_positions(T, cfg.positions_per_seq).numel())
    r = min(cfg.top_r, V)
    plan = MemoryPlan("CoCurve sweep", fix="use --positions N (N evenly spaced positions per window) or shorter "
                                           "windows (--seqlen)")
    plan.add("hidden states", (L + 1) * B * T * d * e, f"(L + 1) {L + 1} x B {B} x T {T} x d {d} x {e} B")
    plan.add("layer parts", B * T * (d_att + 3 * d + F) * e, f"B {B} x T {T} x (d_att {d_att} + 3 d + F {F}) x {e} B")
    plan.add("teacher", B * P * (16 * V + 80 * r), f"B {B} x P {P} x (16 V {V} + 80 r {r})")
    plan.add("features", B * P * r * Ma * 8, f"B {B} x P {P} x r {r} x 8 B = {B * P * r * 8} B per unit x M_a {Ma}")
    head = 4 if e == 4 else 4 + e  # the head's output in the model's dtype, then its float32 copy
    plan.add("unit-batch logits", g * B * P * V * head, f"g {g} x B {B} x P {P} x V {V} x {head} B")
    plan.add("re-run", g * B * T * (3 * F + 5 * d) * e + g * B * heads * T * T * e,
             f"g {g} x B {B} x T {T} x ((3 F + 5 d) x {e} B + H {heads} x T x {e} B)")
    plan.add("KL transients", 16 * B * P * V, f"16 x B {B} x P {P} x V {V}")
    # H and its two halves as they are summed, one block's Gram and halves, the block sum's two temporaries
    plan.add("Grams", 8 * (Ma * Ma + 8 * M * M), f"8 x (M_a^2 {Ma}^2 + 8 M^2 {M}^2)")
    if cfg.subsample_check is not None:  # the subsample's two window Grams, embedded, and their two sums
        plan.add("subsample Grams", 8 * (2 * Ma * Ma + 4 * M * M), f"8 x (2 M_a^2 {Ma}^2 + 4 M^2 {M}^2)")
    return plan
