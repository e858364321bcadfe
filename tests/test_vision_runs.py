"""Vision runs keep the run guarantees of text runs: a prune killed between blocks resumes from its checkpoint to
the bits of an uninterrupted one (at a random block), and a run split over two processes gives the one-process
output bit for bit."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from secateur.calib import engine, resume
from secateur.cli import main
from secateur.testing import save_tiny, tiny_vision_model

pytestmark = pytest.mark.usefixtures("one_thread")
LAYERS = 4


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("v")
    folder = root / "vit"
    save_tiny("vit", folder)
    tiny_vision_model("vit", layers=LAYERS).save_pretrained(folder)  # the same family, 4 blocks to stop between
    npz = root / "calib.npz"
    np.savez(npz, images=np.random.default_rng(0).integers(0, 256, (8, 16, 16, 3), dtype=np.uint8))
    return {"model": str(folder), "npz": str(npz)}


def _prune(inputs, out: Path, *args: str) -> int:
    return main(["prune", "--model", inputs["model"], "--calib", inputs["npz"], "--nsamples", "8", "--chunk-size", "2",
                 "--quiet", "--out", str(out), *args])


def _digests(out: Path) -> dict[str, str]:
    d = {k: hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
         for f in sorted(out.glob("*.safetensors")) for k, t in load_file(f).items()}
    masks = out / "secateur-masks.npz"
    if masks.exists():
        z = np.load(masks)
        d |= {f"mask:{k}": hashlib.sha256(z[k].tobytes()).hexdigest() for k in z.files}
    return d


@pytest.mark.parametrize("args", [("--method", "sparsegpt", "--sparsity", "0.5"),
                                  ("--method", "wanda", "--pattern", "2:4")])
def test_a_killed_vision_prune_resumes_bit_identical(inputs, tmp_path, monkeypatch, args):
    a, b = tmp_path / "a", tmp_path / "b"
    assert _prune(inputs, a, *args) == 0
    k = random.Random(str(args)).randrange(LAYERS - 1)  # a random block to be killed after

    def hook(i: int) -> None:
        if i == k:
            raise KeyboardInterrupt

    monkeypatch.setattr(engine, "_after_block", hook)
    assert _prune(inputs, b, *args) == 130
    assert resume.checkpoint_dir(b).is_dir() and not b.exists()
    seen: list[int] = []
    monkeypatch.setattr(engine, "_after_block", seen.append)
    assert _prune(inputs, b, *args, "--resume") == 0
    assert seen == list(range(k + 1, LAYERS)) and not resume.checkpoint_dir(b).exists()
    assert _digests(a) == _digests(b)


@pytest.mark.slow
def test_two_processes_give_the_one_process_bits(inputs, tmp_path):
    """CORP joint (MLP channels, then Q/K dims per head on round-robin owner ranks) at --procs 2."""
    one, two = tmp_path / "one", tmp_path / "two"
    assert _prune(inputs, one, "--method", "corp", "--sparsity", "0.5") == 0
    assert _prune(inputs, two, "--method", "corp", "--sparsity", "0.5", "--procs", "2") == 0
    assert _digests(one) == _digests(two)


@pytest.mark.parametrize("args", [("--method", "wanda-sp", "--sparsity", "0.5"),
                                  ("--method", "wanda", "--sparsity", "0.5")])
def test_a_streamed_vision_prune_equals_the_in_memory_one(inputs, tmp_path, args):
    """``--stream`` (one block in memory at a time, the folder's older ViT key names mapped to the loaded ones) writes
    the in-memory run's tensors bit for bit (the streamed folder stores them under the loaded names)."""
    mem, streamed = tmp_path / "mem", tmp_path / "stream"
    assert _prune(inputs, mem, *args) == 0
    assert _prune(inputs, streamed, *args, "--stream") == 0
    from secateur.models.loading import load_model

    a, b = load_model(str(mem))[0].state_dict(), load_model(str(streamed))[0].state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    if (mem / "secateur-masks.npz").exists():
        za, zb = np.load(mem / "secateur-masks.npz"), np.load(streamed / "secateur-masks.npz")
        assert sorted(za.files) == sorted(zb.files) and all((za[k] == zb[k]).all() for k in za.files)
