"""A masked (same-shape) run as a Hugging Face folder: safetensors weights, tokenizer, ``secateur-report.json``
and the bit-packed masks (``secateur-masks.npz``), written through :func:`secateur.safe_write.atomic_dir`."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from secateur.masks_file import pack_masks
from secateur.safe_write import MASKS_NAME, atomic_dir, write_report


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


_SPACE_OVERHEAD = 16 << 20  # tokenizer, config, report, zip headers: a few MB at most


def export_size(model: torch.nn.Module | None, masks: dict[str, torch.Tensor] | None = None,
                keep: float = 1.0) -> int:
    """Bytes an export of ``model`` takes, about: its tensors in their saved dtype (tied ones once),
    ``keep`` times that for a model still to be sliced, the bit-packed masks, a fixed overhead."""
    seen, n = set(), 0
    if model is not None:
        for t in model.state_dict().values():
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
            if key not in seen:
                seen.add(key)
                n += t.numel() * t.element_size()
    n = int(n * keep) + sum(m.numel() for m in (masks or {}).values()) // 8
    return n + _SPACE_OVERHEAD
