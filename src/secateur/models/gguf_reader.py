"""A GGUF file's header, read without llama.cpp or the gguf package's model code: its key/value metadata and its
tensor table (names, shapes, types, offsets), each field bounds-checked so that a truncated or damaged file is one
line naming it, never a struct error."""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

from secateur.errors import SecateurError
from secateur.models.families import gguf_families

GGUF_FAMILIES = gguf_families()  # GGUF architecture -> transformers model_type


@dataclass
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # numpy (row-major) order
    qtype: object  # gguf.GGMLQuantizationType
    start: int  # absolute byte offset of the data
    nbytes: int


@dataclass
class GGUFInfo:
    path: Path
    architecture: str
    model_type: str
    metadata: dict  # scalar and string values; arrays as their length
    tensors: list[GGUFTensor]

    @property
    def n_params(self) -> int:  # elements stored (a tied lm_head is not stored twice)
        return sum(math.prod(t.shape) for t in self.tensors)


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def _read_str(buf, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, pos)
    if pos + 8 + n > len(buf):
        raise ValueError(f"a string runs past the end of the file (byte {pos})")
    return bytes(buf[pos + 8:pos + 8 + n]).decode("utf-8"), pos + 8 + n


def _read_value(buf, pos: int, vtype: int):
    if vtype in _SCALARS:
        return struct.unpack_from(_SCALARS[vtype], buf, pos)[0], pos + struct.calcsize(_SCALARS[vtype])
    if vtype == 8:
        return _read_str(buf, pos)
    if vtype == 9:  # array: walked, kept as its length (the vocabulary is transformers' business)
        etype, count = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if etype in _SCALARS:
            return count, pos + count * struct.calcsize(_SCALARS[etype])
        for _ in range(count):
            _, pos = _read_value(buf, pos, etype)
        return count, pos
    raise ValueError(f"unknown metadata value type {vtype} at byte {pos}")


def read_header(path: Path, buf) -> tuple[dict, list[GGUFTensor]]:
    """GGUF v2/v3 header: metadata and the tensor table, without GGUFReader's per-token Python objects (for a
    49k vocabulary that parse costs seconds and ~150 MB; this walk costs milliseconds)."""
    import gguf

    if bytes(buf[:4]) != b"GGUF":
        raise ValueError("no GGUF magic at the start")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} (this reader knows 2 and 3)")
    pos, meta = 24, {}
    for _ in range(n_kv):
        key, pos = _read_str(buf, pos)
        (vtype,) = struct.unpack_from("<I", buf, pos)
        meta[key], pos = _read_value(buf, pos + 4, vtype)
    table = []
    for _ in range(n_tensors):
        name, pos = _read_str(buf, pos)
        (ndim,) = struct.unpack_from("<I", buf, pos)
        dims = struct.unpack_from(f"<{ndim}Q", buf, pos + 4)
        qtype, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * ndim)
        pos += 4 + 8 * ndim + 12
        table.append((name, tuple(reversed(dims)), qtype, offset))
    align = int(meta.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT))
    data_start = (pos + align - 1) // align * align
    tensors = []
    for name, shape, type_id, offset in table:
        try:
            qtype = gguf.GGMLQuantizationType(type_id)
            block, size = gguf.GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise ValueError(f"tensor {name} has ggml type {type_id}, unknown to the installed gguf package "
                             "(a newer format: pip install -U gguf)") from None
        tensors.append(GGUFTensor(name, shape, qtype, data_start + offset, math.prod(shape) // block * size))
    return meta, tensors


def _corrupt(path: Path, why: str) -> SecateurError:
    return SecateurError(f"GGUF file {path} is truncated or corrupt: {why}; re-download it")


def inspect_gguf(path: Path) -> GGUFInfo:
    """Read the header only (memory-mapped); refuse corrupt files, unsupported families and tensor types the
    gguf package cannot dequantize, before any work."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            meta, tensors = read_header(path, buf)
    except (ValueError, struct.error, UnicodeDecodeError, OverflowError, MemoryError) as e:
        raise _corrupt(path, str(e).splitlines()[0] if str(e) else type(e).__name__) from e
    end = max((t.start + t.nbytes for t in tensors), default=0)
    if end > size:
        raise _corrupt(path, f"its tensor data ends at byte {end} but the file has {size} bytes")
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise _corrupt(path, "no general.architecture in its metadata")
    if arch not in GGUF_FAMILIES:
        raise SecateurError(f"GGUF file {path} holds a {arch!r} model; secateur supports the GGUF families "
                            f"{', '.join(GGUF_FAMILIES)}")
    readable = _dequantizable()
    odd = sorted({t.qtype.name for t in tensors if readable is not None and t.qtype not in readable})
    if odd:
        raise SecateurError(f"GGUF file {path} stores tensors as {', '.join(odd)}, which the installed gguf package "
                            "cannot dequantize; upgrade it (pip install -U gguf) or use another quantization")
    model_type = GGUF_FAMILIES[arch]
    if arch == "llama" and "mistral" in str(meta.get("general.name", "")).lower():
        model_type = "mistral"
    return GGUFInfo(path, arch, model_type, meta, tensors)


def _dequantizable() -> set | None:
    """The tensor types gguf.dequantize handles (None when this gguf version does not say)."""
    import gguf

    traits = getattr(gguf.quants, "_type_traits", None)
    if not isinstance(traits, dict):
        return None
    return set(traits) | {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16}
