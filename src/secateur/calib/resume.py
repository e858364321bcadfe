"""Checkpoints that let a killed ``secateur prune --out DIR`` continue where it stopped (``--resume``).

The checkpoint is a hidden folder beside the output, ``<parent>/.<name>.secateur-ckpt/``, holding

* ``manifest.json``: the *fingerprint* of the run -- everything that determines its result (model and its
  weight files, every prune option except out/overwrite/quiet/resume, the calibration tokens' sha256, the
  library versions; not the thread count, which no result depends on: docs/protocols.md) -- and the
  marker that makes the folder recognizably secateur's;
* per finished engine block: ``<stage>-block<i>.pt`` with the block's parameters after pruning and the
  handler's state for that block (masks, statistics, records); ``<stage>-hs<i>-c<j>.pt``: chunk ``j`` of the
  hidden states that feed the next block (one file per chunk of ``--chunk-size`` windows: a generation ``i`` is
  complete when every chunk's file is there; the previous generation is deleted once the new one is complete, so
  a kill leaves at least one complete generation). Checkpoints written before the per-chunk files
  (``<stage>-hs.pt``: every chunk in one file) are still read;
* per compensated projection of a structured run: ``<stage>-<layer>-<group>.pt``;
* ``files-rank<r>.txt``: the manifest of the files each process wrote, one name a line, appended before the file
  is written (so a kill leaves no file unnamed).

secateur deletes only what it wrote: removal (:meth:`Checkpoint.remove`) deletes the manifest, the files the
``files-rank*.txt`` lists name (plain names in the folder, and their temporaries) and those lists, then the folder
only if nothing else is left in it (a user's file in it stays, with the folder, and a note says so). A checkpoint
path that is a symbolic link is refused, never followed (it would put the checkpoint, and its removal, in the
folder it points to).

Stages are named by the order in which the run reaches them (``engine0``, ``comp0``, ...): the computation
is deterministic, so a resumed run reaches the same stages in the same order. Every file is written to a
temporary name and moved into place (``os.replace``), so a kill leaves either the old or the new file.
torch.save/load round-trips tensors exactly, so the continued computation sees the same bits as an
uninterrupted one and ends with bit-identical weights and masks.

Several processes (``secateur prune --procs N``, torchrun; :meth:`Checkpoint.open_shared`): rank 0 creates or
validates the folder and its manifest and the others wait for its answer, then check that they see the folder
(several machines need ``--out`` on a filesystem every process sees). The block and compensation files are the
same on every rank (every rank prunes alike): rank 0 writes them (:meth:`Checkpoint.save`); each rank writes the
hidden-state chunks it holds (:meth:`Checkpoint.save_own`). The fingerprint does not hold the number of processes
and the chunks do not depend on it, so a run killed at ``N`` processes resumes at any other number (one included).
Which files exist is read once, by rank 0, when the checkpoint is opened (:meth:`Checkpoint.has`), so every rank
resumes from the same point.

The active checkpoint is a context variable set by :func:`secateur.api.prune` around the method's run; the
calibration engine and the structured compensation read it with :func:`current` (no argument threading
through every method runner).
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from secateur import stall
from secateur.errors import SecateurError

SUFFIX = ".secateur-ckpt"
MANIFEST = "manifest.json"
FILES_PREFIX, FILES_SUFFIX = "files-rank", ".txt"  # the manifest of the files a process wrote
MARKER = "secateur_checkpoint"
FORMAT = 1
#: prune options that do not change the result (everything else is part of the fingerprint)
NEUTRAL_OPTIONS = ("out", "overwrite", "quiet", "resume", "eval_ppl", "eval_windows")



class CheckpointError(SecateurError):
    """A checkpoint that cannot be used; the run leaves it in place for the user to inspect or remove."""


_current: contextvars.ContextVar[Checkpoint | None] = contextvars.ContextVar("secateur_checkpoint", default=None)


def checkpoint_dir(out: str | Path) -> Path:
    """``<parent>/.<name>.secateur-ckpt`` for the output folder ``out``."""
    out = Path(out).absolute()
    return out.parent / f".{out.name}{SUFFIX}"


def _is_ours(path: Path) -> bool:
    """A folder with our name pattern whose manifest (a JSON object) carries the marker."""
    if not path.name.endswith(SUFFIX) or not path.is_dir():
        return False
    if {p.name for p in path.iterdir()} == {f".{MANIFEST}.tmp"}:
        return True  # killed while writing its manifest
    data, _ = _read_manifest(path)
    return isinstance(data, dict) and MARKER in data


def _read_manifest(path: Path) -> tuple[Any, str | None]:
    """The JSON of the checkpoint ``path``'s manifest, or (None, why it cannot be read)."""
    try:
        return json.loads((path / MANIFEST).read_text(encoding="utf-8")), None
    except FileNotFoundError:
        return None, "is missing"
    except OSError as e:
        return None, f"cannot be read ({e.strerror or e})"
    except UnicodeDecodeError:
        return None, "is not UTF-8 text"
    except json.JSONDecodeError as e:
        return None, f"is not valid JSON (line {e.lineno}: {e.msg})"
    except (ValueError, RecursionError):
        return None, "is not valid JSON"


def _old_fingerprint(path: Path) -> dict:
    """The fingerprint recorded in the checkpoint ``path`` (ours: its manifest is a JSON object with the marker),
    its types checked: a damaged manifest is one line saying how to get past it."""
    from secateur.schemas import parse
    from secateur.schemas.checkpoint import CheckpointManifest

    data, _ = _read_manifest(path)
    fix = f"remove the checkpoint folder {path}, or drop --resume to start over"
    try:
        parse(CheckpointManifest, data, str(path / MANIFEST), fix)
        return data["fingerprint"]
    except SecateurError as e:
        raise CheckpointError(str(e)) from None


def _file_stats(path: Path) -> list[list]:
    """Name, size and mtime of the files of a local model (cheaper than hashing the weights)."""
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    return [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]


def _weights_digest(model: torch.nn.Module) -> str:
    import hashlib

    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def fingerprint(opts, model: torch.nn.Module, token_sha: str | None) -> dict[str, Any]:
    """Everything that determines the result of ``secateur prune`` with options ``opts``."""
    from secateur.models.files import gguf_file
    from secateur.models.loading import resolve
    from secateur.runinfo import versions

    options = {k: v for k, v in sorted(opts.to_dict().items()) if k not in NEUTRAL_OPTIONS}
    local = None  # an in-memory model: the digest of its weights before pruning
    if isinstance(opts.model, str):
        local = gguf_file(opts.model)  # a GGUF input: its file (the cached folder is derived from it)
        if local is None:
            local = Path(resolve(opts.model, opts.dtype)[0])
    weights: Any = _file_stats(local) if local is not None and local.exists() else _weights_digest(model)
    fp = {"options": options, "model_files": weights, "calibration_sha256": token_sha, "versions": versions()}
    return json.loads(json.dumps(fp, default=str))  # the same value as after a round trip through the manifest


def _differences(old: dict, new: dict, prefix: str = "") -> list[str]:
    out = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _differences(a, b, f"{prefix}{k}.")
        elif a != b:
            short = k in ("model_files",)
            out.append(f"{prefix}{k}" + ("" if short else f" ({a!r} -> {b!r})"))
    return out


class Checkpoint:
    """One run's checkpoint folder: atomic ``save``/``load`` of named pieces and per-kind stage names."""

    def __init__(self, path: Path, rank: int = 0, files: set[str] | None = None) -> None:
        self.path = path
        self._stages: dict[str, int] = {}
        self.saved = False  # whether this run has written anything (then an interruption can be resumed)
        self.rank = rank  # split over processes: rank 0 alone writes the shared pieces and removes the folder
        self._files = files  # split: the files rank 0 saw when the checkpoint was opened (None: look each time)

    # --- opening / removing ------------------------------------------------------------------------
    @classmethod
    def open(cls, out: str | Path, fp: dict, resume: bool, log=None) -> Checkpoint:
        """The checkpoint of ``out``: an existing matching one with ``resume``, else a fresh one.

        A mismatching checkpoint is refused with ``resume`` (never deleted); without ``resume`` a stale
        checkpoint of ours is replaced. A folder of that name that is not ours is always refused."""
        log = log or (lambda msg: print(f"secateur: {msg}", file=sys.stderr))
        path = checkpoint_dir(out)
        refuse_link(path, out)
        if path.is_dir() and not any(path.iterdir()):
            path.rmdir()  # killed between mkdir and the manifest: nothing in it
        if path.exists() and not _is_ours(path):
            why = _read_manifest(path)[1] if path.is_dir() else None
            raise CheckpointError(f"{path} exists but is not a secateur checkpoint"
                                  + (f" (its {MANIFEST} {why})" if why else "")
                                  + f"; move it away (or delete it, if it is a damaged checkpoint) to prune to {out}")
        if path.exists() and (other := foreign_files(path)):
            shown = ", ".join(other[:3]) + (f" and {len(other) - 3} more" if len(other) > 3 else "")
            raise CheckpointError(f"the checkpoint folder {path} holds files secateur did not write ({shown}); "
                                  "secateur deletes only what it wrote: move them out of it, then run again")
        if path.exists() and not (path / MANIFEST).exists():  # killed while writing its manifest: nothing in it
            log(f"removing the checkpoint {path}: it was interrupted before it held anything")
            cls(path).remove()
        if path.exists():
            if resume:
                old = _old_fingerprint(path)
                diff = _differences(old, fp)
                if diff:
                    raise CheckpointError(f"the checkpoint {path} was made by a different run (differs in: "
                                        f"{'; '.join(diff)}); remove it, or drop --resume to start over")
                log(f"resuming from the checkpoint {path}")
                return cls(path)
            log(f"replacing the stale checkpoint {path} (pass --resume to continue it instead)")
            cls(path).remove()
        elif resume:
            log(f"no checkpoint at {path}: starting from scratch")
        path.mkdir(parents=True)
        ck = cls(path)
        try:
            ck._write_bytes(MANIFEST, json.dumps({MARKER: FORMAT, "out": str(Path(out).absolute()),
                                                  "fingerprint": fp}, indent=1).encode(),
                            fix="free space and run the command again")
        except BaseException:
            remove_written(path)  # nothing to resume from: the folder goes
            raise
        return ck

    @classmethod
    def open_shared(cls, out: str | Path, fp: dict, resume: bool, rank: int) -> Checkpoint | None:
        """:meth:`open` in a run split over processes (module docstring): rank 0 opens it, every rank gets its
        answer (a refusal is every rank's one line) and checks that it sees the folder. None (no checkpoint, said
        in one line) when a rank does not see it and ``resume`` was not asked; refused when it was."""
        from secateur.calib import dist

        answer: dict[str, Any] = {}
        if rank == 0:
            try:
                ck = cls.open(out, fp, resume)
                answer = {"path": str(ck.path), "files": sorted(p.name for p in ck.path.iterdir())}
            except SecateurError as e:
                answer = {"error": str(e)}
        answer = dist.broadcast(answer, 0)
        if "error" in answer:
            raise CheckpointError(answer["error"])
        path = Path(answer["path"])
        blind = [r for r, ok in enumerate(dist.gather_objects((path / MANIFEST).is_file())) if not ok]
        if blind:
            where = f"rank {blind[0]} does not see the checkpoint folder {path}"
            if resume:
                raise CheckpointError(f"{where}; --resume over several machines needs --out on a filesystem every "
                                      "process sees: put --out there, or drop --resume")
            if rank == 0:
                print(f"secateur: {where} (several machines without a shared --out): this run keeps no "
                      "checkpoint", file=sys.stderr)
                cls(path).remove()
            return None
        return cls(path, rank, set(answer["files"]))

    def remove(self) -> None:
        """Delete what secateur wrote in the folder (module docstring), then the folder if it is empty; only a
        folder that is recognizably a secateur checkpoint, never through a link (split over processes: by rank
        0). A folder left holding other files is named in a note."""
        if self.rank != 0 or self.path.is_symlink() or not _is_ours(self.path):
            return
        kept = remove_written(self.path)
        if kept:
            shown = ", ".join(kept[:3]) + (f" and {len(kept) - 3} more" if len(kept) > 3 else "")
            print(f"secateur: kept {self.path}: it holds files secateur did not write ({shown})", file=sys.stderr)

    # --- pieces ------------------------------------------------------------------------------------
    def stage(self, kind: str) -> str:
        """The next stage name of ``kind`` in this run (``engine0``, ``engine1``, ...)."""
        n = self._stages.get(kind, 0)
        self._stages[kind] = n + 1
        return f"{kind}{n}"

    def _note(self, name: str) -> None:
        """Name ``name`` in this process's manifest of written files, before it is written."""
        with open(self.path / f"{FILES_PREFIX}{self.rank}{FILES_SUFFIX}", "a", encoding="utf-8") as f:
            f.write(name + "\n")

    def _write_bytes(self, name: str, data: bytes, fix: str = "") -> None:
        tmp = self.path / f".{name}.tmp"
        try:
            tmp.write_bytes(data)
            os.replace(tmp, self.path / name)
        except BaseException as e:
            tmp.unlink(missing_ok=True)
            self._write_failed(e, fix)
            raise

    def _write_failed(self, e: BaseException, fix: str = "") -> None:
        """A checkpoint write that failed (a full disk, a quota, an I/O error; torch's own writer says only
        ``file write failed``): one line naming the checkpoint and what it holds, the finished pieces kept for
        ``--resume``. Returns for an interruption or a bug, which the caller re-raises."""
        from secateur.safe_write import _disk_full

        if not isinstance(e, Exception) or isinstance(e, SecateurError):
            return
        text = str(e)
        if _disk_full(e):
            why = "disk full"
        elif isinstance(e, OSError) or "write failed" in text or "PytorchStreamWriter" in text:
            why = "cannot write" + (f" ({e.strerror})" if isinstance(e, OSError) and e.strerror else "")
        else:
            return
        try:
            free = f", {_mb(shutil.disk_usage(self.path).free)} free"
        except OSError:
            free = ""
        fix = fix or "free space and run the same command with --resume, or delete it"
        raise CheckpointError(f"{why} while writing the checkpoint {self.path} ({_mb(self.size())} so far{free}); "
                              f"{fix}") from None

    def save(self, name: str, obj: Any) -> None:
        """Write one piece every rank holds alike (split over processes: rank 0 writes it, the others only note
        that the checkpoint holds something)."""
        if self.rank == 0:
            self.save_own(name, obj)
        self.saved = True

    def save_own(self, name: str, obj: Any) -> None:
        """Write one piece of this process's own (every rank writes its pieces: its hidden-state chunks)
        atomically; a full disk is one line naming the checkpoint (the partial temporary removed, the finished
        pieces kept for ``--resume`` once there is space)."""
        tmp = self.path / f".{name}.tmp"
        try:
            self._note(name)
            torch.save(_pack(obj), tmp)
            stall.point("checkpoint-write")
            os.replace(tmp, self.path / name)
        except BaseException as e:
            tmp.unlink(missing_ok=True)
            self._write_failed(e)
            raise
        self.saved = True

    def size(self) -> int:
        """Bytes the checkpoint folder holds now."""
        try:
            return sum(p.stat().st_size for p in self.path.iterdir() if p.is_file())
        except OSError:
            return 0

    def describe(self) -> str:
        """The line an interrupted run prints: where its progress is, how big, and the two ways out."""
        return (f"progress kept in {self.path} ({_mb(self.size())}); run the same command with --resume to "
                f"continue, or delete that folder")

    def has(self, name: str) -> bool:
        """Whether the checkpoint holds ``name`` (split over processes: when it was opened, as rank 0 saw it)."""
        if self._files is not None:
            return name in self._files
        return (self.path / name).exists()

    def load(self, name: str) -> Any:
        try:
            return _unpack(torch.load(self.path / name, map_location="cpu", weights_only=True))
        except Exception as e:  # a truncated or foreign file: the user must start over
            raise CheckpointError(f"checkpoint file {self.path / name} is unreadable ({type(e).__name__}); remove "
                                f"{self.path} and run without --resume") from e

    def delete(self, name: str) -> None:
        """Delete a piece (split over processes: rank 0 deletes, once every rank is done with it)."""
        if self.rank == 0:
            (self.path / name).unlink(missing_ok=True)


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f} MB"


def refuse_link(path: Path, out: str | Path) -> None:
    """A checkpoint path that is a symbolic link (to a user's folder, or dangling) is refused in one line."""
    if path.is_symlink():
        raise CheckpointError(f"the checkpoint path {path} is a symbolic link (to {os.readlink(path)}); secateur "
                              f"keeps the checkpoint of {out} in a folder of its own and never writes or deletes "
                              "through a link: remove the link, or choose another --out")


def _written(path: Path) -> set[str]:
    """The names secateur wrote in the checkpoint folder ``path``: its manifest, the files its
    ``files-rank*.txt`` lists name (plain names only: a damaged list cannot name a path outside the folder) with
    their temporaries, and the lists themselves."""
    names = {MANIFEST, f".{MANIFEST}.tmp"}
    for lst in path.glob(f"{FILES_PREFIX}*{FILES_SUFFIX}"):
        names.add(lst.name)
        try:
            listed = lst.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            continue
        for name in listed:
            if name and "/" not in name and "\\" not in name and name not in (".", "..") and "\0" not in name:
                names |= {name, f".{name}.tmp"}
    return names


def _partition(path: Path) -> tuple[list[Path], list[str]]:
    """``(the files secateur wrote, the names of everything else)`` in the checkpoint folder ``path``
    (:func:`_written`; a checkpoint of an older secateur, without the lists: its ``*.pt`` files and temporaries)."""
    ours = _written(path)
    legacy = not any(n.startswith(FILES_PREFIX) for n in ours)
    mine, other = [], []
    for p in sorted(path.iterdir()):
        named = p.name in ours or legacy and (p.suffix == ".pt" or p.name.startswith(".") and p.name.endswith(".tmp"))
        if named and (p.is_symlink() or p.is_file()):
            mine.append(p)
        else:
            other.append(p.name)
    return mine, other


def foreign_files(path: Path) -> list[str]:
    """The names in the checkpoint folder ``path`` that secateur did not write (sorted)."""
    return _partition(path)[1]


def remove_written(path: Path) -> list[str]:
    """Delete what secateur wrote in the checkpoint folder ``path`` (:func:`_partition`), then the folder if it is
    empty. Returns the names left in it (sorted; empty when the folder is gone)."""
    mine, _ = _partition(path)
    for p in mine:
        p.unlink(missing_ok=True)
    left = sorted(p.name for p in path.iterdir())
    if not left:
        path.rmdir()
    return left


def size_estimate(model: torch.nn.Module, nsamples: int, seqlen: int) -> int:
    """Disk a prune's checkpoint can hold at its largest, about: every block's parameters (the model's bytes, an
    upper bound), the hidden states feeding the next block twice (the file and its replacement being written)
    and 1/8 of a byte per weight for bit-packed masks. Counted by the free-space check before the prune."""
    n_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    n_weights = sum(p.numel() for p in model.parameters())
    hidden = int(getattr(getattr(model, "config", None), "hidden_size", 0) or 0)
    elem = next(model.parameters()).element_size()
    return n_bytes + 2 * nsamples * seqlen * hidden * elem + n_weights // 8


def _pack(obj: Any) -> Any:
    """Boolean tensors (masks) bit-packed: 1 bit instead of 1 byte per weight on disk."""
    if torch.is_tensor(obj) and obj.dtype == torch.bool:
        import numpy as np

        bits = torch.from_numpy(np.packbits(obj.cpu().numpy().ravel()))
        return {"__bits__": bits, "shape": list(obj.shape)}
    if isinstance(obj, dict):
        return {k: _pack(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_pack(v) for v in obj)
    return obj


def _unpack(obj: Any) -> Any:
    if isinstance(obj, dict) and "__bits__" in obj:
        import math

        import numpy as np

        n = math.prod(obj["shape"])
        return torch.from_numpy(np.unpackbits(obj["__bits__"].numpy())[:n].astype(bool).reshape(obj["shape"]))
    if isinstance(obj, dict):
        return {k: _unpack(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_unpack(v) for v in obj)
    return obj


def current() -> Checkpoint | None:
    """The checkpoint of the running ``prune`` (None when not checkpointing)."""
    return _current.get()


@contextlib.contextmanager
def active(ck: Checkpoint | None) -> Iterator[Checkpoint | None]:
    token = _current.set(ck)
    try:
        yield ck
    finally:
        _current.reset(token)


# --- accumulator (de)serialization: plain tensors and numbers, so torch.load(weights_only=True) reads them --

def pack_accumulator(acc) -> dict:
    from secateur.calib.stats import ACCUMULATORS

    if acc.name not in ACCUMULATORS or type(acc) is not ACCUMULATORS[acc.name]:
        raise TypeError(f"cannot checkpoint accumulator {type(acc).__name__}")
    return {"kind": acc.name, "state": dict(vars(acc))}


def unpack_accumulator(d: dict):
    from secateur.calib.stats import ACCUMULATORS

    cls = ACCUMULATORS[d["kind"]]
    acc = cls.__new__(cls)
    acc.__dict__.update(d["state"])
    return acc
