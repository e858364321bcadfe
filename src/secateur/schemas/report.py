"""Schemas of the JSON that ``secateur report`` and ``secateur export gguf`` read back: a run folder's
``secateur-report.json``, the evaluation JSON written beside it (perplexity, zero-shot, QK error), a structured run's
``secateur_selection.json`` and the rows of bench JSONL results files.

Every schema is :class:`~secateur.schemas.Open`: these files carry many keys that a report does not read, and a
newer secateur or bench may add more. The keys that are read are typed as the code that reads them needs them (a
number where it computes, a mapping where it looks keys up, a hashable string where it groups), so a damaged or
hand-edited file is one line naming the file and the field, never a TypeError while the report is built.

Parts that are read only in some shapes (a kept-width row only when it has ``kept``, an allocation only when it
has ``per_block``) are checked where they are used, with :func:`parse_at`, which names their place in the file.
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, StringConstraints, ValidationError

from secateur.errors import SecateurError
from secateur.schemas import NonNegInt, Open, describe

M = TypeVar("M", bound=BaseModel)

Number = float | None  # strict: an int is a number, a string or a bool is not
#: an N:M pattern as the report splits it (M >= 1)
Pattern = Annotated[str, StringConstraints(pattern=r"^\d+:[1-9]\d*$")]
LayerIndex = Annotated[str, StringConstraints(pattern=r"^\d+$")]

RUN_FIX = "restore the file (rerun the command that wrote it), or move it out of the run folder"
ROW_FIX = "fix or delete that line (one JSON object per line, as the bench writes them), or leave the file out"


def parse_at(schema: type[M], data: Any, source: str, fix: str, at: str = "") -> M:
    """``data`` (found at ``at`` in ``source``) validated against ``schema``, or one line
    ``<source>: <at>.<field>: <what is wrong>; <fix>``."""
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        loc, what = describe(e.errors()[0])
        if at:
            loc = at if loc == "(the whole file)" else f"{at}.{loc}"
        raise SecateurError(f"{source}: {printable(loc)}: {what}; {fix}") from None


def printable(text: str) -> str:
    """``text`` with every character that would break a one-line message (a newline, a control character, a
    Unicode line separator) written as its escape: keys of a damaged file are echoed in messages."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


# --- secateur-report.json ----------------------------------------------------------------------------------------


class Realized(Open):
    targeted: Number = None
    of_all_parameters: Number = None
    per_module: dict[str, Number] | None = None


class Timings(Open):
    phases: dict[str, Any] | None = None


class Details(Open):
    params_before: Number = None
    params_after: Number = None
    removed_blocks: list[int] | None = None
    per_layer: list[Any] | None = None
    allocation: Any = None


class ModelSource(Open):
    gguf: str | None = None
    sha256: str | None = None


class RunReport(Open):
    """``secateur-report.json`` as the report and the GGUF exporter read it (``realized_sparsity``: a mapping, or
    a number in older reports)."""

    schema_version: NonNegInt = 0
    method: str
    kind: str | None = None
    model: str | None = None
    model_source: ModelSource | None = None
    pattern: str | None = None
    target_sparsity: Number = None
    options: dict[str, Any] | None = None
    details: Details | None = None
    realized_sparsity: Any = None
    timings: Timings | None = None
    peak_rss_mb: Number = None
    calibration: dict[str, Any] | None = None
    versions: dict[str, Any] | None = None
    machine: dict[str, Any] | None = None


class KeptRow(Open):
    """A kept-width row (``details.per_layer`` of a structured report or a bench row) that has ``kept``."""

    layer: NonNegInt
    group: str
    kept: float
    width: Number = None


class BlockRemoval(Open):
    block: int
    rho_q: float
    rho_k: float


class Allocation(Open):
    """A Q/K removal allocation with ``per_block`` records (qk-wanda's ``details.allocation``, a QK-error file's
    ``removal``)."""

    per_block: list[BlockRemoval]
    mean_rho_q: Number = None
    mean_rho_k: Number = None
    qk_removed: Number = None
    qk_total: Number = None


# --- evaluation JSON beside a run ----------------------------------------------------------------------------------


class PplEntry(Open):
    """A perplexity result: a ``secateur eval ppl --json`` file, a bench row's ``{dataset: {...}}``."""

    ppl: Number = None
    dataset: str | None = None
    protocol: str | None = None
    windows: NonNegInt | None = None
    windows_total: NonNegInt | None = None
    scored_tokens: Number = None
    scored: Number = None
    tokens_sha256: str | None = None


class TaskScore(Open):
    metric: str | None = None
    score: Number = None
    n: NonNegInt | None = None


class ZeroshotSummary(Open):
    tasks: list[str] | None = None
    mean: Number = None
    se: Number = None


class ZeroshotSettings(Open):
    limit: NonNegInt | None = None
    strategy: str | None = None


class ZeroshotData(Open):
    dir: str | None = None
    sha256: dict[str, Any] | None = None


class ZeroshotResult(Open):
    """A ``secateur eval zeroshot --json`` file (or a bench row's ``zeroshot``, once normalized)."""

    protocol: str | None = None
    tasks: dict[str, TaskScore]
    summary: ZeroshotSummary | None = None
    settings: ZeroshotSettings | None = None
    data: ZeroshotData | None = None


class QKError(Open):
    """A ``secateur eval qk-error --json`` file (``removal``: checked as an :class:`Allocation` when it has
    ``per_block``)."""

    protocol: str | None = None
    e_qk: Number = None
    e_logits: Number = None
    e_block: Number = None
    e_rollout: Number = None
    per_block: list[float] | None = None
    heldout: dict[str, Any] | None = None
    removal: Any = None


class LayerKeep(Open):
    heads: list[int] | None = None
    kv_heads: list[int] | None = None
    channels: list[int] | None = None


class Selection(Open):
    """``secateur_selection.json`` of a structured run (layers by index)."""

    layers: dict[LayerIndex, LayerKeep] | None = None
    removed_blocks: list[int] | None = None


# --- bench JSONL rows ------------------------------------------------------------------------------------------


class BenchPreset(Open):
    """A row's ``preset`` written as the preset's parameters: its ``name`` identifies it."""

    name: str


class BenchRow(Open):
    """One row of a bench results file (many layouts: the keys the report reads are typed; ``preset`` is a name
    or the preset's parameters, checked by the reader; ``per_layer``, ``allocation``, ``zeroshot`` and
    ``{dataset: {...}}`` entries are checked where they are used)."""

    row: str | None = None
    key: str | None = None
    method: str | None = None
    kind: str | None = None
    pattern: Pattern | None = None
    modifier_args: Any = None
    params: Number = None
    removed_blocks: list[int] | None = None
    calibration: dict[str, Any] | None = None
    versions: dict[str, Any] | None = None
    machine: dict[str, Any] | None = None
    per_block: list[float] | None = None


class ModifierArgs(Open):
    mask_structure: Annotated[str, StringConstraints(pattern=r"^(\d+:[1-9]\d*|0:0)$")] | None = None


__all__ = ["Allocation", "BenchPreset", "BenchRow", "KeptRow", "ModelSource", "ModifierArgs", "Pattern", "PplEntry",
           "QKError", "ROW_FIX", "RUN_FIX", "RunReport", "Selection", "ZeroshotResult", "parse_at", "printable"]
