"""The teacher of a recovery: the dense model the run was pruned from, found from the run's own files.

In order: ``--teacher SPEC``; a local model whose content digest is the recipe's ``check.model_sha256`` (or a GGUF
input's ``model_source.sha256``), found with :func:`secateur.models.digest.known_model` (reports name local models
portably, by their last path component, so the path itself is not in the report); the report's ``model`` when it is
loadable as written (an alias, a relative path that exists here, a Hugging Face id). Anything else is one line asking
for ``--teacher``.
"""

from __future__ import annotations

from pathlib import Path

from secateur.errors import SecateurError


def teacher_spec(report: dict, recipe: dict, given: str | None) -> tuple[str, str]:
    """``(spec, how it was found)``."""
    if given is not None:
        return given, "--teacher"
    name = report.get("model")
    check = recipe.get("check") if isinstance(recipe.get("check"), dict) else {}
    digests = [check.get("model_sha256"), (report.get("model_source") or {}).get("sha256")]
    for digest in digests:
        if isinstance(digest, str) and digest:
            from secateur.models.digest import known_model

            found = known_model(digest, str(name or ""))
            if found is not None:
                return str(found), f"local model with the run's sha256 {digest[:12]}..."
    if isinstance(name, str) and name:
        from secateur.models.files import ALIASES

        if name in ALIASES:
            return name, "the run's model (alias)"
        if Path(name).exists():
            return name, "the run's model (path)"
        if name.count("/") == 1 and not name.startswith((".", "/")):
            return name, "the run's model (Hugging Face id)"
    raise SecateurError(f"the run's base model {name!r} is not on this machine (no local model with its sha256); "
                        "pass --teacher SPEC, the dense model the run was pruned from")
