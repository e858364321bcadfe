"""The common options of ``secateur prune`` / ``api.prune`` and its run settings as a schema: their types,
checked before anything else, so a wrong type from Python (a string sparsity, a float nsamples, an int out) is one
line naming the keyword and what to pass instead, never a TypeError or AttributeError from deep inside. (A method's
knobs, such as ``pattern`` or ``targets``, are typed by their declaration: :mod:`secateur.methods.knobs`.)

Ranges and the relations between options (sparsity in [0, 1), --stream's conditions) stay with
:meth:`secateur.options.PruneOptions.validate`, which runs right after this.
"""

from __future__ import annotations

import os
from typing import Any

from pydantic import ConfigDict

from secateur.schemas import Strict, parse


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
