"""Sequential calibration engine: one block at a time, statistics by hooks, pruned inputs propagated.

The calibration hidden states live on the CPU as a list of ``[b, T, d]`` chunks; one block at a time
is moved to the compute device. Inside a block the four groups (``attn_in``, ``attn_out``, ``mlp_in``,
``mlp_out``; see :mod:`secateur.models.adapters`) are processed in forward order. Modes:

``sequential`` (default)
    Each group's statistics are accumulated over all chunks, the handler prunes the group, and the
    next stage runs on the already-pruned earlier groups: every sublayer is computed exactly once, so
    the whole job costs one dense forward of the calibration set (SparseGPT's "true sequential").
``dense-block``
    Statistics of all four groups come from the dense block (the original Wanda procedure), then the
    handler prunes every group and the pruned block is re-run: two block forwards.
``dense``
    Statistics from the dense model only; the handler is called but block outputs stay dense (the
    single dense pass COEC, CORP and the structured selections use).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from tqdm.auto import tqdm

from secateur import stall
from secateur.calib import resume
from secateur.calib.stats import Accumulator, update_all
from secateur.errors import SecateurError
from secateur.models.adapters import GROUPS, Adapter
from secateur.models.blocks import ALONE, RESIDENT, Blocks, Shard
from secateur.models.linear import LinearRef

MODES = ("sequential", "dense-block", "dense")


@dataclass
class BlockContext:
    """What a handler sees: the block, its projections, and the kwargs its attention needs."""

    index: int
    layer: nn.Module
    adapter: Adapter
    refs: dict[str, LinearRef]
    kwargs: dict


class Handler:
    """Override ``accumulators`` (what to collect for a group) and ``on_group`` (what to do with it).

    Resumable handlers (``secateur prune --resume``) set ``resumable = True`` and implement ``block_state``
    (everything the handler learned in a finished block, as tensors/numbers) and ``load_block_state``
    (put it back); the engine checkpoints it with the block's weights and the next block's inputs.
    """

    resumable = False
    modifies_weights = True  # False: the block's weights are not checkpointed (statistics-only handlers)

    def accumulators(self, ctx: BlockContext, group: str, names: list[str]) -> dict[str, Accumulator]:
        return {}

    def on_group(self, ctx: BlockContext, group: str, names: list[str], accs: dict[str, Accumulator]) -> None:
        pass

    def on_block_end(self, ctx: BlockContext) -> None:
        pass

    def block_state(self, ctx: BlockContext) -> dict:
        raise NotImplementedError

    def load_block_state(self, index: int, state: dict) -> None:
        raise NotImplementedError


def _after_block(index: int) -> None:
    """Called after block ``index`` is finished and checkpointed (a seam for the resume tests)."""


@dataclass
class EngineReport:
    mode: str
    n_tokens: int
    timings: dict[str, float] = field(default_factory=dict)
    outputs: list[torch.Tensor] | None = None  # last block's outputs, when asked for

    def add(self, key: str, dt: float) -> None:
        self.timings[key] = self.timings.get(key, 0.0) + dt


def _map_chunks(chunks: list[torch.Tensor | None], fn: Callable[[torch.Tensor], torch.Tensor], device: torch.device,
                accs: dict[str, Accumulator] | None = None, where: str = "",
                shard: Shard = ALONE) -> list[torch.Tensor | None]:
    """``fn`` of every chunk (on ``device``, results on the CPU), ``accs`` updated with each result in chunk order.
    Split over processes (``shard``): each rank maps its own chunks (None elsewhere) and the statistics are merged
    chunk by chunk on every rank (:func:`sharded_updates`)."""
    if shard.split:
        out: list[torch.Tensor | None] = [None] * len(chunks)

        def one(j: int):
            y = fn(chunks[j].to(device))
            out[j] = y.to("cpu")
            return y

        with torch.no_grad():
            sharded_updates(len(chunks), one, accs, where, shard)
        return out
    out = []
    with torch.no_grad():
        for c in chunks:
            y = fn(c.to(device))
            if accs:
                update_all(accs, y, where)
            out.append(y.to("cpu"))
    return out


def sharded_updates(n: int, compute: Callable[[int], object], accs: dict[str, Accumulator] | None, where: str,
                    shard: Shard, update: Callable[[dict, object], None] | None = None) -> None:
    """Chunks ``0 .. n-1`` over the ranks of ``shard`` in rounds of ``world`` chunks: each rank computes its chunk of
    the round (``compute(j)``) into fresh accumulators, then every chunk of the round is merged into ``accs`` on
    every rank, in chunk order (:func:`secateur.calib.dist.ordered_merge`): one chunk's contribution alive per
    rank at a time, and the statistics bit for bit the single process's. ``update(accs, result)``: how a result
    updates accumulators (default: :func:`update_all` with the finiteness check, whose failure every rank raises)."""
    from secateur.calib import dist

    for r0 in range(0, n, shard.world):
        mine = r0 + shard.rank
        part = None
        if mine < n:
            y = compute(mine)
            if accs:
                part = {k: a.fresh() for k, a in accs.items()}
                try:
                    (update or (lambda a, v: update_all(a, v, where)))(part, y)
                except SecateurError as e:
                    part = {"error": str(e)}
            del y
        if accs:
            for j in range(r0, min(r0 + shard.world, n)):
                dist.ordered_merge(accs, part if j == mine else None, shard.owner(j))
            del part


def _map2(a: list[torch.Tensor | None], b: list[torch.Tensor | None], fn, device) -> list[torch.Tensor | None]:
    with torch.no_grad():
        return [None if x is None else fn(x.to(device), y.to(device)).to("cpu") for x, y in zip(a, b)]


def embed_chunks(adapter: Adapter, ids: torch.Tensor, chunk_size: int,
                 shard: Shard = ALONE) -> tuple[list[torch.Tensor | None], dict]:
    """Block-0 inputs for every chunk (on the CPU; split over processes: this rank's chunks, None for the others')
    and the block kwargs (captured at batch size 1)."""
    _, kw = adapter.capture_inputs(ids[:1])
    hs: list[torch.Tensor | None] = []
    for c, s in enumerate(range(0, ids.shape[0], chunk_size)):
        if not shard.owns(c):
            hs.append(None)
            continue
        h, _ = adapter.capture_inputs(ids[s:s + chunk_size])
        hs.append(h.to("cpu"))
    return hs, kw


def kwargs_to(kw: dict, device: torch.device) -> dict:
    """The block kwargs with every tensor (and tuple of tensors, e.g. RoPE tables; per-layer-type values) on
    ``device``."""
    def move(v):
        if isinstance(v, dict):
            return type(v)({k: move(x) for k, x in v.items()})
        return tuple(t.to(device) for t in v) if isinstance(v, tuple) else v.to(device) if torch.is_tensor(v) else v

    return {k: move(v) for k, v in kw.items()}


def run_blocks(adapter: Adapter, h: torch.Tensor, kw: dict, start: int = 0) -> torch.Tensor:
    """``h`` through blocks ``start .. L-1`` with the family's own block forward (no chunking, no copies)."""
    for i in range(start, adapter.n_layers):
        h = adapter.block_forward(adapter.layers[i], h, adapter.layer_kwargs(i, kw))
    return h


@dataclass
class BlockVisit:
    """One block of a :class:`Walk`: the block, its kwargs and its input chunks (where the walk keeps them).

    :meth:`output` is the dense block output of one chunk (computed once, on the compute device); the walk
    hands :attr:`outputs` to the next block. A consumer that computes the outputs another way (the
    calibration engine's staged, pruned forward) sets :attr:`outputs` itself.
    """

    index: int
    layer: nn.Module
    adapter: Adapter
    kwargs: dict
    inputs: list[torch.Tensor]
    device: torch.device
    store: torch.device | None
    _out: dict[int, torch.Tensor] = field(default_factory=dict)
    _set: list[torch.Tensor] | None = None

    def input(self, j: int) -> torch.Tensor:
        """Input chunk ``j`` on the compute device."""
        return self.inputs[j].to(self.device)

    def output(self, j: int, h: torch.Tensor | None = None) -> torch.Tensor:
        """Dense output of chunk ``j`` on the compute device (``h``: that chunk's input already there);
        computed once and kept where the walk keeps its chunks."""
        if j in self._out:
            return self._out[j].to(self.device)
        with torch.no_grad():
            y = self.adapter.block_forward(self.layer, self.input(j) if h is None else h, self.kwargs)
        self._out[j] = y if self.store is None else y.to(self.store)
        return y

    @property
    def outputs(self) -> list[torch.Tensor]:
        """Every chunk's output where the walk keeps them (computing those not yet asked for)."""
        if self._set is None:
            for j in range(len(self.inputs)):
                if j not in self._out and self.inputs[j] is not None:
                    self.output(j)
            self._set = [self._out.get(j) for j in range(len(self.inputs))]
        return self._set

    def mine(self) -> list[int]:
        """The chunks this process holds (every chunk unless the walk is split over processes)."""
        return [j for j, h in enumerate(self.inputs) if h is not None]

    @outputs.setter
    def outputs(self, hs: list[torch.Tensor]) -> None:
        self._set = hs


class Walk:
    """The one block walker: calibration ids -> per-chunk block-0 inputs, then every block in turn.

    ``Walk(adapter, ids, chunk_size, device)`` embeds ``ids [N, T]`` in chunks of ``chunk_size`` sequences
    (kwargs captured at batch size 1, moved to ``device``, default the model's); :meth:`blocks` yields a
    :class:`BlockVisit` per block (each block visits ``device`` and goes back home afterwards) and feeds
    its :attr:`BlockVisit.outputs` to the next. Chunks are kept on ``store`` between blocks (the CPU by
    default; ``None`` keeps them where they were computed). ``blocks``: where the blocks come from and where the
    finished ones go (:mod:`secateur.models.blocks`; default: in memory, kept there): each visit happens inside
    :meth:`~secateur.models.blocks.Blocks.scope`, so a streamed block is loaded for its visit only. Split over
    processes (``blocks.shard``), a rank embeds and carries only its own chunks (``c % world == rank``; the others
    are None) and the statistics are merged chunk by chunk (:func:`sharded_updates`). Used by the calibration
    engine, the held-out QK error, ShortGPT's block influence and the CoCurve sweep's dense pass.
    """

    def __init__(self, adapter: Adapter, ids: torch.Tensor, chunk_size: int,
                 device: str | torch.device | None = None, *, store: str | torch.device | None = "cpu",
                 kwargs: dict | None = None, blocks: Blocks = RESIDENT) -> None:
        self.adapter = adapter
        self.block_context = blocks
        self.shard = blocks.shard
        self.home = adapter.device
        self.device = torch.device(device) if device is not None else self.home
        self.store = None if store is None else torch.device(store)
        if kwargs is None:
            self.hs, kw = embed_chunks(adapter, ids, chunk_size, self.shard)
        else:  # kwargs captured elsewhere: only the hidden states are embedded
            kw = kwargs
            self.hs = [adapter.capture_inputs(ids[s:s + chunk_size])[0] if self.shard.owns(c) else None
                       for c, s in enumerate(range(0, ids.shape[0], chunk_size))]
        if self.store is not None:
            self.hs = [None if h is None else h.to(self.store) for h in self.hs]
        self.kwargs = kwargs_to(kw, self.device)

    def blocks(self, layers: list[int] | None = None, start: int = 0, progress: bool = False,
               desc: str = "blocks") -> Iterator[BlockVisit]:
        """Visit blocks ``layers[start:]`` (default: all) in order."""
        todo = list(range(self.adapter.n_layers) if layers is None else layers)
        for pos in tqdm(range(start, len(todo)), desc=desc, disable=not progress, initial=start, total=len(todo)):
            layer = self.adapter.layers[todo[pos]]
            with self.block_context.scope(todo[pos]):
                layer.to(self.device)
                try:
                    kw = self.adapter.layer_kwargs(todo[pos], self.kwargs)
                    visit = BlockVisit(todo[pos], layer, self.adapter, kw, self.hs, self.device, self.store)
                    yield visit
                    self.hs = visit.outputs
                finally:
                    layer.to(self.home)


def run(model: nn.Module, adapter: Adapter, ids: torch.Tensor, handler: Handler, mode: str = "sequential",
        chunk_size: int = 8, device: str | torch.device | None = None, progress: bool = True,
        layers: list[int] | None = None, keep_outputs: bool = False, blocks: Blocks = RESIDENT) -> EngineReport:
    """Run the calibration set ``ids [N, T]`` through the model block by block, calling ``handler``.

    Embeddings and head stay where the model is; each block visits ``device`` (default: the model's).
    ``blocks``: the block source and sink of the walk (:class:`Walk`). Returns per-phase timings (seconds).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}")
    adapter.check_calibration_length(ids.shape[1])
    rep = EngineReport(mode=mode, n_tokens=int(ids.numel()))
    t0 = time.perf_counter()
    walk = Walk(adapter, ids, chunk_size, device, blocks=blocks)
    rep.add("embed", time.perf_counter() - t0)
    todo = list(range(adapter.n_layers) if layers is None else layers)
    ck = resume.current() if handler.resumable else None
    stage = ck.stage("engine") if ck is not None else ""
    start = 0
    if ck is not None:
        start, restored = _restore(ck, stage, todo, adapter, handler, walk.shard, len(walk.hs))
        walk.hs = restored if restored is not None else walk.hs
    for pos, visit in enumerate(walk.blocks(todo, start, progress, f"blocks ({mode})"), start):
        ctx = BlockContext(visit.index, visit.layer, adapter, adapter.linears(visit.layer), visit.kwargs)
        visit.outputs = _run_block(ctx, visit.inputs, handler, mode, walk.device, rep, walk.shard)
        handler.on_block_end(ctx)
        if ck is not None:
            _save_block(ck, stage, pos, ctx, handler, visit.outputs)
        stall.point("block-done")
        _after_block(visit.index)
    if keep_outputs:
        rep.outputs = walk.hs
    return rep


def _hs_name(stage: str, pos: int, chunk: int) -> str:
    return f"{stage}-hs{pos}-c{chunk}.pt"


def _save_block(ck: resume.Checkpoint, stage: str, pos: int, ctx: BlockContext, handler: Handler,
                hs: list[torch.Tensor | None]) -> None:
    """Block ``pos`` of the run: its weights and handler state (rank 0's file when split over processes: every rank
    holds the same), then the inputs of the next block, one file per chunk, each written by the rank that holds it
    (in this order, so the hidden states never point past a block whose file is missing). Once every chunk is
    written (on every rank), the previous generation of chunks is deleted."""
    from secateur.calib import dist

    weights = {k: v.detach().cpu() for k, v in ctx.layer.state_dict().items()} if handler.modifies_weights else None
    ck.save(f"{stage}-block{pos}.pt", {"index": ctx.index, "weights": weights,
                                       "handler": handler.block_state(ctx)})
    for j, h in enumerate(hs):
        if h is not None:
            ck.save_own(_hs_name(stage, pos, j), {"after": pos, "chunk": j, "hs": h})
    dist.barrier()  # the generation is complete: every rank's chunks are written
    ck.delete(f"{stage}-hs.pt")  # a checkpoint of the one-file format, continued
    if pos > 0:
        for j in range(len(hs)):
            ck.delete(_hs_name(stage, pos - 1, j))


def _restore(ck: resume.Checkpoint, stage: str, todo: list[int], adapter: Adapter, handler: Handler,
             shard: Shard = ALONE, n_chunks: int = 0) -> tuple[int, list[torch.Tensor | None] | None]:
    """Load the finished blocks of a checkpointed run; returns (next position, its input hidden states: this
    process's chunks, None for the others'). The newest complete generation of per-chunk hidden states (every
    chunk's file there, whichever number of processes wrote them), else the one-file format of older checkpoints."""
    done, hs = 0, None
    for pos in range(len(todo) - 1, -1, -1):
        if n_chunks and all(ck.has(_hs_name(stage, pos, j)) for j in range(n_chunks)):
            done = pos + 1
            break
    if done:
        hs = [_load_chunk(ck, _hs_name(stage, done - 1, j), done - 1, j) if shard.owns(j) else None
              for j in range(n_chunks)]
    elif ck.has(f"{stage}-hs.pt"):  # written before the per-chunk files: every chunk in one file
        saved = ck.load(f"{stage}-hs.pt")
        done = saved["after"] + 1
        hs = [h if shard.owns(j) else None for j, h in enumerate(saved["hs"])]
        if len(hs) != n_chunks:
            return 0, None  # not this run's layout: recompute everything
    if not done:
        return 0, None
    if done > len(todo) or not all(ck.has(f"{stage}-block{p}.pt") for p in range(done)):
        return 0, None  # not this run's layout: recompute everything
    for pos in range(done):
        block = ck.load(f"{stage}-block{pos}.pt")
        if block["index"] != todo[pos]:
            raise resume.CheckpointError(f"checkpoint {ck.path} does not match this run's blocks; remove it")
        if block["weights"] is not None:
            adapter.layers[todo[pos]].load_state_dict(block["weights"])
        handler.load_block_state(todo[pos], block["handler"])
    return done, hs


def _load_chunk(ck: resume.Checkpoint, name: str, pos: int, j: int) -> torch.Tensor:
    saved = ck.load(name)
    if saved.get("after") != pos or saved.get("chunk") != j:
        raise resume.CheckpointError(f"checkpoint file {ck.path / name} does not hold chunk {j} after block {pos}; "
                                     f"remove {ck.path} and run without --resume")
    return saved["hs"]


def _run_block(ctx: BlockContext, hs: list[torch.Tensor | None], handler: Handler, mode: str, device,
               rep: EngineReport, shard: Shard = ALONE) -> list[torch.Tensor | None]:
    a, layer, kw = ctx.adapter, ctx.layer, ctx.kwargs

    def _map(chunks, fn, device, accs=None, where=""):  # this run's share of the chunks
        return _map_chunks(chunks, fn, device, accs, where, shard)

    groups = a.groups(layer)
    accs = {g: handler.accumulators(ctx, g, groups[g]) for g in GROUPS}
    o_mod, down_mod = a.out_module(layer, "attn_out"), a.out_module(layer, "mlp_out")

    def prune(g: str) -> None:
        if mode == "sequential":
            t = time.perf_counter()
            handler.on_group(ctx, g, groups[g], accs[g])
            rep.add("prune", time.perf_counter() - t)

    def tick(key: str, t: float) -> None:
        rep.add(key, time.perf_counter() - t)

    t = time.perf_counter()
    xs = _map(hs, lambda h: a.attn_norm(layer, h), device, accs["attn_in"], f"block {ctx.index} attn_in")
    tick("forward", t)
    prune("attn_in")
    t = time.perf_counter()
    att = _map(xs, lambda x: a.attn_core(layer, x, kw), device, accs["attn_out"], f"block {ctx.index} attn_out")
    del xs
    tick("forward", t)
    prune("attn_out")
    t = time.perf_counter()
    h2 = _map2(hs, att, lambda h, y: a.attn_residual(layer, h, o_mod(y)), device)
    del att
    x2 = _map(h2, lambda h: a.mlp_norm(layer, h), device, accs["mlp_in"], f"block {ctx.index} mlp_in")
    tick("forward", t)
    prune("mlp_in")
    t = time.perf_counter()
    m = _map(x2, lambda x: a.mlp_core(layer, x), device, accs["mlp_out"], f"block {ctx.index} mlp_out")
    del x2
    tick("forward", t)
    prune("mlp_out")
    t = time.perf_counter()
    out = _map2(h2, m, lambda h, y: a.mlp_residual(layer, h, down_mod(y)), device)
    tick("forward", t)
    if mode != "sequential":
        t = time.perf_counter()
        for g in GROUPS:
            handler.on_group(ctx, g, groups[g], accs[g])
        tick("prune", t)
        if mode == "dense-block":  # original Wanda: outputs of the pruned block
            t = time.perf_counter()
            out = _map(hs, lambda h: a.block_forward(layer, h, kw), device)
            tick("forward_rerun", t)
    return out
