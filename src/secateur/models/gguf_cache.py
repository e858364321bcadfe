"""GGUF input: check a ``.gguf`` file, dequantize it once into a plain Hugging Face folder, reuse it afterwards.

GGUF-loaded transformers models refuse ``save_pretrained``, so every method and evaluator works on a cached
plain folder instead: ``cache_dir()/gguf/<sha256[:16]>-<dtype>/``, keyed by the file's content (a renamed or
moved file hits the same entry; an edited one does not). The digest itself is cached by (path, size, mtime) in
``cache_dir()/gguf/digests.json`` so a large file is hashed once, not on every run.

Dequantization is tensor by tensor (GGUF memory-mapped, weights written shard by shard with
``safetensors.torch.save_file``): memory stays near one copy of a shard, never the two full models that
``from_pretrained(gguf_file=...)`` + ``from_config`` + ``save_pretrained`` would hold. The tensors are
exactly those ``from_pretrained(dir, gguf_file=name, dtype=...)`` produces: the same dequantization, the same
q/k un-permutation, the same cast.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from secateur.errors import SecateurError

# GGUF ``general.architecture`` -> Hugging Face model_type, for the families secateur's adapters handle
# (llama.cpp writes Mistral as "llama"; transformers tells them apart by general.name, and so do we).
GGUF_FAMILIES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "gpt2": "gpt2"}
TMP_PREFIX = ".secateur-tmp-"  # unfinished cache entries: safe to delete when no secateur run is active
SHARD_BYTES = 2 << 30  # bounds the memory of one write; smaller models get one model.safetensors
_CHUNK = 1 << 20


@dataclass
class GGUFInfo:
    path: Path
    architecture: str
    model_type: str
    n_params: int  # elements of the file's tensors (the tied lm_head is not stored twice)


def _corrupt(path: Path, why: str) -> SecateurError:
    return SecateurError(f"GGUF file {path} is truncated or corrupt: {why}; re-download it")


def inspect_gguf(path: Path) -> GGUFInfo:
    """Read the header only (memory-mapped); refuse corrupt files and unsupported families before any work."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
        field = reader.fields.get("general.architecture")
        arch = field.contents() if field is not None else None
        end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    except (ValueError, IndexError, KeyError, OSError, UnicodeDecodeError, OverflowError) as e:
        raise _corrupt(path, str(e).splitlines()[0] if str(e) else type(e).__name__) from e
    readable = _dequantizable()
    odd = sorted({t.tensor_type.name for t in reader.tensors if readable is not None and t.tensor_type not in readable})
    if end > path.stat().st_size:
        raise _corrupt(path, f"tensor data ends at byte {end} but the file has {path.stat().st_size}")
    if not isinstance(arch, str):
        raise _corrupt(path, "no general.architecture in its metadata")
    if arch not in GGUF_FAMILIES:
        raise SecateurError(f"GGUF file {path} holds a {arch!r} model; secateur supports the GGUF families "
                            f"{', '.join(GGUF_FAMILIES)}")
    if odd:
        raise SecateurError(f"GGUF file {path} stores tensors as {', '.join(odd)}, which the installed gguf package "
                            "cannot dequantize; upgrade it (pip install -U gguf) or use another quantization")
    name = reader.fields.get("general.name")
    model_type = GGUF_FAMILIES[arch]
    if arch == "llama" and name is not None and "mistral" in str(name.contents()).lower():
        model_type = "mistral"
    return GGUFInfo(path, arch, model_type, sum(int(t.n_elements) for t in reader.tensors))


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


def cache_root() -> Path:
    from secateur.models.loading import cache_dir

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
        config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    except (ValueError, KeyError, OSError, TypeError) as e:
        raise SecateurError(f"could not read the model description in GGUF file {path}: "
                            f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from e
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = dtype
    tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{out.name}-", dir=out.parent))
    try:
        AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(tmp)
        _write_weights(path, config, dtype, tmp)
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


def _gguf_tensors(path: Path) -> tuple[str, list[tuple[str, object, object]]]:
    """``(architecture, [(gguf name, ggml type, memory-mapped data)])``; the parsed metadata is dropped so its
    Python objects (a vocabulary is ~100k of them) are freed before the weights are built."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch = reader.fields["general.architecture"].contents()
    return arch, [(t.name, t.tensor_type, t.data) for t in reader.tensors]


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


def _write_weights(path: Path, config, dtype: torch.dtype, folder: Path) -> None:
    """Stream the GGUF tensors, dequantized and converted like transformers' loader, into safetensors shards."""
    import numpy as np
    from safetensors.torch import save_file
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    arch, tensors = _gguf_tensors(path)
    # the loader hands the processors its parsed config dict; the HF config carries the same keys
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config.to_dict())
    model, keys = _hf_names(config)
    config.architectures = [type(model).__name__]  # what save_pretrained records
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

    while tensors:
        name, qtype, data = tensors.pop(0)
        res = processor.process(weights=_dequantize(data, qtype), name=name, tensor_key_mapping=mapping,
                                parsed_parameters={"tensors": side})
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
