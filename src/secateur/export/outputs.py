"""Where a prune's output folder is written: the block sink's side of ``api.prune``.

A run's finished blocks go to its sink (:mod:`secateur.models.blocks`); the rest of the output folder (config,
tokenizer, masks, report, card) is written when the run is done. Two outputs exist, chosen by ``--stream``:

* :class:`SavedAtEnd`: the pruned model is in memory; its blocks need no sink, and the whole folder is written
  at the end (:func:`secateur.export.hf.save_run`, :func:`secateur.export.sliced.save_structured`: each its own
  atomic folder).
* :class:`StreamedOutput`: the model is streamed, so the atomic folder is opened *before* the run (the shards are
  written during it, :class:`secateur.export.shards.ShardSink`) and becomes ``--out`` when the run is done; a
  failed run leaves nothing.
* :class:`WrittenByRankZero`: a streamed run split over processes, on every rank but 0: the same block walk (each
  finished block handed to a sink and released), but the sink writes nothing and no folder is opened here; rank 0's
  :class:`StreamedOutput` writes the output.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch

from secateur.export.hf import save_run
from secateur.export.shards import ShardSink, Spec, finish_export
from secateur.export.sliced import finish_structured_export, save_structured
from secateur.safe_write import atomic_dir, write_report


class SavedAtEnd:
    """A resident run's output: no block sink; :meth:`save` writes the whole folder from the model in memory."""

    streamed = False
    sink = None

    def __init__(self, out: str | None, overwrite: bool, structured: bool) -> None:
        self.out, self.overwrite, self.structured = out, overwrite, structured

    @contextlib.contextmanager
    def opened(self) -> Iterator[None]:
        """Nothing to open: the folder is written whole by :meth:`save`."""
        yield

    def save(self, model: torch.nn.Module, tokenizer, report: dict, masks, files: dict[str, bytes]) -> None:
        """The output folder (atomic): sliced widths (stock or per-layer config, no masks) or a masked run."""
        if self.structured:
            save_structured(model, tokenizer, self.out, report, files, self.overwrite)
        else:
            save_run(model, tokenizer, self.out, report, masks, self.overwrite, files)


class StreamedOutput:
    """A streamed run's output: the atomic folder opened before the run (:meth:`opened`), each finished block
    written to its shards by :attr:`sink`, the rest of the folder by :meth:`save`.

    ``need``: the bytes the export takes (checked against the free space when the folder opens); ``specs``: the
    dense tensor plan (a structured method replaces it once its selection is made); ``residents()``: the tensors
    outside the blocks, written with the first block."""

    streamed = True

    def __init__(self, out: str, overwrite: bool, structured: bool, need: int, specs: list[Spec],
                 residents: Callable[[], Iterable[tuple[str, torch.Tensor]]]) -> None:
        self.out, self.overwrite, self.structured, self.need = out, overwrite, structured, need
        self.specs, self.residents = specs, residents
        self.folder: Path | None = None
        self.sink: ShardSink | None = None

    @contextlib.contextmanager
    def opened(self) -> Iterator[None]:
        """The temporary folder the shards are written to during the run; ``--out`` once the block exits."""
        with atomic_dir(self.out, self.overwrite, need=self.need) as tmp:
            self.folder, self.sink = tmp, ShardSink(tmp, self.specs, self.residents)
            yield

    def save(self, model: torch.nn.Module, tokenizer, report: dict, masks, files: dict[str, bytes]) -> None:
        """The shards closed (every planned tensor written), then the rest of the folder: the config (the meta
        model's: sliced when structured), tokenizer, masks, ``files`` and the report."""
        self.sink.close()
        if self.structured:  # stock or per-layer config, as save_structured writes it
            finish_structured_export(self.folder, model, tokenizer, report, files)
        else:
            finish_export(self.folder, model, tokenizer, report, masks, files)

    def rewrite(self, report: dict, files: dict[str, bytes]) -> None:
        """``files`` and the report written again (after ``--eval-ppl`` read the folder)."""
        for name, data in files.items():
            (self.folder / name).write_bytes(data)
        write_report(self.folder, report)


class _NoSink:
    """A block sink that writes nothing (the ranks other than 0 of a split streamed run)."""

    def plan(self, specs: list[Spec]) -> None:
        """Nothing planned: rank 0's sink plans the output."""

    def write_block(self, index: int, state) -> None:
        """Nothing written: rank 0's sink writes the block (the same bits: every rank prunes it alike)."""


class WrittenByRankZero:
    """A streamed run's output on a rank other than 0 of a split run: no folder, no free-space check, nothing
    written; its blocks are released to a sink that drops them, so the walk is rank 0's. ``folder``: rank 0's
    temporary output folder once :meth:`share` has told it (``--eval-ppl`` reads it after rank 0 saved it)."""

    streamed = True

    def __init__(self) -> None:
        self.sink = _NoSink()
        self.folder: Path | None = None

    @contextlib.contextmanager
    def opened(self) -> Iterator[None]:
        """Nothing to open: rank 0 writes the folder."""
        yield

    def save(self, model, tokenizer, report: dict, masks, files: dict[str, bytes]) -> None:
        raise RuntimeError("only rank 0 saves a split run's output")

    def rewrite(self, report: dict, files: dict[str, bytes]) -> None:
        raise RuntimeError("only rank 0 writes a split run's output")
