"""GGUF input: check a ``.gguf`` file, dequantize it once into a plain Hugging Face folder, reuse it afterwards.

GGUF-loaded transformers models refuse ``save_pretrained``, so every method and evaluator works on a cached
plain folder instead: ``cache_dir()/gguf/<sha256[:16]>-<dtype>/``, keyed by the file's content (a renamed or
moved file hits the same entry; an edited one does not). The digest itself is cached by (path, size, mtime) in
``cache_dir()/gguf/digests.json`` so a large file is hashed once, not on every run.

Dequantization is tensor by tensor (GGUF memory-mapped, weights written shard by shard with
``safetensors.torch.save_file``): memory stays near one copy of a shard, never the two full models that
``from_pretrained(gguf_file=...)`` + ``from_config`` + ``save_pretrained`` would hold. The tensors are
exactly those ``from_pretrained(dir, gguf_file=name, dtype=...)`` produces: the same dequantization, the same
q/k un-permutation, the same cast, through transformers' per-architecture tensor processor (``gemma3``: llama.cpp
stores Gemma's RMSNorm weights as ``1 + w``, the processor subtracts the 1 from every ``*norm.weight``, q/k
norms included; checked on Gemma-3-270M: its dense WikiText-2 perplexity matches).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import mmap
import os
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from secateur.errors import SecateurError
from secateur.models.families import gguf_families

# GGUF ``general.architecture`` -> Hugging Face model_type, for the families whose adapter declares one
# (llama.cpp writes Mistral as "llama"; transformers tells them apart by general.name, and so do we).
GGUF_FAMILIES = gguf_families()
TMP_PREFIX = ".secateur-tmp-"  # unfinished cache entries: safe to delete when no secateur run is active
SHARD_BYTES = 2 << 30  # bounds the memory of one write; smaller models get one model.safetensors
_CHUNK = 1 << 20


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


def _read_header(path: Path, buf) -> tuple[dict, list[GGUFTensor]]:
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
            meta, tensors = _read_header(path, buf)
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


def file_sha256(path: Path) -> str:
    """sha256 of a file, hashed streaming in 1 MiB chunks; remembered by (path, size, mtime)."""
    path = Path(path).resolve()
    st = path.stat()
    book = cache_root() / "digests.json"
    key, stamp = str(path), {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
    try:
        known = json.loads(book.read_text())
    except (OSError, ValueError):
        known = {}
    entry = known.get(key)
    if isinstance(entry, dict) and all(entry.get(k) == v for k, v in stamp.items()) and "sha256" in entry:
        return entry["sha256"]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    known[key] = stamp | {"sha256": h.hexdigest()}
    _write_json_atomic(book, known)
    return h.hexdigest()


def cache_dir() -> Path:
    """secateur's cache: ``$SECATEUR_CACHE`` or ``~/.cache/secateur`` (``models.loading`` hands it on)."""
    return Path(os.environ.get("SECATEUR_CACHE", Path.home() / ".cache" / "secateur"))


def cache_root() -> Path:
    return cache_dir() / "gguf"


def cache_folder(path: Path, dtype: torch.dtype) -> Path:
    return cache_root() / f"{file_sha256(path)[:16]}-{str(dtype).removeprefix('torch.')}"


def cached_folder(path: Path, dtype: torch.dtype = torch.float32) -> Path:
    """The plain HF folder for a GGUF file in ``dtype``: reused when present, else dequantized once."""
    path = Path(path)
    if not path.is_file():
        raise SecateurError(f"GGUF file {path} does not exist")
    target = cache_folder(path, dtype)
    if (target / "config.json").exists():
        return target
    return gguf_to_folder(path, target, dtype)


def _check_space(folder: Path, need: int, path: Path) -> None:
    free = shutil.disk_usage(folder).free
    if free < need + (64 << 20):
        raise SecateurError(f"not enough disk space to dequantize {path.name}: about {need / 1e9:.2f} GB needed in "
                            f"{folder}, {free / 1e9:.2f} GB free; free some space or set SECATEUR_CACHE to a "
                            "larger disk")


def gguf_to_folder(path: Path, out: Path, dtype: torch.dtype = torch.float32) -> Path:
    """Dequantize a GGUF file into a plain HF folder ``out`` (atomic: a temp folder renamed into place)."""
    info = inspect_gguf(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    _check_space(out.parent, info.n_params * dtype.itemsize, path)
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    try:
        config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name, trust_remote_code=False)
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, trust_remote_code=False)
    except (ValueError, KeyError, OSError, TypeError, NotImplementedError) as e:
        raise SecateurError(f"could not read the model description or tokenizer in GGUF file {path}: "
                            f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from e
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = dtype
    tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{out.name}-", dir=out.parent))
    try:
        tok.save_pretrained(tmp)
        del tok  # its Python objects are freed before the weights are built
        _write_weights(info, config, dtype, tmp)
        config.save_pretrained(tmp)
        if (gen := GenerationConfig.from_model_config(config)) is not None:
            gen.save_pretrained(tmp)
        _open_permissions(tmp)
        try:
            os.replace(tmp, out)
        except OSError:
            if not (out / "config.json").exists():  # not a concurrent run that finished first
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _hf_names(config) -> tuple[torch.nn.Module, dict[str, tuple[int, ...]]]:
    """A meta-device model (no memory) for the GGUF->HF name map and the exact keys (with their shapes) that
    save_pretrained writes."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    # named_parameters() lists a tied parameter once, under its first name (the embedding), like save_pretrained
    keys = {n: tuple(p.shape) for n, p in model.named_parameters()}
    persistent = model.state_dict()
    keys |= {n: tuple(b.shape) for n, b in model.named_buffers() if n in persistent}
    return model, keys


def _tensor_data(path: Path, t: GGUFTensor):
    """The memory-mapped data of one tensor, shaped as GGUFReader shapes it (what gguf.dequantize expects)."""
    import gguf
    import numpy as np

    raw = np.memmap(path, mode="r", dtype=np.uint8, offset=t.start, shape=(t.nbytes,))
    if t.qtype == gguf.GGMLQuantizationType.F32:
        return raw.view(np.float32).reshape(t.shape)
    if t.qtype == gguf.GGMLQuantizationType.F16:
        return raw.view(np.float16).reshape(t.shape)
    return raw.reshape(gguf.quant_shape_to_byte_shape(t.shape, t.qtype))


@contextlib.contextmanager
def _shared_name_maps():
    """transformers' get_gguf_hf_weights_map rebuilds gguf's name table for every submodule (~400 times, ~20 s
    for SmolLM2); the table depends only on (arch, n_blocks) and is only read, so build it once."""
    import gguf

    original = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.cache(original)
    try:
        yield
    finally:
        gguf.get_tensor_name_map = original


def _dequantize(data, qtype):
    """gguf.dequantize, in row chunks into one output array: the same values (blocks are independent) with
    a bounded temporary instead of several full-size ones for a large embedding."""
    import gguf
    import numpy as np

    if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16) or data.ndim < 2:
        return gguf.dequantize(data, qtype)
    rows = max(1, (32 << 20) // max(1, data[0].size * 4))  # ~32 MiB of output per chunk
    first = gguf.dequantize(data[:rows], qtype)
    out = np.empty((data.shape[0], *first.shape[1:]), dtype=first.dtype)
    out[:rows] = first
    for i in range(rows, data.shape[0], rows):
        out[i:i + rows] = gguf.dequantize(data[i:i + rows], qtype)
    return out


def _write_weights(info: GGUFInfo, config, dtype: torch.dtype, folder: Path) -> None:
    """Stream the GGUF tensors, dequantized and converted like transformers' loader, into safetensors shards."""
    import numpy as np
    from safetensors.torch import save_file
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    path = info.path
    # the loader hands the processors its parsed config dict; the HF config carries the same keys
    processor = TENSOR_PROCESSORS.get(info.architecture, TensorProcessor)(config=config.to_dict())
    model, keys = _hf_names(config)
    config.architectures = [type(model).__name__]  # what save_pretrained records
    with _shared_name_maps():
        mapping = get_gguf_hf_weights_map(model, processor)
    del model
    done, side = set(), {}
    shards: list[dict[str, str]] = []  # per shard: HF name -> temp file
    shard: dict[str, torch.Tensor] = {}
    size = 0

    def flush() -> None:
        nonlocal shard, size
        if shard:
            name = f"shard-{len(shards):05d}.safetensors"
            save_file(shard, str(folder / name), metadata={"format": "pt"})
            shards.append(dict.fromkeys(shard, name))
        shard, size = {}, 0

    def add(hf_name: str, weights) -> None:
        nonlocal size
        if hf_name not in keys or hf_name in done:
            return
        if tuple(weights.shape) != keys[hf_name]:
            raise SecateurError(f"GGUF file {path}: tensor {hf_name} has shape {tuple(weights.shape)} but its "
                                f"metadata describes {keys[hf_name]}; this file's hyperparameters are not "
                                "understood (transformers cannot load it either)")
        # the loader's conversion (from_numpy(np.copy(w)).to(dtype)); the copy only where w is a view
        owned = weights.flags.c_contiguous and weights.flags.writeable and weights.base is None
        t = torch.from_numpy(weights if owned else np.copy(weights)).to(dtype)
        if size and size + t.nbytes > SHARD_BYTES:
            flush()
        shard[hf_name], size = t, size + t.nbytes
        done.add(hf_name)

    for t in info.tensors:
        res = processor.process(weights=_dequantize(_tensor_data(path, t), t.qtype), name=t.name,
                                tensor_key_mapping=mapping, parsed_parameters={"tensors": side})
        for hf_name, t in side.items():  # processors that place a tensor themselves (gpt2's lm_head)
            add(hf_name, t.numpy())
        side.clear()
        if res.name in mapping:
            add(mapping[res.name], res.weights)
        del res
    flush()
    missing = [k for k in keys if k not in done]
    if missing:
        raise SecateurError(f"GGUF file {path} lacks {len(missing)} tensors of a {config.model_type} model "
                            f"(first: {missing[0]}); it may be incomplete, re-download it")
    _name_shards(folder, shards)


def _name_shards(folder: Path, shards: list[dict[str, str]]) -> None:
    """save_pretrained's layout: model.safetensors, or model-0000i-of-0000n.safetensors plus the index."""
    if len(shards) == 1:
        os.replace(folder / next(iter(shards[0].values())), folder / "model.safetensors")
        return
    weight_map, total = {}, 0
    for i, part in enumerate(shards, 1):
        old = folder / next(iter(part.values()))
        total += old.stat().st_size
        final = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        os.replace(old, folder / final)
        weight_map.update(dict.fromkeys(part, final))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _open_permissions(folder: Path) -> None:
    """mkdtemp makes a private folder; a cache entry gets the user's usual permissions."""
    mask = _umask()
    os.chmod(folder, 0o777 & ~mask)
    for f in folder.iterdir():
        os.chmod(f, 0o666 & ~mask)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _write_json_atomic(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f"{TMP_PREFIX}{path.name}-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=1)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def model_source(path: Path, dtype: torch.dtype) -> dict:
    """For the report: which file, its content digest and the cached folder the run really loaded."""
    return {"gguf": str(Path(path).resolve()), "sha256": file_sha256(path), "cache": str(cache_folder(path, dtype))}
