"""Where a run's decoder blocks come from and where the finished ones go: the block source and the block sink.

The block walker (:class:`secateur.calib.engine.Walk`), the methods' own per-block loops and the perplexity
evaluator visit block ``i`` inside :meth:`Blocks.scope`: the **source** materializes the block before the visit
and releases it afterwards, handing a finished block to the **sink** first. Two sources exist:

* :class:`ResidentSource`: every block is in memory already (a model loaded whole); loading and releasing do
  nothing, a finished block stays in the model, and the run's output is written at its end.
* :class:`secateur.models.streaming.BlockStream` (``--stream``): the model is built on the meta device and each
  block is read from its safetensors files when visited, then put back on the meta device.

A sink is anything with :meth:`BlockSink.plan` and :meth:`BlockSink.write_block`: the shard writer of a streamed
prune (:class:`secateur.export.shards.ShardSink`) writes each finished block to the output's shards at once. This
module is the floor every stage can import (the engine never imports ``export/``: the sink arrives as an object).
The context travels as an argument (``blocks=``), never as an attribute of the model.

Several processes (``secateur prune --procs N``, ``torchrun``): the context's :class:`Shard` says which chunks of
calibration windows (chunk ``c`` of ``--chunk-size`` windows: rank ``c % N``) and which evaluation windows
(window ``w``: rank ``w % N``) this process computes; the boundaries never depend on ``N``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from secateur.errors import SecateurError


class BlockSink(Protocol):
    """Where finished blocks go (a streamed prune's output shards)."""

    def plan(self, specs: list) -> None:
        """The output's tensors (``export.shards.Spec``), when a method fixes them (a structured selection)."""

    def write_block(self, index: int, state: Mapping[str, torch.Tensor]) -> None:
        """Block ``index`` is final: ``state`` maps the model's state-dict names to its tensors as they are now."""


class BlockSource(Protocol):
    """Where blocks come from: materialized for a visit, released after it."""

    streamed: bool  # True: blocks are loaded one at a time (and a method keeps its masks bit-packed)

    def load(self, index: int) -> None:
        """Block ``index`` materialized for its visit."""

    def release(self, index: int, sink: BlockSink | None) -> None:
        """Block ``index`` freed (handed to ``sink`` first when it is given: the visit finished)."""


class ResidentSource:
    """Every block already in memory: nothing to load or free; finished blocks stay in the model (its output is
    written whole at the end of the run)."""

    streamed = False

    def load(self, index: int) -> None:
        """Nothing to load: the block is in memory."""

    def release(self, index: int, sink: BlockSink | None) -> None:
        """Nothing to free: the block stays in the model, where the end of the run saves it."""


@dataclass(frozen=True)
class Shard:
    """This process's share of a run split over ``world`` processes: item ``i`` (a chunk of calibration windows,
    an evaluation window) is computed by rank ``i % world``."""

    rank: int = 0
    world: int = 1

    def owner(self, i: int) -> int:
        return i % self.world

    def owns(self, i: int) -> bool:
        return i % self.world == self.rank

    @property
    def split(self) -> bool:
        return self.world > 1


ALONE = Shard()


@dataclass(frozen=True)
class Blocks:
    """A run's block context, handed to the walker and to every method: its ``source`` and, when finished blocks
    are written as they finish, its ``sink`` (None: they stay where the source keeps them)."""

    source: BlockSource
    sink: BlockSink | None = None
    shard: Shard = ALONE  # several processes: this one's chunks of windows (module docstring)

    @property
    def streamed(self) -> bool:
        return self.source.streamed

    def resident_only(self, what: str) -> None:
        """Refuse a streamed context in a method that needs the whole model in memory (``--stream`` refuses it
        before anything is loaded; this guards the Python API's direct callers)."""
        if self.streamed:
            raise SecateurError(f"{what} needs the whole model in memory; run it without --stream")

    def without_sink(self) -> Blocks:
        """The same source, finished blocks written nowhere (a pass that only reads them: statistics, scores)."""
        return replace(self, sink=None)

    def with_sink(self, sink: BlockSink | None) -> Blocks:
        return replace(self, sink=sink)

    def with_shard(self, shard: Shard) -> Blocks:
        return replace(self, shard=shard)

    @contextlib.contextmanager
    def scope(self, index: int) -> Iterator[None]:
        """Block ``index`` materialized for the duration, then released: handed to the sink when the visit
        finished (an exception releases it unwritten)."""
        self.source.load(index)
        done = False
        try:
            yield
            done = True
        finally:
            self.source.release(index, self.sink if done else None)


#: the context of a model held whole in memory (every caller's default)
RESIDENT = Blocks(ResidentSource())
