"""Schemas of the zero-shot task files (``secateur eval zeroshot --data-dir``, :mod:`secateur.eval.zeroshot_tasks`):
one per line format of the offline copies in ``../shared/data`` (their READMEs describe them), so a damaged line is
one error naming the file, the line and the key, never a KeyError or a silently different item. That a gold
index names one of its line's choices is checked by the reader, with the same line number.

Open: the upstream files may carry keys that secateur does not read; the ones it reads are checked.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from secateur.schemas import NonNegInt, Open

Choices = Annotated[list[str], Field(min_length=2)]


class QueryLine(Open):
    """llm-foundry's ICL multiple-choice line: boolq, arc_easy, arc_challenge, openbook_qa, piqa."""

    query: str
    choices: Choices
    gold: NonNegInt


class BoolQLine(QueryLine):
    """boolq.jsonl: ``Passage: ...\\nQuestion: ...?`` and the choices no / yes (``choices`` optional)."""

    choices: Choices = ["no", "yes"]
    gold: Annotated[int, Field(ge=0, le=1)]


class WinograndeLine(Open):
    """winogrande.jsonl (partial scoring): the two contexts, the shared continuation, the gold index."""

    context_options: Annotated[list[str], Field(min_length=2, max_length=2)]
    continuation: str
    gold: Annotated[int, Field(ge=0, le=1)]


class PiqaLine(Open):
    """piqa-official/valid.jsonl (its labels are in valid-labels.lst)."""

    goal: str
    sol1: str
    sol2: str


class RteRow(Open):
    """rte-glue/validation.parquet or dev.tsv (GLUE's columns; the TSV's whole numbers read as numbers)."""

    sentence1: str
    sentence2: str
    label: Annotated[int, Field(ge=0, le=1)]
    idx: NonNegInt


__all__ = ["BoolQLine", "PiqaLine", "QueryLine", "RteRow", "WinograndeLine"]
