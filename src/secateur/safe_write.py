"""Writing outputs safely: atomic folders and files, the overwrite rules, free space, stale temporaries.

The ground floor every stage that writes uses (export/, eval/, report/, recovery/, options checks): nothing here
knows a model.

``DIR`` is built in a temporary sibling folder and renamed into place only when everything is
written, so a failure (including a full disk or an interruption) leaves no ``DIR`` behind.

Safety rules (checked before anything is loaded, again before anything is replaced):

* ``overwrite`` replaces only a previous secateur output: a folder holding its marker
  (``secateur-report.json`` for ``prune``, ``secateur-export.json`` for ``save_pruned``,
  ``secateur-report-index.json`` for ``report``) and no name such an export does not write
  (:func:`check_replaceable`). Anything else is refused, naming the path and why.
* the output may not be, or contain, the model it is made from, the current or home directory, ``/``.
* temporary folders are named ``.<out>.secateur-tmp-<pid>-<random>`` (``-old-`` while the previous
  output is moved aside) and hold a marker with their pid and host first; a later write to the same
  output removes those whose process is gone (:func:`remove_stale_temps`), and nothing else.
* one output, one writer (:func:`output_lock`): a run holds an exclusive ``flock`` on ``.<out>.secateur-lock``
  beside its output for its whole life (as git holds ``index.lock``), the lock file naming its PID and host; a
  second run onto the same output is refused in one line naming that PID. The kernel releases the lock when its
  process dies (SIGKILL included), so a dead run's lock file is simply taken over; the file is removed when the
  run ends.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import json
import os
import shutil
import socket
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from secateur.errors import SecateurError

REPORT_NAME = "secateur-report.json"
MASKS_NAME = "secateur-masks.npz"
EXPORT_MARKER = "secateur-export.json"  # written by export.sliced.save_pruned (library use)
REPORT_INDEX = "secateur-report-index.json"  # marker of a `secateur report` folder
TEMP_MARKER = ".secateur-tmp.json"  # first file in every temporary folder: {"pid", "host", "out"}
LOCK_SUFFIX = ".secateur-lock"  # .<out>.secateur-lock beside an output: "<pid> <host>" of the run writing it
_TEMP_KINDS = ("tmp", "old")

# Every name a model export may write (save_run, save_structured, save_pruned, CoCurve, the card and recipe).
TOKENIZER_NAMES = {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "spiece.model",
                   "sentencepiece.bpe.model", "chat_template.json", "chat_template.jinja"}
MODEL_NAMES = {"config.json", "generation_config.json", "model.safetensors.index.json", "README.md"}  # + the card
METHOD_NAMES = {"secateur_hetero.py", "configuration_decilm.py", "secateur_selection.json", "qk-removal.png",
                "cocurve_graph.npz", "cocurve_mask.npz", "cocurve_report.json", "cocurve_mask.pt"}
MODEL_PATTERNS = ("*.safetensors", "secateur-*.json", "secateur-*.npz", "secateur-*.png", "secateur-*.yaml")
REPORT_NAMES = {REPORT_INDEX, "report.md", "report.html"}
# kind -> (markers, one of which must be present; exact names; patterns; sub-folders and their patterns)
_KINDS: dict[str, tuple[set[str], set[str], tuple[str, ...], dict[str, tuple[str, ...]]]] = {
    "model": ({REPORT_NAME, EXPORT_MARKER, "cocurve_report.json"}, TOKENIZER_NAMES | MODEL_NAMES | METHOD_NAMES,
              MODEL_PATTERNS, {}),
    "report": ({REPORT_INDEX}, REPORT_NAMES, (), {"plots": ("*.png",)}),
}


def _mb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def _existing_ancestor(p: Path) -> Path:
    """``p`` itself or its nearest ancestor that exists (the folder a new path would be created in)."""
    while not os.path.lexists(p) and p != p.parent:
        p = p.parent
    return p


def _protected(protect: Iterable[str | Path]) -> list[tuple[Path, str]]:
    places = [(Path.cwd().resolve(), "the current directory"), (Path.home().resolve(), "the home directory"),
              (Path("/"), "the root folder")]
    return places + [(Path(p).resolve(), f"the --model {p}") for p in protect]


def model_paths(spec: str | None) -> list[Path]:
    """The local files an output must not replace: a model folder or ``.gguf`` file, an alias's cache folder."""
    if not spec:
        return []
    from secateur.models.loading import ALIASES, cache_dir

    if spec in ALIASES:
        return [cache_dir() / ALIASES[spec][2]]
    p = Path(spec)
    return [p] if os.path.lexists(p) else []


def _foreign_entries(folder: Path, kind: str) -> tuple[bool, list[str]]:
    """(has the kind's marker, names in ``folder`` that such an export never writes)."""
    markers, names, patterns, subdirs = _KINDS[kind]
    foreign, marked = [], False
    for p in sorted(folder.iterdir()):
        n = p.name
        if p.is_symlink() or not (p.is_file() or p.is_dir()):
            foreign.append(n)
        elif p.is_dir():
            if n not in subdirs or any(q.is_symlink() or not q.is_file()
                                       or not any(fnmatch.fnmatchcase(q.name, g) for g in subdirs[n])
                                       for q in p.iterdir()):
                foreign.append(n + "/")
        elif n in markers:
            marked = True
        elif n not in names and not any(fnmatch.fnmatchcase(n, g) for g in patterns):
            foreign.append(n)
    return marked, foreign


def check_replaceable(out: str | Path, kind: str = "model") -> None:
    """Refuse to replace ``out`` unless it is a previous secateur output of ``kind`` (see the module doc)."""
    out = Path(out)
    how = "--overwrite only replaces a previous secateur output"
    if out.is_symlink():
        raise SecateurError(f"output {out} is a symbolic link; {how}: give the real folder or another path")
    if not out.is_dir():
        raise SecateurError(f"output {out} is a file, not a secateur output folder; {how}: choose another path")
    try:
        marked, foreign = _foreign_entries(out, kind)
    except OSError as e:
        raise SecateurError(f"output {out} cannot be read ({e.strerror or e}); {how}") from None
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise SecateurError(f"output {out} holds files secateur did not write ({shown}); {how}: "
                            "move them or choose another path")
    if not marked and any(out.iterdir()):
        marker = " or ".join(sorted(_KINDS[kind][0]))
        raise SecateurError(f"output {out} is not a secateur output folder (no {marker}); {how}: "
                            "choose another path")


#: characters secateur adds to an output's name for its siblings: ``.<name>.secateur-tmp-<pid>-<8 random>`` (the
#: longest: 1 + 14 + 7-digit pid + 1 + 8), ``.<name>.secateur-ckpt``, ``.<name>.secateur-lock``
NAME_EXTRA = 31


def check_name_length(path: str | Path) -> None:
    """Refuse, before anything runs, an output path the file system cannot hold: a folder name longer than it
    allows, or an output name that leaves no room for secateur's temporary siblings (:data:`NAME_EXTRA`), or a
    path longer than ``PATH_MAX`` (ENAMETOOLONG, found otherwise only when the output is written)."""
    path = Path(path)
    where = _existing_ancestor(path.parent) if path.parent != path else path
    try:
        name_max = os.pathconf(where if where.is_dir() else "/", "PC_NAME_MAX")
        path_max = os.pathconf(where if where.is_dir() else "/", "PC_PATH_MAX")
    except (OSError, ValueError):
        name_max, path_max = 255, 4096
    for part in path.parts[:-1]:
        if len(os.fsencode(part)) > name_max:
            raise SecateurError(f"output path has a folder name of {len(os.fsencode(part))} bytes ({part[:24]}...); "
                                f"this file system holds names of at most {name_max}: choose a shorter path")
    n = len(os.fsencode(path.name))
    if n > name_max - NAME_EXTRA:
        raise SecateurError(f"output name {path.name[:24]}... is {n} bytes long; this file system holds names of at "
                            f"most {name_max} and secateur adds up to {NAME_EXTRA} for its temporary files: choose a "
                            f"name of at most {name_max - NAME_EXTRA}")
    if len(os.fsencode(str(path.absolute()))) + NAME_EXTRA >= path_max:
        raise SecateurError(f"output path is {len(os.fsencode(str(path.absolute())))} bytes long; this file system "
                            f"holds paths of at most {path_max} and secateur adds up to {NAME_EXTRA}: choose a "
                            "shorter path")


def check_writable_output(path: str | Path, folder: bool = True) -> None:
    """Fail now, before any model is loaded, when ``path`` cannot be written: its nearest existing ancestor
    is not a folder or refuses a probe file (read-only, permissions, ...; a real write, so root is not
    exempt), or a file output names a folder."""
    path = Path(path)
    check_name_length(path)
    if not folder and path.is_dir():
        raise SecateurError(f"output file {path} is a folder; name a file")
    where = _existing_ancestor(path.parent)
    if not where.is_dir():
        raise SecateurError(f"cannot write {path}: {where} is not a folder; choose an output path inside a folder")
    try:
        fd, probe = tempfile.mkstemp(prefix=".secateur-probe-", dir=where)
    except OSError as e:
        raise SecateurError(f"cannot write {path}: {where} is not writable ({e.strerror or e}); "
                            "choose a folder you can write to") from None
    os.close(fd)
    os.unlink(probe)


def check_output_dir(out: str | Path, overwrite: bool, kind: str = "model",
                     protect: Iterable[str | Path] = ()) -> Path:
    """Every check of an output folder that needs no model: named, not a protected place (``protect``:
    e.g. the model's folder; also the current and home directories, ``/``), replaceable if it exists
    (:func:`check_replaceable`), writable (:func:`check_writable_output`). A killed run's temporary
    folders for ``out`` are removed first (:func:`remove_stale_temps`: only secateur's own)."""
    if out is None or str(out).strip() == "":
        raise SecateurError("output path is empty; name the output folder (--out DIR)")
    out = Path(out)
    check_name_length(out)
    real = out.resolve()
    places = _protected(protect)
    for place, what in places:
        if real == place:
            raise SecateurError(f"output {out} is {what}; choose a new folder")
    for place, what in places:
        if real in place.parents:
            raise SecateurError(f"output {out} contains {what}; choose a new folder")
    for p in protect:  # inside the model's folder: the output (and its checkpoint) would mix with the model's files
        model = Path(p).resolve()
        if model.is_dir() and model in real.parents:
            raise SecateurError(f"output {out} is inside the --model folder {p}; choose a folder outside it")
    remove_stale_temps(out)
    if os.path.lexists(out):
        if not overwrite:
            raise SecateurError(f"output {out} already exists; pass --overwrite to replace it")
        check_replaceable(out, kind)
    check_writable_output(out)
    return out


def check_free_space(out: str | Path, need: int, including: str = "") -> None:
    """Refuse before writing when the filesystem of ``out`` has less than ``need`` bytes free (``including``: what
    ``need`` counts besides the export, named in the message)."""
    where = _existing_ancestor(Path(out).parent)
    free = shutil.disk_usage(where).free
    if free < need:
        raise SecateurError(f"not enough disk space for {out}: the export{including} needs about {_mb(need)}, "
                            f"{_mb(free)} free on {where}; free some space or choose another --out")


def _disk_full(e: BaseException | None) -> bool:
    """ENOSPC/EDQUOT anywhere in the chain, also when a library wraps it in its own type (safetensors)."""
    for _ in range(8):
        if e is None:
            return False
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(s in str(e) for s in ("No space left on device", "Disk quota exceeded")):
            return True
        e = e.__cause__ or e.__context__
    return False


def _host() -> str:
    return socket.gethostname()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True  # someone else's process (or not a pid we can judge): keep its folder
    return True


def _make_temp(out: Path, kind: str) -> Path:
    """A fresh hidden sibling of ``out`` whose first file says which process owns it."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.secateur-{kind}-{os.getpid()}-", dir=out.parent))
    (tmp / TEMP_MARKER).write_text(json.dumps({"pid": os.getpid(), "host": _host(), "out": out.name}))
    return tmp


def _stale(p: Path, out: Path) -> bool:
    """``p`` is a temporary folder of ``out`` left by a secateur process of this host that is gone."""
    name = p.name
    prefixes = [f".{out.name}.secateur-{k}-" for k in _TEMP_KINDS]
    prefix = next((x for x in prefixes if name.startswith(x)), None)
    if prefix is None or p.is_symlink() or not p.is_dir():
        return False
    pid_part = name[len(prefix):].split("-", 1)[0]
    if not pid_part.isdigit() or int(pid_part) == os.getpid() or _pid_alive(int(pid_part)):
        return False
    marker = p / TEMP_MARKER
    if not marker.is_file():  # killed between mkdtemp and the marker: only an empty folder is ours for sure
        return not any(p.iterdir())
    try:
        info = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(info, dict) and info.get("pid") == int(pid_part) and info.get("host") == _host() \
        and info.get("out") == out.name


def remove_stale_temps(out: str | Path) -> list[Path]:
    """Remove the temporary folders a killed secateur run left beside ``out`` (see :func:`_stale`); a previous
    output that was moved aside when the run died is put back first when ``out`` is missing. Returns them."""
    out = Path(out)
    if not out.name or not out.parent.is_dir():
        return []
    removed = []
    for p in sorted(out.parent.glob(f".{_glob_escape(out.name)}.secateur-*")):
        if not _stale(p, out):
            continue
        aside = p / out.name
        if p.name.startswith(f".{out.name}.secateur-old-") and aside.is_dir() and not os.path.lexists(out):
            os.replace(aside, out)
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    return removed


def _glob_escape(s: str) -> str:
    return "".join(f"[{c}]" if c in "*?[" else c for c in s)


def _missing_parents(p: Path) -> list[Path]:
    missing = []
    while not os.path.lexists(p) and p != p.parent:
        missing.append(p)
        p = p.parent
    return missing


def _room_for(target: Path, need: int | None) -> list[Path]:
    """Before writing ``target``: its free space checked (``need`` bytes, when known); returns the parent folders
    that do not exist yet (made by the writer, removed again if it fails)."""
    if need is not None:
        check_free_space(target, need)
    return _missing_parents(target.parent)


def _remove_empty(created: list[Path]) -> None:
    """Remove the parent folders a failed write created (``_missing_parents``), only while they are empty."""
    for p in created:
        with contextlib.suppress(OSError):
            p.rmdir()


def _raise_write_error(e: BaseException, target: Path, need: int | None) -> None:
    """Turn a failed write of ``target`` into one line naming the problem and the fix (a full disk with the space
    needed and free; any other OS or safetensors error); returns for anything else (ours, Ctrl-C, bugs), which
    the caller re-raises unchanged."""
    if isinstance(e, SecateurError) or not isinstance(e, Exception):
        return
    if _disk_full(e):
        where = _existing_ancestor(target.parent)
        needs = f"the export needs about {_mb(need)}, " if need is not None else ""
        raise SecateurError(f"disk full while writing {target}: {needs}{_mb(shutil.disk_usage(where).free)} "
                            f"free on {where}; nothing was written") from e
    if isinstance(e, OSError) or type(e).__name__ == "SafetensorError":
        raise SecateurError(f"could not write {target}: {getattr(e, 'strerror', None) or e}; check the "
                            "folder's permissions and free space") from e


@contextlib.contextmanager
def atomic_dir(out: str | Path, overwrite: bool = False, kind: str = "model",
               need: int | None = None) -> Iterator[Path]:
    """Yield a temporary folder that becomes ``out`` on success and vanishes on failure or interruption.

    ``overwrite`` replaces only a previous secateur output of ``kind`` (:func:`check_replaceable`, checked
    before and again just before the swap); ``need``: the bytes the export will take, checked against the
    free space and named when the disk fills up. Parent folders created here are removed on failure. The
    output's lock (:func:`output_lock`) is held throughout (already held by a run that took it first)."""
    out = Path(out)
    with output_lock(out):
        yield from _atomic_dir(out, overwrite, kind, need)


def _atomic_dir(out: Path, overwrite: bool, kind: str, need: int | None) -> Iterator[Path]:
    check_output_dir(out, overwrite, kind)
    created = _room_for(out, need)
    tmp = None
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = _make_temp(out, "tmp")
        yield tmp
        (tmp / TEMP_MARKER).unlink()
        usual_permissions(tmp)  # mkdtemp's 0700 / a writer's 0600 would hide the output from other accounts
        if os.path.lexists(out):  # move the old folder aside first, so there is never a moment without either
            check_replaceable(out, kind)
            trash = _make_temp(out, "old")
            os.replace(out, trash / out.name)
            os.replace(tmp, out)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        _remove_empty(created)
        _raise_write_error(e, out, need)
        raise


def lock_path(out: str | Path) -> Path:
    """The lock file of the output ``out``: ``.<name>.secateur-lock`` in its folder."""
    out = Path(out)
    return out.parent / f".{out.name}{LOCK_SUFFIX}"


_HELD: dict[str, list] = {}  # lock file (absolute) -> [fd, depth]: this process's locks (re-entrant)


def _holder(fd: int) -> str:
    """``PID <pid> on <host>`` from a lock file's content (the run that holds it), as far as it says."""
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        pid, _, host = os.read(fd, 512).decode("utf-8", "replace").strip().partition(" ")
    except OSError:
        pid = host = ""
    if not pid.isdigit():
        return "PID unknown"
    return f"PID {pid}" + (f" on {host}" if host and host != _host() else "")


def _acquire(out: Path, path: Path) -> int | None:
    """The lock on ``path`` taken (its fd), or None when no lock file can be made there (an unwritable or missing
    folder: the output checks say so in their own words). Refused in one line when another process holds it."""
    import fcntl

    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise SecateurError(f"output {out} is being written by another secateur run ({holder}); wait for it "
                                "to end, or choose another --out") from None
        except OSError:  # a file system without locks: the output checks and atomic renames remain
            os.close(fd)
            return None
        try:  # the previous holder may have removed the file between our open and our lock: lock the new one
            st = os.stat(path)
            same = (st.st_ino, st.st_dev) == (os.fstat(fd).st_ino, os.fstat(fd).st_dev)
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()} {_host()}\n".encode())
    return fd


@contextlib.contextmanager
def output_lock(out: str | Path | None) -> Iterator[None]:
    """Hold the exclusive lock of the output ``out`` for the block (module docstring; re-entrant in one process;
    nothing for ``None``, an empty path or a path without a name such as ``.``). The lock file is removed, and the
    folders made for it when they are empty, when the block ends however it ends."""
    if out is None or not str(out).strip() or not Path(out).name or Path(out).name in (".", ".."):
        yield
        return
    path = lock_path(out)
    key = os.path.abspath(path)
    if key in _HELD:
        _HELD[key][1] += 1
        try:
            yield
        finally:
            _HELD[key][1] -= 1
        return
    created = _missing_parents(path.parent)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError:
        created = []
    try:
        fd = _acquire(Path(out), path)
    except BaseException:
        _remove_empty(created)
        raise
    if fd is None:
        _remove_empty(created)
        yield
        return
    _HELD[key] = [fd, 1]
    try:
        yield
    finally:
        del _HELD[key]
        with contextlib.suppress(OSError):
            os.unlink(path)  # still holding the lock: a process that opened it re-checks the path and retries
        os.close(fd)
        _remove_empty(created)


def write_file_atomic(path: str | Path, text: str) -> Path:
    """Write a small text file (eval ``--json``) through :func:`atomic_file`: never a partial file, an existing
    file replaced (a folder or a link at ``path`` is refused)."""
    with atomic_file(path, overwrite=True, kind="file") as tmp:
        tmp.write_text(text)
    return Path(path)


def _file_temps(path: Path) -> list[Path]:
    """Temporary siblings a killed :func:`atomic_file` left for ``path`` (their pid, in the name, is gone)."""
    prefix = f".{path.name}.secateur-tmp-"
    found = []
    for p in sorted(path.parent.glob(f"{_glob_escape(prefix)}*")) if path.parent.is_dir() else []:
        pid_part = p.name[len(prefix):].split("-", 1)[0]
        if pid_part.isdigit() and int(pid_part) != os.getpid() and not _pid_alive(int(pid_part)) \
                and p.is_file() and not p.is_symlink():
            found.append(p)
    return found


def check_output_file(path: str | Path, overwrite: bool, is_ours=None, kind: str = "file") -> Path:
    """Every check of a one-file output (``secateur export gguf --out``) that needs no model: named, not a folder
    or a link, replaceable only with ``overwrite`` and only when ``is_ours(path)`` says secateur wrote it,
    writable. A killed export's temporary siblings are removed first."""
    if path is None or str(path).strip() == "":
        raise SecateurError("output path is empty; name the output file (--out FILE)")
    path = Path(path)
    check_name_length(path)
    how = "--overwrite only replaces a previous secateur output"
    for p in _file_temps(path):
        with contextlib.suppress(OSError):
            p.unlink()
    if path.is_symlink():
        raise SecateurError(f"output {path} is a symbolic link; {how}: give another path")
    if path.is_dir():
        raise SecateurError(f"output {path} is a folder; name a {kind} (--out FILE)")
    if os.path.lexists(path):
        if not overwrite:
            raise SecateurError(f"output {path} already exists; pass --overwrite to replace it")
        if is_ours is not None and not is_ours(path):
            raise SecateurError(f"output {path} is not a {kind} secateur wrote; {how}: choose another path")
    check_writable_output(path, folder=False)
    return path


@contextlib.contextmanager
def atomic_file(path: str | Path, overwrite: bool = False, is_ours=None, need: int | None = None,
                kind: str = "file") -> Iterator[Path]:
    """Yield a temporary sibling of ``path`` (``.<name>.secateur-tmp-<pid>-*``) that becomes ``path`` when the
    block ends and is removed on any failure or interruption (Ctrl-C, SIGTERM through the CLI): never a partial
    ``path``, never a leftover. ``overwrite`` / ``is_ours``: see :func:`check_output_file` (checked again just
    before the rename); ``need``: bytes, checked against the free space and named when the disk fills up."""
    with output_lock(path):
        yield from _atomic_file(path, overwrite, is_ours, need, kind)


def _atomic_file(path: str | Path, overwrite: bool, is_ours, need: int | None, kind: str) -> Iterator[Path]:
    path = check_output_file(path, overwrite, is_ours, kind)
    created = _room_for(path, need)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.secateur-tmp-{os.getpid()}-", dir=path.parent)
        os.close(fd)
        tmp = Path(name)
        yield tmp
        usual_permissions(tmp)
        if os.path.lexists(path):
            check_output_file(path, overwrite, is_ours, kind)
        os.replace(tmp, path)
        tmp = None
    except BaseException as e:
        if tmp is not None:
            with contextlib.suppress(OSError):
                tmp.unlink()
        _remove_empty(created)
        _raise_write_error(e, path, need)
        raise


def write_report(folder: Path, report: dict) -> None:
    """``secateur-report.json`` into ``folder`` (a run's temporary folder; written last, it marks a complete
    output), its ``peak_rss_mb`` read now: after the weights were written, which is often the run's peak."""
    from secateur.runinfo import peak_rss_mb

    report["peak_rss_mb"] = peak_rss_mb()
    (Path(folder) / REPORT_NAME).write_text(json.dumps(report, indent=2, default=str))


def usual_permissions(path: Path) -> None:
    """The user's usual modes (0777 / 0666 less the umask) on ``path`` and everything under it: what a plain
    ``mkdir`` / ``open`` would have made, so a serving account or a colleague can read a finished output."""
    mask = os.umask(0)
    os.umask(mask)
    path = Path(path)
    items = [path, *path.rglob("*")] if path.is_dir() else [path]
    for p in items:
        if p.is_symlink():
            continue
        os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~mask)
