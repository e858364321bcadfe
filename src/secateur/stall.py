"""Named points of a run where the signal tests hold it still (``tests/test_signals.py``).

``SECATEUR_STALL=<point>:<marker file>`` makes the process create the marker file when it reaches ``<point>``
and sleep there for up to a minute, so a test can deliver SIGINT or SIGTERM exactly at that point (start-up,
calibration, a checkpoint write, the final save) instead of at a guessed time. Unset (always, outside the
tests), :func:`point` is two dictionary lookups. Imports nothing heavy: start-up is one of the points.

``SECATEUR_FAIL=<point>:<rank>:<how>`` (``tests/test_distributed.py``) makes the process of that rank (``RANK``;
0 in a plain process) fail there: ``error`` raises a :class:`~secateur.errors.SecateurError`, ``raise`` a
RuntimeError (an unexpected exception), ``kill`` sends itself SIGKILL.
"""

from __future__ import annotations

import os
import time

POINTS = ("startup", "join", "calibration", "checkpoint-write", "block-done", "save")


def point(name: str) -> None:
    if os.environ.get("SECATEUR_FAIL"):
        _fail(name, os.environ["SECATEUR_FAIL"])
    spec = os.environ.get("SECATEUR_STALL")
    if not spec:
        return
    want, _, marker = spec.partition(":")
    if want != name:
        return
    with open(marker, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(60)


def _fail(name: str, spec: str) -> None:
    want, _, rest = spec.partition(":")
    rank, _, how = rest.partition(":")
    if want != name or rank != os.environ.get("RANK", "0"):
        return
    if how == "kill":
        import signal

        os.kill(os.getpid(), signal.SIGKILL)
    if how == "raise":
        raise RuntimeError(f"injected failure at {name}")
    from secateur.errors import SecateurError

    raise SecateurError(f"injected failure at {name}; unset SECATEUR_FAIL")
