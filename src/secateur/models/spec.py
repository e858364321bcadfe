"""A model spec resolved once: what it is, where its files are, its checked config and its GGUF provenance.

``api.prune`` and ``api.eval_ppl`` build one :class:`ModelSpec` from what they were given and every later stage
reads it (the context check, the memory refusal, the streamed block source, the report's ``model_source``)
instead of resolving the spec again. Each fact is computed the first time a stage asks for it, in the order the
stages ask, so a broken model is refused by the same check, with the same message, as before; and nothing as
costly as a GGUF's dequantization happens before a stage needs its folder.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch
from torch import nn

from secateur.models.loading import check_model, check_seqlen, gguf_file, load_model, model_source, resolve


@dataclass
class ModelSpec:
    """``given``: a hub id, a model folder, a ``.gguf`` file or alias, or a model already in memory; ``dtype``: the
    run's (a GGUF is dequantized to it)."""

    given: str | nn.Module
    dtype: str | torch.dtype = "float32"

    @property
    def in_memory(self) -> bool:
        return not isinstance(self.given, str)

    @property
    def name(self) -> str:
        """The spec, or an in-memory model's ``config._name_or_path`` (``in-memory`` when unnamed)."""
        if not self.in_memory:
            return self.given
        return getattr(getattr(self.given, "config", None), "_name_or_path", None) or "in-memory"

    @cached_property
    def kind(self) -> str:
        """``in-memory``, ``gguf`` (a file or the alias), ``folder`` or ``hub``."""
        if self.in_memory:
            return "in-memory"
        if gguf_file(self.given) is not None:
            return "gguf"
        return "folder" if Path(self.location[0]).is_dir() else "hub"

    @cached_property
    def location(self) -> tuple[str, dict]:
        """``(path or hub id, extra from_pretrained kwargs)``: :func:`secateur.models.loading.resolve` (a GGUF: its
        folder dequantized once in ``dtype`` and cached)."""
        return resolve(self.given, self.dtype)

    @cached_property
    def config(self) -> dict | None:
        """The config, checked once (family, shipped code, weight files against it) before any weight is read;
        an in-memory model's own (nothing checked); None when unknown (a hub id offline)."""
        if self.in_memory:
            return self.given.config.to_dict()
        if gguf_file(self.given) is not None:  # from the header: nothing dequantized for a check
            return check_model(self.given)
        return check_model(self.given, *self.location)

    def load(self, device: str = "cpu") -> tuple[nn.Module, object]:
        """``(model, tokenizer)`` loaded whole, from the location resolved and the config checked here (once)."""
        if self.kind == "gguf":  # its header was checked; the folder dequantized from it is checked as any folder
            check_model(self.given, *self.location)
        else:
            _ = self.config  # the checks run before any weight is read, as they always have
        return load_model(self.given, self.dtype, device, resolved=self.location)

    def check_seqlen(self, seqlen: int, flag: str = "--seqlen") -> None:
        """Refuse windows longer than the model's context (:func:`secateur.models.loading.check_seqlen`)."""
        check_seqlen(self.name, seqlen, self.config, flag)

    def local_folder(self) -> Path:
        """The folder ``--stream`` reads block by block (a GGUF: its cached folder); a hub id is refused."""
        from secateur.models.streaming import local_folder

        return local_folder(self.given, self.dtype, self.location[0])

    @cached_property
    def source(self) -> dict | None:
        """Where a GGUF's weights came from (file, sha256, cached folder), for the report; None otherwise."""
        return None if self.in_memory else model_source(self.given, self.dtype)
