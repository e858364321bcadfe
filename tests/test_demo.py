"""``secateur demo`` without a data folder still compares dense and pruned perplexity, on held-out text the
dense model samples with a seed the calibration does not use, and says so."""

import json
import re

from secateur import api, cli
from secateur.data import sources
from secateur.models import loading
from secateur.testing import tiny_model, tiny_tokenizer


def test_demo_without_data_uses_heldout_self_text(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("SECATEUR_DATA", raising=False)
    monkeypatch.setattr(sources, "default_data_dir", lambda: None)  # a clone with no ../shared/data

    def tiny_load(spec, dtype="float32", device="cpu"):  # the real model is too slow for a unit test
        return tiny_model("llama"), tiny_tokenizer()

    monkeypatch.setattr(loading, "load_model", tiny_load)  # every entry point loads through loading.load_model
    monkeypatch.setattr(api, "check_model", lambda spec: None, raising=False)
    out = tmp_path / "demo"
    assert cli.main(["demo", "--out", str(out), "--nsamples", "2", "--seqlen", "16"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "perplexity" in ln]
    assert len(lines) == 1, lines
    m = re.fullmatch(r"perplexity on self-generated held-out text \[seed 1, calibration seed 0, nonoverlap-16, "
                     r"8 windows; .*SECATEUR_DATA.*\]: dense (\S+), wanda-50% (\S+)", lines[0])
    assert m, lines[0]
    dense, pruned = float(m.group(1)), float(m.group(2))
    assert dense > 1 and pruned > 1 and dense != pruned
    calib = json.loads((out / "secateur-report.json").read_text())["calibration"]
    assert calib["source"] == "self" and calib["seed"] == 0
