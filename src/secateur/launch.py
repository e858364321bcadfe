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
#: the supervisor's PID (set by :func:`supervise`): a rank that outlives it removes :data:`ERRORS_ENV`'s folder
SUPERVISOR_ENV = "SECATEUR_SPLIT_SUPERVISOR"
#: seconds the other ranks get to end after SIGTERM before SIGKILL
GRACE_S = 5.0
# how long the supervisor waits, once a rank failed, for the others' own reports (the root cause may land second)
_SETTLE_S = 0.5


def env_world() -> tuple[int, int]:
    """``(rank, world)`` from the environment (torchrun, ``--procs``); ``(0, 1)`` in a plain process. Imports no
    torch: the CLI's interrupt handler asks it, possibly while torch is half imported."""
    values = {}
    for name, default in (("WORLD_SIZE", "1"), ("RANK", "0")):
        raw = os.environ.get(name, default)
        try:
            values[name] = int(raw)
        except ValueError:
            raise SecateurError(f"{name}={one_line(raw)[:40]!r} is not an integer; unset it, or let torchrun set "
                                "WORLD_SIZE and RANK") from None
    return values["RANK"], values["WORLD_SIZE"]


def _world_or_one() -> tuple[int, int]:
    """:func:`env_world`, or ``(0, 1)`` when the environment is what failed (the error handler must not fail)."""
    try:
        return env_world()
    except SecateurError:
        return 0, 1


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask; the machine's count where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


#: what one process holds before it loads a model (Python, torch and secateur imported), at least
BASE_PROCESS_BYTES = 300 << 20
#: processes per CPU core ``--procs`` may start (a few more than the cores still make progress; tests run 3 on 2)
PROCS_PER_CORE = 2


def check_procs(procs: int | None) -> int:
    """``--procs`` checked against the environment: the number of processes this command runs as. Started here
    (``--procs`` without torchrun), more processes than this machine can run are refused up front, in one line,
    instead of starting them to stall: more than :data:`PROCS_PER_CORE` per CPU core (past that they only wait for
    one another: ``--procs 64`` on 2 cores ran for minutes without a line), or more than its available memory
    holds before any of them loads the model (each holds what this process holds now, at least
    :data:`BASE_PROCESS_BYTES`)."""
    _, world = env_world()
    if procs is None:
        return world
    if procs < 1:
        raise SecateurError(f"--procs must be >= 1 (processes on this machine), got {procs}; pass e.g. --procs 2")
    if world > 1 and procs != world:
        raise SecateurError(f"--procs {procs} but torchrun started {world} processes (WORLD_SIZE); drop --procs")
    if world == 1 and procs > 1:
        cores = usable_cores()
        if procs > PROCS_PER_CORE * cores:
            raise SecateurError(f"--procs {procs} is more than {PROCS_PER_CORE} processes for each of the {cores} CPU "
                                "core(s) this process may use (the processes would only wait for one another); pass "
                                f"--procs {cores} (at most {PROCS_PER_CORE * cores})")
        from secateur.models.memory import available_bytes, current_rss

        each = max(BASE_PROCESS_BYTES, current_rss() or 0)
        available = available_bytes()
        if available is not None and procs * each > available:
            fit = max(1, available // each)
            raise SecateurError(f"--procs {procs}: each process holds about {each / 2**30:.2f} GiB before it loads "
                                f"the model ({procs * each / 2**30:.2f} GiB for {procs}), and "
                                f"{available / 2**30:.2f} GiB is available; pass --procs {fit} or fewer")
    return procs


def supervised() -> bool:
    return bool(os.environ.get(ERRORS_ENV)) and env_world()[1] > 1


def quiet_ranks() -> None:
    """Ranks other than 0 print nothing (their failure line goes through :func:`fail`)."""
    rank, world = _world_or_one()  # a broken environment: this process prints, and its first check says why
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
    rank, world = _world_or_one()
    message = one_line(message)
    if world == 1:
        print(f"secateur: error: {message}", file=sys.stderr)
        return code
    line = f"rank {rank}: {message}"
    folder = os.environ.get(ERRORS_ENV)
    if folder:
        try:
            (Path(folder) / f"rank-{rank}.json").write_text(json.dumps({"kind": kind, "line": line, "code": code}))
            return code
        except OSError:  # the supervisor is gone (and its folder with it): say it here
            pass
    if kind != "stopped":
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
    remove_stale_folders()
    with tempfile.TemporaryDirectory(prefix=f"{PROCS_PREFIX}{os.getpid()}-") as errors:
        children: list[subprocess.Popen] = []
        order: list[int] = []  # ranks in the order they were seen to fail
        try:
            for rank in range(procs):
                env = os.environ | {"WORLD_SIZE": str(procs), "RANK": str(rank), "LOCAL_RANK": str(rank),
                                    "LOCAL_WORLD_SIZE": str(procs), "MASTER_ADDR": "127.0.0.1",
                                    "MASTER_PORT": str(port), "OMP_NUM_THREADS": threads, ERRORS_ENV: errors,
                                    SUPERVISOR_ENV: str(os.getpid())}
                quiet = None if rank == 0 else subprocess.DEVNULL
                children.append(subprocess.Popen([sys.executable, "-m", "secateur", *_without_procs(argv)], env=env,
                                                  stdout=quiet, stderr=quiet))
            # every child polled each time (a list, not any(): any() stops at the first live rank, so a dead
            # rank behind it went unseen until the live one gave up at SECATEUR_DIST_TIMEOUT)
            while None in [c.poll() for c in children]:
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


def orphan_cleanup() -> None:
    """At a supervised rank's exit: when its supervisor is gone (killed with SIGKILL: its ``finally`` never ran),
    remove the supervisor's folder, which nobody else would."""
    import shutil

    folder, pid = os.environ.get(ERRORS_ENV), os.environ.get(SUPERVISOR_ENV)
    if folder and pid and pid.isdigit() and os.getppid() != int(pid):
        shutil.rmtree(folder, ignore_errors=True)


#: the supervisor's folder for its ranks' failure lines: ``<tmp>/secateur-procs-<supervisor pid>-<random>``
PROCS_PREFIX = "secateur-procs-"


def remove_stale_folders() -> list[Path]:
    """Remove the rank folders (:data:`PROCS_PREFIX`) of this user's supervisors that are gone (SIGKILL leaves
    them: no ``finally`` runs); a folder whose supervisor still runs, or another user's, is left alone."""
    import shutil

    from secateur.safe_write import _pid_alive

    removed = []
    for p in Path(tempfile.gettempdir()).glob(f"{PROCS_PREFIX}*"):
        pid = p.name[len(PROCS_PREFIX):].split("-", 1)[0]
        try:
            mine = p.is_dir() and not p.is_symlink() and p.stat().st_uid == os.getuid()
        except OSError:
            continue
        if mine and pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


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
