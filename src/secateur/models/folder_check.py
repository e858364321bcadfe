"""A model folder checked against its own config before any weight is used.

``config.json`` says what the model is (its sizes, its layer count); the safetensors files hold what it has.
When the two disagree, transformers either refuses with a multi-page traceback (a hidden or vocabulary size
that differs) or, worse, loads what it can and initialises the rest at random (a config that says 3 layers over
weights that hold 2: the third layer is random, and a prune saves it). :func:`check_folder` compares them from
the files' headers alone (no weight byte is read) and refuses a disagreement with one line naming the tensor,
both shapes and the config field behind it:

1. the config's sizes are validated (:class:`secateur.schemas.config.ModelSizes`: positive integers);
2. the layer count of the config against the layers the weights hold (before anything is built, so an absurd
   ``num_hidden_layers`` costs nothing);
3. the model is built from the config on the meta device, and every tensor its state dict implies (tied
   weights: one of the tied names; non-persistent buffers such as RoPE tables are not saved and not expected)
   must be in the files with its shape, and the files must hold nothing else (names transformers itself
   ignores, such as old GPT-2 checkpoints' ``attn.bias``, excepted; a missing or extra base-model prefix is
   matched as transformers matches it);
4. every tensor held for a parameter is of a floating type (``F16``, ``BF16``, ``F32``, ``F64``, ``F8_*``): the
   model is built in the run's floating dtype and a float tensor is cast to it as transformers does (a
   documented upcast), but integers or booleans stored for a weight (a quantized or damaged shard) would be
   cast to float and pruned as if they were weights. Integer buffers (position ids) are left alone.

A folder without safetensors (``*.bin`` only) cannot be read without unpickling its weights; there
:func:`secateur.models.loading.load_model` refuses the loader's own report of missing, unexpected or mismatched
keys instead. A folder that passed is remembered (by its files' sizes and mtimes) for the rest of the process.
"""

from __future__ import annotations

import contextlib
import json
import re
import warnings
from pathlib import Path

from secateur.errors import SecateurError
from secateur.schemas import parse
from secateur.schemas.config import ModelSizes, ShardIndex

INDEX_NAME = "model.safetensors.index.json"
WEIGHTS_NAME = "model.safetensors"
LAYER_FIELDS = ("num_hidden_layers", "n_layer", "num_layers")
_LAYER = re.compile(r"^(.*?)\.(\d+)\.")
_CHECKED: set[tuple] = set()


def _show(shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def weight_files(spec: str, folder: Path) -> list[Path] | None:
    """The safetensors files the loader reads: the shards an index names, ``model.safetensors``, else every
    ``*.safetensors``; None when there is none (a ``*.bin`` folder)."""
    index = folder / INDEX_NAME
    if index.is_file():
        try:
            data = json.loads(index.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise SecateurError(f"model {spec}: {INDEX_NAME} is not valid JSON ({type(e).__name__}); re-download "
                                "or re-export the model") from None
        idx = parse(ShardIndex, data, f"model {spec}: {INDEX_NAME}", "re-download or re-export the model")
        files = [folder / name for name in sorted(set(idx.weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise SecateurError(f"model {spec}: shard {f.name} named by {INDEX_NAME} is missing; re-download "
                                    "or re-export the model")
        return files
    if (folder / WEIGHTS_NAME).is_file():
        return [folder / WEIGHTS_NAME]
    files = sorted(folder.glob("*.safetensors"))
    return files or None


def _headers(files: list[Path]) -> dict[str, dict]:
    """Tensor name -> its header entry (``dtype``, ``shape``, ``data_offsets``) in the files."""
    held: dict[str, dict] = {}
    for f in files:
        with f.open("rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n).decode("utf-8"))
        held.update({name: v for name, v in header.items() if name != "__metadata__"})
    return held


def held_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of the files, from their headers (``check_safetensors`` has vouched for them)."""
    return {name: tuple(int(d) for d in v["shape"]) for name, v in _headers(files).items()}


def held_dtypes(files: list[Path]) -> dict[str, str]:
    """Tensor name -> safetensors dtype (``F32``, ``BF16``, ``I32``...) of the files, from their headers."""
    return {name: str(v.get("dtype")) for name, v in _headers(files).items()}


def is_floating(dtype: str) -> bool:
    """A safetensors dtype of floating point numbers (``F16``, ``BF16``, ``F32``, ``F64``, ``F8_E4M3``...)."""
    return dtype == "BF16" or dtype.startswith("F")


def _layers(names) -> tuple[str | None, dict[int, list[str]]]:
    """The decoder-block list of a set of tensor names (the numbered prefix with the most indices) and, per
    index, its names."""
    by_prefix: dict[str, dict[int, list[str]]] = {}
    for name in names:
        m = _LAYER.match(name)
        if m:
            by_prefix.setdefault(m.group(1), {}).setdefault(int(m.group(2)), []).append(name)
    if not by_prefix:
        return None, {}
    prefix = max(by_prefix, key=lambda p: len(by_prefix[p]))
    return prefix, by_prefix[prefix]


def _layer_field(cfg: dict) -> tuple[str, int] | None:
    """The config's block count: its own field, or a composite image classifier's ``vision_config``'s (a SigLIP or
    CLIP classifier holds only its vision tower's blocks)."""
    for key in LAYER_FIELDS:
        v = cfg.get(key)
        if isinstance(v, int) and not isinstance(v, bool):
            return key, v
    from secateur.models.families import family_class

    fam = family_class(cfg.get("model_type"))
    sub = cfg.get(fam.layout.sub_config) if fam is not None and fam.layout.sub_config else None
    return _layer_field(sub) if isinstance(sub, dict) else None


def check_layer_count(spec: str, cfg: dict, held: dict[str, tuple[int, ...]]) -> None:
    """Config layers vs the layers the weights hold, before the model is built (a config's ``10**9`` layers
    would take that long to build)."""
    field = _layer_field(cfg)
    prefix, layers = _layers(held)
    if field is None or prefix is None:
        return
    key, n = field
    m = max(layers) + 1
    says = f"(they hold {m} layers; config says {key} {n}); fix config.json or re-export the model"
    if n > m:
        first = sorted(layers[m - 1])[0]
        name = f"{prefix}.{m}." + first[len(f"{prefix}.{m - 1}."):]
        raise SecateurError(f"model {spec}: config.json implies {name} {_show(held[first])}, which the weights do "
                            f"not hold {says}")
    if n < m:
        first = sorted(layers[n])[0]
        raise SecateurError(f"model {spec}: the weights hold {first} {_show(held[first])}, which config.json does "
                            f"not imply {says}")


@contextlib.contextmanager
def _quiet():
    """transformers' warnings while a config is read or a meta model built: the checks speak instead."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(level)


def meta_model(spec: str, folder: Path):
    """The model of ``folder``'s config on the meta device (no memory), or one line saying the config
    describes no model transformers can build."""
    import torch
    from transformers import AutoConfig

    from secateur.models.files import model_class_for, register_custom_classes

    register_custom_classes()
    try:
        with _quiet():
            config = AutoConfig.from_pretrained(str(folder), trust_remote_code=False)
            cls, vision = model_class_for(str(folder))
            with torch.device("meta"):
                if vision:
                    return cls._from_config(config)
                return cls.from_config(config, trust_remote_code=False)
    except SecateurError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure here is the config's: one line, never a traceback
        what = " ".join(line.strip() for line in str(e).strip().splitlines())[:200]
        raise SecateurError(f"model {spec}: config.json describes no model transformers can build "
                            f"({type(e).__name__}{': ' + what if what else ''}); fix config.json or re-export "
                            "the model") from None


def _embedding_clause(model, cfg: dict, have: dict[str, tuple[str, tuple[int, ...]]]) -> str:
    """When the input embedding disagrees with the config, which of its sizes does (vocabulary, width): the one
    tensor whose shape names config fields unambiguously."""
    try:
        emb = model.get_input_embeddings().weight
    except (AttributeError, NotImplementedError):
        return ""
    name = next((n for n, p in model.named_parameters() if p is emb), None)
    if name is None or name not in have or len(have[name][1]) != 2:
        return ""
    (v, h), (v2, h2) = tuple(emb.shape), have[name][1]
    says = []
    if v != v2 and "vocab_size" in cfg:
        says.append(f"vocab_size {cfg['vocab_size']} where the weights have {v2}")
    if h != h2:
        for key in ("hidden_size", "n_embd", "d_model", "word_embed_proj_dim"):
            if cfg.get(key) == h:
                says.append(f"{key} {h} where the weights have {h2}")
                break
    return f" (config says {'; '.join(says)})" if says else ""


def loaded_names(model, names) -> dict[str, str]:
    """``{name as loaded: name as held}`` for the held tensor ``names``: transformers' checkpoint renamings of
    ``model`` applied (ViT, DeiT and DINOv2 folders are saved in the older ``encoder.layer.N.attention.attention.query``
    format and loaded as ``layers.N.attention.q_proj``); names the mapping leaves alone map to themselves."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key
    except ImportError:  # a transformers without checkpoint conversions
        return {k: k for k in names}
    transforms = get_model_conversion_mapping(model)
    if not transforms:
        return {k: k for k in names}
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if not isinstance(t, WeightRenaming)]
    return {rename_source_key(k, renamings, converters)[0]: k for k in names}


def as_loaded(model, held: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """``held`` (name -> shape) under the names transformers loads the tensors as (:func:`loaded_names`)."""
    return {new: held[old] for new, old in loaded_names(model, held).items()}


def compare(spec: str, model, held: dict[str, tuple[int, ...]], cfg: dict,
            dtypes: dict[str, str] | None = None) -> None:
    """Every tensor ``model``'s state dict implies is held with its shape, and nothing else is held; with
    ``dtypes`` (held name -> safetensors dtype), every parameter is held as floating point numbers."""
    if dtypes is not None:
        dtypes = {new: dtypes[old] for new, old in loaded_names(model, dtypes).items()}
    held = as_loaded(model, held)
    sd = model.state_dict(keep_vars=True)
    expected = {k: tuple(v.shape) for k, v in sd.items()}
    groups: dict[int, list[str]] = {}
    for k, v in sd.items():  # tied weights: one tensor under several names, saved under one
        groups.setdefault(id(v), []).append(k)
    prefix = getattr(model, "base_model_prefix", "") or ""

    def model_name(k: str) -> str | None:
        if k in expected:
            return k
        if prefix and f"{prefix}.{k}" in expected:
            return f"{prefix}.{k}"
        if prefix and k.startswith(prefix + ".") and k[len(prefix) + 1:] in expected:
            return k[len(prefix) + 1:]
        return None

    ignored = [re.compile(p) for p in (getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])]
    ignored_missing = [re.compile(p) for p in (getattr(model, "_keys_to_ignore_on_load_missing", None) or [])]
    have: dict[str, tuple[str, tuple[int, ...]]] = {}
    unexpected = []
    for k, shape in held.items():
        name = model_name(k)
        if name is not None:
            have[name] = (k, shape)
        elif not any(p.search(k) for p in ignored):
            unexpected.append(k)
    for name, want in expected.items():
        if name in have and have[name][1] != want:
            raise SecateurError(f"model {spec}: config.json implies {name} {_show(want)} but the weights hold "
                                f"{_show(have[name][1])}{_embedding_clause(model, cfg, have)}; fix config.json or "
                                "re-export the model")
    for names in groups.values():
        if not any(n in have for n in names) and not any(p.search(n) for n in names for p in ignored_missing):
            raise SecateurError(f"model {spec}: config.json implies {names[0]} {_show(expected[names[0]])}, which "
                                "the weights do not hold; the weights are incomplete or belong to another model: "
                                "re-download or re-export it")
    if dtypes is not None:
        params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        for name in sorted(params & set(have)):
            dt = dtypes.get(have[name][0])
            if dt is not None and not is_floating(dt):
                raise SecateurError(f"model {spec}: the weights hold {have[name][0]} as {dt}, not floating point "
                                    f"numbers (a quantized or damaged file; {cfg.get('model_type')} weights are "
                                    "F32, F16 or BF16); re-download or re-export the model in a floating dtype")
    if unexpected:
        k = sorted(unexpected)[0]
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise SecateurError(f"model {spec}: the weights hold {k} {_show(held[k])}{more}, which config.json does not "
                            f"imply (no {cfg.get('model_type')} parameter has that name); the weights belong to "
                            "another model or were edited: re-download or re-export it")


def _stamp(folder: Path, files: list[Path]) -> tuple:
    parts = []
    for f in [folder / "config.json", *files]:
        st = f.stat()
        parts.append((str(f.resolve()), st.st_size, st.st_mtime_ns))
    return tuple(parts)


def check_sizes(spec: str, cfg: dict) -> ModelSizes:
    """The config's sizes are positive integers (one line naming the field otherwise)."""
    return parse(ModelSizes, cfg, f"model {spec}: config.json", "fix config.json or re-export the model")


def check_folder(spec: str, folder: str | Path, cfg: dict) -> None:
    """Refuse a model folder whose weights disagree with its ``config.json`` (see the module docstring);
    ``cfg``: the config as read by :func:`secateur.models.loading.read_config`."""
    folder = Path(folder)
    check_sizes(spec, cfg)
    files = weight_files(spec, folder)
    if files is None:
        return
    stamp = _stamp(folder, files)
    if stamp in _CHECKED:
        return
    held = held_shapes(files)
    check_layer_count(spec, cfg, held)
    compare(spec, meta_model(spec, folder), held, cfg, held_dtypes(files))
    _CHECKED.add(stamp)


__all__ = ["check_folder", "check_layer_count", "check_sizes", "compare", "held_dtypes", "held_shapes", "is_floating",
           "meta_model", "weight_files"]
