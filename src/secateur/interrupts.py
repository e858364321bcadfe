"""Ctrl-C and SIGTERM for the command line: raised where the program is, except where raising would go wrong.

The CLI turns SIGINT into ``KeyboardInterrupt`` and SIGTERM into :class:`Terminated` (a ``KeyboardInterrupt``) so
that one cleanup path runs for both (temporary folders removed, checkpoints named). Python raises the exception
in whatever Python code runs when the signal lands, and three places cannot take it (each seen in
``tests/test_signals.py``'s random-time cases):

* an import: torch's initialization runs Python from C++ (pybind11), where an exception it cannot carry ends the
  interpreter (``terminate called after throwing pybind11::error_already_set``, exit -6) or marks the interrupt
  unhandled even after the CLI caught it (exit -2 after ``secateur: interrupted``); transformers' lazy loader
  wraps it in a RuntimeError (a traceback, exit 1);
* a ``__del__``: Python prints "Exception ignored" and the run goes on as if Ctrl-C never came.

A fourth is a cleanup that raises over the interrupt (zipfile's close in ``numpy.savez``, stopped mid-write): the
CLI looks for the interrupt in the error's context (:func:`interrupt_in`) and ends as interrupted.

So the handler looks at the Python stack it interrupted: outside those places it raises at once; inside them it
sends the same signal again :data:`RETRY_S` later, until it lands where raising is safe (an import or a
finalizer ends within milliseconds). Library users are untouched: only :func:`as_interrupts` installs this, and
only in the main thread.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from types import FrameType

#: seconds between re-sends of a signal that landed where it cannot be raised
RETRY_S = 0.05
_UNSAFE_FILES = ("<frozen importlib._bootstrap>", "<frozen importlib._bootstrap_external>")


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the program is so that the same cleanup as for Ctrl-C runs (temporary folders)."""


def unsafe(frame: FrameType | None) -> bool:
    """Whether ``frame`` or a caller of it is an import or a finalizer (``__del__``): places an exception raised by a
    signal handler does not reach the CLI's handler intact."""
    while frame is not None:
        code = frame.f_code
        if code.co_filename in _UNSAFE_FILES or code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False


def interrupt_in(e: BaseException) -> KeyboardInterrupt | None:
    """The interrupt ``e`` was raised while handling, if any: a library's cleanup can raise its own error over it
    (``numpy.savez`` stopped mid-write: zipfile's close raises ValueError in a ``finally``), and the user still
    asked to stop."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, KeyboardInterrupt):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def _resend(signum: int) -> None:
    timer = threading.Timer(RETRY_S, os.kill, (os.getpid(), signum))
    timer.daemon = True  # never holds the interpreter's exit
    timer.start()


def _handler(signum: int, frame: FrameType | None) -> None:
    if unsafe(frame):
        _resend(signum)
        return
    if signum == signal.SIGTERM:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the cleanup short
        raise Terminated()
    raise KeyboardInterrupt()


@contextlib.contextmanager
def as_interrupts() -> Iterator[None]:
    """SIGTERM and SIGINT become :class:`Terminated` / ``KeyboardInterrupt`` inside the block, raised where it is safe.

    SIGINT is taken over only from Python's own handler: a process started with SIGINT ignored (``nohup``, a
    background job) keeps ignoring it."""
    try:
        previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, _handler)}
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, _handler)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
