"""Content digests of a model's weights, so that a recipe names the model it was made from by what it holds.

A GGUF input is digested as its file (:func:`secateur.models.gguf_cache.file_sha256`); a local folder as the
sha256 of its weight files and ``config.json``, each hashed once and remembered by (path, size, mtime) in the
cache's digest book, so a replay of a 13 GB folder re-reads it only when a file changed. A Hub id has no local
digest (its revision is the Hub's business).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path

WEIGHT_GLOBS = ("*.safetensors", "*.bin", "config.json")


def folder_sha256(folder: str | Path) -> str:
    """sha256 over ``name NUL sha256(file) LF`` for the folder's weight files and config.json, sorted by name;
    remembered in the digest book under the folder's path (:func:`known_model` finds it again)."""
    from secateur.models.gguf_cache import file_sha256

    folder = Path(folder).resolve()
    files = sorted({p for g in WEIGHT_GLOBS for p in folder.glob(g) if p.is_file()}, key=lambda p: p.name)
    h = hashlib.sha256()
    for p in files:
        h.update(f"{p.name}\0{file_sha256(p)}\n".encode())
    _remember_folder(folder, h.hexdigest())
    return h.hexdigest()


def _book() -> tuple[Path, dict]:
    from secateur.models.gguf_cache import cache_root

    path = cache_root() / "digests.json"
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    return path, known if isinstance(known, dict) else {}


def _remember_folder(folder: Path, digest: str) -> None:
    from secateur.files import write_json_atomic

    path, known = _book()
    if (known.get(str(folder)) or {}).get("folder_sha256") == digest:
        return
    known[str(folder)] = {"folder_sha256": digest}
    with contextlib.suppress(OSError):  # a read-only cache only costs the lookup, never the run
        write_json_atomic(path, known)


def known_model(digest: str, name: str = "") -> Path | None:
    """A local model on this machine with content ``digest`` (a GGUF file or a folder hashed here before, still
    holding the same content), else None: how a recipe that names its model portably finds it again. Copies with
    the same content may sit in several folders; one whose last component is ``name`` (the recipe's) is preferred,
    so a replay names the same folder, and its tokenizer, as the run it replays."""
    from secateur.models.gguf_cache import known_file

    found = known_file(digest)
    if found is not None:
        return found
    _, known = _book()
    keys = [k for k, e in known.items() if isinstance(e, dict) and e.get("folder_sha256") == digest]
    for key in sorted(keys, key=lambda k: Path(k).name != name):  # stable: the book's order within each group
        if Path(key).is_dir() and folder_sha256(key) == digest:  # verified now (per-file digests cached by mtime)
            return Path(key)
    return None


def local_digest(spec: str) -> str | None:
    """The content digest of a local model (a ``.gguf`` file or alias: the file's; a folder: :func:`folder_sha256`),
    None for anything else (a Hub id, a path that is not there)."""
    from secateur.models.files import gguf_file
    from secateur.models.gguf_cache import file_sha256

    g = gguf_file(spec)
    if g is not None:
        return file_sha256(g) if g.is_file() else None
    p = Path(spec)
    return folder_sha256(p) if p.is_dir() else None
