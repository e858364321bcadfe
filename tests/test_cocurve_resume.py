"""The CoCurve sweep resumes from its per-block checkpoint with ``H`` bit-identical to an uninterrupted run.

The interruption is modelled two ways: an exception raised inside a block at a random point (every block
index, drawn by a seeded generator), and a real ``SIGKILL`` of a separate process after its first saved
block. Either way the resumed sweep must reuse the saved blocks (counted) and end with the same ``H``
(sha256 of the bytes), single-unit KLs and support mass.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from secateur.calib import resume
from secateur.methods.cocurve import cocurve_inventory
from secateur.models.adapters import get_adapter
from secateur.scoring import cocurve_sweep
from secateur.scoring.cocurve_graph import array_sha256
from secateur.scoring.cocurve_sweep import SweepConfig, ablation_sweep
from secateur.testing import random_ids, tiny_model

CFG = SweepConfig(positions_per_seq=6, top_r=24, unit_batch=4, seqs_per_block=1)
N_SEQS = 4


def _sweep(ck: resume.Checkpoint | None = None):
    model = tiny_model("llama", layers=4)
    a = get_adapter(model)
    with resume.active(ck):
        return ablation_sweep(model, a, cocurve_inventory(a, n_ffn_groups=4), random_ids(N_SEQS, 24, seed=4), CFG)


def _open(tmp_path: Path, resume_it: bool) -> resume.Checkpoint:
    return resume.Checkpoint.open(tmp_path / "graph", {"test": "sweep"}, resume_it, log=lambda m: None)


class _Killed(Exception):
    pass


@pytest.mark.parametrize("seed", range(3))
def test_interrupted_sweep_resumes_bit_identical(tmp_path, monkeypatch, seed):
    ref = _sweep()
    kill_at = random.Random(seed).randrange(1, N_SEQS)  # blocks finished before the interruption
    real_block = cocurve_sweep._sweep_block
    calls = {"n": 0}

    def dying_block(*a, **kw):
        if calls["n"] == kill_at:
            raise _Killed
        calls["n"] += 1
        return real_block(*a, **kw)

    monkeypatch.setattr(cocurve_sweep, "_sweep_block", dying_block)
    with pytest.raises(_Killed):
        _sweep(_open(tmp_path, False))
    monkeypatch.setattr(cocurve_sweep, "_sweep_block", real_block)
    saved = sorted(p.name for p in resume.checkpoint_dir(tmp_path / "graph").glob("sweep0-block*.pt"))
    assert saved == [f"sweep0-block{b}.pt" for b in range(kill_at)]
    got = _sweep(_open(tmp_path, True))
    assert got.timings["resumed_blocks"] == kill_at
    assert array_sha256(got.H) == array_sha256(ref.H)
    assert torch.equal(got.kl_single, ref.kl_single) and got.support_mass == ref.support_mass
    assert all(torch.equal(a, b) for a, b in zip(got.halves, ref.halves))  # the split-half graphs too
    assert got.timings["n_ablations"] == ref.timings["n_ablations"]  # the saved blocks' counts are carried


_CHILD = """
import sys, time
import torch
torch.set_num_threads(1)
from secateur.calib import resume
from secateur.scoring import cocurve_sweep
sys.path.insert(0, {tests!r})
import test_cocurve_resume as t
real = cocurve_sweep._sweep_block
def slow(*a, **kw):
    out = real(*a, **kw)
    time.sleep(0.5)  # room for the parent's SIGKILL between block saves
    return out
cocurve_sweep._sweep_block = slow
ck = resume.Checkpoint.open({graph!r}, {{"test": "sweep"}}, {resume_it}, log=lambda m: None)
sw = t._sweep(ck)
print("DONE", flush=True)
"""


def test_sigkilled_sweep_resumes_bit_identical(tmp_path):
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # the child's kernels (1 thread): H is compared across the two processes
    try:
        _sigkill_case(tmp_path)
    finally:
        torch.set_num_threads(n)


def _sigkill_case(tmp_path: Path) -> None:
    ref = _sweep()
    graph = tmp_path / "graph"
    ckdir = resume.checkpoint_dir(graph)
    code = _CHILD.format(tests=str(Path(__file__).parent), graph=str(graph), resume_it=False)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 120
    while not list(ckdir.glob("sweep0-block*.pt")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()[-2000:]
    done = len(list(ckdir.glob("sweep0-block*.pt")))
    assert 1 <= done < N_SEQS
    got = _sweep(_open(tmp_path, True))
    assert got.timings["resumed_blocks"] == done
    assert array_sha256(got.H) == array_sha256(ref.H)
    assert torch.equal(got.kl_single, ref.kl_single)


def test_a_piece_of_other_positions_is_recomputed(tmp_path):
    """A saved block that does not say it holds this run's positions per window (written before the default became
    every position, or with another number) is recomputed, not added to H."""
    ref = _sweep()
    _sweep(_open(tmp_path, False))
    ckdir = resume.checkpoint_dir(tmp_path / "graph")
    old = ckdir / "sweep0-block1.pt"
    piece = torch.load(old, weights_only=True)
    assert piece.pop("positions") == CFG.positions_per_seq
    torch.save(piece, old)
    other = ckdir / "sweep0-block2.pt"
    piece = torch.load(other, weights_only=True)
    piece["positions"] = 24
    torch.save(piece, other)
    got = _sweep(_open(tmp_path, True))
    assert got.timings["resumed_blocks"] == N_SEQS - 2
    assert array_sha256(got.H) == array_sha256(ref.H) and torch.equal(got.kl_single, ref.kl_single)
