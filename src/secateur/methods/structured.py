"""Structured pruning with compensation (issues 5 and 6): the composition of the score-based selections and
their options.

One dense calibration pass -> selection -> per-layer compensation (a second dense pass, one block's Grams at a
time) -> physical slicing::

    res    = prune_structured(model, adapter, ids, cfg)                      # collects what it needs
    stats  = collect_stats(model, adapter, ids, stat_kinds(cfg))             # or: every layer's statistics, cached
    res    = prune_structured(model, adapter, ids, cfg, stats=stats)         # (same weights, L Grams in memory)

1. **Statistics** (:func:`secateur.calib.collect.collect_stats`): accumulators on the inputs of ``o_proj``
   (``attn_out``) and ``down_proj`` (``mlp_out``): ``sumsq`` + ``meanvar`` for every selection score (so the
   selection never depends on the compensator), kept for every layer (global allocation reads them; 24 d bytes
   per layer and group). The uncentered ``gram`` ``C = E[x x^T]`` (with the mean) a compensator reads is taken
   in the compensation stage, one block at a time (memory formula:
   :mod:`secateur.methods.materialize`), unless the statistics passed in hold every layer's. ShortGPT adds one
   dense pass for the block influence (:func:`add_block_influence`). Structured selection from a dense pass does
   not depend on the sparsity, so one :class:`~secateur.calib.collect.StructuredStats` of :func:`stat_kinds`
   serves every sparsity and compensator (the benchmarks cache it).
2. **Selection** (:func:`secateur.budgets.select.select_units`): units ``kv_group`` / ``head`` / ``head_slot``
   (attention; ``head_slot``: one query head of every KV group, :mod:`secateur.structured.units`) and
   ``channel`` (MLP), ``uniform`` allocation (keep ``ceil((1 - rho) n)`` per layer and kind, COEC Sec. 1)
   or ``flap-global`` (FLAP AL-AM). Scores: ``wanda_sp`` (COEC's L2 form), ``flap`` (WIFV), ``rcpu``,
   ``magnitude`` (mag-sp), ``random`` (seeded), ``shortgpt`` (whole blocks), ``corp`` (MLP channels).
3. **Compensation and materialization** (:func:`secateur.methods.materialize.materialize_selection`, shared
   with CoCurve): every ``o_proj`` / ``down_proj`` that lost columns is repaired from the dense weight and the
   dense statistics, then the units are sliced out.

Block-streamed (``prune --stream``, issue 16 §3; ``blocks=`` a streamed :class:`~secateur.models.blocks.Blocks`):
the same sequence in two passes over a model built on the meta device, the output bit for bit that of the
in-memory prune + :func:`secateur.export.sliced.save_structured`. Pass 1 loads each block, runs the dense
statistics pass through it and scores its units while it is loaded (:func:`secateur.budgets.select
.selection_scores` of that block's pools; magnitude loads each block only to score it, random needs none,
ShortGPT's block influence is the streamed walk), then releases it unwritten. The selection then fixes the
output's tensors: every kept block is sliced on a meta copy to learn them (uneven widths, the bias a compensator
may add: an optional tensor, :class:`secateur.export.shards.Spec`) and the sink plans its shards. Pass 2 (the
per-block Gram pass, :class:`secateur.methods.compensation_pass.BlockCompensation`) loads each block, compensates it,
slices it when its forward is done and hands it to the sink as it is released; blocks no forward needs are loaded,
sliced and written alone; ShortGPT's removed blocks are never loaded again and the kept ones are written under
their new index. At most one block is materialized at any time (memory plan:
:func:`secateur.models.memory.structured_prune_plan`).

Details for the report (:class:`StructuredResult.details`): per-layer reconstruction error before/after,
the chosen GCV lambda and alternation rounds (COEC), the compensation time, the statistics' memory
(``statistics_memory``: bytes and formula), realized fractions (overall, per unit kind, per layer), parameter
counts before/after.
"""

from __future__ import annotations

import copy
import json
import math
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from secateur.budgets.select import select_units, selection_scores
from secateur.calib import engine
from secateur.calib.collect import GROUP_ROLE, SCORE_STATS, StructuredStats, block_influence, collect_stats
from secateur.calib.engine import BlockContext
from secateur.errors import SecateurError, check_fraction
from secateur.export.shards import Spec
from secateur.methods.knobs import knob, rounding_knob
from secateur.methods.materialize import (
    BlockCompensation,
    CompensationConfig,
    CompensationOptions,
    compensation_details,
    materialize_selection,
    statistics_memory,
)
from secateur.methods.result import MethodResult
from secateur.models.adapters import Adapter
from secateur.models.blocks import RESIDENT, Blocks, BlockSink
from secateur.models.streaming import saved_tensors
from secateur.structured.slicing import Replacement, finish_slicing, slice_layers
from secateur.structured.units import Inventory, inventory

# --- names ---------------------------------------------------------------------------------------------

#: registry method name -> unit score (secateur.scoring.structured)
SELECTIONS: dict[str, str] = {
    "wanda-sp": "wanda_sp", "flap": "flap", "rcpu": "rcpu", "magnitude-sp": "magnitude", "random": "random",
    "shortgpt": "shortgpt", "corp": "corp", "vbp": "vbp",
}
#: ``--structured`` maps these unstructured method names to their structured counterpart
STRUCTURED_ALIASES: dict[str, str] = {"magnitude": "magnitude-sp", "wanda": "wanda-sp"}
#: the compensation each selection method ships with (COEC Table 1 "native")
NATIVE: dict[str, str] = {"wanda-sp": "none", "flap": "bias", "rcpu": "rcpu", "magnitude-sp": "none",
                          "random": "none", "shortgpt": "none", "corp": "corp", "vbp": "bias"}
#: ``--allocation`` name -> allocator of :func:`secateur.budgets.select.select_units`
STRUCTURED_ALLOCATIONS: dict[str, str] = {"uniform": "uniform", "flap-global": "flap"}
#: the methods ``--stream`` runs block by block (CoCurve is refused: see REFUSED)
STREAMED = ("wanda-sp", "flap", "rcpu", "magnitude-sp", "random", "shortgpt", "corp", "vbp")
#: methods that stay in memory, with the reason the refusal gives
REFUSED = {m: "its ablation sweep and held-out lambda choice read the whole model's output logits for every "
              "candidate, which one block at a time cannot give" for m in ("cocurve", "cocurve-diag")}
UNIT_CHOICES = ("kv_group", "head", "head_slot", "channel", "qk")
ATTN_UNITS = ("kv_group", "head", "head_slot")


@dataclass
class StructuredConfig(CompensationConfig):
    """What to prune and how to repair it (the compensation fields: :class:`CompensationConfig`).

    score: unit score (``wanda_sp``, ``flap``, ``rcpu``, ``magnitude``, ``random``, ``shortgpt``, ``corp``).
    units: unit kinds (``kv_group``, ``head`` or ``head_slot``, and/or ``channel``); ``shortgpt`` always uses
    blocks.
    allocation: ``uniform`` (COEC) or ``flap-global`` (FLAP AL-AM, score ``flap`` only).
    width_multiple: every layer's kept MLP width (``channel`` units) a multiple of it, or the full width (uniform:
    rounded up; flap-global: to a neighbouring multiple, nearest the ranking's budget; rules in
    :mod:`secateur.budgets.allocate`); attention widths are not rounded; 1 (default): no rounding.
    deploy: ``vllm``: every layer that keeps attention keeps the same query heads (vLLM's DeciLM format;
    :func:`secateur.budgets.allocate.equal_heads`); None (default): no constraint.
    """

    score: str = "rcpu"
    sparsity: float = 0.3
    units: tuple[str, ...] = ("kv_group", "channel")
    allocation: str = "uniform"
    rounding: str = "ceil"
    seed: int = 0
    score_opts: dict = field(default_factory=dict)
    width_multiple: int = 1
    deploy: str | None = None

    def validate(self) -> None:
        if self.score not in SELECTIONS.values():
            raise SecateurError(f"unknown structured score {self.score!r}; choose from {sorted(SELECTIONS)}")
        super().validate()
        if self.allocation not in STRUCTURED_ALLOCATIONS:
            raise SecateurError(f"allocation must be one of {', '.join(STRUCTURED_ALLOCATIONS)}, "
                                f"not {self.allocation!r}")
        check_fraction(self.sparsity, unit="parameters")  # [0, 1): a pruned model keeps some units
        bad = [u for u in self.units if u not in UNIT_CHOICES]
        if bad or not self.units:
            raise SecateurError(f"--units takes a comma list of {', '.join(UNIT_CHOICES)}, not {bad or 'nothing'}; "
                                "pass e.g. kv_group,channel")
        if sum(u in ATTN_UNITS for u in self.units) > 1:
            raise SecateurError(f"--units names two attention units; choose one of {', '.join(ATTN_UNITS)}")
        if self.allocation == "flap-global" and self.score != "flap":
            raise SecateurError("--allocation flap-global is FLAP's AL-AM allocation; use it with --method flap")
        if self.score == "shortgpt" and self.compensation != "none":
            raise SecateurError("shortgpt removes whole blocks: there are no kept columns to compensate "
                                "(use --compensation none)")
        if self.score == "corp" and any(u not in ("channel", "qk") for u in self.units):
            raise SecateurError("corp ranks MLP channels (--units channel) and query/key head dimensions (--units "
                                "qk, non-RoPE models); use --units channel, qk or channel,qk, or compensate another "
                                "selection with --compensation corp")
        if self.score == "vbp" and any(u != "channel" for u in self.units):
            raise SecateurError("vbp ranks MLP neurons by their activation variance; use --units channel")
        if "qk" in self.units and self.score != "corp":
            raise SecateurError("--units qk (query/key head dimensions) is CORP's unit; use it with --method corp")
        from secateur.budgets.allocate import DEPLOY_TARGETS, check_width_multiple

        check_width_multiple(self.kinds, self.width_multiple)
        if self.deploy is not None and self.deploy not in DEPLOY_TARGETS:
            raise SecateurError(f"--deploy takes {', '.join(DEPLOY_TARGETS)}, not {self.deploy!r}")

    @property
    def kinds(self) -> tuple[str, ...]:
        """The unit kinds the selection allocates (CORP's ``qk`` dims are chosen per head by its own pass)."""
        return ("block",) if self.score == "shortgpt" else tuple(u for u in self.units if u != "qk")


@dataclass
class StructuredResult:
    selection: Any
    details: dict
    timings: dict[str, float]


# --- the pipeline -----------------------------------------------------------------------------------------

def selection_kinds(cfg: StructuredConfig) -> tuple[str, ...]:
    """The accumulators the selection of ``cfg`` reads (what its own dense pass collects for every layer; the
    Grams of a compensation come from the per-block pass of :func:`materialize_selection`)."""
    return () if cfg.score in ("magnitude", "random", "shortgpt") else SCORE_STATS


def stat_kinds(cfg: StructuredConfig) -> tuple[str, ...]:
    """The accumulators statistics passed to :func:`prune_structured` must hold for ``cfg``: the score's (none for
    magnitude, random and ShortGPT, whose block influence is its own forward) plus the Grams when compensating
    (every layer's: a cache reused across sparsities; without one the Grams are taken one block at a time)."""
    return selection_kinds(cfg) + (("gram",) if cfg.needs_gram else ())


def add_block_influence(stats: StructuredStats, model: nn.Module, adapter: Adapter, ids: torch.Tensor,
                        chunk_size: int = 8, blocks: Blocks = RESIDENT) -> StructuredStats:
    """``stats`` with ShortGPT's block influence (timed as ``block_influence_s``)."""
    t = time.perf_counter()
    stats.block_influence = block_influence(model, adapter, ids, batch_size=chunk_size, blocks=blocks)
    stats.timings["block_influence_s"] = time.perf_counter() - t
    stats.n_tokens = stats.n_tokens or int(ids.numel())
    return stats


def _statistics(model, adapter, ids, cfg: StructuredConfig, stats, chunk_size, device, progress,
                blocks: Blocks = RESIDENT):
    """The statistics ``cfg`` reads: ``stats`` when given (checked: with every Gram when compensating), else the
    selection's, collected from ``ids``."""
    need_bi = cfg.score == "shortgpt"
    kinds = stat_kinds(cfg)
    if stats is not None:  # reused statistics must hold what this config reads
        missing = [k for k in kinds if not stats.has((k,))]
        if missing:
            raise SecateurError(f"the statistics passed lack {', '.join(missing)} (needed by score {cfg.score!r} "
                                f"with compensation {cfg.compensation!r}); collect them with stat_kinds(cfg)")
        if need_bi and stats.block_influence is None:
            if ids is None:
                raise SecateurError("shortgpt needs calibration data for the block influence")
            stats.block_influence = block_influence(model, adapter, ids, batch_size=chunk_size, blocks=blocks)
        return stats, {}
    if (kinds or need_bi) and ids is None:
        raise SecateurError(f"structured score {cfg.score!r} needs calibration data")
    stats = collect_stats(model, adapter, ids, selection_kinds(cfg), chunk_size, device, progress, blocks=blocks)
    if need_bi:
        add_block_influence(stats, model, adapter, ids, chunk_size, blocks)
    return stats, dict(stats.timings)


def prepared(cfg: StructuredConfig) -> StructuredConfig:
    """``cfg`` validated, COEC's paper defaults filled in when it compensates with COEC."""
    import dataclasses

    cfg.validate()
    if cfg.compensation == "coec" and cfg.coec is None:
        from secateur.compensate import COECOptions

        cfg = dataclasses.replace(cfg, coec=COECOptions())
    return cfg


def prune_structured(model: nn.Module, adapter: Adapter, ids: torch.Tensor | None, cfg: StructuredConfig,
                     stats: StructuredStats | None = None, chunk_size: int = 8, device=None,
                     progress: bool = False, blocks: Blocks = RESIDENT) -> StructuredResult:
    """Select, compensate and slice ``model`` in place (see the module docstring); ``stats`` may be
    reused across calls (it must hold :func:`stat_kinds` of ``cfg``). ``blocks`` streamed: the two block passes
    of the module docstring, each finished block handed to ``blocks.sink``; the meta model ends sliced, so its
    config is the export's."""
    from secateur.eval.efficiency import count_params

    cfg = prepared(cfg)
    t_all = time.perf_counter()
    scored = None
    if blocks.streamed:  # pass 1: each block scored while it is loaded, released unwritten
        if stats is not None:
            raise SecateurError("statistics passed in are an in-memory run's; a block-streamed prune collects its own")
        stats, inv, scores, timings = streamed_scores(model, adapter, ids, cfg, chunk_size, device, progress,
                                                      blocks.without_sink())
        scored = (inv, scores)
    else:
        stats, timings = _statistics(model, adapter, ids, cfg, stats, chunk_size, device, progress, blocks)
    params_before = count_params(model)
    t = time.perf_counter()
    sel = _select(adapter, cfg, stats, scored)
    timings["select_s"] = time.perf_counter() - t
    if blocks.streamed:  # pass 2: compensate, slice and write block by block
        records, mt, memory = write_selection(model, adapter, ids, cfg, sel, stats, blocks, chunk_size=chunk_size,
                                              device=device, progress=progress)
    else:
        records, mt, memory = materialize_selection(model, adapter, sel, cfg, stats, ids, chunk_size=chunk_size,
                                                    device=device, progress=progress, blocks=blocks)
    timings.update(mt)
    if cfg.needs_gram and ids is not None:
        stats.n_tokens = stats.n_tokens or int(ids.numel())
    timings["total_s"] = time.perf_counter() - t_all
    details = structured_details(cfg, sel, stats, params_before, count_params(model), records, mt, memory)
    return StructuredResult(sel, details, timings)


def _allocation(cfg: StructuredConfig) -> str:
    return "blocks" if cfg.score == "shortgpt" else STRUCTURED_ALLOCATIONS[cfg.allocation]


def _select(adapter: Adapter, cfg: StructuredConfig, stats: StructuredStats,
            scored: tuple[Inventory, torch.Tensor] | None):
    """The selection of ``cfg``: scored here from ``stats`` (in memory), or from the unit scores a streamed pass 1
    assembled (``scored``: its inventory and scores)."""
    if scored is None:
        score_stats, extra = (stats.block_influence if cfg.score == "shortgpt" else stats.groups), {}
    else:
        score_stats, extra = None, {"inv": scored[0], "scores": scored[1]}
    return select_units(adapter, cfg.score, cfg.sparsity, score_stats, kinds=cfg.kinds, allocation=_allocation(cfg),
                        rounding=cfg.rounding, seed=cfg.seed, width_multiple=cfg.width_multiple, deploy=cfg.deploy,
                        **extra, **cfg.score_opts)


def _score_opts(cfg: StructuredConfig) -> tuple[dict, dict]:
    """``cfg.score_opts`` split into the inventory's (FFN grouping) and the scorer's, as select_units splits them."""
    inv = {k: cfg.score_opts[k] for k in ("n_ffn_groups", "ffn_order") if k in cfg.score_opts}
    return inv, {k: v for k, v in cfg.score_opts.items() if k not in inv}


def streamed_scores(model: nn.Module, adapter: Adapter, ids: torch.Tensor | None, cfg: StructuredConfig,
                    chunk_size: int = 8, device=None, progress: bool = False, blocks: Blocks = RESIDENT
                    ) -> tuple[StructuredStats, Inventory, torch.Tensor, dict]:
    """Pass 1 of a streamed prune: ``(selection statistics, the inventory, its unit scores, timings)``, each block
    scored while ``blocks`` holds it (module docstring); ``head_slot`` pools are ranked by the scores as scored."""
    inv_opts, score_opts = _score_opts(cfg)
    inv = inventory(adapter, cfg.kinds, **inv_opts)
    alloc = _allocation(cfg)
    scores = torch.zeros(len(inv), dtype=torch.float64)

    def score(i: int, groups) -> None:
        part = selection_scores(inv, adapter, cfg.score, groups, allocation=alloc, seed=cfg.seed, layers={i},
                                **score_opts)
        for p in inv.pools:
            if p.layer == i:
                scores[p.offset:p.offset + p.n] = part[p.offset:p.offset + p.n]

    kinds = selection_kinds(cfg)
    if (kinds or cfg.score == "shortgpt") and ids is None:
        raise SecateurError(f"structured score {cfg.score!r} needs calibration data")
    if kinds:
        stats = collect_stats(model, adapter, ids, kinds, chunk_size, device, progress, on_block=score, blocks=blocks)
        return stats, inv, scores, dict(stats.timings)
    stats = StructuredStats()
    if cfg.score == "magnitude":  # weights only: each block loaded to be scored
        t = time.perf_counter()
        for i in range(adapter.n_layers):
            with blocks.scope(i):
                score(i, None)
        stats.timings["stats_s"] = time.perf_counter() - t
    elif cfg.score == "shortgpt":
        t = time.perf_counter()
        stats.block_influence = block_influence(model, adapter, ids, batch_size=chunk_size, blocks=blocks)
        stats.timings["block_influence_s"] = time.perf_counter() - t
        stats.n_tokens = int(ids.numel())
        scores = selection_scores(inv, adapter, "shortgpt", stats.block_influence, allocation=alloc, seed=cfg.seed,
                                  **score_opts)
    else:  # random: seeded, no statistics and no weights
        scores = selection_scores(inv, adapter, cfg.score, None, allocation=alloc, seed=cfg.seed, **score_opts)
    return stats, inv, scores, dict(stats.timings)


def _block_specs(adapter: Adapter, sel, i: int, name: str, comp: BlockCompensation | None) -> list[Spec]:
    """The tensors block ``i`` is written with (as ``{name}.{key}``): its meta copy sliced with placeholder
    compensations, every bias a compensator could add to a bias-free projection optional."""
    layer = adapter.layers[i]
    todo = {} if comp is None else {g: kept for (j, g), (kept, _) in comp.todo.items() if j == i and kept.numel()}
    if i not in sel.layers and not todo:
        return [Spec(f"{name}.{k}", t.dtype, tuple(t.shape)) for k, t in layer.state_dict().items()]
    dry = copy.deepcopy(layer)
    where = {r.role: n for n, r in adapter.linears(layer).items()}
    reps, optional = {}, set()
    for g, kept in todo.items():
        ref = adapter.role_refs(layer)[GROUP_ROLE[g]]
        out = ref.weight.shape[0]
        reps[(i, g)] = Replacement(torch.empty(out, kept.numel(), device="meta"), torch.empty(out, device="meta"))
        if ref.bias is None:  # a compensator's bias, or none (the slice-only fallback): known when solved
            optional.add(f"{where[GROUP_ROLE[g]]}.bias")
    slice_layers(adapter, sel, reps, [i], layer_of=lambda _: dry)
    return [Spec(f"{name}.{k}", t.dtype, tuple(t.shape), optional=k in optional) for k, t in dry.state_dict().items()]


def plan_specs(model: nn.Module, adapter: Adapter, sel, comp: BlockCompensation | None) -> tuple[list[Spec], dict]:
    """The output's tensors in state-dict order (residents as they are, each kept block sliced, removed blocks
    gone, kept ones renumbered) and the new index of every kept block."""
    prefix = adapter.base_prefix + "."
    removed = set(sel.removed_blocks)
    new_index = {i: n for n, i in enumerate(i for i in range(adapter.n_layers) if i not in removed)}
    specs: list[Spec] = []
    done: set[int] = set()
    for name, t in saved_tensors(model).items():
        if not name.startswith(prefix):
            specs.append(Spec(name, t.dtype, tuple(t.shape)))
            continue
        i = int(name[len(prefix):].split(".", 1)[0])
        if i in done or i in removed:
            continue
        done.add(i)
        specs += _block_specs(adapter, sel, i, f"{prefix}{new_index[i]}", comp)
    return specs, new_index


@dataclass
class _Renumbered:
    """The run's sink with every kept block written under its new index (ShortGPT's removed blocks close up)."""

    sink: BlockSink
    prefix: str  # the block list's, with its trailing dot
    new_index: dict[int, int]

    def plan(self, specs: list) -> None:
        self.sink.plan(specs)

    def write_block(self, index: int, state: Mapping[str, torch.Tensor]) -> None:
        p, new = self.prefix, self.new_index[index]
        self.sink.write_block(new, {f"{p}{new}.{k[len(p):].split('.', 1)[1]}": t for k, t in state.items()})


class _CompensateAndSlice(BlockCompensation):
    """The per-block Gram pass of a streamed run: the block compensated (by the parent's ``on_group``), then
    sliced as soon as its forward is done (the walk's outputs are the dense ones already), then written."""

    def __init__(self, cfg, adapter: Adapter, sel, finish: Callable[[int], None]) -> None:
        super().__init__(cfg, adapter, sel)
        self.finish = finish

    def on_block_end(self, ctx: BlockContext) -> None:
        super().on_block_end(ctx)  # the block's compensations
        self.finish(ctx.index)


def write_selection(model: nn.Module, adapter: Adapter, ids: torch.Tensor | None, cfg: StructuredConfig, sel,
                    stats: StructuredStats, blocks: Blocks, *, chunk_size: int = 8, device=None,
                    progress: bool = False) -> tuple[list[dict], dict[str, float], dict | None]:
    """Pass 2 of a streamed prune (module docstring): the output's tensors planned (``blocks.sink.plan``), then
    every kept block compensated (per-block Grams), sliced and handed to the sink; the meta model ends sliced.
    Returns the compensation records, the timings (``gram_pass_s``, ``compensation_s``, ``slice_s``) and
    ``statistics_memory``, as :func:`secateur.methods.materialize.materialize_selection` does in memory."""
    if cfg.compensation != "none" and ids is None:
        raise SecateurError(f"compensation {cfg.compensation!r} needs dense calibration statistics")
    comp = None if cfg.compensation == "none" else _CompensateAndSlice(cfg, adapter, sel, lambda i: finish(i))
    reps = {} if comp is None else comp.results.reps  # filled block by block by the Gram pass

    def finish(i: int) -> None:  # block i loaded: slice it with its compensations; it is written when released
        mine = {k: reps.pop(k) for k in [k for k in reps if k[0] == i]}  # freed with the block: no O(L) growth
        slice_layers(adapter, sel, mine, [i])

    memory = None if comp is None else statistics_memory(adapter, sel, cfg, stats, per_block=True)
    specs, new_index = plan_specs(model, adapter, sel, comp)
    if blocks.sink is not None:
        blocks.sink.plan(specs)
        blocks = blocks.with_sink(_Renumbered(blocks.sink, adapter.base_prefix + ".", new_index))
    comp_s, visited, mt = 0.0, [], {}
    if comp is not None and comp.todo:
        t = time.perf_counter()
        engine.run(model, adapter, ids, comp, mode="dense", chunk_size=chunk_size, device=device,
                   progress=progress, layers=comp.layers, blocks=blocks)
        comp_s = comp.results.seconds
        mt["gram_pass_s"] = time.perf_counter() - t - comp_s
        visited = comp.layers
    t = time.perf_counter()
    for i in range(adapter.n_layers):  # the blocks no forward needs: loaded, sliced, written
        if i not in visited and i not in sel.removed_blocks:
            with blocks.scope(i):
                finish(i)
    finish_slicing(model, sel)
    mt.update(compensation_s=comp_s, slice_s=time.perf_counter() - t)
    if memory is not None:
        memory["grams_bytes_measured_peak"] = comp.peak_bytes
    return ([] if comp is None else comp.results.records), mt, memory


def structured_details(cfg: StructuredConfig, sel, stats: StructuredStats, params_before: int, params_after: int,
                       records: list[dict], mt: dict, memory: dict | None) -> dict:
    """The report's details of a structured prune (in memory or block-streamed)."""
    info = sel.info
    return {
        "structured": True, "score": cfg.score, "units": list(cfg.kinds),
        "allocation": "blocks" if cfg.score == "shortgpt" else cfg.allocation, "target_sparsity": cfg.sparsity,
        "realized": info.get("realized"), "by_kind": info.get("by_kind"),
        "per_layer_realized": {str(k): v["realized"] for k, v in (info.get("per_layer") or {}).items()},
        "removed_blocks": list(sel.removed_blocks),
        "params_before": params_before, "params_after": params_after,
        "params_removed_fraction": 1 - params_after / params_before if params_before else 0.0,
        "calibration_tokens": stats.n_tokens,
        **{k: info[k] for k in ("width_multiple", "unrounded_realized", "deploy", "deploy_query_heads",
                              "undeployed_realized") if k in info},
        **compensation_details(cfg, records, mt["compensation_s"], memory),
    }


# --- the registered methods (--method wanda-sp|flap|rcpu|magnitude-sp|random|shortgpt|corp) -------------------

def integer(value) -> int:
    """An integral knob value: an int, an integral float or a decimal string (no bool, no fraction)."""
    if isinstance(value, bool):
        raise ValueError("not an integer")
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError("not an integer")
        return int(value)
    return int(value) if isinstance(value, int) else int(str(value).strip())


@dataclass
class StructuredOptions(CompensationOptions):
    """The score-based structured methods' knobs: the units, the allocation, the rounding of each layer's count
    and the compensation."""

    units: str | tuple[str, ...] | None = knob("comma list of kv_group|head|head_slot and/or channel (default: "
                                               "kv_group,channel; head_slot: one query head of every KV group); "
                                               "corp: channel (MLP only), qk (query/key head dims only, non-RoPE) "
                                               "or channel,qk (joint; corp's default on a vision model)")
    allocation: str | None = knob("uniform ceil-kept per layer (COEC, default) or FLAP's global AL-AM (with "
                                  "--method flap)", choices=STRUCTURED_ALLOCATIONS)
    width_multiple: int | None = knob("keep every layer's MLP width (kept channels) a multiple of N, or the full "
                                      "width: 256 for llama.cpp's k-quants (Q4_K ...), 32 for q8_0; uniform rounds "
                                      "up, flap-global to the multiple nearest its budget; attention widths are not "
                                      "rounded (default: 1)", type=integer, metavar="N")
    rounding: str | None = rounding_knob()
    deploy: str | None = knob("vllm: make the selection one that vLLM's per-layer DeciLM format (secateur export vllm) "
                              "holds: the same query heads in every layer that keeps attention (KV heads per layer, "
                              "MLP widths and whole attentions stay free)", choices=("vllm",))


CORP_RANKINGS = ("combined", "activation", "magnitude")


@dataclass
class CorpOptions(StructuredOptions):
    """CORP's knobs: the structured ones and its MLP ranking (CORP Fig. 5)."""

    CLI_GROUP = "CORP (--method corp)"

    corp_ranking: str | None = knob("CORP's MLP channel ranking (Fig. 5): combined E[h_i^2] ||W2[:, i]|| (default), "
                                    "activation E[h_i^2], magnitude ||W2[:, i]||", choices=CORP_RANKINGS)


def _units(value) -> tuple[str, ...]:
    if value is None:
        return ("kv_group", "channel")
    if isinstance(value, str):
        return tuple(u.strip() for u in value.split(",") if u.strip())
    return tuple(value)


def structured_config(name: str, opts, adapter: Adapter | None = None) -> StructuredConfig:
    """The validated :class:`StructuredConfig` of registry method ``name`` from ``PruneOptions`` (its common
    fields and its :class:`StructuredOptions`); no ``--compensation``: the method as its paper ships it
    (FLAP's bias, RCPU's rotation, CORP's ridge). CORP's default units: MLP channels and query/key dims (joint,
    its headline vision setting) on a vision encoder, MLP channels on a language model (RoPE: no Q/K pruning)."""
    o: StructuredOptions = opts.method_options
    if o.units is None and name == "corp":
        units = ("channel", "qk") if adapter is not None and adapter.modality == "vision" else ("channel",)
    elif o.units is None and name == "vbp":
        units = ("channel",)
    else:
        units = _units(o.units)
    cfg = StructuredConfig(**o.compensation_fields(NATIVE[name]), score=SELECTIONS[name], units=units,
                           allocation=o.allocation or "uniform", rounding=o.rounding or "ceil",
                           sparsity=float(opts.sparsity), seed=int(opts.seed or 0),
                           width_multiple=1 if o.width_multiple is None else o.width_multiple,
                           deploy=getattr(o, "deploy", None))
    ranking = getattr(o, "corp_ranking", None)
    if ranking not in (None, "combined"):
        cfg.score_opts = {"weight_factor": ranking}
    cfg.validate()
    return cfg


def check_reachable(name: str, adapter: Adapter, opts) -> None:
    """Refuse, from the model's shapes alone (before calibration), a uniform target above what the rounding
    rule can deliver: ``ceil`` keeps at least one unit of every (layer, kind) pool."""
    if name == "shortgpt":
        return
    cfg = structured_config(name, opts, adapter)
    if "qk" in cfg.units:
        from secateur.methods.corp_qk import check_supported

        check_supported(adapter)
    if STRUCTURED_ALLOCATIONS[cfg.allocation] != "uniform" or not cfg.kinds:
        return
    from secateur.budgets.allocate import UNIT_NAMES, uniform_reach
    from secateur.structured.units import inventory

    reach = uniform_reach(inventory(adapter, cfg.kinds), cfg.rounding, cfg.width_multiple)
    if cfg.sparsity > reach:
        kept = " and ".join(f"one {UNIT_NAMES.get(k, k)}" if k != "channel" or cfg.width_multiple == 1 else
                            f"{cfg.width_multiple} MLP channels (--width-multiple)" for k in cfg.kinds)
        raise SecateurError(f"--sparsity {cfg.sparsity} cannot be reached with --structured {name}: at most "
                            f"{reach:.4f} of the removable parameters can go, because at least {kept} per layer "
                            f"are kept (ceil rounding); use --sparsity {math.floor(reach * 1000) / 1000} or less")


def run(name: str, model: nn.Module, adapter: Adapter, calib_ids: torch.Tensor | None, opts,
        blocks: Blocks = RESIDENT) -> MethodResult:
    """Registry runner: prune in place (``blocks`` streamed: each finished block handed to its sink, see the
    module docstring); the selection travels as ``secateur_selection.json``."""
    cfg = structured_config(name, opts, adapter)
    if cfg.needs_gram and calib_ids is not None and cfg.kinds and not opts.run.quiet:
        # said up front: the compensation's passes are most of the run
        print(f"secateur: note: --compensation {cfg.compensation} takes the calibration set through the model again "
              f"after the statistics pass, block by block, for the Grams of the kept inputs (about 3-4 forwards of "
              f"{adapter.describe_inputs(calib_ids)} in all)", file=sys.stderr)
    if "qk" in cfg.units:
        return _corp_with_qk(name, model, adapter, calib_ids, cfg, opts, blocks)
    res = prune_structured(model, adapter, calib_ids, cfg, chunk_size=opts.run.chunk_size,
                           device=opts.device, progress=not opts.run.quiet, blocks=blocks)
    return method_result(name, res)


def _corp_with_qk(name: str, model: nn.Module, adapter: Adapter, ids: torch.Tensor | None, cfg: StructuredConfig,
                  opts, blocks: Blocks) -> MethodResult:
    """CORP joint (seed 002 Sec. 3): its MLP channels (``channel``: the structured pass, selection + ridge
    compensation + slicing) and then, on the MLP-pruned model, its query/key head dimensions (``qk``: a sequential
    pass, :func:`secateur.methods.corp_qk.prune_corp_qk` sliced into narrow q/k heads), both at ``--sparsity``:
    ``d_h - floor(rho d_h)`` dims kept per head, ``rho`` of the MLP channels removed. The Q/K statistics are taken
    on the already MLP-pruned blocks' inputs (sequential, as SparseGPT propagates its errors). ``--compensation
    none``: neither part compensated (the paper's "w/o compensation" arm)."""
    from secateur.eval.efficiency import count_params
    from secateur.methods.corp_qk import CorpQKConfig, prune_corp_qk

    blocks.resident_only("--method corp --units qk (query/key head dimensions)")
    before = count_params(model)
    mlp = replace(cfg, units=cfg.kinds) if cfg.kinds else None
    res = (prune_structured(model, adapter, ids, mlp, chunk_size=opts.run.chunk_size, device=opts.device,
                            progress=not opts.run.quiet, blocks=blocks) if mlp else None)
    qk_cfg = CorpQKConfig(sparsity=cfg.sparsity, compensate=cfg.compensation != "none")
    qk = prune_corp_qk(model, adapter, ids, qk_cfg, chunk_size=opts.run.chunk_size,
                       device=opts.device, progress=not opts.run.quiet, blocks=blocks, slice_heads=True)
    after = count_params(model)
    g = adapter.geometry
    qk_targeted = adapter.n_layers * 2 * g.n_heads * g.head_dim * (g.hidden + int(g.qkv_bias))
    mlp_targeted = int(res.selection.info.get("total_removable") or 0) if res else 0
    timings = {**(res.timings if res else {}), **{f"qk_{k}": v for k, v in qk["timings"].items()}}
    details = {"method": name, **(res.details if res else {"structured": True, "score": "corp"}),
               "units": list(cfg.units), "qk": qk["details"], "params_before": before, "params_after": after,
               "params_removed_fraction": 1 - after / before,
               "realized_sparsity": {"targeted": (before - after) / (mlp_targeted + qk_targeted),
                                     "of_all_parameters": 1 - after / before, "pruned_weights": before - after,
                                     "targeted_weights": mlp_targeted + qk_targeted,
                                     "mlp_channels": res.selection.info.get("realized") if res else 0.0,
                                     "qk_dims": 1 - qk["details"]["d_s"][0] / g.head_dim}}
    files = {"secateur_selection.json": json.dumps(res.selection.to_dict(), indent=1).encode()} if res else {}
    return MethodResult(masks={}, timings=timings, details=details, extra_files=files)


def method_result(name: str, res: StructuredResult) -> MethodResult:
    """The registry's result of a structured prune; the selection travels as ``secateur_selection.json``."""
    d = res.details
    details = {"method": name, **d,
               "realized_sparsity": res.selection.realized_sparsity(d["params_before"], d["params_after"])}
    files = {"secateur_selection.json": json.dumps(res.selection.to_dict(), indent=1).encode()}
    return MethodResult(masks={}, timings=res.timings, details=details, extra_files=files)
