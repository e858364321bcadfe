"""Typed method options declared once: the CLI flags and the API keywords are built from these fields.

A method family declares its knobs as a dataclass deriving from :class:`MethodOptions`; each field is a
:func:`knob` whose metadata says its CLI flag, help, argparse type/action and choices. Every knob defaults to
``None`` = unset (the method's own default applies; the help text names it), so a knob can be told apart from
its default and a knob given to the wrong method is refused. ``secateur prune`` adds one argparse option per
knob (:func:`secateur.cli`), ``api.prune(**kwargs)`` passes the same names as keywords
(:meth:`MethodOptions.from_kwargs`), and both end in :meth:`MethodOptions.validate`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from secateur.budgets.masks import ROUNDINGS
from secateur.errors import SecateurError


def knob(help: str, *, flag: str | None = "", type: Callable[[Any], Any] | None = None,
         choices: Sequence[str] | None = None, action: Any = None, metavar: str | None = None,
         example: str | None = None) -> Any:
    """A method knob (default ``None`` = unset). ``flag``: the CLI option (``""``: ``--`` + the field name with
    dashes; ``None``: API only); ``type``/``action``/``metavar``: argparse's; ``choices``: the allowed values,
    checked for API callers too; ``example``: a value a text knob's type error offers (``'2:4'``)."""
    meta = {"help": help, "flag": flag, "type": type, "choices": None if choices is None else tuple(choices),
            "action": action, "metavar": metavar, "example": example}
    return dataclasses.field(default=None, metadata=meta)


def rounding_knob() -> Any:
    """The ``--rounding`` knob, declared alike by each options class whose method rounds a removal count."""
    return knob("weights (structured: units) removed per group = round(sparsity * size): ceil or floor "
                "(default: ceil)", choices=ROUNDINGS)  # secateur.budgets.masks


def flag_of(f: dataclasses.Field) -> str | None:
    """The CLI flag of a knob field (``--coec-rounds``), or None for an API-only knob."""
    flag = f.metadata.get("flag", "")
    if flag is None:
        return None
    return flag or "--" + f.name.replace("_", "-")


@dataclasses.dataclass
class MethodOptions:
    """Base of every method family's options (no knobs). ``CLI_GROUP`` titles its argparse group."""

    CLI_GROUP: ClassVar[str] = ""

    @classmethod
    def knob_fields(cls) -> tuple[dataclasses.Field, ...]:
        return dataclasses.fields(cls)

    @classmethod
    def knob_names(cls) -> frozenset[str]:
        return frozenset(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> MethodOptions:
        """The options from flat keywords (``None`` = unset; unknown names are the caller's to refuse),
        each value coerced by its knob's ``type`` and checked against its ``choices``."""
        values = {}
        for f in cls.knob_fields():
            v = kwargs.get(f.name)
            if v is not None:
                values[f.name] = _coerce(f, v)
        opts = cls(**values)
        opts.validate()
        return opts

    @property
    def needs_calibration(self) -> bool:
        """Whether these knobs need a calibration set even when the method itself does not (a compensator)."""
        return False

    def given(self) -> dict[str, Any]:
        """The knobs that are set."""
        return {k: v for k, v in self.to_dict().items() if v is not None}

    def to_dict(self) -> dict[str, Any]:
        """Every knob by name (``None`` = unset), as the report's ``options`` records them."""
        return {f.name: getattr(self, f.name) for f in self.knob_fields()}

    def validate(self) -> None:
        """Choices and types of the knobs (subclasses add their own rules and call this)."""
        for f in self.knob_fields():
            v = getattr(self, f.name)
            if v is not None:
                _check_choice(f, v)


def _coerce(f: dataclasses.Field, v: Any) -> Any:
    """A knob's value from the API or argparse, by its type: a flag takes only a bool; a bool is not a number; a
    whole-number knob does not take a fraction (``int(2.5)`` would silently be 2)."""
    typ = f.metadata.get("type")
    name = flag_of(f) or f.name
    if f.metadata.get("action") is not None:  # a flag: a bool from the API, True/False from argparse
        if not isinstance(v, bool):
            raise SecateurError(f"{name}: {v!r} is not True or False; pass a bool")
        return v
    if isinstance(v, bool) and typ in (int, float):
        raise SecateurError(f"{name}: {v!r} is a bool, not a number; pass a {typ.__name__}")
    if typ is int and isinstance(v, float) and not v.is_integer():
        raise SecateurError(f"{name}: {v!r} is not a whole number; pass an int")
    if typ is None:  # a text knob (or a comma list, which the API may also give as a tuple/list of names)
        many = "tuple" in str(f.type)
        if not (isinstance(v, str) or many and isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v)):
            example = f.metadata.get("example")
            raise SecateurError(f"{name}: {v!r} is a {type(v).__name__}; pass a string"
                                + (f", e.g. {example}" if example else "")
                                + (" (comma-separated for several)" if many else ""))
        return v
    if isinstance(v, (list, tuple, dict, set)) and typ in (int, float, str):
        raise SecateurError(f"{name}: {v!r} is a {type(v).__name__}; pass a single {typ.__name__}"
                            + (" (comma-separated for several)" if typ is str else ""))
    try:
        return typ(v)
    except (TypeError, ValueError, AttributeError) as e:  # a parser of the flag's text given another type
        raise SecateurError(f"{name}: {v!r} is not a valid value ({e}); see secateur prune --help") from None


def _check_choice(f: dataclasses.Field, v: Any) -> None:
    choices = f.metadata.get("choices")
    if choices is not None and v not in choices:
        raise SecateurError(f"unknown {f.name.replace('_', ' ')} {v!r}; choose from {', '.join(choices)}")
