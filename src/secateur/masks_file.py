"""The masks file of a masked run (``secateur-masks.npz``): one bit per weight (True = pruned) and each mask's
shape, so a reader (evaluation, recovery, tests) needs neither the exporter nor the method that wrote it.

A masks file is read back as an input like any other (:func:`read_packed`): every entry is a pair
``<module>::bits`` (uint8, 1-D, exactly the bytes its shape needs) and ``<module>::shape`` (a 1-D array of
non-negative integers), nothing else is in the file, and it holds at least one mask. Anything else (an empty
archive, foreign keys, a lone half of a pair, another dtype, a truncated bit array, a file that is not an npz) is
one line naming the file and the entry; whether the masks belong to a run's weights is the run's check
(:func:`secateur.recovery.runfolder.check_masks`).
"""

from __future__ import annotations

import os
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from secateur.errors import SecateurError, one_line

BITS, SHAPE = "::bits", "::shape"
FIX = "restore the file, or prune again to write it"


def pack_masks(masks: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """Bit-pack boolean masks (True = pruned): 1 bit per weight, plus the shape of each."""
    arrays: dict[str, np.ndarray] = {}
    for name, m in masks.items():
        arrays[name + BITS] = np.packbits(m.cpu().numpy().astype(bool).ravel())
        arrays[name + SHAPE] = np.array(m.shape, dtype=np.int64)
    return arrays


@dataclass(frozen=True)
class Packed:
    """One mask as stored: its shape and its packed bits (checked: ``len(bits) == ceil(prod(shape) / 8)``)."""

    shape: tuple[int, ...]
    bits: np.ndarray

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1

    def pruned(self) -> int:
        """The number of True bits (pruned weights); the padding bits of the last byte are not counted."""
        return int(np.unpackbits(self.bits, count=self.numel).sum(dtype=np.int64))

    def tensor(self) -> torch.Tensor:
        return torch.from_numpy(np.unpackbits(self.bits, count=self.numel).astype(bool).reshape(self.shape))


def _path(path) -> Path:
    if isinstance(path, bool) or not isinstance(path, (str, os.PathLike)):
        raise SecateurError(f"masks file: path must be a str or os.PathLike, not {type(path).__name__}; pass the "
                            "path of a secateur-masks.npz")
    p = Path(os.fspath(path))
    if not p.exists():
        raise SecateurError(f"masks file {one_line(str(p))} does not exist; pass the secateur-masks.npz of a masked "
                            "run (secateur prune --out)")
    if not p.is_file():
        raise SecateurError(f"masks file {one_line(str(p))} is not a regular file; pass the secateur-masks.npz of a "
                            "masked run")
    return p


def read_packed(path: str | os.PathLike) -> dict[str, Packed]:
    """Every mask of the file ``path`` as stored (name -> :class:`Packed`), each entry checked (module docstring)."""
    p = _path(path)
    where = f"masks file {one_line(str(p))}"
    try:
        with np.load(p, allow_pickle=False) as z:
            if not isinstance(z, np.lib.npyio.NpzFile):
                raise ValueError("an .npy array, not an .npz archive")
            arrays = {k: z[k] for k in z.files}
    except SecateurError:
        raise
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, KeyError, TypeError) as e:
        raise SecateurError(f"{where} cannot be read as an npz archive ({type(e).__name__}); {FIX}") from None
    except AttributeError:  # np.load of a non-npz returns an array with no context manager on some versions
        raise SecateurError(f"{where} is not an npz archive; {FIX}") from None
    names = sorted({k[: -len(BITS)] for k in arrays if k.endswith(BITS)} |
                   {k[: -len(SHAPE)] for k in arrays if k.endswith(SHAPE)})
    foreign = sorted(k for k in arrays if not (k.endswith(BITS) or k.endswith(SHAPE)))
    if foreign:
        raise SecateurError(f"{where} holds the entry {one_line(foreign[0])!r}, not a mask (secateur writes "
                            f"'<module>{BITS}' and '<module>{SHAPE}' only); {FIX}")
    if not names:
        raise SecateurError(f"{where} holds no mask; {FIX}")
    out: dict[str, Packed] = {}
    for name in names:
        shown = one_line(name)
        if name + BITS not in arrays or name + SHAPE not in arrays:
            half = SHAPE if name + BITS in arrays else BITS
            raise SecateurError(f"{where}: mask {shown!r} has no '{half}' entry; {FIX}")
        shape, bits = arrays[name + SHAPE], arrays[name + BITS]
        if shape.ndim != 1 or shape.dtype.kind not in "iu" or (shape < 0).any():
            raise SecateurError(f"{where}: {shown}{SHAPE} is not a list of sizes ({shape.dtype} {list(shape.shape)})"
                                f"; {FIX}")
        if bits.ndim != 1 or bits.dtype != np.uint8:
            raise SecateurError(f"{where}: {shown}{BITS} is {bits.dtype} {list(bits.shape)}, not packed bits "
                                f"(uint8, one dimension); {FIX}")
        packed = Packed(tuple(int(s) for s in shape), bits)
        if len(bits) != -(-packed.numel // 8):
            raise SecateurError(f"{where}: {shown}{BITS} holds {len(bits)} bytes, its shape "
                                f"{list(packed.shape)} needs {-(-packed.numel // 8)}; {FIX}")
        out[name] = packed
    return out


def load_masks(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Inverse of :func:`pack_masks` from a saved ``secateur-masks.npz`` (checked by :func:`read_packed`)."""
    return {name: p.tensor() for name, p in read_packed(path).items()}
