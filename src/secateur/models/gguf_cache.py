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

The cache verifies what it serves. Each entry holds a manifest, ``secateur-cache.json``
(:class:`secateur.schemas.cache.CacheManifest`): the GGUF's digest and, for every file written, its size, mtime
and sha256. At use, sizes and mtimes are compared with it (no byte read), and a file whose mtime changed is hashed
again; an entry that no longer matches (a file altered in place, truncated, missing or added, a damaged manifest)
is derived again from the GGUF, with one stderr line naming the entry, never used as it is. An entry written by
an older secateur (no manifest) is checked for completeness and adopted: its manifest is written then. The cache
folder itself (``$SECATEUR_CACHE``) must be a folder secateur can write to before anything is derived into it: a
file there, or a read-only folder, is one line naming the variable and what to do. The first dequantization of a
large GGUF says what it is doing, where, and how much it will write, before the long silent part.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from secateur.errors import SecateurError
from secateur.files import regular_file, umask, write_json_atomic
from secateur.models.gguf_reader import (
    GGUFInfo,
    GGUFTensor,
    inspect_gguf,
)
from secateur.schemas import parse
from secateur.schemas.cache import MANIFEST_SCHEMA, CacheManifest

# GGUF ``general.architecture`` -> Hugging Face model_type, for the families whose adapter declares one
# (llama.cpp writes Mistral as "llama"; transformers tells them apart by general.name, and so do we).
TMP_PREFIX = ".secateur-tmp-"  # unfinished cache entries: safe to delete when no secateur run is active
SHARD_BYTES = 2 << 30  # bounds the memory of one write; smaller models get one model.safetensors
_CHUNK = 1 << 20
MANIFEST_NAME = "secateur-cache.json"  # an entry's manifest (secateur.schemas.cache.CacheManifest)
ANNOUNCE_BYTES = 64 << 20  # a dequantization that writes more than this says so first (a tiny file is quick)
CACHE_FIX = "set SECATEUR_CACHE to a writable folder (or unset it to use ~/.cache/secateur)"


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
    with contextlib.suppress(OSError):  # a read-only or misplaced cache only costs hashing again next time
        write_json_atomic(book, known)
    return h.hexdigest()


def known_file(sha256: str) -> Path | None:
    """A file of this machine with content ``sha256``, from the digest book (still there, same size and mtime as
    when it was hashed), else None: how a run whose report names its GGUF by file name finds it again."""
    try:
        known = json.loads((cache_root() / "digests.json").read_text())
    except (OSError, ValueError):
        return None
    for key, entry in known.items() if isinstance(known, dict) else ():
        if not isinstance(entry, dict) or entry.get("sha256") != sha256:
            continue
        p = Path(key)
        try:
            st = p.stat()
        except OSError:
            continue
        if st.st_size == entry.get("size") and st.st_mtime_ns == entry.get("mtime_ns"):
            return p
    return None


def cache_dir() -> Path:
    """secateur's cache: ``$SECATEUR_CACHE`` or ``~/.cache/secateur`` (``models.loading`` hands it on; an empty
    ``SECATEUR_CACHE`` counts as unset, never as the working directory)."""
    env = os.environ.get("SECATEUR_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "secateur"


def _cache_label() -> str:
    env = os.environ.get("SECATEUR_CACHE")
    return f"SECATEUR_CACHE={env}" if env else f"the cache folder {cache_dir()} (SECATEUR_CACHE unset)"


def check_cache_env() -> None:
    """The cache is a folder, or can become one: a file in its place is one line naming SECATEUR_CACHE."""
    for p in (cache_dir(), cache_root()):
        if p.exists() and not p.is_dir():
            where = "" if p == cache_dir() else f" ({p} is)"
            raise SecateurError(f"{_cache_label()} is a file, not a folder{where}; {CACHE_FIX}")


def writable_cache_root() -> Path:
    """``cache_root()``, created if needed and proven writable by making (and removing) a file in it; else one
    line naming SECATEUR_CACHE and what to do (root ignores permission bits, so only a real write can tell)."""
    check_cache_env()
    root = cache_root()
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=f"{TMP_PREFIX}probe-", dir=root)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise SecateurError(f"{_cache_label()} is not writable ({e.strerror or type(e).__name__}: "
                            f"{e.filename or root}); {CACHE_FIX}") from None
    return root


def check_gguf_path(path: Path) -> Path:
    """A GGUF path that is a regular file (a FIFO or a device would hang the reader), or one line."""

    return regular_file(path, "GGUF file", "check the path and pass a .gguf file")


def cache_root() -> Path:
    return cache_dir() / "gguf"


def cache_folder(path: Path, dtype: torch.dtype) -> Path:
    return cache_root() / f"{file_sha256(path)[:16]}-{str(dtype).removeprefix('torch.')}"


def cached_folder(path: Path, dtype: torch.dtype = torch.float32) -> Path:
    """The plain HF folder for a GGUF file in ``dtype``: reused when present, else dequantized once."""
    path = check_gguf_path(Path(path))
    check_cache_env()
    target = cache_folder(path, dtype)
    if not os.path.lexists(target):
        return gguf_to_folder(path, target, dtype)
    why = entry_problem(target, path, dtype)
    if why is None:
        return target
    print(f"secateur: the GGUF cache entry {target} does not match what secateur wrote ({why}); deriving it again "
          f"from {path.name}", file=sys.stderr)
    _retire(target)
    return gguf_to_folder(path, target, dtype, announce=False)


def _hash(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _entry_files(folder: Path) -> list[Path]:
    """The files an entry serves: everything but its manifest and unfinished temporaries."""
    return sorted(p for p in folder.iterdir() if p.name != MANIFEST_NAME and not p.name.startswith(TMP_PREFIX))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def write_manifest(folder: Path, gguf_sha256: str, dtype: torch.dtype) -> None:
    """Record every file of ``folder`` (size, mtime, sha256) in its manifest."""
    files = {}
    for f in _entry_files(folder):
        st = f.stat()
        files[f.name] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": _hash(f)}
    write_json_atomic(folder / MANIFEST_NAME, {"secateur_gguf_cache": MANIFEST_SCHEMA, "gguf_sha256": gguf_sha256,
                                                "dtype": _dtype_name(dtype), "files": files})


def _adoptable(folder: Path) -> str | None:
    """Why an entry without a manifest (an older secateur's) cannot be adopted; None: it is complete."""
    from secateur.models.files import check_safetensors

    if not (folder / "config.json").is_file():
        return "no config.json and no manifest"
    weights = sorted(folder.glob("*.safetensors"))
    if not weights:
        return "no weights and no manifest"
    try:
        for f in weights:
            check_safetensors(f)
    except SecateurError:
        return f"{f.name} is truncated or corrupt"
    return None


def entry_problem(folder: Path, gguf: Path, dtype: torch.dtype) -> str | None:
    """None when the cache entry ``folder`` serves as it is; else what is wrong with it (one clause).

    Cheap at use: sizes and mtimes against the manifest; a file is hashed only when its mtime changed (and the
    manifest then learns the new mtime, so the next run is cheap again)."""
    if not folder.is_dir():
        return "it is not a folder"
    try:
        data = json.loads((folder / MANIFEST_NAME).read_text(encoding="utf-8"))
    except FileNotFoundError:
        why = _adoptable(folder)
        if why is None:  # written before manifests existed: complete, so adopted (its digests recorded now)
            with contextlib.suppress(OSError):
                write_manifest(folder, file_sha256(gguf), dtype)
        return why
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return f"its manifest {MANIFEST_NAME} cannot be read ({type(e).__name__})"
    try:
        man = parse(CacheManifest, data, MANIFEST_NAME, "")
    except SecateurError as e:
        return f"its manifest is damaged: {str(e).rstrip('; ')}"
    if man.gguf_sha256 != file_sha256(gguf) or man.dtype != _dtype_name(dtype):
        return "its manifest names another GGUF file or dtype"
    present = {p.name for p in _entry_files(folder)}
    if missing := sorted(set(man.files) - present):
        return f"{missing[0]} is missing"
    if extra := sorted(present - set(man.files)):
        return f"{extra[0]} was not written by secateur"
    touched = {}
    for name, rec in man.files.items():
        st = (folder / name).stat()
        if st.st_size != rec.size:
            return f"{name} has {st.st_size} bytes, {rec.size} when written: truncated or altered"
        if st.st_mtime_ns != rec.mtime_ns:
            if _hash(folder / name) != rec.sha256:
                return f"{name} was altered after it was written (its sha256 differs)"
            touched[name] = rec.model_dump() | {"mtime_ns": st.st_mtime_ns}
    if touched:  # same bytes, new mtime (a copy, a touch): remember it so the next check is cheap again
        with contextlib.suppress(OSError):
            write_json_atomic(folder / MANIFEST_NAME, data | {"files": data["files"] | touched})
    return None


def _retire(folder: Path) -> None:
    """Move a stale entry out of the way (renamed, then deleted), or one line saying how to remove it."""
    root = writable_cache_root()
    try:
        if folder.is_dir() and not folder.is_symlink():
            old = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}stale-{folder.name}-", dir=root))
            os.replace(folder, old / folder.name)
            shutil.rmtree(old, ignore_errors=True)
        else:
            folder.unlink()
    except FileNotFoundError:  # a concurrent run moved it first
        pass
    except OSError as e:
        raise SecateurError(f"the stale GGUF cache entry {folder} cannot be removed ({e.strerror or e}); delete it "
                            "(rm -r) and run again") from None


def _check_space(folder: Path, need: int, path: Path) -> None:
    free = shutil.disk_usage(folder).free
    if free < need + (64 << 20):
        raise SecateurError(f"not enough disk space to dequantize {path.name}: about {need / 1e9:.2f} GB needed in "
                            f"{folder}, {free / 1e9:.2f} GB free; free some space or set SECATEUR_CACHE to a "
                            "larger disk")


def gguf_to_folder(path: Path, out: Path, dtype: torch.dtype = torch.float32, announce: bool = True) -> Path:
    """Dequantize a GGUF file into a plain HF folder ``out`` (atomic: a temp folder renamed into place) with its
    manifest; ``announce``: a large one says what it does first (one stderr line)."""
    info = inspect_gguf(path)
    if out.parent == cache_root():
        writable_cache_root()
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
    need = info.n_params * dtype.itemsize
    _check_space(out.parent, need, path)
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
    if announce and need >= ANNOUNCE_BYTES:
        print(f"secateur: first use of {path.name}: dequantizing it to {_dtype_name(dtype)} into the cache folder "
              f"{out} (about {need / 1e9:.1f} GB, written once; later runs reuse it)", file=sys.stderr)
    tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{out.name}-", dir=out.parent))
    try:
        tok.save_pretrained(tmp)
        del tok  # its Python objects are freed before the weights are built
        _write_weights(info, config, dtype, tmp)
        config.save_pretrained(tmp)
        if (gen := GenerationConfig.from_model_config(config)) is not None:
            gen.save_pretrained(tmp)
        _open_permissions(tmp)
        write_manifest(tmp, file_sha256(path), dtype)  # what this entry holds, checked at every use
        try:
            os.replace(tmp, out)
        except OSError as e:
            if not (out / MANIFEST_NAME).exists():  # not a concurrent run that finished first
                raise SecateurError(f"could not move the new GGUF cache entry into {out} ({e.strerror or e}); "
                                    "delete it (rm -r) and run again") from None
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
    mask = umask()
    os.chmod(folder, 0o777 & ~mask)
    for f in folder.iterdir():
        os.chmod(f, 0o666 & ~mask)


def model_source(path: Path, dtype: torch.dtype) -> dict:
    """For the report: which file, its content digest and the cached folder the run really loaded."""
    return {"gguf": str(Path(path).resolve()), "sha256": file_sha256(path), "cache": str(cache_folder(path, dtype))}
