"""Write pruned models as Hugging Face folders, atomically, with their report and masks.

``DIR`` is built in a temporary sibling folder and renamed into place only when everything is
written, so a failure (including a full disk) leaves no ``DIR`` behind.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from secateur.errors import SecateurError

REPORT_NAME = "secateur-report.json"
MASKS_NAME = "secateur-masks.npz"


@contextlib.contextmanager
def atomic_dir(out: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary folder that becomes ``out`` on success and vanishes on failure."""
    out = Path(out)
    if out.exists() and not overwrite:
        raise SecateurError(f"output {out} already exists (pass --overwrite to replace it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        if out.exists():  # move the old folder aside first, so there is never a moment without either
            trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, trash / out.name)
            os.replace(tmp, out)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if e.errno == errno.ENOSPC:
            raise SecateurError(f"disk full while writing {out}; nothing was written") from e
        raise SecateurError(f"could not write {out}: {e.strerror or e}") from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def pack_masks(masks: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """Bit-pack boolean masks (True = pruned): 1 bit per weight, plus the shape of each."""
    arrays: dict[str, np.ndarray] = {}
    for name, m in masks.items():
        arrays[name + "::bits"] = np.packbits(m.cpu().numpy().astype(bool).ravel())
        arrays[name + "::shape"] = np.array(m.shape, dtype=np.int64)
    return arrays


def load_masks(path: str | Path) -> dict[str, torch.Tensor]:
    """Inverse of :func:`pack_masks` from a saved ``secateur-masks.npz``."""
    z = np.load(path)
    out = {}
    for key in z.files:
        if key.endswith("::bits"):
            name = key[: -len("::bits")]
            shape = tuple(int(s) for s in z[name + "::shape"])
            n = int(np.prod(shape))
            out[name] = torch.from_numpy(np.unpackbits(z[key])[:n].astype(bool).reshape(shape))
    return out


def save_run(model, tokenizer, out: str | Path, report: dict, masks: dict[str, torch.Tensor] | None = None,
             overwrite: bool = False, extra_files: dict[str, bytes] | None = None) -> Path:
    """Save a masked (same-shape) run: ``model`` (safetensors) + tokenizer + ``secateur-report.json`` (+ masks)
    as one atomic folder. Sliced models go through :func:`secateur.structured.export.save_pruned`."""
    with atomic_dir(out, overwrite) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if masks:
            np.savez_compressed(tmp / MASKS_NAME, **pack_masks(masks))
        for name, data in (extra_files or {}).items():
            (tmp / name).write_bytes(data)
        (tmp / REPORT_NAME).write_text(json.dumps(report, indent=2, default=str))
    return Path(out)
