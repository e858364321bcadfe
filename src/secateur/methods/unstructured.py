"""Unstructured and N:M pruning: magnitude, Wanda, SparseGPT, over the sequential engine.

Scores (lower = pruned first):
  magnitude  ``|W_ij|``                           (no calibration)
  wanda      ``|W_ij| * ||X_j||_2``                (Sun et al. 2024, Eq. 1; ||X_j|| from ``SumSq``)
  sparsegpt  OBS saliency ``w^2 / [U]_jj^2`` with reconstruction (see :mod:`secateur.compensate.sparsegpt`)

Budgets: ``row`` (each output row loses ``round(rho * d_in)``; Wanda's comparison group), ``matrix``
(one pool per projection), or an N:M pattern (per row, the M-N lowest of every M consecutive inputs).
Rounding is ``ceil`` by default (``floor`` reproduces Wanda's code); ties break by a stable sort on the
flat index (lower index pruned first). See :mod:`secateur.budgets.masks`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch import nn

from secateur.budgets.masks import ROW_CHUNK_ELEMENTS, deletion_count, prune_mask
from secateur.calib import dist, engine
from secateur.calib.stats import Accumulator, Gram, SumSq
from secateur.compensate.sparsegpt import sparsegpt_prune
from secateur.errors import SecateurError, check_fraction
from secateur.linalg import one_thread
from secateur.methods.knobs import MethodOptions, knob, rounding_knob
from secateur.methods.result import MethodResult
from secateur.models.adapters import Adapter
from secateur.models.blocks import RESIDENT, Blocks
from secateur.models.streaming import PackedMasks
from secateur.scoring.wanda import wanda_scores

METHODS = ("magnitude", "wanda", "sparsegpt")
ALL_ROLES = ("q", "k", "v", "qkv", "o", "gate", "up", "down")


def parse_pattern(pattern: str | None) -> tuple[int, int] | None:
    if not pattern:
        return None
    try:
        n, m = (int(x) for x in pattern.split(":"))
    except ValueError:
        raise SecateurError(f"pattern {pattern!r} is not N:M; write it as N:M, e.g. 2:4 (keep 2 of every 4)") from None
    if not 0 < n < m:
        raise SecateurError(f"pattern {pattern!r} needs 0 < N < M; keep N of every M weights, e.g. 2:4")
    return n, m


def parse_targets(targets: str | None) -> frozenset[str]:
    """Roles to prune; default every projection of every block."""
    if not targets:
        return frozenset(ALL_ROLES)
    roles = {t.strip() for t in targets.split(",") if t.strip()}
    if not roles:
        raise SecateurError(f"--targets {targets!r} names no projection role; give a comma list from "
                            f"{', '.join(ALL_ROLES)} or omit it to prune all")
    bad = roles - set(ALL_ROLES)
    if bad:
        raise SecateurError(f"unknown projection roles {sorted(bad)}; choose from {', '.join(ALL_ROLES)}")
    if roles & {"q", "k", "v"}:
        roles.add("qkv")  # GPT-2's fused projection follows q/k/v
    return frozenset(roles)


@dataclass
class UnstructuredConfig:
    method: str = "wanda"
    sparsity: float = 0.5
    pattern: tuple[int, int] | None = None
    budget: str | None = None  # None: the method's own comparison group (see resolved_budget)
    rounding: str = "ceil"
    targets: frozenset[str] = frozenset(ALL_ROLES)
    blocksize: int = 128
    percdamp: float = 0.01

    def validate(self) -> None:
        if self.method not in METHODS:
            raise SecateurError(f"unknown method {self.method!r}; choose from {', '.join(METHODS)}")
        if self.pattern is None:
            check_fraction(self.sparsity)  # [0, 1): every projection keeps some weights
        if self.budget not in (None, "row", "matrix"):
            raise SecateurError(f"budget must be row or matrix, got {self.budget!r}; "
                                "pass --budget row or matrix, or omit it")
        if self.rounding not in ("ceil", "floor"):
            raise SecateurError(f"rounding must be ceil or floor, got {self.rounding!r}; pass --rounding ceil or floor")

    @property
    def resolved_budget(self) -> str:
        """The comparison group used: an explicit ``budget``, else Wanda's per-output row (Wanda Sec. 3) and
        the whole layer for magnitude (its paper's convention). N:M patterns ignore it; SparseGPT has its own."""
        if self.budget is not None:
            return self.budget
        return "matrix" if self.method == "magnitude" else "row"


def block_masks(masks: dict[str, torch.Tensor], ctx: engine.BlockContext) -> dict[str, torch.Tensor]:
    """The masks of block ``ctx`` (compact copies: a mask may view a larger buffer) for a checkpoint."""
    prefix = f"{ctx.adapter.base_prefix}.{ctx.index}."
    return {k: v.clone() for k, v in masks.items() if k.startswith(prefix)}


class UnstructuredHandler(engine.Handler):
    """Prunes the targeted projections of each group as soon as the group's statistics are complete."""

    resumable = True

    def __init__(self, cfg: UnstructuredConfig) -> None:
        self.cfg = cfg
        self.masks: dict[str, torch.Tensor] = {}
        self.precision: dict[str, str] = {}  # SparseGPT: the precision each solve ran in (float32 or its fallback)
        self.owners = dist.Owners("sparsegpt")  # SparseGPT's solves over several processes: round-robin owners

    def _targets(self, ctx: engine.BlockContext, names: list[str]) -> list[str]:
        return [n for n in names if ctx.refs[n].role in self.cfg.targets]

    def accumulators(self, ctx, group, names) -> dict[str, Accumulator]:
        tg = self._targets(ctx, names)
        if not tg or self.cfg.method == "magnitude":
            return {}
        d = ctx.refs[tg[0]].in_features
        return {"gram": Gram(d)} if self.cfg.method == "sparsegpt" else {"sumsq": SumSq(d)}

    def on_group(self, ctx, group, names, accs) -> None:
        targets = self._targets(ctx, names)
        if self.cfg.method == "sparsegpt":  # the group's OBS solves, each on its owner rank (calib.dist.owned_map)
            # side by side only on the CPU: a GPU solve is parallel already, and CUDA's linear algebra library,
            # loaded lazily, fails when threads load it at once ("lazy wrapper should be called at most once")
            cpu = targets and ctx.refs[targets[0]].weight.device.type == "cpu"
            workers = torch.get_num_threads() if cpu else 1
            with one_thread():  # each solve on one thread, the group's solves side by side on the process's threads
                solved = self.owners.map(targets, lambda name: sparsegpt_solve(ctx.refs[name].weight, self.cfg, accs),
                                         workers=workers)
        for k, name in enumerate(targets):
            ref = ctx.refs[name]
            key = f"{ctx.adapter.base_prefix}.{ctx.index}.{name}"
            if self.cfg.method == "sparsegpt":
                new, self.masks[key], self.precision[key] = solved[k]
                ref.set_weight(new)
            else:
                self.masks[key] = prune_linear(ref.weight, self.cfg, accs, ref)

    def block_state(self, ctx) -> dict:
        prefix = f"{ctx.adapter.base_prefix}.{ctx.index}."
        return {"masks": block_masks(self.masks, ctx),
                "precision": {k: v for k, v in self.precision.items() if k.startswith(prefix)}}

    def load_block_state(self, index, state) -> None:
        self.masks.update(state["masks"])
        self.precision.update(state.get("precision", {}))  # absent in a checkpoint written before float32 solves

    def details(self) -> dict:
        """SparseGPT: how many solves ran in float32 and which fell back to float64 (``sparsegpt._factor``)."""
        if not self.precision:
            return {}
        fallback = sorted(k for k, v in self.precision.items() if v != "float32")
        return {"solver_precision": {"float32": len(self.precision) - len(fallback), "float64": fallback}}


def sparsegpt_solve(W: torch.Tensor, cfg: UnstructuredConfig,
                    accs: dict[str, Accumulator]) -> tuple[torch.Tensor, torch.Tensor, str]:
    """SparseGPT's ``(new weight, mask, precision)`` of one ``[out, in]`` weight (nothing written)."""
    n, m = cfg.pattern or (0, 0)
    count = None if m else functools.partial(deletion_count, rho=cfg.sparsity, rounding=cfg.rounding)
    info: dict = {}
    new, mask = sparsegpt_prune(W, accs["gram"].G, count, n, m, cfg.blocksize, cfg.percdamp, info=info)
    return new, mask, info["precision"]


def prune_linear(W: torch.Tensor, cfg: UnstructuredConfig, accs: dict[str, Accumulator], ref=None) -> torch.Tensor:
    """Prune one ``[out, in]`` weight in place (through ``ref`` when given); return the mask."""
    if cfg.method == "sparsegpt":
        new, mask, _ = sparsegpt_solve(W, cfg, accs)
        ref.set_weight(new) if ref is not None else W.copy_(new.to(W.dtype))
        return mask
    scores = W.detach().abs().to(torch.float64) if cfg.method == "magnitude" else wanda_scores(W, accs["sumsq"])
    mask = prune_mask(scores, cfg.sparsity, budget=cfg.resolved_budget, rounding=cfg.rounding, pattern=cfg.pattern)
    with torch.no_grad():
        W.masked_fill_(mask, 0)
    return mask


@dataclass
class UnstructuredResult:
    masks: dict[str, torch.Tensor]
    timings: dict[str, float] = field(default_factory=dict)
    details: dict = field(default_factory=dict)


def prune_unstructured(model: nn.Module, adapter: Adapter, calib_ids: torch.Tensor | None,
                       cfg: UnstructuredConfig, mode: str = "sequential", chunk_size: int = 8,
                       device: str | None = None, progress: bool = True,
                       blocks: Blocks = RESIDENT) -> UnstructuredResult:
    """Prune ``model`` in place; masks keyed by the full parameter-owner name (``model.layers.3.mlp.up_proj``).
    ``blocks``: where the blocks come from and where the pruned ones go (:mod:`secateur.models.blocks`)."""
    cfg.validate()
    handler = UnstructuredHandler(cfg)
    if blocks.streamed:  # block-streamed: the masks grow with depth while one block is held, so kept bit-packed
        handler.masks = PackedMasks()
    if cfg.method == "magnitude":  # data-free: no engine pass
        for i, layer in enumerate(adapter.layers):
            with blocks.scope(i):  # a streamed model's block is loaded only here
                ctx = engine.BlockContext(i, layer, adapter, adapter.linears(layer), {})
                for names in adapter.groups(layer).values():
                    handler.on_group(ctx, "", names, {})
        return UnstructuredResult(handler.masks)
    if calib_ids is None:
        raise SecateurError(f"{cfg.method} needs calibration data")
    rep = engine.run(model, adapter, calib_ids, handler, mode=mode, chunk_size=chunk_size, device=device,
                     progress=progress, blocks=blocks)
    return UnstructuredResult(handler.masks, rep.timings, handler.details())


# --- the registered methods (--method magnitude|wanda|sparsegpt) ---------------------------------------------

def segment_calibration(ids: torch.Tensor, segment_len: int | None, chunk_size: int) -> tuple[torch.Tensor, int]:
    """Cut ``ids [N, L]`` into ``[N L / s, s]`` independent sequences (positions restart in each, QK-Wanda
    App. E.1); the chunk size scales by ``L / s`` so each forward still carries ``chunk_size`` windows of tokens
    (the paper's batches of 2048/T segments). Masks do not depend on the chunking (I9)."""
    from secateur.scoring import segment_sequences

    if not segment_len or segment_len == ids.shape[1]:
        return ids, chunk_size
    seg = segment_sequences(ids, segment_len)
    return seg, chunk_size * (ids.shape[1] // segment_len)


@dataclass
class RowPruningOptions(MethodOptions):
    """The knobs Wanda's family and QK-Wanda share: the comparison group, the rounding of each group's removal
    count and the calibration segment length."""

    CLI_GROUP = "unstructured and QK-Wanda pruning (every default below is None = unset)"

    budget: str | None = knob("comparison group: row | matrix (Wanda, magnitude; default: row, matrix for magnitude); "
                              "shared | separate | row (QK-Wanda; default: shared)")
    rounding: str | None = rounding_knob()
    segment_len: int | None = knob("cut every calibration window into independent sequences of T tokens "
                                   "(QK-Wanda paper: 64)", type=int, metavar="T")

    def validate(self) -> None:
        super().validate()
        if self.segment_len is not None and self.segment_len < 1:
            raise SecateurError(f"--segment-len must be a positive number of tokens, got {self.segment_len}; "
                                "pass e.g. 64")


@dataclass
class UnstructuredOptions(RowPruningOptions):
    """Magnitude, Wanda and SparseGPT's knobs: the shared ones, an N:M pattern and the projections pruned."""

    pattern: str | None = knob("N:M semi-structured pattern, e.g. 2:4 or 4:8 (keeps N of M)", example="'2:4'")
    targets: str | None = knob("comma list of projection roles to prune: q,k,v,o,gate,up,down (default: all)",
                               example="'q,k' (comma-separated roles), or None for every projection")

    def validate(self) -> None:
        super().validate()
        parse_pattern(self.pattern)
        parse_targets(self.targets)


def unstructured_config(name: str, opts) -> UnstructuredConfig:
    """The validated :class:`UnstructuredConfig` of method ``name`` from ``PruneOptions`` (its sparsity) and its
    :class:`UnstructuredOptions`."""
    o: UnstructuredOptions = opts.method_options
    cfg = UnstructuredConfig(method=name, sparsity=opts.sparsity, pattern=parse_pattern(o.pattern), budget=o.budget,
                             rounding=o.rounding or "ceil", targets=parse_targets(o.targets))
    cfg.validate()
    return cfg


def run(name: str, model: nn.Module, adapter: Adapter, calib_ids: torch.Tensor | None, opts,
        blocks: Blocks = RESIDENT) -> MethodResult:
    """Registry runner: prune in place (``blocks``: streamed, each block written to the sink as it finishes),
    return the masks."""
    cfg = unstructured_config(name, opts)
    chunk = opts.run.chunk_size
    if calib_ids is not None:  # --segment-len: same independent short sequences as qk-wanda
        calib_ids, chunk = segment_calibration(calib_ids, opts.method_options.segment_len, chunk)
    res = prune_unstructured(model, adapter, calib_ids, cfg, mode=opts.run.mode, chunk_size=chunk,
                             device=opts.device, progress=not opts.run.quiet, blocks=blocks)
    return MethodResult(masks=res.masks, timings=res.timings, details=res.details)


# --- memory (the streamed prune's plan, secateur.models.memory: this module declares its terms) -----------------

def wanda_memory(s) -> tuple[int, str]:
    """Wanda's statistics while one block is visited: float64 squared norms of every projection input."""
    return 8 * (2 * s.hidden + s.attn + s.ffn), "8 (2 d + d_att + F)"


def sparsegpt_memory(s) -> tuple[int, str]:
    """SparseGPT's: the block's four float64 Grams, and its OBS solver on the widest input."""
    d, a, f = s.hidden, s.attn, s.ffn
    return (8 * (2 * d * d + a * a + f * f) + 8 * (4 * f * f + 2 * d * f),
            "float64 Grams 8 (2 d^2 + d_att^2 + F^2) + OBS solver 8 (4 F^2 + 2 d F)")


def selection_memory(cfg: UnstructuredConfig, s) -> tuple[int, str]:
    """Magnitude's and Wanda's mask selection on the largest projection (``P_max = d max(F, d_att)`` entries):
    its float64 scores and ``|W|`` in the run's dtype (``b`` bytes; the score is formed in place), plus the
    selection's transients (kthvalue's copy of the values and its int64 indices, or N:M's argsort: 16 bytes per
    entry): on one pool of ``P_max`` entries for a matrix budget, on at most ``ROW_CHUNK_ELEMENTS`` for a row
    budget or an N:M pattern (rows at a time). Measured at 7B widths (bf16): 11.8 and 27.2 bytes per entry of
    the largest projection, for the formula's 10.4 and 26 + 1 (the boolean mask, in the masks term)."""
    p, b = s.hidden * max(s.ffn, s.attn), s.elem
    if cfg.pattern is None and cfg.resolved_budget == "matrix":
        return (24 + b) * p, f"(8 + 16 + {b}) x P_max {p} (d max(F, d_att): float64 scores, |W|, one pool's kthvalue)"
    return ((8 + b) * p + 16 * ROW_CHUNK_ELEMENTS,
            f"(8 + {b}) x P_max {p} (d max(F, d_att): float64 scores, |W|) + 16 x {ROW_CHUNK_ELEMENTS} (by rows)")


def memory_terms(s, cfg: UnstructuredConfig) -> dict[str, tuple[int, str]]:
    """The method's own terms of the streamed prune's plan: its statistics (Wanda, SparseGPT) and its mask
    selection (magnitude, Wanda; SparseGPT selects inside its solver, 128 columns at a time)."""
    if cfg.method == "sparsegpt":
        return {"statistics": sparsegpt_memory(s)}
    terms = {"statistics": wanda_memory(s)} if cfg.method == "wanda" else {}
    return terms | {"selection": selection_memory(cfg, s)}
