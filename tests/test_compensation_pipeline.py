"""Issue 29: the per-block compensation pass runs its solves on worker threads beside the walk
(:meth:`secateur.methods.compensation_pass.BlockCompensation.pipelined`). The weights are bit for bit those of the
sequential pass, the Grams alive stay bounded, and a run killed while solves are still in flight resumes to the
same bits (their statistics are in the checkpoint's ``pend`` files)."""

from __future__ import annotations

import threading
from contextlib import contextmanager

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from secateur.calib import engine, resume
from secateur.compensate import COECOptions
from secateur.methods import compensation_pass
from secateur.methods.structured import StructuredConfig, prune_structured
from secateur.models.adapters import get_adapter
from secateur.testing import random_ids, tiny_model

CASES = {"wanda-sp+coec": ("wanda_sp", "coec"), "rcpu": ("rcpu", "rcpu"), "flap+ls": ("flap", "ls")}


@contextmanager
def pipelined(threads: int = 2):
    """``threads`` torch threads (the pass pipelines only with more than one) and the pool started from the first
    block (tiny solves never outlast the walk, so ``"auto"`` would not start it); both given back on leaving. Module
    fixtures and hypothesis tests cannot take ``monkeypatch``, so this sets and restores by hand."""
    n, mode = torch.get_num_threads(), compensation_pass.BlockCompensation.pipeline
    try:
        torch.set_num_threads(threads)
        compensation_pass.BlockCompensation.pipeline = "always"
        yield
    finally:
        torch.set_num_threads(n)
        compensation_pass.BlockCompensation.pipeline = mode


@pytest.fixture
def threads():
    """Set the torch thread count for one test, the pool started from the first block (:func:`pipelined`)."""
    with pipelined(torch.get_num_threads()):
        yield torch.set_num_threads


def _run(family: str, case: str, layers: int = 4):
    m = tiny_model(family, layers=layers)
    cfg = StructuredConfig(score=CASES[case][0], sparsity=0.3, compensation=CASES[case][1],
                           coec=COECOptions(max_rounds=2))
    res = prune_structured(m, get_adapter(m), random_ids(4, 16), cfg)
    # the walk's waits and its own time are parts of the pass: neither negative, neither over the whole
    t = res.timings
    assert 0 <= t["compensation_wall_s"] and 0 <= t["gram_pass_s"] <= t["total_s"], t
    return {k: v.detach().clone() for k, v in m.state_dict().items()}, res.details


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("case", list(CASES))
def test_pipelined_pass_is_bit_identical_to_the_sequential_one(threads, family, case):
    threads(1)
    want, d1 = _run(family, case)
    threads(2)
    got, d2 = _run(family, case)
    assert torch.get_num_threads() == 2  # the pass gives the thread count back
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want), case
    strip = [{k: v for k, v in r.items() if k != "seconds"} for r in d1["per_layer"]]
    assert strip == [{k: v for k, v in r.items() if k != "seconds"} for r in d2["per_layer"]]
    m1, m2 = d1["statistics_memory"], d2["statistics_memory"]
    assert m1["mode"] == "one block at a time" and "solves on 2 threads" in m2["mode"]
    per_block = m1["grams_bytes"]
    # at most w + 1 = 3 blocks' Grams alive, and the bound the report states holds
    assert per_block <= m2["grams_bytes_measured_peak"] <= m2["grams_bytes"] == 3 * per_block


def test_a_failing_solve_ends_the_run_with_its_error(threads, monkeypatch):
    threads(2)
    real = compensation_pass._compensate_one

    def failing(cfg, adapter, i, group, *a):
        if i == 2:
            raise FloatingPointError("solve of layer 2 failed")
        return real(cfg, adapter, i, group, *a)

    monkeypatch.setattr(compensation_pass, "_compensate_one", failing)
    with pytest.raises(FloatingPointError, match="layer 2"):
        _run("llama", "wanda-sp+coec")
    assert torch.get_num_threads() == 2


@pytest.mark.parametrize("mode", ["auto", "never"])
def test_auto_pipelines_once_the_solves_outlast_the_walk(monkeypatch, mode):
    """``"auto"`` starts the pool after the first block whose solves took longer than its walk (here: a solve
    slowed to 0.2 s, far above a tiny block's walk) and gives the thread count back; ``"never"`` does not.
    Either way the weights are the sequential pass's."""
    import time

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        want, _ = _run("llama", "flap+ls")
        real = compensation_pass._compensate_one

        def slow(*a):
            time.sleep(0.2)
            return real(*a)

        monkeypatch.setattr(compensation_pass, "_compensate_one", slow)
        monkeypatch.setattr(compensation_pass.BlockCompensation, "pipeline", mode)
        torch.set_num_threads(2)
        got, d = _run("llama", "flap+ls")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(n)
    assert all(torch.equal(want[k], got[k]) for k in want)
    mode_line = d["statistics_memory"]["mode"]
    assert ("solves on 2 threads" in mode_line) == (mode == "auto"), mode_line


@st.composite
def _kills(draw) -> tuple[int, int]:
    """(block of the compensation pass after which the run is killed, first block whose solves are held). At
    most one held block may be in flight when the walk submits another (two would fill both workers' slots and
    the walk would wait for a solve that is held for ever), so ``hold_from >= kill_after - 1``; 4 holds none."""
    kill_after = draw(st.integers(0, 3))
    return kill_after, draw(st.integers(max(0, kill_after - 1), 4))


ARGS = ["--method", "wanda-sp", "--compensation", "coec", "--coec-rounds", "2", "--sparsity", "0.5"]


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """A tiny model folder and the digests of its uninterrupted run (2 threads, pool from the first block)."""
    from secateur.testing import tiny_tokenizer
    from tests.test_resume import _digests, _prune

    tmp = tmp_path_factory.mktemp("pipe-clean")
    model = tmp / "model"
    tiny_model("llama", layers=4).save_pretrained(model)
    tiny_tokenizer().save_pretrained(model)
    with pipelined():
        assert _prune(str(model), tmp / "a", ARGS) == 0
    return model, _digests(tmp / "a")


@settings(max_examples=3, deadline=None)
@given(kill=_kills())
@example(kill=(2, 1))  # two blocks in flight, one held, killed with both unfinished
@example(kill=(0, 4))  # killed at the first block, nothing held
def test_kill_with_solves_in_flight_resumes_bit_identical(tmp_path_factory, clean, kill):
    """The run is killed (KeyboardInterrupt, as Ctrl-C) after block ``kill_after`` of the compensation pass while
    every solve of a block >= ``hold_from`` is held unfinished; the resumed run gives the uninterrupted run's
    bits and leaves no ``pend`` file behind."""
    from tests.test_resume import _digests, _prune

    kill_after, hold_from = kill
    model, want = clean
    tmp = tmp_path_factory.mktemp("pipe")
    args = ARGS
    real_after, real_one = engine._after_block, compensation_pass._compensate_one
    gate = threading.Event()
    try:
        seen: list[int] = []

        def hook(i: int) -> None:
            seen.append(i)
            if len(seen) == 4 + kill_after + 1:  # the statistics pass (4 blocks), then the compensation pass
                raise KeyboardInterrupt

        def held(cfg, adapter, i, *a):
            if i >= hold_from:
                gate.wait()
            return real_one(cfg, adapter, i, *a)

        engine._after_block, compensation_pass._compensate_one = hook, held
        with pipelined():
            assert _prune(str(model), tmp / "b", args) == 130
        ck = resume.checkpoint_dir(tmp / "b")
        pend = {p.name.split("pend-")[1] for p in ck.glob("*pend-*.pt")}
        # every held block that was checkpointed left its statistics (o_proj and down_proj); a block whose solves
        # were not held may have too, if the walk outran them
        assert pend >= {f"{i}-{g}.pt" for i in range(hold_from, kill_after + 1) for g in ("attn_out", "mlp_out")}
        gate.set()
        engine._after_block, compensation_pass._compensate_one = (lambda i: None), real_one
        with pipelined():
            assert _prune(str(model), tmp / "b", args, "--resume") == 0
        assert _digests(tmp / "b") == want
        assert not ck.exists() or not list(ck.glob("*pend-*.pt"))
    finally:
        gate.set()
        engine._after_block, compensation_pass._compensate_one = real_after, real_one
