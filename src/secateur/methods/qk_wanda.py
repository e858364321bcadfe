"""QK-Wanda pruning over the sequential engine: query/key-coupled scores, row / separate / shared budgets.

Paper: Ilin & Richtárik, "QK-Wanda: Coupling Queries and Keys for Unstructured Pruning" (seed 003);
spec ``/work/shared/spec/qk-wanda.md``. Scores (Eqs. 5/7, 31-32; variants M/R/C, Eqs. 14-15, 37-38,
62-63, 67-68) come from :mod:`secateur.scoring`; this module wires them into the calibration engine.

Per block (Alg. 1):

1. statistics of the q/k input ``X^(s)`` of every calibration sequence ``s`` (independent sequences:
   with ``segment_len`` each window is cut into ``L/s`` sequences whose positions restart);
2. scores ``S^Q = (W^Q)^2 * G_Q``, ``S^K = (W^K)^2 * G_K`` from the block's *current dense* q/k weights
   (retained biases included);
3. masks of both projections are selected *before* either is applied, under one budget (§3.3, E.5):

   ``row``       each output row of W_Q and of W_K loses ``ceil(rho d)`` weights (Wanda's group)
   ``separate``  one pool per projection: ``ceil(rho n_Q)`` and ``ceil(rho n_K)``
   ``shared``    one pool over W_Q and W_K of the block: ``ceil(rho (n_Q + n_K))`` (default)

   Ties: stable ascending sort; rows by increasing column, matrices row-major, the shared pool lists
   all Q entries before all K entries (:mod:`secateur.budgets.masks`). ``floor`` rounding selectable;
4. the selected weights are zeroed; retained weights and biases are not modified.

Scope ``qk`` (default) prunes only W_Q and W_K. Scope ``all`` is the paper's full-block hybrid (Sec. 4.5):
QK-Wanda on Q/K plus row-wise Wanda (``|W_ij| ||X_j||``, same ``rho`` and rounding) on v, o and the MLP.
With the engine's ``dense-block`` mode every mask of a block comes from the same dense pass (spec [A4],
Wanda's order); in ``sequential`` mode o and the MLP see the already pruned attention (Q/K masks are the
same in both modes, since they depend only on the block input).

Progressive re-scoring (App. K, an ablation): ``progressive = J > 1`` grows the masks in J simultaneous
steps with cumulative per-pool targets ``M_r = floor(r M / J)`` (Eq. 53; ``M`` = the budget's final
count). Step ``r`` re-scores both projections from the partially pruned pair ``(W^{Q,r-1}, W^{K,r-1})``
on the same block inputs and adds the ``M_r - M_{r-1}`` lowest-scoring *remaining* weights of each pool;
deleted weights stay deleted. It keeps the block's q/k inputs (one ``N x T x d`` buffer) for the re-scoring
passes.

Cost: in ``dense-block``/``dense`` mode the handler reuses the q/k projection outputs of the block's own
dense forward (hooks on the projections), so the extra work is energies and one ``[D_K, N] x [N, d]``
product per chunk (base variant) -- the paper's procedure. In ``sequential`` mode q/k are pruned before the
attention runs, so the statistics recompute ``Q, K`` from ``X`` (two extra projections per chunk).

Models with q/k norms (Qwen3) are refused: their QK products are not affine in the weights (paper §5).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from secateur.budgets.masks import allocation_summary, budget_counts, lowest_k_masks, prune_masks
from secateur.calib import engine
from secateur.calib.qk import ProjectedQKStats
from secateur.calib.stats import Accumulator, InputChunks, SumSq
from secateur.errors import SecateurError, check_fraction
from secateur.methods.knobs import knob
from secateur.methods.result import MethodResult
from secateur.methods.unstructured import (  # noqa: F401 (segment_calibration: re-exported)
    RowPruningOptions,
    UnstructuredConfig,
    block_masks,
    prune_linear,
    segment_calibration,
)
from secateur.models.adapters import Adapter
from secateur.models.blocks import RESIDENT, Blocks
from secateur.models.linear import LinearRef
from secateur.scoring import QKStats, QKVariant

QK_BUDGETS = ("shared", "separate", "row")
SCOPES = ("qk", "all")
WANDA_ROLES = ("v", "o", "gate", "up", "down")  # pruned row-wise by Wanda in the hybrid scope


@dataclass
class QKWandaConfig:
    sparsity: float = 0.5
    budget: str = "shared"
    variant: str = "base"
    scope: str = "qk"
    rounding: str = "ceil"
    segment_len: int | None = None
    progressive: int = 1
    stats_dtype: torch.dtype = torch.float64

    def validate(self) -> None:
        if self.budget == "matrix":  # Wanda's name for the separate pools
            self.budget = "separate"
        if self.budget not in QK_BUDGETS:
            raise SecateurError(f"QK-Wanda budget must be one of {', '.join(QK_BUDGETS)}, got {self.budget!r}; "
                                "pass one of those")
        if self.scope not in SCOPES:
            raise SecateurError(f"QK-Wanda scope must be one of {', '.join(SCOPES)}, got {self.scope!r}")
        if self.rounding not in ("ceil", "floor"):
            raise SecateurError(f"rounding must be ceil or floor, got {self.rounding!r}; pass --rounding ceil or floor")
        check_fraction(self.sparsity)  # [0, 1): every Q/K pool keeps some weights
        if self.segment_len is not None and self.segment_len < 1:
            raise SecateurError(f"--segment-len must be a positive number of tokens, got {self.segment_len}; "
                                "pass e.g. 64")
        if not isinstance(self.progressive, int) or self.progressive < 1:
            raise SecateurError(f"--progressive must be a positive number of steps, got {self.progressive!r}; "
                                "pass e.g. 4, or omit it")
        self.variant = QKVariant.parse(self.variant).code

    def to_dict(self) -> dict:
        d = asdict(self)
        d["stats_dtype"] = str(self.stats_dtype).replace("torch.", "")
        return d


def check_supported(adapter: Adapter) -> None:
    """Refuse architectures whose QK products are not affine in W_Q, W_K (q/k norms, e.g. Qwen3)."""
    g = adapter.geometry
    if g.qk_norm:
        raise SecateurError(f"qk-wanda does not support {adapter.config.model_type} models: their q/k norms make "
                            "the query/key products non-affine in the weights (paper §5); use --method wanda")
    refs = adapter.role_refs(adapter.layers[0])
    if "q" not in refs or "k" not in refs:
        raise SecateurError(f"qk-wanda needs separate query and key projections; {type(adapter).__name__} has none")




class QKWandaHandler(engine.Handler):
    """Engine handler: QK-Wanda masks for q/k (and row-wise Wanda for v/o/MLP in the hybrid scope).

    ``reuse_projections``: take Q/K from the dense forward of the block (hooks on the projections); only
    valid when the engine runs the dense block before calling ``on_group`` (``dense-block``/``dense``).
    """

    resumable = True

    def __init__(self, cfg: QKWandaConfig, reuse_projections: bool = False) -> None:
        self.cfg = cfg
        self.variant = QKVariant.parse(cfg.variant)
        self.reuse = reuse_projections and cfg.progressive == 1
        self.masks: dict[str, torch.Tensor] = {}
        self.blocks: list[dict] = []
        self.timings: dict[str, float] = {}
        self._hooks: list = []
        self._hook_stats: ProjectedQKStats | None = None
        self._wanda = UnstructuredConfig(method="wanda", sparsity=cfg.sparsity, budget="row", rounding=cfg.rounding)

    # --- helpers ------------------------------------------------------------------------------------
    @staticmethod
    def _qk(ctx: engine.BlockContext) -> tuple[LinearRef, LinearRef]:
        refs = ctx.adapter.role_refs(ctx.layer)
        return refs["q"], refs["k"]

    def _wanda_refs(self, ctx: engine.BlockContext, names: list[str]) -> list[LinearRef]:
        """Hybrid-scope Wanda targets whose module is in ``names`` (a group)."""
        if self.cfg.scope != "all":
            return []
        mods = {id(ctx.refs[n].module) for n in names}
        refs = ctx.adapter.role_refs(ctx.layer)
        return [refs[r] for r in WANDA_ROLES if r in refs and id(refs[r].module) in mods]

    def _new_stats(self, ctx: engine.BlockContext, Wq: torch.Tensor, Wk: torch.Tensor) -> ProjectedQKStats:
        """Statistics for the weights ``Wq, Wk`` (model dtype, ``[out, in]``) with the block's biases."""
        q, k = self._qk(ctx)
        rope = ctx.kwargs.get("position_embeddings") if self.variant.rope else None
        bq = None if q.bias is None else q.bias.detach()
        bk = None if k.bias is None else k.bias.detach()
        return ProjectedQKStats(Wq, Wk, bq, bk, ctx.adapter.geometry, self.variant, rope=rope,
                                dtype=self.cfg.stats_dtype, proj=(Wq.detach(), bq, Wk.detach(), bk))

    def _store(self, ctx: engine.BlockContext, ref: LinearRef, mask: torch.Tensor) -> None:
        """Record ``mask`` ([out, in] of ``ref``) under its module's full name, merging fused row slices."""
        name = next(n for n, r in ctx.refs.items() if r.module is ref.module)
        key = f"{ctx.adapter.base_prefix}.{ctx.index}.{name}"
        if ref.rows is None:
            self.masks[key] = mask.cpu()
            return
        full = self.masks.get(key)
        if full is None:
            full = torch.zeros(ctx.refs[name].weight.shape, dtype=torch.bool)
        full[ref.rows] = mask.cpu()
        self.masks[key] = full

    def _install_hooks(self, ctx: engine.BlockContext) -> None:
        q, k = self._qk(ctx)
        stats = self._new_stats(ctx, q.weight, k.weight)
        modules = list({id(r.module): r.module for r in (q, k)}.values())
        pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

        def rows(out: torch.Tensor, ref: LinearRef) -> torch.Tensor:
            return out[..., ref.rows] if ref.rows is not None else out

        def hook(mod: nn.Module, args: tuple, out: torch.Tensor) -> None:
            pending[id(mod)] = (args[0], out)
            if len(pending) == len(modules):
                x = pending[id(q.module)][0]
                if pending[id(k.module)][0] is not x:
                    raise RuntimeError("q and k projections received different inputs")
                stats.update_projected(x, rows(pending[id(q.module)][1], q), rows(pending[id(k.module)][1], k))
                pending.clear()

        self._hook_stats = stats
        self._hooks = [m.register_forward_hook(hook) for m in modules]

    def _remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # --- engine interface ---------------------------------------------------------------------------
    def accumulators(self, ctx, group, names) -> dict[str, Accumulator]:
        accs: dict[str, Accumulator] = {}
        if group == "attn_in":
            q, k = self._qk(ctx)
            if self.reuse:
                self._install_hooks(ctx)
            else:
                accs["qk"] = self._new_stats(ctx, q.weight, k.weight)
            if self.cfg.progressive > 1:
                accs["inputs"] = InputChunks()
        tg = self._wanda_refs(ctx, names)
        if tg:
            accs["sumsq"] = SumSq(tg[0].in_features)
        return accs

    def on_group(self, ctx, group, names, accs) -> None:
        if group == "attn_in":
            t = time.perf_counter()
            self._remove_hooks()
            stats = self._hook_stats if self.reuse else accs["qk"]
            self._hook_stats = None
            self._prune_qk(ctx, stats, accs.get("inputs"))
            self.timings["qk_select"] = self.timings.get("qk_select", 0.0) + time.perf_counter() - t
        for ref in self._wanda_refs(ctx, names):
            self._store(ctx, ref, prune_linear(ref.weight, self._wanda, accs, ref))

    def on_block_end(self, ctx) -> None:
        self._remove_hooks()  # defensive: never leave hooks on a block

    def block_state(self, ctx) -> dict:
        return {"masks": block_masks(self.masks, ctx), "blocks": [b for b in self.blocks if b["block"] == ctx.index]}

    def load_block_state(self, index, state) -> None:
        self.masks.update(state["masks"])
        self.blocks += state["blocks"]

    # --- Q/K selection ------------------------------------------------------------------------------
    def _prune_qk(self, ctx: engine.BlockContext, stats: QKStats, inputs: InputChunks | None) -> None:
        q, k = self._qk(ctx)
        cfg = self.cfg
        Sq, Sk = stats.scores(self.variant)  # the statistics hold exactly this block's current q/k weights
        if cfg.progressive == 1:
            mq, mk = prune_masks([Sq, Sk], cfg.sparsity, cfg.budget, cfg.rounding)
        else:
            mq, mk = self._progressive(ctx, Sq, Sk, inputs)
        with torch.no_grad():  # both masks are selected before either is applied
            q.weight.masked_fill_(mq.to(q.weight.device), 0)
            k.weight.masked_fill_(mk.to(k.weight.device), 0)
        self._store(ctx, q, mq)
        self._store(ctx, k, mk)
        nq, nk = int(torch.count_nonzero(mq)), int(torch.count_nonzero(mk))
        self.blocks.append({"block": ctx.index, "q_removed": nq, "k_removed": nk, "q_total": mq.numel(),
                            "k_total": mk.numel(), "rho_q": nq / mq.numel(), "rho_k": nk / mk.numel()})

    def _progressive(self, ctx, Sq, Sk, inputs: InputChunks) -> tuple[torch.Tensor, torch.Tensor]:
        """App. K: J simultaneous re-scoring steps, cumulative targets ``M_r = floor(r M / J)`` (Eq. 53)."""
        cfg, J = self.cfg, self.cfg.progressive
        q, k = self._qk(ctx)
        Wq0, Wk0 = q.weight.detach().clone(), k.weight.detach().clone()
        M = budget_counts([Sq.shape, Sk.shape], cfg.sparsity, cfg.budget, cfg.rounding)
        masks = [torch.zeros(Sq.shape, dtype=torch.bool), torch.zeros(Sk.shape, dtype=torch.bool)]
        for r in range(1, J + 1):
            if r > 1:  # re-score from the current sparse pair on the same block inputs
                stats = self._new_stats(ctx, Wq0.masked_fill(masks[0].to(Wq0.device), 0),
                                        Wk0.masked_fill(masks[1].to(Wk0.device), 0))
                for x in inputs.chunks:
                    stats.update(x)
                Sq, Sk = stats.scores(self.variant)
            target = [m * r // J for m in M] if isinstance(M, list) else M * r // J
            scores = [s.to("cpu").masked_fill(m, -torch.inf) for s, m in zip((Sq, Sk), masks)]
            masks = [a | b for a, b in zip(lowest_k_masks(scores, cfg.budget, target), masks)]
        inputs.chunks.clear()
        return masks[0], masks[1]


@dataclass
class QKWandaResult:
    masks: dict[str, torch.Tensor]
    timings: dict[str, float] = field(default_factory=dict)
    details: dict = field(default_factory=dict)


def prune_qk_wanda(model: nn.Module, adapter: Adapter, calib_ids: torch.Tensor | None, cfg: QKWandaConfig,
                   mode: str = "sequential", chunk_size: int = 8, device: str | None = None,
                   progress: bool = True, blocks: Blocks = RESIDENT) -> QKWandaResult:
    """Prune ``model`` in place with QK-Wanda; masks keyed like the other unstructured methods
    (``model.layers.3.self_attn.q_proj``), details hold the configuration and the Q/K allocation."""
    cfg.validate()
    check_supported(adapter)
    if calib_ids is None:
        raise SecateurError("qk-wanda needs calibration data")
    ids, chunk = segment_calibration(calib_ids, cfg.segment_len, chunk_size)
    if blocks.shard.split and (mode != "sequential" or cfg.progressive > 1):
        raise SecateurError("qk-wanda over several processes runs --mode sequential without --progressive (its "
                            "other paths read every chunk of the block inputs in one process); drop --procs or those")
    handler = QKWandaHandler(cfg, reuse_projections=mode != "sequential")
    rep = engine.run(model, adapter, ids, handler, mode=mode, chunk_size=chunk, device=device, progress=progress,
                     blocks=blocks)
    timings = dict(rep.timings) | handler.timings
    details = {"method": QKVariant.parse(cfg.variant).method_name, "config": cfg.to_dict(), "mode": mode,
               "calibration_sequences": list(ids.shape), "projections_reused": handler.reuse,
               "allocation": allocation_summary(handler.blocks)}
    return QKWandaResult(handler.masks, timings, details)


# --- the registered method (--method qk-wanda) ---------------------------------------------------------------

def _variant_code(v: str) -> str:
    return QKVariant.parse(v).code


@dataclass
class QKWandaOptions(RowPruningOptions):
    """QK-Wanda's knobs: ``--budget``, ``--rounding`` and ``--segment-len`` (shared with Wanda's family) and its
    own."""

    variant: str | None = knob("qk-wanda score: base (unmasked, pre-RoPE) or any of base, M, R, C, MR, MC, RC, MRC "
                               "(M causal, R RoPE-aware, C centered; default: base)", type=_variant_code)
    scope: str | None = knob("qk-wanda: qk prunes only W_Q, W_K (default); all adds row-wise Wanda on v, o and the "
                             "MLP", choices=SCOPES)
    progressive: int | None = knob("qk-wanda: re-score in J simultaneous steps (paper App. K ablation; default 1 = "
                                   "one-shot)", type=int, metavar="J")


def qk_wanda_config(opts) -> QKWandaConfig:
    """The validated :class:`QKWandaConfig` from ``PruneOptions`` and its :class:`QKWandaOptions`."""
    o: QKWandaOptions = opts.method_options
    cfg = QKWandaConfig(sparsity=opts.sparsity, budget=o.budget or "shared", variant=o.variant or "base",
                        scope=o.scope or "qk", rounding=o.rounding or "ceil", segment_len=o.segment_len,
                        progressive=o.progressive or 1)
    cfg.validate()
    return cfg


def run(model: nn.Module, adapter: Adapter, calib_ids: torch.Tensor | None, opts,
        blocks: Blocks = RESIDENT) -> MethodResult:
    """Registry runner: prune in place; the details carry the per-block Q/K allocation (the report draws it).
    ``blocks``: in memory only (``--stream`` is refused for this method before anything is loaded)."""
    blocks.resident_only("--method qk-wanda")
    res = prune_qk_wanda(model, adapter, calib_ids, qk_wanda_config(opts), mode=opts.run.mode,
                         chunk_size=opts.run.chunk_size, device=opts.device, progress=not opts.run.quiet,
                         blocks=blocks)
    return MethodResult(masks=res.masks, timings=res.timings, details=res.details)
