"""The VLM assembly and projector training script (bench/tools/train_vlm.py, issue 47 §2) on a tiny random LLaVA: an
interrupted run resumed from its checkpoint ends with the bits of an uninterrupted one, the folder reloads with
``from_pretrained`` and one tower of it prunes through ``--towers``; the caption helpers name classes exactly.
Skipped without the shared Fashion-MNIST copy."""

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


def _script():
    sys.path.insert(0, str(ROOT))
    from bench.tools import train_vlm

    return train_vlm


def _train(out: Path, *extra: str) -> int:
    return _script().main(["--tiny", "--steps", "12", "--batch", "8", "--ckpt-every", "4", "--eval-images", "16",
                           "--out", str(out), *extra])


def test_an_interrupted_training_resumes_to_the_same_projector(tmp_path):
    assert _train(tmp_path / "whole") == 0
    stop = random.Random(1).randint(5, 10)  # between two checkpoints
    assert _train(tmp_path / "cut", "--stop-after", str(stop)) == 3
    assert (tmp_path / "cut" / "train-ckpt.pt").exists() and not (tmp_path / "cut" / "train.json").exists()
    assert _train(tmp_path / "cut") == 0
    a, b = load_file(tmp_path / "whole" / "model.safetensors"), load_file(tmp_path / "cut" / "model.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    info = json.loads((tmp_path / "cut" / "train.json").read_text())
    d = info["dense"]
    assert info["steps"] == 12 and d["images"] == 16 and 0 <= d["caption_accuracy"] <= 1 and d["caption_ppl"] > 1


def test_the_trained_folder_reloads_and_prunes_one_tower(tmp_path):
    from transformers import AutoModelForImageTextToText

    from secateur.cli import main

    _train(tmp_path / "m")
    AutoModelForImageTextToText.from_pretrained(tmp_path / "m")
    assert main(["prune", "--model", str(tmp_path / "m"), "--towers", "language", "--method", "wanda", "--sparsity",
                 "0.5", "--calib", "wikitext2", "--nsamples", "4", "--seqlen", "32", "--out", str(tmp_path / "o"),
                 "--quiet"]) == 0
    assert json.loads((tmp_path / "o" / "secateur-report.json").read_text())["vlm"]["towers"] == {"language": 0.5}


def test_captions_name_classes():
    t = _script()
    from secateur.data.captions import named_class

    assert named_class("A photo of a T-shirt.") == "t-shirt"  # not "shirt": the longest name wins
    assert named_class("a shirt") == "shirt" and named_class("an ankle boot!") == "ankle boot"
    assert named_class("a cat") is None
    assert len(set(t.TRAIN_TEMPLATES) & set(t.HELD_OUT_TEMPLATES)) == 0
