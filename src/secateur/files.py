"""Reading and writing files safely: the ground floor every stage may use.

A path secateur reads must be a regular file (a FIFO or ``/dev/zero`` would hang or never end), and a small file
it writes (a manifest, a digest book) appears whole or not at all."""

from __future__ import annotations

import json
import os
import stat
import tempfile
from pathlib import Path

from secateur.errors import SecateurError

_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"))


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a plain file")


def regular_file(path: str | Path, what: str, fix: str) -> Path:
    """``path`` when it is a regular file (or a link to one); a FIFO, a device, a socket or a folder is refused
    with one line (``<what> <path> is not a regular file (a FIFO); <fix>``) before anything opens it: reading a
    FIFO waits for a writer that never comes, ``/dev/zero`` never ends."""
    p = Path(path)
    try:
        mode = os.stat(p).st_mode
    except FileNotFoundError:
        raise SecateurError(f"{what} {p} does not exist; {fix}") from None
    except OSError as e:
        raise SecateurError(f"{what} {p} cannot be read ({e.strerror or type(e).__name__}); {fix}") from None
    if not stat.S_ISREG(mode):
        raise SecateurError(f"{what} {p} is not a regular file ({_kind(mode)}); {fix}")
    return p


def read_regular_bytes(path: str | Path, what: str, fix: str) -> bytes:
    """The bytes of a regular file (see :func:`regular_file`), opened without blocking and checked again on the
    open descriptor, so a path swapped for a FIFO between the check and the read cannot hang the run either."""
    p = regular_file(path, what, fix)
    try:
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise SecateurError(f"{what} {p} cannot be read ({e.strerror or type(e).__name__}); {fix}") from None
    with os.fdopen(fd, "rb") as f:
        mode = os.fstat(f.fileno()).st_mode
        if not stat.S_ISREG(mode):
            raise SecateurError(f"{what} {p} is not a regular file ({_kind(mode)}); {fix}")
        try:
            return f.read()
        except OSError as e:
            raise SecateurError(f"{what} {p} cannot be read ({e.strerror or type(e).__name__}); {fix}") from None


def read_json(path: str | Path, fix: str, what: str = "file"):
    """The JSON value in ``path`` (a regular file, :func:`read_regular_bytes`), or one line naming the file, what
    is wrong with it and ``fix``: missing, unreadable, not UTF-8, invalid JSON (with its line), nested too deeply.
    Every JSON file secateur reads back (reports, configs, indexes, manifests) enters here; its schema is checked
    by the caller (:func:`secateur.schemas.parse`)."""
    data = read_regular_bytes(path, what, fix)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SecateurError(f"{path}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}); "
                            f"{fix}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise SecateurError(f"{path}: invalid JSON (line {e.lineno}: {e.msg}); {fix}") from None
    except RecursionError:
        raise SecateurError(f"{path}: invalid JSON (nested too deeply); {fix}") from None


def umask() -> int:
    """The process's umask (read by setting it and putting it back): files made by ``mkstemp`` get the usual
    modes."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_json_atomic(path: Path, obj: dict, prefix: str = ".secateur-tmp-") -> None:
    """Write ``obj`` as JSON to ``path`` through a temporary file in the same folder (named ``prefix...``) and an
    atomic rename: a reader sees the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f"{prefix}{path.name}-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=1)
        os.chmod(tmp, 0o666 & ~umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
