"""The idx format of MNIST and Fashion-MNIST (``*-idx3-ubyte[.gz]`` images, ``*-idx1-ubyte[.gz]`` labels).

Header: two zero bytes, a type code (0x08: unsigned byte, the only one these sets use), the number of dimensions
``n``, then ``n`` big-endian uint32 sizes; the data follow, C order. The header is checked against the file's
length before the data are read, so a truncated or padded file is one line naming it, never a reshape error.
"""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np

from secateur.errors import SecateurError


def read_idx(path: str | Path) -> np.ndarray:
    """The array an idx file (plain or gzip) holds: ``uint8 [N, H, W]`` images or ``uint8 [N]`` labels."""
    path = Path(path)
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except (OSError, EOFError, gzip.BadGzipFile) as e:
        raise SecateurError(f"idx file {path}: cannot read it ({e}); give an idx or idx.gz file as in "
                            "Fashion-MNIST") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08 or not 1 <= raw[3] <= 4:
        raise SecateurError(f"idx file {path}: not an unsigned-byte idx file (bad magic number); give an "
                            "idx or idx.gz file as in Fashion-MNIST")
    ndim = raw[3]
    head = 4 + 4 * ndim
    if len(raw) < head:
        raise SecateurError(f"idx file {path}: truncated header; the file is damaged, fetch it again")
    dims = struct.unpack(f">{ndim}I", raw[4:head])
    want = int(np.prod(dims, dtype=np.int64))
    if len(raw) - head != want:
        raise SecateurError(f"idx file {path}: its header says {' x '.join(map(str, dims))} = {want} bytes of "
                            f"data, the file holds {len(raw) - head}; the file is damaged, fetch it again")
    return np.frombuffer(raw, dtype=np.uint8, offset=head).reshape(dims)
