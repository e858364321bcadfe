"""One command, several processes: ``secateur prune --procs N`` / ``secateur eval ppl --procs N`` and torchrun.

Two ways in, one code path: torchrun (``torchrun --nproc-per-node N -m secateur prune ...``) sets ``WORLD_SIZE``,
``RANK``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``; ``--procs N`` is a small supervisor that sets the
same variables and starts N copies of the same command (:func:`supervise`). Every rank parses the same options,
validates them before joining the process group (:func:`joined`: gloo on CPU, NCCL with ``--device cuda``, every
collective bounded by ``SECATEUR_DIST_TIMEOUT`` seconds) and runs the same :mod:`secateur.api` call, split as
:mod:`secateur.calib.dist` describes; rank 0 alone prints and writes.

Failures: a rank that fails says so in one line, ``secateur: error: rank R: <problem>; <fix>``. Under ``--procs``
the ranks write that line to the supervisor instead of printing it; the supervisor stops the other ranks as soon
as one exits non-zero (SIGTERM, then SIGKILL after :data:`GRACE_S`), prints the line of the rank that failed first
(a rank that only lost contact with it comes last) and exits 2 (a rank ended by a signal is named with it); Ctrl-C
or SIGTERM to the supervisor stops every rank (130 / 143). Under torchrun, torchrun stops the other ranks; a rank
that loses contact with a failed one ends with its own line within the timeout.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from secateur.errors import SecateurError, one_line

#: where a supervised rank writes its one-line failure (set by :func:`supervise`)
ERRORS_ENV = "SECATEUR_SPLIT_ERRORS"
#: seconds the other ranks get to end after SIGTERM before SIGKILL
GRACE_S = 5.0
# how long the supervisor waits, once a rank failed, for the others' own reports (the root cause may land second)
_SETTLE_S = 0.5


def env_world() -> tuple[int, int]:
    """``(rank, world)`` from the environment (torchrun, ``--procs``); ``(0, 1)`` in a plain process. Imports no
    torch: the CLI's interrupt handler asks it, possibly while torch is half imported."""
    try:
        world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    except ValueError:
        raise SecateurError("WORLD_SIZE and RANK must be integers (torchrun sets them)") from None
    return rank, world


def check_procs(procs: int | None) -> int:
    """``--procs`` checked against the environment: the number of processes this command runs as."""
    _, world = env_world()
    if procs is None:
        return world
    if procs < 1:
        raise SecateurError(f"--procs must be >= 1 (processes on this machine), got {procs}; pass e.g. --procs 2")
    if world > 1 and procs != world:
        raise SecateurError(f"--procs {procs} but torchrun started {world} processes (WORLD_SIZE); drop --procs")
    return procs


def supervised() -> bool:
    return bool(os.environ.get(ERRORS_ENV)) and env_world()[1] > 1


def quiet_ranks() -> None:
    """Ranks other than 0 print nothing (their failure line goes through :func:`fail`)."""
    rank, world = env_world()
    if world > 1 and rank > 0:
        devnull = open(os.devnull, "w")  # noqa: SIM115 (the process's streams until it exits)
        sys.stdout = devnull
        sys.stderr = devnull


@contextlib.contextmanager
def joined(device: str = "cpu") -> Iterator[None]:
    """The process group of a split run, joined for the duration (nothing in a plain process); call it once the
    options are validated, so bad input fails on every rank before any rank waits for another."""
    from secateur import stall
    from secateur.calib import dist

    stall.point("join")
    started = dist.init_from_env(device)
    try:
        yield
    finally:
        if started:
            dist.finish()


def is_peer_loss(e: BaseException) -> bool:
    """An error of the process group itself: another rank died, or a collective timed out."""
    import torch.distributed as tdist

    if isinstance(e, getattr(tdist, "DistError", ())):
        return True
    text = str(e)
    return any(s in text for s in ("Connection closed", "Connection reset", "Broken pipe", "gloo", "NCCL",
                                   "Timed out", "timed out", "Socket Timeout"))


def describe(e: BaseException) -> tuple[str, str]:
    """``(kind, one-line message)`` of an exception that ends a rank of a split run."""
    if isinstance(e, SecateurError):
        return "error", str(e)
    first = re.sub(r"^\[[^\]]*\]\s*", "", (str(e).strip().splitlines() or [""])[0])  # gloo's [file:line]
    first = first.split(". ")[0][:200]
    if is_peer_loss(e):
        from secateur.calib.dist import timeout_s

        return "peer", (f"lost contact with another process ({type(e).__name__}: {first}); the process that failed "
                        f"first says why (a hung process is given up after SECATEUR_DIST_TIMEOUT={timeout_s():g} s)")
    return "error", f"{type(e).__name__}: {first}; unexpected: run the command in one process for the traceback"


def fail(kind: str, message: str, code: int) -> int:
    """A rank's failure: its line printed (torchrun) or handed to the supervisor (``--procs``); returns ``code``."""
    rank, world = env_world()
    message = one_line(message)
    if world == 1:
        print(f"secateur: error: {message}", file=sys.stderr)
        return code
    line = f"rank {rank}: {message}"
    folder = os.environ.get(ERRORS_ENV)
    if folder:
        (Path(folder) / f"rank-{rank}.json").write_text(json.dumps({"kind": kind, "line": line, "code": code}))
    elif kind != "stopped":
        print(f"secateur: error: {line}", file=sys.__stderr__)
    return code


def _without_procs(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--procs":
            skip = True
        elif not a.startswith("--procs="):
            out.append(a)
    return out


def supervise(argv: list[str], procs: int) -> int:
    """Run ``secateur <argv>`` as ``procs`` processes on this machine (module docstring); the exit status."""
    from secateur.calib.dist import free_port

    port = free_port()
    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // procs))
    with tempfile.TemporaryDirectory(prefix="secateur-procs-") as errors:
        children: list[subprocess.Popen] = []
        order: list[int] = []  # ranks in the order they were seen to fail
        try:
            for rank in range(procs):
                env = os.environ | {"WORLD_SIZE": str(procs), "RANK": str(rank), "LOCAL_RANK": str(rank),
                                    "LOCAL_WORLD_SIZE": str(procs), "MASTER_ADDR": "127.0.0.1",
                                    "MASTER_PORT": str(port), "OMP_NUM_THREADS": threads, ERRORS_ENV: errors}
                quiet = None if rank == 0 else subprocess.DEVNULL
                children.append(subprocess.Popen([sys.executable, "-m", "secateur", *_without_procs(argv)], env=env,
                                                  stdout=quiet, stderr=quiet))
            while any(c.poll() is None for c in children):
                order += [r for r, c in enumerate(children) if c.returncode not in (None, 0) and r not in order]
                if order:
                    _stop(children, settle=True)
                    break
                time.sleep(0.05)
        except BaseException:  # Ctrl-C / SIGTERM to the supervisor: every rank stops
            _stop(children, settle=False)
            raise
        order += [r for r, c in enumerate(children) if c.returncode not in (None, 0) and r not in order]
        if not order:
            return 0
        print(f"secateur: error: {_root_cause(order, children, Path(errors))}", file=sys.stderr)
        return 2


def _stop(children: list[subprocess.Popen], settle: bool) -> None:
    """End every rank still running: SIGTERM, then SIGKILL after :data:`GRACE_S`."""
    if settle:  # a rank that failed at the same moment reports its own cause
        end = time.monotonic() + _SETTLE_S
        while time.monotonic() < end and any(c.poll() is None for c in children):
            time.sleep(0.05)
    for c in children:
        if c.poll() is None:
            c.send_signal(signal.SIGTERM)
    end = time.monotonic() + GRACE_S
    for c in children:
        with contextlib.suppress(subprocess.TimeoutExpired):
            c.wait(max(0.0, end - time.monotonic()))
        if c.poll() is None:
            c.kill()
            c.wait()


def _root_cause(order: list[int], children: list[subprocess.Popen], errors: Path) -> str:
    """The line of the rank that failed first: its own error, or the signal that ended it; a rank that only lost
    contact with another (or was stopped) is named only when nothing else is known."""
    lines: dict[int, tuple[str, str]] = {}
    for r in order:
        f = errors / f"rank-{r}.json"
        if f.exists():
            d = json.loads(f.read_text())
            lines[r] = (d["kind"], d["line"])
        elif children[r].returncode < 0:
            sig = signal.Signals(-children[r].returncode).name
            lines[r] = ("signal", f"rank {r}: ended by {sig} (killed, or out of memory); the other processes were "
                                  "stopped: free memory or use fewer --procs, then run it again")
        else:
            lines[r] = ("error", f"rank {r}: exited with status {children[r].returncode}")
    for kinds in (("error", "signal"), ("peer",), ("stopped",)):
        for r in order:
            if lines[r][0] in kinds:
                return lines[r][1]
    return lines[order[0]][1]
