"""Issue 44 §4: the CORP vision bench scripts run end to end on a tiny random ViT (rows, page, no error), into a
temporary results folder (``$BENCH_RESULTS``) with the model in a temporary cache (``$SECATEUR_CACHE``). Accuracy of
a random model means nothing; what is checked is that every row the groups name is recorded with its fields and
that the page renders the tables those rows feed."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from secateur.data.sources import default_data_dir
from secateur.testing import save_tiny

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def _fmnist() -> bool:
    d = default_data_dir()
    return d is not None and (d / "fashion-mnist").exists()


def _run(script: str, args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    env = os.environ | {"SECATEUR_CACHE": str(tmp_path / "cache"), "BENCH_RESULTS": str(tmp_path / "res"),
                        "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(ROOT / "bench" / "quality" / script), *args], env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(not _fmnist(), reason="Fashion-MNIST not in ../shared/data")
def test_corp_vit_and_torch_pruning_benches_on_a_tiny_vit(tmp_path):
    save_tiny("vit", tmp_path / "cache" / "vision" / "fmnist-vit")
    (tmp_path / "res").mkdir()
    r = _run("corp_vit.py", ["--groups", "t4a", "--nsamples", "16", "--max-images", "32"], tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(x) for x in (tmp_path / "res" / "vision" / "corp-vit.jsonl").read_text().splitlines()]
    keys = {x["key"] for x in rows}
    assert keys == {f"grail-{s}-heads-{p}" for s in ("magnitude", "wanda") for p in ("0.3", "0.5")}
    for x in rows:
        assert 0 <= x["top1"] <= 1 and x["params"] > 0 and x["group"] == "t4a" and x["load_avg_1_5_15"]
    page = (tmp_path / "res" / "vision" / "corp-vit.md").read_text()
    assert "Table 4(a)'s shape" in page and "| attention | 50% |" in page
    if importlib.util.find_spec("torch_pruning") is None:  # a bench-only dependency (its requirements file)
        return
    r = _run("torch_pruning_vit.py", ["--sparsities", "0.5", "--parts", "heads", "--max-images", "32"], tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(x) for x in (tmp_path / "res" / "vision" / "corp-vit.jsonl").read_text().splitlines()]
    assert "torch-pruning-heads-0.5" in {x["key"] for x in rows}
