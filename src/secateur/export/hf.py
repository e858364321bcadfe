"""A masked (same-shape) run as a Hugging Face folder: safetensors weights, tokenizer, ``secateur-report.json``
and the bit-packed masks (``secateur-masks.npz``), written through :func:`secateur.export.folder.atomic_dir`."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from secateur.export.folder import MASKS_NAME, atomic_dir, export_size, write_report


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
    as one atomic folder. Sliced models go through :func:`secateur.export.sliced.save_pruned`."""
    with atomic_dir(out, overwrite, need=export_size(model, masks)) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        write_run_files(tmp, tokenizer, report, masks, extra_files)
    return Path(out)


def write_run_files(folder: Path, tokenizer, report: dict, masks=None, extra_files: dict[str, bytes] | None = None
                    ) -> None:
    """The files of a run folder besides the model: tokenizer, bit-packed masks, the method's files and
    ``secateur-report.json`` (written last: its presence marks a complete secateur output)."""
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    if masks:
        np.savez_compressed(folder / MASKS_NAME, **pack_masks(masks))
    for name, data in (extra_files or {}).items():
        (folder / name).write_bytes(data)
    write_report(folder, report)
