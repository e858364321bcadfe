"""Schemas of everything secateur reads, validated where it enters, with one error shape.

Every file or argument secateur reads back (recipes, run reports, checkpoint and cache manifests, result rows,
task files, ``api.prune`` keywords) has a pydantic model in a module of this package. :func:`parse` validates
data against it and turns the first failure into one :class:`~secateur.errors.SecateurError` line:

    <source>: <field>: <what is wrong> (got <value>); <what to do>

so a damaged or hand-edited file never reaches the code that uses it as a traceback or, worse, as a silently
different value. The models are strict (a string is not a number, ``'2'`` is not ``2``; an int is accepted
where a float is expected) and forbid unknown keys unless they say otherwise.

This package is on the ground floor: it imports nothing of secateur but :mod:`secateur.errors`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from secateur.errors import SecateurError

M = TypeVar("M", bound=BaseModel)

#: a sha256 as secateur writes it: 64 lowercase hex digits (a YAML-read integer is refused, not converted)
Sha256 = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
PositiveInt = Annotated[int, Field(ge=1)]
NonNegInt = Annotated[int, Field(ge=0)]


class Strict(BaseModel):
    """Base of every schema: strict types, unknown keys refused, values frozen once read."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class Open(BaseModel):
    """Base of a schema that checks the fields it names and keeps the rest (files that other tools extend)."""

    model_config = ConfigDict(strict=True, extra="allow", frozen=True)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def describe(err: dict) -> tuple[str, str]:
    """(field path, what is wrong) of one pydantic error."""
    loc = ".".join(str(x) for x in err.get("loc", ())) or "(the whole file)"
    kind, msg = err.get("type", ""), err.get("msg", "invalid")
    if kind == "extra_forbidden":
        return loc, "unknown key"
    if kind == "missing":
        return loc, "missing"
    msg = msg[0].lower() + msg[1:] if msg else msg
    if "input" in err and kind not in ("missing",):
        msg += f" (got {_show(err['input'])})"
    return loc, msg


def parse(schema: type[M], data: Any, source: str, fix: str | Callable[[str], str]) -> M:
    """``data`` validated against ``schema``, or one line: ``<source>: <field>: <what is wrong>; <fix>``.
    ``fix``: the same advice for every field, or a function of the failing field's path."""
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        loc, what = describe(e.errors()[0])
        advice = fix(loc) if callable(fix) else fix
        raise SecateurError(f"{source}: {loc}: {what}; {advice}") from None


__all__ = ["NonNegInt", "Open", "PositiveInt", "Sha256", "Strict", "describe", "parse"]
