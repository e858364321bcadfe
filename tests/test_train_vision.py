"""The Fashion-MNIST training script behind the vision benches (bench/tools/train_vision.py): an interrupted run
resumed from its checkpoint ends with the bits of an uninterrupted one (data order and augmentation are drawn from
the seed and the step, the optimizer and schedule are checkpointed), and the folder it writes is one secateur
prunes and scores. Skipped without the shared Fashion-MNIST copy."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "fashion-mnist"
pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not (DATA / "train-images-idx3-ubyte.gz").exists(),
                                 reason="no shared Fashion-MNIST copy")]


def _train(out: Path, *extra: str) -> int:
    sys.path.insert(0, str(ROOT / "bench" / "tools"))
    import train_vision

    return train_vision.main(["--arch", "vit", "--tiny", "--epochs", "1", "--ckpt-every", "4", "--out", str(out),
                              *extra])


def test_an_interrupted_training_resumes_to_the_same_weights(tmp_path):
    assert _train(tmp_path / "whole") == 0
    stop = random.Random(0).randint(5, 14)  # anywhere between two checkpoints of the 16 steps
    assert _train(tmp_path / "cut", "--stop-after", str(stop)) == 3
    assert (tmp_path / "cut" / "train-ckpt.pt").exists() and not (tmp_path / "cut" / "train.json").exists()
    assert _train(tmp_path / "cut") == 0
    a, b = load_file(tmp_path / "whole" / "model.safetensors"), load_file(tmp_path / "cut" / "model.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    assert not (tmp_path / "cut" / "train-ckpt.pt").exists()
    info = json.loads((tmp_path / "cut" / "train.json").read_text())
    assert info["steps"] == 16 and 0.0 <= info["test_top1"] <= 1.0


def test_the_trained_folder_prunes_and_scores(tmp_path):
    from secateur.cli import main

    _train(tmp_path / "m")
    assert main(["prune", "--model", str(tmp_path / "m"), "--method", "corp", "--sparsity", "0.5", "--calib",
                 "fashion-mnist", "--nsamples", "32", "--out", str(tmp_path / "o"), "--quiet"]) == 0
    assert main(["eval", "accuracy", "--model", str(tmp_path / "o"), "--max-images", "200", "--json",
                 str(tmp_path / "a.json"), "--quiet"]) == 0
    acc = json.loads((tmp_path / "a.json").read_text())
    assert acc["n_images"] == 200 and acc["top5"] >= acc["top1"]
