"""Optional dependencies, installed by the package's extras (pyproject.toml): a feature whose package is absent is
refused in one line naming the extra that installs it, before any work, instead of an ImportError traceback."""

from __future__ import annotations

import importlib

from secateur.errors import SecateurError

#: import name -> (distribution, extra)
EXTRAS = {
    "PIL": ("pillow", "vision"),
    "peft": ("peft", "recover"),
    "lm_eval": ("lm-eval", "eval"),
    "llama_cpp": ("llama-cpp-python", "deploy"),
}


def require(module: str, feature: str) -> None:
    """Import ``module`` (an :data:`EXTRAS` key) or raise one line: ``feature`` needs it, and the extra to install."""
    try:
        importlib.import_module(module)
    except ImportError:
        dist, extra = EXTRAS[module]
        raise SecateurError(f"{feature} needs {dist}, which is not installed; install it with: "
                            f"pip install 'secateur[{extra}]'") from None
