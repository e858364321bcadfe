"""Collect the statistics the structured scores need from a calibration-engine pass.

Usage (dense statistics, as COEC/FLAP/CoCurve baselines use)::

    h = StatsCollector.for_method("rcpu")
    engine.run(model, adapter, ids, h, mode="dense")
    sel = select_units(adapter, "rcpu", 0.3, stats=h.stats)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from secateur.calib import engine
from secateur.calib.engine import BlockContext, Handler, Walk
from secateur.calib.stats import Accumulator, BlockInfluence, make_accumulators
from secateur.errors import SecateurError
from secateur.models.adapters import Adapter
from secateur.models.blocks import RESIDENT, Blocks

# accumulators over the o_proj / down_proj inputs that each score reads
REQUIRED_STATS: dict[str, tuple[str, ...]] = {
    "random": (), "magnitude": (), "magnitude_unit": (),
    "wanda_sp": ("sumsq",), "flap": ("meanvar",), "flap_wifn": ("sumsq",),
    "rcpu": ("sumsq", "meanvar"), "corp": ("sumsq",),
}


class StatsCollector(Handler):
    """Keeps ``stats[layer][group] = {name: accumulator}`` for the ``attn_out`` and ``mlp_out`` groups (the
    o_proj / down_proj inputs); :func:`collect_stats` runs it and times the pass."""

    resumable = True
    modifies_weights = False

    def __init__(self, kinds: tuple[str, ...] | list[str], groups: tuple[str, ...] = ("attn_out", "mlp_out"),
                 on_block: Callable[[int, dict], None] | None = None):
        self.kinds = tuple(kinds)
        self.groups = groups
        self.stats: dict[int, dict[str, dict[str, Accumulator]]] = {}
        self.on_block = on_block  # on_block(index, stats) while the block is loaded (a streamed run's scores)

    @classmethod
    def for_method(cls, method: str, metric: str = "wifv") -> StatsCollector:
        key = "flap_wifn" if method == "flap" and metric == "wifn" else method
        if key not in REQUIRED_STATS:
            raise SecateurError(f"no statistics recipe for score {method!r}")
        return cls(REQUIRED_STATS[key])

    def accumulators(self, ctx: BlockContext, group: str, names: list[str]) -> dict[str, Accumulator]:
        if group not in self.groups or not self.kinds or not names:
            return {}
        return make_accumulators(self.kinds, ctx.refs[names[0]].in_features)

    def on_group(self, ctx: BlockContext, group: str, names: list[str], accs: dict[str, Accumulator]) -> None:
        if accs:
            self.stats.setdefault(ctx.index, {})[group] = accs

    def on_block_end(self, ctx: BlockContext) -> None:
        if self.on_block is not None:
            self.on_block(ctx.index, self.stats)

    def block_state(self, ctx: BlockContext) -> dict:
        from secateur.calib.resume import pack_accumulator

        stats = self.stats.get(ctx.index, {})
        return {g: {k: pack_accumulator(a) for k, a in accs.items()} for g, accs in stats.items()}

    def load_block_state(self, index: int, state: dict) -> None:
        from secateur.calib.resume import unpack_accumulator

        if state:
            self.stats[index] = {g: {k: unpack_accumulator(a) for k, a in accs.items()} for g, accs in state.items()}


def block_influence(model, adapter: Adapter, ids: torch.Tensor, batch_size: int = 8,
                    blocks: Blocks = RESIDENT) -> torch.Tensor:
    """ShortGPT's BI of every block (:class:`BlockInfluence`) from one dense pass over ``ids [N, T]``: the
    calibration engine's block walker, ``batch_size`` sequences per chunk (``model``: unused, the adapter's;
    ``blocks``: where the walk's blocks come from)."""
    accs = [BlockInfluence() for _ in range(adapter.n_layers)]
    with torch.no_grad():
        walk = Walk(adapter, ids, batch_size, blocks=blocks)
        for visit in walk.blocks():
            if walk.shard.split:  # each rank its chunks; the sums merged in chunk order on every rank
                def pair(j: int, visit=visit) -> tuple[torch.Tensor, torch.Tensor]:
                    h = visit.input(j)
                    return h, visit.output(j, h)

                engine.sharded_updates(len(visit.inputs), pair, {"bi": accs[visit.index]}, "", walk.shard,
                                       update=lambda part, hy: part["bi"].update(*hy))
                continue
            for j in range(len(visit.inputs)):
                h = visit.input(j)
                accs[visit.index].update(h, visit.output(j, h))
    return torch.tensor([a.bi for a in accs], dtype=torch.float64)


#: the structured pipeline's statistics groups: the inputs of o_proj (``attn_out``) and down_proj (``mlp_out``)
GROUP_ROLE = {"attn_out": "o", "mlp_out": "down"}
#: the accumulators every structured selection score reads (so the selection never depends on the compensator)
SCORE_STATS = ("sumsq", "meanvar")


@dataclass
class StructuredStats:
    """Dense calibration statistics: ``groups[layer][group] = {name: accumulator}`` and, for ShortGPT,
    the per-block influence; ``n_tokens`` and the engine timings for the report."""

    groups: dict[int, dict[str, dict[str, Accumulator]]] = field(default_factory=dict)
    block_influence: torch.Tensor | None = None
    n_tokens: int = 0
    timings: dict[str, float] = field(default_factory=dict)

    def has(self, kinds: tuple[str, ...] | set[str]) -> bool:
        return all(k in accs for g in self.groups.values() for accs in g.values() for k in kinds) and \
            bool(self.groups)


def collect_stats(model: torch.nn.Module, adapter, ids: torch.Tensor, kinds: tuple[str, ...] = SCORE_STATS,
                  chunk_size: int = 8, device=None, progress: bool = False,
                  on_block: Callable[[int, dict], None] | None = None, blocks: Blocks = RESIDENT) -> StructuredStats:
    """One dense engine pass (COEC Sec. 3.1 "a single forward pass accumulates all Grams"; CORP Alg. 1
    "global" schedule) collecting ``kinds`` on the o_proj / down_proj inputs of every layer. No ``kinds``:
    empty statistics (ShortGPT's block influence is its own forward, see
    :func:`secateur.methods.structured.add_block_influence`). ``on_block(index, stats)``: called after each block's
    statistics, while the block is loaded (a block-streamed run scores it then); ``blocks``: the walk's block
    source and sink (:mod:`secateur.models.blocks`)."""
    if not kinds:
        return StructuredStats()
    h = StatsCollector(tuple(kinds), tuple(GROUP_ROLE), on_block)
    t = time.perf_counter()
    rep = engine.run(model, adapter, ids, h, mode="dense", chunk_size=chunk_size, device=device, progress=progress,
                     blocks=blocks)
    return StructuredStats(h.stats, None, rep.n_tokens, {"stats_s": time.perf_counter() - t,
                                                         **{f"engine_{k}": v for k, v in rep.timings.items()}})
