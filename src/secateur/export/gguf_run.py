"""A prune run folder as secateur export gguf reads it: config, report and weights checked against their schemas
and against each other before any tensor is planned, every refusal one line with the fix (:data:`RUN_FIX`)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np

from secateur.errors import SecateurError
from secateur.safe_write import REPORT_NAME

# families this exporter writes -> their llama.cpp architecture (the converter writes Mistral as llama)
FAMILY_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}


def family_of_config(cfg: dict) -> str:
    from secateur.models.hetero import base_model_type

    return base_model_type(str(cfg.get("model_type", "")))


def gguf_module():
    import gguf

    return gguf


class RunFolder:
    """A run folder's config and tensors, read lazily from its safetensors (one file or a sharded index)."""

    def __init__(self, path: str | Path, stack: contextlib.ExitStack) -> None:
        from secateur.schemas.report import RunReport
        from secateur.schemas.run_folder import ConfigFamily, RunConfig, ShardIndex

        self.path = Path(path)
        if not self.path.is_dir():
            raise SecateurError(f"run {self.path} is not a folder; give a secateur prune --out folder")
        cfg = self.path / "config.json"
        if not cfg.is_file():
            raise SecateurError(f"run {self.path} has no config.json; give a secateur prune --out folder")
        # every file read back is checked where it enters: one line naming the file and the field
        self.config = read_checked(cfg, ConfigFamily)
        if family_of_config(self.config) in FAMILY_ARCH:  # another family is refused by name (export_gguf)
            read_checked(cfg, RunConfig)
        if (self.path / REPORT_NAME).is_file():  # read later for the tokenizer's source GGUF
            read_checked(self.path / REPORT_NAME, RunReport)
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            files = sorted(set(read_checked(index, ShardIndex)["weight_map"].values()))
        elif (self.path / "model.safetensors").is_file():
            files = ["model.safetensors"]
        else:
            raise SecateurError(f"run {self.path} has no safetensors weights (model.safetensors or an index); give "
                                "a secateur prune --out folder")
        self._where: dict[str, object] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for f in files:
            h = _open_safetensors(self.path / f, index if index.is_file() else None, stack)
            for name in h.keys():
                self._where[name] = h
                self.shapes[name] = tuple(h.get_slice(name).get_shape())
        if family_of_config(self.config) in FAMILY_ARCH:  # the weights against config.json, from the headers
            from secateur.models.folder_check import check_folder

            check_folder(str(self.path), self.path, self.config)

    def tensor(self, name: str) -> np.ndarray:
        return self._where[name].get_tensor(name).float().numpy()

    def raw(self, name: str):
        """Tensor ``name`` as a torch tensor in its stored dtype (``export vllm`` writes it back unchanged)."""
        return self._where[name].get_tensor(name)


RUN_FIX = "re-export the run (secateur prune --out), or restore the file"


def read_checked(path: Path, schema) -> dict:
    """A JSON file of the run folder, checked against ``schema`` (:mod:`secateur.schemas`)."""
    from secateur.files import read_json
    from secateur.schemas.report import parse_at

    data = read_json(path, RUN_FIX)
    if not isinstance(data, dict):
        raise SecateurError(f"{path}: a JSON {'array' if isinstance(data, list) else 'value'} "
                            f"({str(data)[:20]!r}), not an object; {RUN_FIX}")
    parse_at(schema, data, str(path), RUN_FIX)
    return data


def _open_safetensors(path: Path, index: Path | None, stack: contextlib.ExitStack):
    """An open safetensors file of the run folder; a missing, truncated or corrupt one is one line (the message of
    :func:`secateur.models.loading.check_safetensors`)."""
    from safetensors import safe_open

    from secateur.models.files import check_safetensors

    if not path.is_file():
        raise SecateurError(f"model file {path} is missing" + (f" (named by {index.name})" if index else "")
                            + f"; {RUN_FIX}")
    check_safetensors(path)
    try:
        h = stack.enter_context(safe_open(str(path), framework="pt"))
        for name in h.keys():
            h.get_slice(name).get_shape()
    except Exception as e:  # noqa: BLE001 - safetensors' own errors (SafetensorError, ...) for a damaged header
        raise SecateurError(f"model file {path} is truncated or corrupt ({e.__class__.__name__}: {first_line(e)}); "
                            "re-download or re-export it") from None
    return h


def first_line(e: Exception) -> str:
    """The start of an exception's message, safe inside a one-line error."""
    from secateur.schemas.report import printable

    lines = str(e).splitlines()
    return printable(lines[0][:80]) if lines else ""
