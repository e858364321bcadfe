"""``secateur report`` from fixed inputs is byte-identical to a stored golden report (tests/golden/).

The inputs exercise every section (perplexity with a pivot and plots, zero-shot, structured widths, per-layer
allocation, QK error, manifests) and both input kinds (run folders and a bench JSONL file). The golden files
were written by the code before issue 15 split ``report`` into modules; the HTML is compared with the base64
PNG data replaced by "..." (plot bytes depend on the matplotlib version), the Markdown exactly
(only the secateur version in its first paragraph is normalized).
"""

import importlib.util
import json
import re
from pathlib import Path

import pytest

GOLDEN = Path(__file__).parent / "golden"
HAS_MPL = importlib.util.find_spec("matplotlib") is not None
VERSIONS = {"secateur": "0.0.0", "torch": "2.0.0", "transformers": "5.0.0", "python": "3.12.0"}
MACHINE = {"cpu": "Test CPU", "cores": 2, "torch_threads": 1, "cuda": None, "platform": "Linux-test"}
CALIB = {"source": "c4", "n": 4, "seqlen": 64, "seed": 0, "rule": "random-windows", "sha256": "ab" * 32}
PPL = {"dataset": "wikitext2", "protocol": "nonoverlap-64", "windows": 10, "windows_total": 10,
       "scored_tokens": 630, "tokens_sha256": "cd" * 32}


def _report(method: str, sparsity: float, **extra) -> dict:
    rep = {"method": method, "kind": "unstructured", "model": "tiny", "target_sparsity": sparsity, "pattern": None,
           "options": {"method": method, "sparsity": sparsity, "compensation": "none"},
           "realized_sparsity": {"targeted": sparsity + 0.001, "of_all_parameters": sparsity * 0.7,
                                 "per_module": {f"model.layers.{i}.mlp.{r}_proj": sparsity + 0.01 * i
                                                for i in range(3) for r in ("up", "down")}},
           "calibration": CALIB, "timings": {"phases": {"prune": 1.25 + sparsity}}, "peak_rss_mb": 812.4,
           "versions": VERSIONS, "machine": MACHINE, "details": {}}
    return rep | extra


def _write(folder: Path, files: dict[str, dict]) -> Path:
    folder.mkdir(parents=True)
    for name, doc in files.items():
        (folder / name).write_text(json.dumps(doc, indent=1))
    return folder


def golden_inputs(root: Path) -> list[str]:
    """Two unstructured run folders, one structured folder and a bench JSONL file, under ``root``; returns the
    inputs relative to ``root`` (so the report's source column does not depend on where it runs)."""
    qk = {"protocol": "qk-error-eq49", "e_qk": 12.3456, "e_logits": 3.25, "per_block": [10.0, 12.5, 14.8],
          "heldout": {"source": "wikitext2", "n": 2, "seqlen": 32, "seed": 7, "sha256": "ef" * 32},
          "removal": {"mean_rho_q": 0.55, "mean_rho_k": 0.45,
                      "per_block": [{"block": i, "rho_q": 0.5 + 0.05 * i, "rho_k": 0.5 - 0.05 * i} for i in range(3)]}}
    zs = {"protocol": "zeroshot-lmeval-mc-0shot", "settings": {"limit": 10, "strategy": "packed"},
          "data": {"sha256": {"boolq": "00"}},
          "tasks": {"boolq": {"metric": "acc", "score": 0.6, "n": 10},
                    "hellaswag": {"metric": "acc_norm", "score": 0.3, "n": 10}},
          "summary": {"tasks": ["boolq", "hellaswag"], "mean": 45.0, "se": 10.6}}
    _write(root / "wanda50", {"secateur-report.json": _report("wanda", 0.5), "ppl.json": PPL | {"ppl": 31.4159},
                              "zeroshot.json": zs, "notes.json": {"hello": 1}})
    _write(root / "wanda70", {"secateur-report.json": _report("sparsegpt", 0.7), "ppl.json": PPL | {"ppl": 77.125},
                              "qk-error.json": qk})
    per_layer = [{"layer": i, "group": g, "kept": k, "width": w} for i in range(3)
                 for g, k, w in (("attn_out", 24 - 4 * i, 32), ("mlp_down", 48 - 8 * i, 64))]
    st = _report("wanda", 0.3, kind="structured", details={"params_before": 100000, "params_after": 71234,
                                                          "removed_blocks": [2], "per_layer": per_layer})
    st["realized_sparsity"] = {"targeted": 0.3, "of_all_parameters": None, "per_module": {"0": 0.2, "1": 0.3}}
    _write(root / "struct30", {"secateur-report.json": st, "ppl.json": PPL | {"ppl": 55.5}})
    rows = [{"row": "dense", "preset": "p", "calibration": CALIB, "wikitext2": PPL | {"ppl": 20.0}},
            {"row": "magnitude-50", "preset": "p", "wikitext2": PPL | {"ppl": 40.0}, "prune_s": 0.5},
            {"row": "2:4-wanda", "method": "wanda", "pattern": "2:4", "preset": "p",
             "c4": {"protocol": "nonoverlap-64", "windows": 2, "windows_total": 5, "ppl": 90.0}},
            {"kind": "qk-error", "row": "magnitude-50", "preset": "p", "e_qk": 20.5, "per_block": [19.0, 22.0]}]
    (root / "bench.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return ["wanda50", "wanda70", "struct30/secateur-report.json", "bench.jsonl"]


def normalize_html(page: str) -> str:
    return re.sub(r'src="data:image/png;base64,[^"]*"', 'src="data:image/png;base64,..."', page)


def normalize_md(md: str) -> str:
    return re.sub(r"\(secateur [^)]*\)", "(secateur VERSION)", md, count=1)


@pytest.mark.skipif(not HAS_MPL, reason="the golden report has plots (matplotlib)")
def test_report_is_byte_identical_to_golden(tmp_path, monkeypatch):
    from secateur.cli import main

    monkeypatch.chdir(tmp_path)
    inputs = golden_inputs(tmp_path)
    assert main(["report", *inputs, "--out", "rep", "--title", "golden"]) == 0
    md = (tmp_path / "rep" / "report.md").read_text()
    page = (tmp_path / "rep" / "report.html").read_text()
    assert normalize_md(md) == (GOLDEN / "report.md").read_text()
    assert normalize_html(normalize_md(page)) == (GOLDEN / "report.html").read_text()
    plots = sorted(p.name for p in (tmp_path / "rep" / "plots").iterdir())
    assert plots == (GOLDEN / "plots.txt").read_text().split()
