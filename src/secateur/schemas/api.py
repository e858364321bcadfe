"""The common options of ``secateur prune`` / ``api.prune`` and its run settings as a schema: their types,
checked before anything else, so a wrong type from Python (a string sparsity, a float nsamples, an int out) is one
line naming the keyword and what to pass instead, never a TypeError or AttributeError from deep inside. (A method's
knobs, such as ``pattern`` or ``targets``, are typed by their declaration: :mod:`secateur.methods.knobs`.)

Ranges and the relations between options (sparsity in [0, 1), --stream's conditions) stay with
:meth:`secateur.options.PruneOptions.validate`, which runs right after this.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable
from typing import Any, TypeVar

from pydantic import ConfigDict, ValidationError, validate_call

from secateur.errors import SecateurError
from secateur.schemas import Strict, describe, parse

F = TypeVar("F", bound=Callable[..., Any])


class CommonOptions(Strict):
    """Types of the fields every prune run has and of its run settings (``model`` and ``tokenizer`` may be Python
    objects: checked by ``PruneOptions.validate``)."""

    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)

    method: str
    sparsity: float
    calib: str
    nsamples: int
    seqlen: int
    seed: int
    data_dir: str | None
    mode: str
    chunk_size: int
    dtype: str
    device: str
    out: str | None
    overwrite: bool
    quiet: bool
    resume: bool
    structured: bool
    stream: bool
    eval_ppl: str | None
    eval_windows: int | None
    towers: str | None


FIXES = {
    "sparsity": "pass a number, the fraction to remove, e.g. 0.5",
    "out": "pass a folder path (a str or pathlib.Path), or None to keep the model in memory only",
    "calib": "pass self, c4, wikitext2, ptb or a path to a .txt file",
    "data_dir": "pass a folder path (a str or pathlib.Path), or None",
    "nsamples": "pass a whole number, e.g. 128",
    "seqlen": "pass a whole number, e.g. 2048",
    "seed": "pass a whole number, e.g. 0",
    "chunk_size": "pass a whole number, e.g. 8",
    "eval_windows": "pass a whole number, or None for every window",
}
_PATHS = ("out", "calib", "data_dir")


def _fix(field: str) -> str:
    if field in FIXES:
        return FIXES[field]
    if field in ("overwrite", "quiet", "resume", "structured", "stream"):
        return "pass True or False"
    return "pass a string (see secateur prune --help for the values)"


def check_common(values: dict[str, Any], source: str = "prune options") -> None:
    """Refuse a common option of the wrong type in one line (path-like values count as strings)."""
    data = {k: os.fspath(v) if k in _PATHS and isinstance(v, os.PathLike) else v for k, v in values.items()}
    parse(CommonOptions, data, source, _fix)


def plain_paths(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` with path-like options as strings (what the rest of secateur expects)."""
    return {k: os.fspath(v) if k in _PATHS and isinstance(v, os.PathLike) else v for k, v in values.items()}


# --- the public functions' arguments, typed by their signatures ------------------------------------------------

def _arg_fix(fn: Callable, arg: str) -> str:
    """What to pass for the argument ``arg`` of ``fn``, from its annotation (as written in the signature)."""
    param = inspect.signature(fn).parameters.get(arg)
    ann = str(param.annotation) if param is not None else ""
    if "Module" in ann:
        return "pass a model name, folder or .gguf path (a str or os.PathLike), or a loaded model with its tokenizer"
    if "PathLike" in ann or "Path" in ann:
        return "pass a path (a str or os.PathLike)" + (", or None" if "None" in ann else "")
    if ann.startswith("bool"):
        return "pass True or False"
    if ann.startswith("int"):
        return "pass a whole number" + (", or None" if "None" in ann else "")
    if ann.startswith("float"):
        return "pass a number"
    if ann.startswith("list"):
        return f"pass a list ({ann})"
    return f"see help({fn.__module__}.{fn.__name__})"


def checked_call(fn: F) -> F:
    """``fn`` with its arguments validated against its signature's annotations first (pydantic's
    ``validate_call``, strict: ``'64'`` is not an int, ``None`` is not a path, ``5`` is not a str), a wrong one
    raised as one :class:`SecateurError` naming the function, the argument and what to pass, as the CLI names a
    flag; never a TypeError or AttributeError from deep inside. Unannotated arguments are not checked."""
    validated = validate_call(fn, config=ConfigDict(strict=True, arbitrary_types_allowed=True))

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return validated(*args, **kwargs)
        except ValidationError as e:
            if e.title != fn.__name__:  # raised inside the function by another schema: not its arguments
                raise
            err = e.errors()[0]
            loc = err.get("loc") or ()
            arg = str(loc[0]) if loc else "(arguments)"
            _, what = describe({**err, "loc": loc[:1]})
            raise SecateurError(f"{fn.__name__}(): argument {arg}: {what}; {_arg_fix(fn, arg)}") from None

    return wrapper  # type: ignore[return-value]


def path_or_none(value: Any, name: str, fix: str = "pass a path (a str or os.PathLike)") -> str | None:
    """``value`` as a str path (an ``os.PathLike`` converted), ``None`` kept; anything else one line naming
    ``name`` (the API's ``recover(out=5)`` must not write a folder named ``5``)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, os.PathLike)):
        raise SecateurError(f"{name} must be a path (a str or os.PathLike), not {type(value).__name__} "
                            f"{value!r:.40}; {fix}")
    return os.fspath(value)
