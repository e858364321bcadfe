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
(``results/cocurve-sweep-cost.md``), so with exact re-runs one ablation costs at least the mean re-run
depth's share of the dense layers (SmolLM2-135M, quick preset: 14.5 of 30 layers, 0.40 dense forwards).

Positions: ``t = s j - 1`` for ``j = 1..P_tok`` with ``s = T // P_tok`` (cocurve.md §9, ``16 j - 1`` for
``T = 2048, P_tok = 128``); every position when ``P_tok >= T``. The top-r support comes from a stable
descending sort of the dense log-probabilities (ties: smaller token id first).

Blocks of ``seqs_per_block`` consecutive sequences are the unit of work and of reduction: block ``b``
runs on rank ``b % world`` and ``H`` is the sum of the block Grams in block order, so the result does
not depend on the number of processes (:mod:`secateur.calib.dist`).

Resume: with a checkpoint active (:func:`secateur.calib.resume.current`: ``secateur prune --resume``, or
the bench's graph stage), every finished block's Gram, KL sums and support mass are saved as one piece
(``<stage>-block<b>.pt``, written atomically) and a resumed sweep loads the pieces it finds instead of
recomputing them. The reduction then adds the very float64 tensors an uninterrupted run would have
added, in the same block order, so ``H`` is bit-identical (``tests/test_cocurve_resume.py``: kill after a
block, resume, compare ``H``'s sha256). Blocks are keyed by index; the checkpoint's fingerprint (tokens,
options, model) is what makes an index mean the same block.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from secateur.calib import dist, engine, resume
from secateur.errors import SecateurError
from secateur.models.adapters import Adapter
from secateur.structured.units import ATTN_KINDS, MLP_KINDS, Inventory

CENTERS = ("fisher", "none")


@dataclass(frozen=True)
class SweepConfig:
    """Knobs of the ablation sweep. Defaults are the paper's (P_tok = 128, r = 256)."""

    positions_per_seq: int = 128
    top_r: int = 256
    renormalize: bool = True
    center: str = "fisher"
    unit_batch: int = 8  # ablations stacked along the batch dimension per re-run of the upper layers
    seqs_per_block: int = 1  # sequences per work/reduction block (fixes the summation order of H)
    progress: bool = False

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


# --- pure feature math ------------------------------------------------------------------------------


def sample_positions(seqlen: int, per_seq: int) -> torch.Tensor:
    """Evenly spaced positions ``s j - 1`` (``s = T // P_tok``), or all of them when ``P_tok >= T``."""
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
    idx = torch.sort(logp, dim=-1, descending=True, stable=True).indices[..., :r]
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
        return f, (self.p0 * (self.logp0 - logq)).sum()


def _check_sweep(adapter: Adapter, ids: torch.Tensor, cfg: SweepConfig) -> None:
    if ids.dim() != 2:
        raise SecateurError(f"calibration ids must be [N, T], got {tuple(ids.shape)}")
    if cfg.top_r < 1 or cfg.unit_batch < 1 or cfg.seqs_per_block < 1:
        raise SecateurError("top_r, unit_batch and seqs_per_block must be >= 1")
    if cfg.center not in CENTERS:
        raise SecateurError(f"center must be one of {CENTERS}, not {cfg.center!r}")
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
    return len(todo)


def _sweep_block(walker: _Walker, plan: _Plan, x: torch.Tensor, cfg: SweepConfig,
                 clock: dict[str, float]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block of sequences -> (its ``M x M`` Gram, per-unit KL sums, support mass sum); adds to ``clock``."""
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
    g = gram(phi)
    full = torch.zeros(plan.M, plan.M, dtype=torch.float64)
    sel = torch.tensor([sp.index for sp in plan.specs])
    full[sel[:, None], sel[None, :]] = g
    clock["abl"] += t2 - t1
    clock["gram"] += time.perf_counter() - t2
    return full, kl, teacher.p_sup.sum(-1).to(torch.float64).sum().reshape(1)


def _reduce(local: dict[str, dict[int, torch.Tensor]], plan: _Plan, n_blocks: int, n_pos: int,
            clock: dict[str, float], extra: dict) -> SweepResult:
    """Block-ordered sums over the processes -> :class:`SweepResult` (``H`` symmetrized, timings)."""
    M = plan.M
    H = dist.ordered_block_sum(local["gram"], n_blocks, (M, M))
    kl_sum = dist.ordered_block_sum(local["kl"], n_blocks, (M,))
    mass = dist.ordered_block_sum(local["mass"], n_blocks, (1,))
    H = H / n_pos
    H = 0.5 * (H + H.T)  # exact symmetry (Phi^T Phi is symmetric up to GEMM rounding)
    times = dist.sum_floats([clock["dense"], clock["abl"], clock["gram"], float(clock["n_abl"])])
    dense_per_block = times[0] / n_blocks
    per_abl = times[1] / max(times[3], 1.0)
    timings = {"dense_s": times[0], "ablations_s": times[1], "gram_s": times[2], "n_ablations": int(times[3]),
               "per_ablation_s": per_abl, "dense_forward_per_block_s": dense_per_block,
               "ablation_over_dense": per_abl / dense_per_block if dense_per_block > 0 else None} | extra
    return SweepResult(H=H, ablated=plan.ablated, kl_single=kl_sum / n_pos, n_positions=n_pos,
                       support_mass=float(mass[0]) / n_pos, timings=timings)


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
    _, kw = adapter.capture_inputs(ids[:1])
    walker = _Walker(model, adapter, kw, pos)
    rank, world = dist.rank_world()
    blocks = [(b, s, min(s + cfg.seqs_per_block, N)) for b, s in enumerate(range(0, N, cfg.seqs_per_block))]
    local: dict[str, dict[int, torch.Tensor]] = {"gram": {}, "kl": {}, "mass": {}}
    clock = {"dense": 0.0, "abl": 0.0, "gram": 0.0, "n_abl": 0}
    ck = resume.current()
    stage = ck.stage("sweep") if ck is not None else ""
    resumed = 0
    with torch.no_grad():
        for b, s, e in (blk for blk in blocks if blk[0] % world == rank):
            piece = f"{stage}-block{b}.pt"
            if ck is not None and ck.has(piece):
                saved = ck.load(piece)
                local["gram"][b], local["kl"][b], local["mass"][b] = saved["gram"], saved["kl"], saved["mass"]
                for k in clock:
                    clock[k] += saved["clock"][k]
                resumed += 1
                continue
            before = dict(clock)
            local["gram"][b], local["kl"][b], local["mass"][b] = _sweep_block(walker, plan, ids[s:e].to(device),
                                                                              cfg, clock)
            if ck is not None:
                ck.save(piece, {"gram": local["gram"][b], "kl": local["kl"][b], "mass": local["mass"][b],
                                "clock": {k: clock[k] - before[k] for k in clock}})
            if cfg.progress:
                print(f"[cocurve] rank {rank} block {b + 1}/{len(blocks)}: dense {clock['dense']:.1f}s "
                      f"ablations {clock['abl']:.1f}s", flush=True)
    n_resumed = int(dist.sum_floats([float(resumed)])[0])
    extra = {"world_size": world, "n_blocks": len(blocks), "tokens_per_block": cfg.seqs_per_block * T,
             "resumed_blocks": n_resumed}
    return _reduce(local, plan, len(blocks), N * pos.numel(), clock, extra)
