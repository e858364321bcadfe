"""The masks file of a masked run (``secateur-masks.npz``): one bit per weight (True = pruned) and each mask's
shape, so a reader (evaluation, recovery, tests) needs neither the exporter nor the method that wrote it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


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
