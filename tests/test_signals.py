"""Ctrl-C and SIGTERM at every stage of a real ``secateur prune`` (a separate process): the exit code is 130 / 143,
no traceback, and nothing is left on disk but what the README names (the checkpoint, named on stderr with its
size and both ways out). A kept checkpoint resumes to the bit-identical output.

The stages are held still with ``SECATEUR_STALL`` (:mod:`secateur.stall`: start-up, calibration, a checkpoint
write, the final save), so the signal lands exactly there; a seeded generator adds interruptions at random
times of an uninterrupted run.
"""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from secateur.calib.resume import checkpoint_dir
from secateur.recovery.train import CKPT_FILE

CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}


@pytest.fixture(scope="module")
def inputs(tiny_inputs):
    return tiny_inputs


def _argv(inputs: dict, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "secateur.cli", "prune", "--model", inputs["model"], "--method", "sparsegpt",
            "--sparsity", "0.5", "--calib", inputs["text"], "--nsamples", "4", "--seqlen", "32", "--quiet",
            "--out", str(out), *extra]


def _env(**extra: str) -> dict:
    return os.environ | {"PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"} | extra


def _sigint_default() -> None:
    """The child starts with SIGINT at its default, as from a terminal: a shell that runs the suite in the background
    (``make test &``, nohup) ignores SIGINT, the ignore is inherited, and Python then installs no KeyboardInterrupt
    handler, so the child would never see Ctrl-C (found on a fresh clone run in the background: 4 SIGINT cases)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _files(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


def _digest(folder: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.npz")):
        h.update(p.read_bytes())
    return h.hexdigest()


def _check_interrupted(proc: subprocess.Popen, sig: int, work: Path, out: Path) -> tuple[str, bool]:
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == CODES[sig], err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    assert err.rstrip().splitlines()[-1].startswith("secateur: interrupted"), err[-600:]
    ck = checkpoint_dir(out)
    left = _files(work)
    assert not out.exists()
    if ck.exists():  # kept: named on stderr with its size and both ways out, and nothing else left
        assert f"progress kept in {ck} (" in err and "--resume" in err and "delete that folder" in err, err
        assert {p for p in left if not p.startswith(ck.name)} == set(), left
        return err, True
    assert left == set(), left
    return err, False


@pytest.mark.parametrize("point", ["startup", "calibration", "checkpoint-write", "save"])
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_at_each_stage(inputs, tmp_path, point, sig):
    work, marker = tmp_path / "work", tmp_path / "marker"
    work.mkdir()
    out = work / "out"
    proc = subprocess.Popen(_argv(inputs, out), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env(SECATEUR_STALL=f"{point}:{marker}"), preexec_fn=_sigint_default)
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-2000:]
        time.sleep(0.05)
    proc.send_signal(sig)
    _, kept = _check_interrupted(proc, sig, work, out)
    # what is kept where: nothing is checkpointed before the first block is saved; the final save keeps it all
    assert kept == (point == "save"), point
    if kept:  # the named way out works: --resume ends in the output an uninterrupted run writes
        again = subprocess.run(_argv(inputs, out, "--resume"), capture_output=True, text=True, env=_env(),
                               timeout=300)
        assert again.returncode == 0, again.stderr[-2000:]
        ref = tmp_path / "ref"
        subprocess.run(_argv(inputs, ref), capture_output=True, text=True, env=_env(), timeout=300, check=True)
        assert _digest(out) == _digest(ref)
        assert _files(work) == {p for p in _files(work) if p == "out" or p.startswith("out/")}


@pytest.mark.parametrize("seed", range(3))
def test_signal_at_a_random_time(inputs, tmp_path, seed):
    """A delay drawn uniformly over an uninterrupted run's wall time (measured here), either signal."""
    rng = random.Random(seed)
    work = tmp_path / "work"
    work.mkdir()
    t = time.monotonic()
    subprocess.run(_argv(inputs, tmp_path / "timing"), capture_output=True, env=_env(), timeout=300, check=True)
    wall = time.monotonic() - t
    sig = rng.choice([signal.SIGINT, signal.SIGTERM])
    out = work / "out"
    proc = subprocess.Popen(_argv(inputs, out), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env(), preexec_fn=_sigint_default)
    time.sleep(rng.uniform(0.0, wall))
    proc.send_signal(sig)
    code = proc.wait(timeout=120)
    if code == 0:  # finished before the signal: a complete output and nothing else
        assert _files(work) == {p for p in _files(work) if p == "out" or p.startswith("out/")}
        assert (out / "secateur-report.json").exists()
        return
    if code == -sig:  # the signal's default action: before secateur's handlers exist (the interpreter importing
        # torch) or after they are gone (the output complete, the interpreter shutting down): either nothing at
        # all or the complete output, never a part of one
        left = _files(work)
        assert left == set() or ((out / "secateur-report.json").exists()
                                 and left == {p for p in left if p == "out" or p.startswith("out/")}), left
        return
    _check_interrupted(proc, sig, work, out)


def _wait_for_interrupt(seconds: float) -> float:
    """Sleep in short steps until the pending signal is raised; the seconds waited (fails after ``seconds``)."""
    t = time.monotonic()
    while time.monotonic() - t < seconds:
        time.sleep(0.005)
    raise AssertionError(f"no interrupt within {seconds} s")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("where", ["import", "__del__"])
def test_a_signal_inside_an_import_or_finalizer_is_raised_after_it(tmp_path, monkeypatch, sig, where):
    """The CLI's handler defers a signal that lands inside an import (where torch's C++ initialization cannot carry
    the exception: the interpreter aborts; transformers wraps it in a RuntimeError) or a ``__del__`` (Python prints
    'Exception ignored' and forgets it): the import or finalizer completes undisturbed, and the interrupt is raised
    in the next safe place, within a few re-send periods."""
    from secateur import interrupts

    done = tmp_path / "done"
    body = (f"import signal, time\nsignal.raise_signal({int(sig)})\ntime.sleep(0.2)\n"
            f"open({str(done)!r}, 'w').close()\n")  # the last line runs only if the signal did not cut the body
    name = f"_signal_probe_{where.strip('_')}_{int(sig)}"
    (tmp_path / f"{name}.py").write_text(body if where == "import" else "class Probe:\n    def __del__(self):\n"
                                         + "".join(f"        {line}\n" for line in body.splitlines()))
    monkeypatch.syspath_prepend(str(tmp_path))
    expected = interrupts.Terminated if sig == signal.SIGTERM else KeyboardInterrupt
    # as from a terminal: a suite run in the background (nohup, ``make test &``) starts with SIGINT ignored, and
    # as_interrupts then leaves it ignored on purpose
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _deferred_case(interrupts, name, where, expected)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert done.exists()  # the import or finalizer ran to its end, and the interrupt still came
    assert signal.getsignal(signal.SIGTERM) is not interrupts._handler  # restored on leaving


def _deferred_case(interrupts, name: str, where: str, expected: type) -> None:
    with interrupts.as_interrupts():
        with pytest.raises(expected):
            if where == "import":
                __import__(name)
            else:
                probe = __import__(name).Probe()
                del probe  # the finalizer runs here, the signal landing inside it
            _wait_for_interrupt(10 * interrupts.RETRY_S + 1.0)


def test_unsafe_finds_imports_and_finalizers_on_the_stack():
    import sys

    from secateur import interrupts

    assert not interrupts.unsafe(sys._getframe())

    class Holder:
        def __del__(self):
            seen.append(interrupts.unsafe(sys._getframe()))

    seen: list[bool] = []
    Holder()
    assert seen == [True]


@pytest.mark.parametrize("stop", [KeyboardInterrupt, "Terminated"])
def test_an_error_raised_over_the_interrupt_still_ends_as_interrupted(inputs, tmp_path, monkeypatch, capsys, stop):
    """A library's cleanup may raise over the interrupt (seen: SIGTERM inside ``numpy.savez``, whose zipfile close in
    a ``finally`` raised ValueError, and the CLI printed a traceback, exit 1): still the interrupt's line and exit
    status, no output folder, and nothing but the named checkpoint."""
    from secateur import cli, interrupts
    from secateur.export import hf

    exc = interrupts.Terminated if stop == "Terminated" else stop

    def cut(*a, **k):
        try:
            raise exc()
        finally:
            raise ValueError("Can't close the ZIP file while there is an open writing handle on it")

    monkeypatch.setattr(hf, "write_run_files", cut)
    out = tmp_path / "out"
    code = cli.main(_argv(inputs, out)[3:])
    err = capsys.readouterr().err
    assert code == (143 if stop == "Terminated" else 130), err
    assert err.rstrip().splitlines()[-1].startswith("secateur: interrupted") and "Traceback" not in err
    ck = checkpoint_dir(out)  # at the save every block is done: the progress is kept, and named
    assert not out.exists() and {p.name for p in tmp_path.iterdir()} <= {ck.name}
    assert not ck.exists() or f"progress kept in {ck} (" in err, err


def test_interrupt_in_follows_the_chain():
    from secateur.interrupts import interrupt_in

    try:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as ki:
            raise RuntimeError("wrapped") from ki
    except RuntimeError as e:
        assert isinstance(interrupt_in(e), KeyboardInterrupt)
    assert interrupt_in(ValueError("alone")) is None


# --- secateur recover: the same promises for the training loop --------------------------------------------------

@pytest.fixture(scope="module")
def pruned(inputs, tmp_path_factory) -> str:
    from secateur import api

    run = tmp_path_factory.mktemp("recover-run") / "run"
    api.prune(model=inputs["model"], method="magnitude", sparsity=0.5, out=str(run), quiet=True)
    return str(run)


def _recover_argv(inputs: dict, run: str, work: Path, *extra: str) -> list[str]:
    """64 steps of one 32-token window, a checkpoint every 8, the adapter saved beside the output."""
    return [sys.executable, "-m", "secateur.cli", "recover", run, "--teacher", inputs["model"], "--data",
            inputs["text"], "--tokens", "2048", "--seqlen", "32", "--rank", "4", "--checkpoint-every", "8",
            "--heldout-windows", "1", "--quiet", "--out", str(work / "out"), "--save-adapter",
            str(work / "adapter"), *extra]


def _adapter_sha(out: Path) -> str:
    import json

    return json.loads((out / "secateur-report.json").read_text())["recovery"]["adapter_sha256"]


@pytest.fixture(scope="module")
def recovered(inputs, pruned, tmp_path_factory) -> dict:
    """An uninterrupted recovery: its wall time and adapters."""
    work = tmp_path_factory.mktemp("recover-ref")
    t = time.monotonic()
    subprocess.run(_recover_argv(inputs, pruned, work), capture_output=True, env=_env(), timeout=300, check=True)
    return {"wall": time.monotonic() - t, "sha": _adapter_sha(work / "out")}


def _check_recover_outcome(proc, sig: int, work: Path, inputs: dict, pruned: str, recovered: dict) -> str:
    """Interrupted: the one line, the exit status, no output and no adapter folder, only the named checkpoint; a
    kept checkpoint resumes to the uninterrupted adapters. Returns 'finished' | 'default' | 'kept' | 'clean'."""
    code = proc.wait(timeout=120)
    left = _files(work)
    done = {p for p in left if p.split("/")[0] in ("out", "adapter")}
    if code == 0:  # finished before the signal: both folders complete, nothing else
        assert left == done and _adapter_sha(work / "out") == recovered["sha"], left
        return "finished"
    if code == -sig:  # before the handlers exist or after they are gone: nothing, or everything
        assert left == set() or (left == done and (work / "out" / "secateur-report.json").exists()), left
        return "default"
    err = proc.stderr.read()
    assert code == CODES[sig] and "Traceback" not in err, err[-2000:]
    assert err.rstrip().splitlines()[-1].startswith("secateur: interrupted"), err[-600:]
    ck = checkpoint_dir(work / "out")
    assert not (work / "out").exists() and not (work / "adapter").exists(), left
    if not ck.exists():
        assert left == set(), left
        return "clean"
    assert {p for p in left if not p.startswith(ck.name)} == set(), left
    assert f"progress kept in {ck} (" in err and "--resume" in err, err[-600:]
    again = subprocess.run(_recover_argv(inputs, pruned, work, "--resume"), capture_output=True, text=True,
                           env=_env(), timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert _adapter_sha(work / "out") == recovered["sha"] and not ck.exists()
    return "kept"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_recover_signal_after_a_checkpoint(inputs, pruned, recovered, tmp_path, sig):
    """The signal lands in the training loop once a checkpoint exists: kept, named, and resumed to the same bits."""
    work = tmp_path / "work"
    work.mkdir()
    proc = subprocess.Popen(_recover_argv(inputs, pruned, work), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=_env(), preexec_fn=_sigint_default)
    ck, deadline = checkpoint_dir(work / "out"), time.monotonic() + 120
    while not (ck / CKPT_FILE).exists() and proc.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    proc.send_signal(sig)
    assert _check_recover_outcome(proc, sig, work, inputs, pruned, recovered) in ("kept", "finished")


@pytest.mark.parametrize("seed", range(3))
def test_recover_signal_at_a_random_time(inputs, pruned, recovered, tmp_path, seed):
    """A delay drawn uniformly over an uninterrupted recovery's wall time, either signal."""
    rng = random.Random(100 + seed)
    work = tmp_path / "work"
    work.mkdir()
    sig = rng.choice([signal.SIGINT, signal.SIGTERM])
    proc = subprocess.Popen(_recover_argv(inputs, pruned, work), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=_env(), preexec_fn=_sigint_default)
    time.sleep(rng.uniform(0.0, recovered["wall"]))
    proc.send_signal(sig)
    _check_recover_outcome(proc, sig, work, inputs, pruned, recovered)
