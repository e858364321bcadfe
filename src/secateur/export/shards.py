"""Incremental safetensors shards: a standard Hugging Face weights folder written one tensor at a time.

Every tensor's name, dtype and shape is known before the run (a streamed prune keeps shapes), so the shards are
planned up front (:func:`plan_shards`: state-dict order, a new shard when ``max_shard_bytes`` would be passed):
each file is created at its final size with its final header, and :meth:`ShardWriter.write` puts a tensor's
bytes at its offset as soon as the tensor is final (then the caller frees it). :meth:`ShardWriter.close`
checks every planned tensor was written and writes ``model.safetensors.index.json`` (one shard: a single
``model.safetensors``, no index, as ``save_pretrained``). No tensor is ever copied to serialize it.

A tensor that may or may not exist (``Spec.optional``: the bias a structured compensator may add to a bias-free
projection, unknown until it is solved) is kept aside when written (it is small) and put after the shard's
planned tensors by :meth:`ShardWriter.close`, which writes the header then; the header's room is planned for every
optional tensor present and padded with spaces (as safetensors allows) when some are absent.

The folder is the temporary folder of :func:`secateur.safe_write.atomic_dir`, so a failed run leaves nothing.
:class:`ShardSink` is the streamed run's block sink (:mod:`secateur.models.blocks`): each finished block goes to the
writer as its block source releases it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from secateur.errors import SecateurError

DTYPE_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
               torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
               torch.bool: "BOOL"}
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
INDEX_NAME = "model.safetensors.index.json"


@dataclass(frozen=True)
class Spec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    optional: bool = False  # written or not, known only during the run (see the module docstring)

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


@dataclass
class Shard:
    file: str
    specs: list[Spec] = field(default_factory=list)
    offsets: dict[str, tuple[int, int]] = field(default_factory=dict)
    header: bytes = b""

    @property
    def data_bytes(self) -> int:
        """Bytes of the planned (not optional) tensors."""
        return sum(s.nbytes for s in self.specs if not s.optional)

    def _header(self, present: set[str]) -> tuple[bytes, dict[str, tuple[int, int]]]:
        """The JSON header and the offsets of the planned tensors, then the optional ones in ``present``."""
        pos, meta, offsets = 0, {"__metadata__": {"format": "pt"}}, {}
        order = [s for s in self.specs if not s.optional] + [s for s in self.specs if s.optional and s.name in present]
        for s in order:
            offsets[s.name] = (pos, pos + s.nbytes)
            meta[s.name] = {"dtype": DTYPE_NAMES[s.dtype], "shape": list(s.shape),
                            "data_offsets": [pos, pos + s.nbytes]}
            pos += s.nbytes
        return json.dumps(meta, separators=(",", ":")).encode(), offsets

    def finish(self, present: set[str] | None = None) -> None:
        """Offsets in order and the JSON header, padded with spaces to 8 bytes (as safetensors writes it) and,
        with optional tensors, to the room of all of them (``present``: those written; None: plan the room)."""
        room = len(self.header)
        if present is None:
            present = {s.name for s in self.specs if s.optional}
        h, self.offsets = self._header(present)
        self.header = h + b" " * ((room or len(h) + (-len(h) % 8)) - len(h))


def plan_shards(specs: list[Spec], max_shard_bytes: int) -> list[Shard]:
    """Tensors in order into shards of at most ``max_shard_bytes`` (a larger tensor gets a shard of its own);
    ``model-0000i-of-0000N.safetensors``, or ``model.safetensors`` alone."""
    groups: list[list[Spec]] = [[]]
    size = 0
    for s in specs:
        if s.dtype not in DTYPE_NAMES:
            raise SecateurError(f"tensor {s.name}: dtype {s.dtype} cannot be written to safetensors here")
        if groups[-1] and size + s.nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(s)
        size += s.nbytes
    n = len(groups)
    shards = [Shard("model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors", g)
              for i, g in enumerate(groups)]
    for sh in shards:
        sh.finish()
    return shards


class ShardWriter:
    """Writes planned tensors into their shards under ``folder`` in any order (see the module docstring)."""

    def __init__(self, folder: str | Path, specs: list[Spec], max_shard_bytes: int | None = None) -> None:
        self.folder = Path(folder)
        self.shards = plan_shards(specs, max_shard_bytes or DEFAULT_MAX_SHARD_BYTES)
        self.where = {s.name: (sh, s) for sh in self.shards for s in sh.specs}
        self.written: set[str] = set()
        self.pending: dict[str, torch.Tensor] = {}  # optional tensors, written by close()
        for sh in self.shards:
            with (self.folder / sh.file).open("wb") as f:
                f.write(len(sh.header).to_bytes(8, "little"))
                f.write(sh.header)
                f.truncate(8 + len(sh.header) + sh.data_bytes)

    @property
    def total_bytes(self) -> int:
        return sum(s.nbytes for sh in self.shards for s in sh.specs if s.name in self.written)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Put ``tensor`` (its planned dtype and shape) at its place; written once."""
        if name not in self.where:
            raise SecateurError(f"tensor {name} is not in the export plan")
        if name in self.written:
            raise SecateurError(f"tensor {name} was written twice")
        sh, spec = self.where[name]
        if tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
            raise SecateurError(f"tensor {name} is {tensor.dtype} {list(tensor.shape)}, the export plan says "
                                f"{spec.dtype} {list(spec.shape)}")
        self.written.add(name)
        if spec.optional:
            self.pending[name] = tensor.detach().to("cpu", copy=True)
            return
        self._put(sh, name, tensor)

    def _put(self, sh: Shard, name: str, tensor: torch.Tensor) -> None:
        t = tensor.detach().to("cpu").contiguous().reshape(-1)
        data = t.view(torch.uint8).numpy() if t.numel() else b""
        start, _ = sh.offsets[name]
        with (self.folder / sh.file).open("r+b") as f:
            f.seek(8 + len(sh.header) + start)
            f.write(memoryview(data) if t.numel() else data)

    def close(self) -> None:
        """Every planned tensor written, the optional ones written after them with their shard's final header,
        then the index (several shards)."""
        missing = [n for n, (_, s) in self.where.items() if n not in self.written and not s.optional]
        if missing:
            raise SecateurError(f"streamed export incomplete: {len(missing)} tensors never written (first: "
                                f"{missing[0]})")
        for sh in self.shards:
            if not any(s.optional for s in sh.specs):
                continue
            sh.finish({s.name for s in sh.specs if s.optional and s.name in self.written})
            with (self.folder / sh.file).open("r+b") as f:
                f.seek(8)
                f.write(sh.header)
                f.truncate(8 + len(sh.header) + sum(s.nbytes for s in sh.specs if s.name in self.written))
            for s in sh.specs:
                if s.optional and s.name in self.pending:
                    self._put(sh, s.name, self.pending.pop(s.name))
        if len(self.shards) > 1:
            index = {"metadata": {"total_size": self.total_bytes},
                     "weight_map": {s.name: sh.file for sh in self.shards for s in sh.specs if s.name in self.written}}
            (self.folder / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


class ShardSink:
    """A streamed prune's block sink (:class:`secateur.models.blocks.BlockSink`): the tensors of each finished block
    written to their shards under ``folder`` when the block is released, so no pruned block is held.

    The shards are planned from ``specs``, the dense plan (an unstructured prune keeps every shape), unless a method
    plans the output first (:meth:`plan`: a structured selection fixes the sliced tensors before any block is
    written). The writer opens with the first block written, the tensors outside the blocks (``residents()``:
    embeddings, final norm, head) first; :meth:`close` checks that every planned tensor came."""

    def __init__(self, folder: str | Path, specs: list[Spec],
                 residents: Callable[[], Iterable[tuple[str, torch.Tensor]]]) -> None:
        self.folder = Path(folder)
        self.specs = list(specs)
        self.residents = residents
        self.writer: ShardWriter | None = None

    def plan(self, specs: list[Spec]) -> None:
        """The output's tensors, now known (before any block is written)."""
        if self.writer is not None:
            raise SecateurError("the export plan changed after the first block was written")
        self.specs = list(specs)

    def _open(self) -> ShardWriter:
        if self.writer is None:
            self.writer = ShardWriter(self.folder, self.specs)
            for name, t in self.residents():
                self.writer.write(name, t)
        return self.writer

    def write_block(self, index: int, state: Mapping[str, torch.Tensor]) -> None:
        writer = self._open()
        for name, t in state.items():
            writer.write(name, t.detach())

    def close(self) -> None:
        """Every planned tensor written: the optional ones, the headers and the index (:meth:`ShardWriter.close`)."""
        self._open().close()


def finish_export(folder: str | Path, model, tokenizer, report: dict, masks=None,
                  extra_files: dict[str, bytes] | None = None) -> None:
    """Everything of a masked run's folder but the weights (:func:`secateur.export.hf.save_run`'s other files):
    ``config.json`` (architectures and dtype as ``save_pretrained`` sets them), the generation config, the
    tokenizer, the bit-packed masks, the method's files and ``secateur-report.json``."""
    from secateur.export.hf import write_run_files

    folder = Path(folder)
    config = model.config
    config.architectures = [type(model).__name__]
    config.save_pretrained(folder)
    if getattr(model, "generation_config", None) is not None and model.can_generate():
        model.generation_config.save_pretrained(folder)
    write_run_files(folder, tokenizer, report, masks, extra_files)
