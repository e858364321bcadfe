"""The per-block compensation pass: one dense engine walk after the selection that keeps one block's Grams.

Memory **[impl]** (issue 16): the Grams are not kept for every layer. Without statistics passed in,
:func:`secateur.methods.materialize.materialize_selection` runs this pass (:class:`BlockCompensation`): it
accumulates one block's Grams, compensates that block's projections (:mod:`secateur.methods.compensation`) and
frees them before the next block; the replacements are sliced in after the pass (the walk stays dense, so every
Gram is the dense model's, bit for bit those of a single pass that kept them all). Peak memory of the statistics,
independent of the depth ``L``::

    8 (d_o^2 + d_down^2)   one block's float64 Grams (o_proj and down_proj inputs; each becomes E[x x^T] in place)
  + 8 d_in^2               COEC's tempered copy C^alpha of the projection being solved (alpha != 1; not cached)
  + the solver's workspace (a few |K| x |K| / d_in x d_in float64 matrices of that one projection)
  + 24 d bytes per layer and group: the selection statistics (sumsq, meanvar), kept for every layer

instead of ``L`` times the first two lines. Each run reports the numbers as ``statistics_memory``. The price is
a second dense forward of the calibration set. With more than one torch thread the solves run on worker threads
beside the walk once a block's solves outlast it (:meth:`BlockCompensation.pipelined`), each on one thread: the
same weights, bit for bit.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from secateur.calib.collect import GROUP_ROLE, StructuredStats
from secateur.calib.dist import Owners as dist_owners
from secateur.calib.engine import BlockContext, Handler
from secateur.calib.stats import Accumulator
from secateur.compensate import COECOptions
from secateur.errors import SecateurError
from secateur.methods.compensation import (
    CompensationConfig,
    _compensate_one,
    _Frozen,
    _Results,
    _to_compensate,
)
from secateur.models.adapters import Adapter


class _DaemonPool:
    """``n`` daemon threads taking jobs first in, first out. Daemon threads, unlike ``ThreadPoolExecutor``'s, do
    not hold the process at an interrupt: Ctrl-C ends a run at once instead of after the solves that are
    running (minutes each at 7B widths); their results are not needed then."""

    def __init__(self, n: int) -> None:
        import queue
        import threading

        self.n = n
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        for j in range(n):
            threading.Thread(target=self._loop, daemon=True, name=f"secateur-comp-{j}").start()

    def _loop(self) -> None:
        while (item := self.jobs.get()) is not None:
            fut, fn, arg = item
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(arg))
                except BaseException as e:  # noqa: BLE001 - handed to the caller by fut.result()
                    fut.set_exception(e)

    def submit(self, fn, arg):
        from concurrent.futures import Future

        fut: Future = Future()
        self.jobs.put((fut, fn, arg))
        return fut

    def close(self) -> None:
        for _ in range(self.n):
            self.jobs.put(None)


class BlockCompensation(Handler):
    """The per-block compensation pass (engine mode ``dense``): accumulates the dense input Grams of one block's
    ``o_proj`` / ``down_proj`` that lost columns, compensates them as soon as the block's forward is done
    (``on_block_end``, recorded in the order attn_out, mlp_out; over several processes each projection is solved
    on its owner rank, :func:`secateur.calib.dist.owned_map`) and drops them once solved. The Gram becomes
    ``E[x x^T]`` in place (the same values as :attr:`secateur.calib.stats.Gram.second_moment`). Nothing is written
    to the model: the walk stays dense and the replacements are sliced in after the pass. Resumable: a finished
    block's projections are in the checkpoint's ``comp`` files, reloaded by :meth:`load_block_state`.

    Pipelined **[impl]** (issue 29; :meth:`pipelined`, one process with ``w = torch.get_num_threads() > 1``): the
    walk stops waiting for a block's solves. With :attr:`pipeline` ``"auto"`` this starts after the first block
    whose solves took longer than its walk. From then on the solves run on ``w`` worker threads, torch pinned to
    one intra-op thread until the pass ends, while the next blocks are walked, so the solves of ``w`` blocks use
    ``w`` cores (the eigendecompositions, pinned to one thread anyway, no longer leave the other cores idle).
    Results are bit for bit those of the sequential pass: every solve runs on one thread either way, and results
    are recorded in block order. At most ``w`` blocks are in flight (the walk waits for the oldest before it
    submits another), so the Grams alive are at most ``w + 1`` blocks'. A block checkpointed while its solves are
    still running leaves their statistics in the checkpoint (``pend`` files, deleted once the result is saved),
    which ``--resume`` solves first.

    ``live_bytes`` / ``peak_bytes``: the Gram state alive now and at most (8 d^2 bytes each)."""

    resumable = True
    modifies_weights = False
    #: ``"auto"``: the pool starts once a block's solves took longer than its walk (cheap solves, as the least-squares
    #: or RCPU ones, would gain nothing and the walk would lose its threads); ``"always"`` / ``"never"``
    pipeline = "auto"

    def __init__(self, cfg: CompensationConfig, adapter: Adapter, sel) -> None:
        self.cfg, self.adapter = cfg, adapter
        self.todo = {(i, g): (kept, int(ref.weight.shape[1])) for i, g, ref, kept in _to_compensate(adapter, sel)}
        self.results = _Results()
        self.live_bytes = 0
        self.peak_bytes = 0
        self.owners = dist_owners("compensation")  # the solves over several processes: round-robin owners
        self.pending: list[tuple[int, str, Any, Any, Any]] = []  # this block's projections, solved at its end
        self.pending_bytes = 0  # their Grams' bytes
        self.pool = None  # the worker threads of a pipelined pass
        self.workers = 1
        # blocks whose solves run: (block, [(key, job, future)], their Grams' bytes), oldest first
        self.inflight: list[tuple[int, list[tuple[tuple[int, str], Any, Any]], int]] = []
        self.waited_s = 0.0  # seconds the walk spent waiting for solves (pipelined) or solving (sequential)
        self.can_pipeline = False  # inside pipelined(), where a pool may start
        self.threads_before = 1
        self.mark = time.perf_counter()  # when the walk of the current block began (its previous block's end)

    @contextmanager
    def pipelined(self) -> Iterator[None]:
        """Run the pass (the caller's ``engine.run``) with the solves on worker threads when that helps: one
        process, more than one torch thread, and (``pipeline = "auto"``) solves that outlast the walk. Every
        solve is collected before the block returns, and the thread count is given back."""
        from secateur.calib.dist import rank_world

        if torch.get_num_threads() <= 1 or rank_world()[1] > 1 or self.pipeline == "never":
            yield
            return
        self.can_pipeline, self.mark = True, time.perf_counter()
        if self.pipeline == "always":
            self._start_pool()
        try:
            yield
            while self.inflight:
                self._collect_oldest()
        finally:
            for _, jobs, _ in self.inflight:  # an error or an interrupt: what has not started never will
                for _, _, fut in jobs:
                    fut.cancel()
            self.inflight.clear()
            if self.pool is not None:
                self.pool.close()
                self.pool = None
                torch.set_num_threads(self.threads_before)
            self.can_pipeline = False

    def _start_pool(self) -> None:
        """From now on the solves run on ``w`` worker threads and the walk on one intra-op thread (each solve is
        pinned to one thread anyway, so the weights do not change; the walk's GEMMs do not depend on it)."""
        self.threads_before = self.workers = torch.get_num_threads()
        torch.set_num_threads(1)
        self.pool = _DaemonPool(self.workers)

    @property
    def layers(self) -> list[int]:
        """The blocks the pass must visit: up to the last one with a projection to compensate."""
        return list(range(max(i for i, _ in self.todo) + 1)) if self.todo else []

    def accumulators(self, ctx: BlockContext, group: str, names: list[str]) -> dict[str, Accumulator]:
        got = self.todo.get((ctx.index, group))
        if got is None or got[0].numel() == 0 or self._saved(ctx.index, group):
            return {}
        from secateur.calib.stats import Gram

        self.live_bytes += 8 * got[1] ** 2
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        return {"gram": Gram(got[1])}

    def _saved(self, i: int, group: str) -> bool:
        return self.results._saved(i, group)

    def on_group(self, ctx: BlockContext, group: str, names: list[str], accs: dict[str, Accumulator]) -> None:
        from secateur.compensate import InputStats

        key = (ctx.index, group)
        if key not in self.todo or self.results.restore(*key):
            return
        kept, width = self.todo[key]
        st = None
        if "gram" in accs:
            gram = accs.pop("gram")  # the engine's reference goes: the Gram lives in ``pending`` until the block ends
            if gram.n <= 0:
                raise SecateurError("the Gram accumulator saw no tokens")
            st = InputStats(second_moment=gram.G.div_(gram.n), mean=gram.mean, n=int(gram.n))
            del gram
        ref = self.adapter.role_refs(ctx.layer)[GROUP_ROLE[group]]
        self.pending.append((*key, ref, kept, st))
        self.pending_bytes += 0 if st is None else 8 * width ** 2

    def _solve(self, job) -> tuple[Any, dict]:
        return _compensate_one(self.cfg, self.adapter, *job)

    def on_block_end(self, ctx: BlockContext) -> None:
        """The block's projections solved (each on its owner rank over several processes, in parallel:
        :func:`secateur.calib.dist.owned_map`; pipelined: submitted to the workers), their Grams freed once
        solved, the results recorded in the single process's order (attn_out, mlp_out)."""
        jobs, self.pending = self.pending, []
        nbytes, self.pending_bytes = self.pending_bytes, 0
        t = time.perf_counter()
        if self.pool is not None:
            while len(self.inflight) >= self.workers:  # bounded memory: at most ``workers`` blocks in flight
                self._collect_oldest()
            if jobs:
                frozen = [(i, g, _Frozen.of(self.cfg, self.adapter, i, g, ref), kept, st)
                          for i, g, ref, kept, st in jobs]
                self.inflight.append((ctx.index, [(job[:2], job, self.pool.submit(self._solve, job))
                                                  for job in frozen], nbytes))
            self.mark = time.perf_counter()  # the waits were counted by _collect_oldest
            return
        keys = [job[:2] for job in jobs]
        try:
            solved = self.owners.map(jobs, self._solve)
        finally:
            del jobs[:]  # every Gram of the block goes
            self.live_bytes -= nbytes
        for (i, group), (comp, rec) in zip(keys, solved, strict=True):
            self.results.add(i, group, comp, rec)
        now = time.perf_counter()
        self.waited_s += now - t
        if self.can_pipeline and self.pool is None and keys and now - t > t - self.mark:
            self._start_pool()  # the solves outlast the walk: from the next block on they run beside it
        self.mark = time.perf_counter()

    def _collect_oldest(self) -> None:
        """Wait for the oldest block in flight, record its results in order, drop its Grams and ``pend`` files."""
        t = time.perf_counter()
        _, jobs, nbytes = self.inflight[0]
        done = [(key, fut.result()) for key, _, fut in jobs]  # a failed solve raises here, in block order
        self.inflight.pop(0)
        self.live_bytes -= nbytes
        for key, (comp, rec) in done:
            self.results.add(*key, comp, rec)
            self.results.drop_pending(*key)
        self.waited_s += time.perf_counter() - t

    def block_state(self, ctx: BlockContext) -> dict:
        """Nothing: a finished block's compensations are in the checkpoint's ``comp`` files, and those of a block
        still in flight (pipelined) are saved as ``pend`` files here, so the checkpoint can always continue."""
        while self.inflight and all(fut.done() for _, _, fut in self.inflight[0][1]):
            self._collect_oldest()  # in block order; a failed solve raises here
        for index, jobs, _ in self.inflight:
            if index == ctx.index:
                for key, job, _ in jobs:
                    self.results.save_pending(*key, job[3], job[4])
        return {}

    def load_block_state(self, index: int, state: dict) -> None:
        for i, group in self.todo:
            if i == index and not self.results.restore(i, group):
                kept, _ = self.todo[(i, group)]
                st = self.results.load_pending(i, group)
                if kept.numel() and st is None:
                    from secateur.calib.resume import CheckpointError

                    raise CheckpointError(f"checkpoint {self.results.ck.path} lacks the compensation of layer {i} "
                                          f"{group}; remove it and run without --resume")
                ref = self.adapter.role_refs(self.adapter.layers[i])[GROUP_ROLE[group]]
                self.results.add(i, group, *_compensate_one(self.cfg, self.adapter, i, group, ref, kept, st))
                self.results.drop_pending(i, group)


#: the memory of the statistics of a compensated structured run (also in the report: ``statistics_memory``)
MEMORY_FORMULA = ("per block: 8 (d_o^2 + d_down^2) bytes for the float64 input Grams of its o_proj and down_proj, "
                  "+ 8 d_in^2 for COEC's tempered copy C^alpha (alpha != 1) + the solver's workspace, one block at "
                  "a time (independent of the depth L; w + 1 blocks' Grams and w solves' workspaces when the "
                  "solves run on w threads beside the walk); plus 24 d bytes per layer and group for the selection "
                  "statistics (sumsq, meanvar)")


def _nbytes(acc) -> int:
    return sum(v.numel() * v.element_size() for v in vars(acc).values() if torch.is_tensor(v))


def statistics_memory(adapter: Adapter, sel, cfg: CompensationConfig, stats: StructuredStats | None,
                      per_block: bool, peak_bytes: int | None = None, workers: int = 1) -> dict:
    """The report's ``statistics_memory``: bytes of the Grams alive at once (one block's with the per-block
    pass, every layer's with statistics passed in), of COEC's tempered copy, of the selection statistics, and
    :data:`MEMORY_FORMULA`."""
    widths: dict[int, list[int]] = {}
    for i, _, ref, kept in _to_compensate(adapter, sel):
        if kept.numel():
            widths.setdefault(i, []).append(int(ref.weight.shape[1]))
    blocks = [sum(8 * d * d for d in ds) for ds in widths.values()] or [0]
    coec = cfg.compensation == "coec" and (cfg.coec or COECOptions()).alpha != 1.0
    selection = sum(_nbytes(a) for g in (stats.groups.values() if stats else ()) for accs in g.values()
                    for k, a in accs.items() if k != "gram")
    # pipelined (``workers`` > 1): the largest w + 1 blocks at most, never more than all of them
    alive = sum(sorted(blocks, reverse=True)[: workers + 1]) if workers > 1 else max(blocks)
    out = {"mode": ("one block at a time" if workers <= 1 else f"one block at a time, solves on {workers} threads "
                    f"beside the walk (at most {workers + 1} blocks' Grams)") if per_block
           else "every layer (statistics passed in)",
           "grams_bytes": alive if per_block else sum(blocks), "grams_bytes_all_layers": sum(blocks),
           "tempered_bytes": 8 * max((d * d for ds in widths.values() for d in ds), default=0) if coec else 0,
           "selection_bytes": selection, "formula": MEMORY_FORMULA}
    if peak_bytes is not None:
        out["grams_bytes_measured_peak"] = peak_bytes
    return out


