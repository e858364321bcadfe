"""Named points of a run where the signal tests hold it still (``tests/test_signals.py``).

``SECATEUR_STALL=<point>:<marker file>`` makes the process create the marker file when it reaches ``<point>``
and sleep there for up to a minute, so a test can deliver SIGINT or SIGTERM exactly at that point (start-up,
calibration, a checkpoint write, the final save) instead of at a guessed time. Unset (always, outside the
tests), :func:`point` is one dictionary lookup. Imports nothing heavy: start-up is one of the points.
"""

from __future__ import annotations

import os
import time

POINTS = ("startup", "calibration", "checkpoint-write", "save")


def point(name: str) -> None:
    spec = os.environ.get("SECATEUR_STALL")
    if not spec:
        return
    want, _, marker = spec.partition(":")
    if want != name:
        return
    with open(marker, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(60)
