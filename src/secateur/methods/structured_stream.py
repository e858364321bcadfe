"""``prune --stream`` for the score-based structured methods (issue 16 §3): the model built on the meta device
(:mod:`secateur.models.streaming`), two block-streamed passes, the output bit for bit that of
:func:`secateur.methods.structured.prune_structured` + :func:`secateur.export.sliced.save_structured`.

1. **Statistics and scores**: each block loaded, the calibration set run through it (the same dense engine pass
   as :func:`secateur.calib.collect.collect_stats`), its selection statistics accumulated and its units scored
   while it is loaded (:func:`secateur.budgets.select.selection_scores` of that block's pools), then released
   without being written. Magnitude loads each block only to score it; random scores need no block; ShortGPT's
   block influence is the streamed walk of :func:`secateur.calib.collect.block_influence`.
2. **Selection** from the assembled scores (:func:`secateur.budgets.select.select_units`, ``scores=``): the output
   shapes are known now. Every kept block is sliced on a meta copy to learn its tensors (uneven widths, the bias
   a compensator may add: an optional tensor of the shard plan, :class:`secateur.export.shards.Spec`), and the
   caller's ``open_writer(specs)`` plans the shards.
3. **Compensate, slice, write**: the per-block Gram pass (:class:`secateur.methods.materialize.BlockCompensation`,
   dense walk) loads each block, compensates its projections when its forward is done, slices it and hands it
   to the writer as it is released; blocks past the last compensated one (and every block without compensation)
   are loaded, sliced and written without a forward. ShortGPT's removed blocks are never loaded again and the
   kept ones are written under their new index. The meta model ends sliced: its config is the export's.

At most one block is materialized at any time; what stays is the selection statistics (24 d bytes per layer and
group), the unit scores and one block's Grams (memory plan: :func:`secateur.models.memory.structured_prune_plan`).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable

import torch
from torch import nn

from secateur.budgets.select import select_units, selection_scores
from secateur.calib import engine
from secateur.calib.collect import GROUP_ROLE, StructuredStats, block_influence, collect_stats
from secateur.calib.engine import BlockContext, block_scope
from secateur.errors import SecateurError
from secateur.export.shards import Spec
from secateur.methods.materialize import BlockCompensation, statistics_memory
from secateur.methods.result import MethodResult
from secateur.methods.structured import (
    STRUCTURED_ALLOCATIONS,
    StructuredConfig,
    StructuredResult,
    method_result,
    prepared,
    selection_kinds,
    structured_config,
    structured_details,
)
from secateur.models.adapters import Adapter
from secateur.models.streaming import STREAM_ATTR, saved_tensors
from secateur.structured.slicing import Replacement, finish_slicing, slice_layers
from secateur.structured.units import Inventory, inventory

#: the methods this module streams (CoCurve is refused: see REFUSED)
STREAMED = ("wanda-sp", "flap", "rcpu", "magnitude-sp", "random", "shortgpt", "corp")
#: methods that stay in memory, with the reason the refusal gives
REFUSED = {m: "its ablation sweep and held-out lambda choice read the whole model's output logits for every "
              "candidate, which one block at a time cannot give" for m in ("cocurve", "cocurve-diag")}

Writer = Callable[[str, torch.Tensor], None]


def run(name: str, model: nn.Module, adapter: Adapter, calib_ids: torch.Tensor | None, opts,
        open_writer: Callable[[list[Spec]], Writer]) -> MethodResult:
    """Registry runner of a streamed structured prune (``model`` built by
    :func:`secateur.models.streaming.open_streamed`, residents loaded): ``open_writer(specs)`` is called once the
    output's tensors are known and returns the writer of each finished tensor."""
    res = prune_structured_streamed(model, adapter, calib_ids, structured_config(name, opts), open_writer,
                                    chunk_size=opts.chunk_size, device=opts.device, progress=not opts.quiet)
    return method_result(name, res)


def _allocation(cfg: StructuredConfig) -> str:
    return "blocks" if cfg.score == "shortgpt" else STRUCTURED_ALLOCATIONS[cfg.allocation]


def _score_opts(cfg: StructuredConfig) -> tuple[dict, dict]:
    """``cfg.score_opts`` split into the inventory's (FFN grouping) and the scorer's, as select_units splits them."""
    inv = {k: cfg.score_opts[k] for k in ("n_ffn_groups", "ffn_order") if k in cfg.score_opts}
    return inv, {k: v for k, v in cfg.score_opts.items() if k not in inv}


def stream_scores(model: nn.Module, adapter: Adapter, ids: torch.Tensor | None, cfg: StructuredConfig,
                  chunk_size: int = 8, device=None, progress: bool = False
                  ) -> tuple[StructuredStats, Inventory, torch.Tensor, dict]:
    """Pass 1: ``(selection statistics, the inventory, its unit scores, timings)``, each block scored while it is
    loaded and released unwritten (module docstring); ``head_slot`` pools are ranked by the scores as scored."""
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
    if kinds and ids is None:
        raise SecateurError(f"structured score {cfg.score!r} needs calibration data")
    if kinds:
        stats = collect_stats(model, adapter, ids, kinds, chunk_size, device, progress, on_block=score)
        return stats, inv, scores, dict(stats.timings)
    stats = StructuredStats()
    if cfg.score == "magnitude":  # weights only: each block loaded to be scored
        t = time.perf_counter()
        for i in range(adapter.n_layers):
            with block_scope(adapter, i):
                score(i, None)
        stats.timings["stats_s"] = time.perf_counter() - t
    elif cfg.score == "shortgpt":
        if ids is None:
            raise SecateurError("structured score 'shortgpt' needs calibration data")
        t = time.perf_counter()
        stats.block_influence = block_influence(model, adapter, ids, batch_size=chunk_size)
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
    stream = getattr(model, STREAM_ATTR)
    prefix = stream.prefix + "."
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


class _CompensateAndSlice(BlockCompensation):
    """The per-block Gram pass of a streamed run: the block compensated (by the parent's ``on_group``), then
    sliced as soon as its forward is done (the walk's outputs are the dense ones already), then written."""

    def __init__(self, cfg, adapter: Adapter, sel, finish: Callable[[int], None]) -> None:
        super().__init__(cfg, adapter, sel)
        self.finish = finish

    def on_block_end(self, ctx: BlockContext) -> None:
        self.finish(ctx.index)


def prune_structured_streamed(model: nn.Module, adapter: Adapter, ids: torch.Tensor | None, cfg: StructuredConfig,
                              open_writer: Callable[[list[Spec]], Writer], chunk_size: int = 8, device=None,
                              progress: bool = False) -> StructuredResult:
    """Select, compensate, slice and write a block-streamed model (module docstring); the meta model ends
    sliced, so its config is the export's."""
    from secateur.eval.efficiency import count_params

    cfg = prepared(cfg)
    t_all = time.perf_counter()
    stats, inv, scores, timings = stream_scores(model, adapter, ids, cfg, chunk_size, device, progress)
    params_before = count_params(model)
    t = time.perf_counter()
    inv_opts, score_opts = _score_opts(cfg)
    sel = select_units(adapter, cfg.score, cfg.sparsity, None, kinds=cfg.kinds, allocation=_allocation(cfg),
                       rounding=cfg.rounding, seed=cfg.seed, scores=scores, inv=inv, width_multiple=cfg.width_multiple,
                       **inv_opts, **score_opts)
    timings["select_s"] = time.perf_counter() - t
    records, memory = write_selection(model, adapter, ids, cfg, sel, stats, open_writer, timings,
                                      chunk_size=chunk_size, device=device, progress=progress)
    if cfg.needs_gram and ids is not None:
        stats.n_tokens = stats.n_tokens or int(ids.numel())
    timings["total_s"] = time.perf_counter() - t_all
    details = structured_details(cfg, sel, stats, params_before, count_params(model), records, timings, memory)
    return StructuredResult(sel, details, timings)


def write_selection(model: nn.Module, adapter: Adapter, ids: torch.Tensor | None, cfg: StructuredConfig, sel,
                    stats: StructuredStats, open_writer: Callable[[list[Spec]], Writer], timings: dict, *,
                    chunk_size: int = 8, device=None, progress: bool = False) -> tuple[list[dict], dict | None]:
    """Pass 2 (module docstring): plan the output's tensors, then compensate (per-block Grams), slice and write
    every kept block; the meta model ends sliced. Returns the compensation records and ``statistics_memory``;
    adds ``compensation_s``, ``gram_pass_s`` and ``slice_s`` to ``timings``."""
    if cfg.compensation != "none" and ids is None:
        raise SecateurError(f"compensation {cfg.compensation!r} needs dense calibration statistics")
    stream = getattr(model, STREAM_ATTR)
    comp = None if cfg.compensation == "none" else _CompensateAndSlice(cfg, adapter, sel, lambda i: finish(i))
    reps = {} if comp is None else comp.results.reps  # filled block by block by the Gram pass

    def finish(i: int) -> None:  # block i loaded: slice it with its compensations; it is written when released
        mine = {k: reps.pop(k) for k in [k for k in reps if k[0] == i]}  # freed with the block: no O(L) growth
        slice_layers(adapter, sel, mine, [i])

    memory = None if comp is None else statistics_memory(adapter, sel, cfg, stats, per_block=True)
    specs, new_index = plan_specs(model, adapter, sel, comp)
    write = open_writer(specs)
    p = stream.prefix + "."

    def renamed(name: str, tensor: torch.Tensor) -> None:
        i, rest = name[len(p):].split(".", 1)
        write(f"{p}{new_index[int(i)]}.{rest}", tensor)

    stream.writer = renamed
    comp_s, visited = 0.0, []
    try:
        if comp is not None and comp.todo:
            t = time.perf_counter()
            engine.run(model, adapter, ids, comp, mode="dense", chunk_size=chunk_size, device=device,
                       progress=progress, layers=comp.layers)
            comp_s = comp.results.seconds
            timings["gram_pass_s"] = time.perf_counter() - t - comp_s
            visited = comp.layers
        t = time.perf_counter()
        for i in range(adapter.n_layers):  # the blocks no forward needs: loaded, sliced, written
            if i not in visited and i not in sel.removed_blocks:
                with block_scope(adapter, i):
                    finish(i)
    finally:
        stream.writer = None
    finish_slicing(model, sel)
    timings.update(compensation_s=comp_s, slice_s=time.perf_counter() - t)
    if memory is not None:
        memory["grams_bytes_measured_peak"] = comp.peak_bytes
    return ([] if comp is None else comp.results.records), memory
