"""The schema of ``secateur-recipe.yaml`` (``secateur prune --recipe FILE``): the type of every key, checked before
any value reaches :class:`~secateur.options.PruneOptions`, so a hand-edited or damaged recipe is one line naming
the file, the key and what to write instead, never a TypeError from deep inside a method.

YAML reads what it can as numbers and booleans: ``nsamples: '2'`` is a string (refused: write ``2``), an unquoted
digest of 64 decimal digits is an integer (refused: quote it, or the calibration check would silently compare a
number with a digest), ``pattern: 2:4`` is the sexagesimal integer 124 (refused: quote it).

The schema is built from what the caller knows (:func:`recipe_schema`): the common options it types here, any other
common option it names (typed by ``PruneOptions.validate`` later), every method's knobs with the types of their
dataclass fields, and the digest keys of ``check:``. Ranges and relations between options stay with
``PruneOptions.validate`` except the counts, which are refused here with the recipe's name.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import types
import typing
from os import PathLike
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import BeforeValidator, Field, create_model
from pydantic_core import PydanticCustomError

from secateur.errors import SecateurError
from secateur.schemas import Sha256, Strict

_EXPONENT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")


def _exponent_float(v: Any) -> Any:
    """``1e-3`` unquoted: PyYAML (YAML 1.1) reads it as a string, YAML 1.2 and every user as a number."""
    return float(v) if isinstance(v, str) and _EXPONENT.match(v.strip()) else v


#: a number as a user writes it in YAML (``0.5``, ``1e-3``); a quoted word is still refused
Number = Annotated[float, BeforeValidator(_exponent_float)]


#: the common options a recipe holds, by type (``None`` allowed where PruneOptions allows it)
COMMON: dict[str, Any] = {
    "model": str,
    "method": str,
    "sparsity": Number,
    "calib": str,
    "nsamples": Annotated[int, Field(ge=1)],
    "seqlen": Annotated[int, Field(ge=2)],
    "seed": int,
    "data_dir": str | None,
    "mode": str,
    "chunk_size": Annotated[int, Field(ge=1)],
    "dtype": str,
    "device": str,
    "structured": bool,
    "stream": bool,
}

FIXES = {
    "model": "write the model's Hugging Face id, folder or .gguf path as a string",
    "method": "write a method name, e.g. wanda (secateur prune --help lists them)",
    "sparsity": "write the fraction of weights to remove as a number, e.g. 0.5",
    "pattern": "write N:M in quotes, e.g. pattern: '2:4' (unquoted, YAML reads 2:4 as a number), or null",
    "targets": "write a comma-separated string, e.g. targets: q,k, or null for every projection",
    "calib": "write self, c4, wikitext2, ptb or the path of a .txt file",
    "nsamples": "write a whole number >= 1 without quotes, e.g. nsamples: 128",
    "seqlen": "write a whole number >= 2 without quotes, e.g. seqlen: 2048",
    "seed": "write a whole number without quotes, e.g. seed: 0",
    "chunk_size": "write a whole number >= 1 without quotes, e.g. chunk_size: 8",
    "data_dir": "write a folder path, or null",
    "structured": "write true or false without quotes",
    "stream": "write true or false without quotes",
    "secateur_recipe": "write the schema number secateur wrote, e.g. secateur_recipe: 1",
    "made_with": "write it as secateur does (name: version), or delete it",
}
CHECK_FIX = "quote it: 64 hex digits in quotes, as secateur writes it, or delete the line to replay without this check"


def _not_a_number(v: Any) -> Any:
    """A digest that YAML read as a number (64 unquoted decimal digits) is named as such, not as a bad string."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        raise PydanticCustomError("digest_number", "a number, not a digest (YAML reads unquoted digits as an integer)")
    return v


Digest = Annotated[Sha256 | None, BeforeValidator(_not_a_number)]


def _str_or_list(v: Any) -> Any:
    if isinstance(v, str) or isinstance(v, list) and all(isinstance(x, str) for x in v):
        return v
    raise PydanticCustomError("str_or_list", "input should be a string or a list of strings")


#: a knob typed ``str | tuple[str, ...]`` (``units``) as YAML writes it: ``kv_group,channel`` or a list of strings
StrOrList = Annotated[Any, BeforeValidator(_str_or_list)]


def _yaml_type(tp: Any) -> Any:
    """A knob's field type as YAML can write it (``None`` dropped: every knob may be null), one type per field so
    that a failure names the key alone: a tuple of strings is a string or a list (``units``)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return _yaml_type(args[0])
        if all(a is str or typing.get_origin(a) in (tuple, list) for a in args):
            return StrOrList
        return Any
    if origin in (tuple, list):
        return StrOrList
    return Number if tp is float else tp


def knob_types(option_classes: typing.Iterable[type]) -> dict[str, Any]:
    """Every knob of the method options dataclasses by name -> its field type (``X | None``: unset is null)."""
    out: dict[str, Any] = {}
    for cls in option_classes:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            out.setdefault(f.name, _yaml_type(hints.get(f.name, Any)))
    return out


def _fix_of(field: str, knobs: dict[str, Any]) -> str:
    key = field.split(".")[0]
    if key == "check":
        return CHECK_FIX
    if key in FIXES:
        return FIXES[key]
    tp = knobs.get(key)
    if tp is not None:
        if tp is bool:
            return "write true or false without quotes, or null for the method's default"
        if tp is int:
            return "write a whole number without quotes, or null for the method's default"
        if tp is Number:
            return "write a number without quotes, or null for the method's default"
        if tp is StrOrList:
            return "write a comma-separated string (or a list of strings), or null for the method's default"
        return "write a string (secateur prune --help lists the values), or null for the method's default"
    return "write a string (secateur prune --help lists the values)"


@functools.lru_cache(maxsize=8)
def _schema(common: tuple[str, ...], knobs: tuple[tuple[str, Any], ...], checks: tuple[str, ...]) -> type[Strict]:
    check_fields = {k: (Digest if k.endswith("_sha256") else Any, None) for k in checks}
    check_model = create_model("RecipeCheck", __base__=Strict, **check_fields)
    fields: dict[str, Any] = {
        # defaults are never validated: an absent key is the option's default, an explicit null is checked
        "secateur_recipe": (int, None),
        "check": (check_model | None, None),
        "made_with": (dict[str, Any] | None, None),
    }
    for name, tp in knobs:
        fields[name] = (tp | None, None)
    for name in common:
        fields[name] = (COMMON.get(name, Any), None)
    return create_model("RecipeSchema", __base__=Strict, **fields)


def recipe_schema(common: typing.Iterable[str], option_classes: typing.Iterable[type],
                  checks: typing.Iterable[str]) -> tuple[type[Strict], typing.Callable[[str], str]]:
    """The schema of a recipe with the common options ``common`` (typed by :data:`COMMON` where listed there), the
    knobs of ``option_classes`` and the digests ``checks``; and the advice for a failing field."""
    knobs = knob_types(option_classes)
    schema = _schema(tuple(sorted(set(common))), tuple(sorted(knobs.items(), key=lambda kv: kv[0])),
                     tuple(checks))
    return schema, lambda field: _fix_of(field, knobs)


__all__ = ["COMMON", "CHECK_FIX", "FIXES", "knob_types", "recipe_schema"]


RECIPE_SCHEMA = 1  # bump when a recipe's meaning changes; a newer recipe is refused by an older secateur


def read_recipe(source: str | Path | dict) -> tuple[dict, str]:
    """A recipe (a file or a dict) and how to name it in messages; its schema must be one this secateur reads.
    The types of its values are checked by :func:`secateur.options.options_from_recipe`
    (:mod:`secateur.schemas.recipe`)."""
    if isinstance(source, dict):
        data, name = dict(source), "recipe"
    elif isinstance(source, (str, PathLike)):
        name = f"recipe {source}"
        path = Path(source)
        if path.exists() and not path.is_file():
            raise SecateurError(f"{name} is not a regular file; pass a secateur-recipe.yaml file")
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8"))
        except OSError as e:
            raise SecateurError(f"{name} cannot be read ({e.strerror or e}); check the path") from None
        except (yaml.YAMLError, UnicodeDecodeError, RecursionError) as e:
            where = getattr(e, "problem_mark", None)
            at = f" (line {where.line + 1})" if where is not None else ""
            raise SecateurError(f"{name} is not valid YAML{at}; write it as secateur does (key: value)") from None
    else:
        raise SecateurError(f"recipe: {type(source).__name__} {source!r:.60} is not a recipe; pass the path of a "
                            "secateur-recipe.yaml or its dict")
    if not isinstance(data, dict):
        raise SecateurError(f"{name} is {'empty' if data is None else _a(type(data).__name__)}, not a mapping of "
                            "option names to values; write it as secateur does (key: value per line)")
    schema = data.get("secateur_recipe")
    if not isinstance(schema, int) or isinstance(schema, bool):
        raise SecateurError(f"{name} has no secateur_recipe schema number; it was not written by secateur: start "
                            "from a secateur-recipe.yaml that secateur prune --out wrote")
    if schema > RECIPE_SCHEMA:
        raise SecateurError(f"{name} has schema {schema}, newer than this secateur reads ({RECIPE_SCHEMA}); "
                            "upgrade secateur")
    if schema < 1:
        raise SecateurError(f"{name}: secateur_recipe: schema {schema} does not exist; write the schema number "
                            f"secateur wrote ({RECIPE_SCHEMA})")
    return data, name


def _a(noun: str) -> str:
    return ("an " if noun[0] in "aeiou" else "a ") + noun
