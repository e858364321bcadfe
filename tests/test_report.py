"""``secateur report``: tables hold the numbers of the runs' JSON, plots exist, bad input exits 2 writing nothing."""

import importlib.util
import json
import math
import re
from pathlib import Path

import pytest
import torch

from secateur.cli import main
from secateur.eval.zeroshot import PROTOCOL as ZS_PROTOCOL
from secateur.safe_write import REPORT_NAME
from secateur.testing import save_tiny

HAS_MPL = importlib.util.find_spec("matplotlib") is not None
WORDS = "the cat sat on a mat and then it ran to the big red house where many dogs live".split()


def _tables(md: str) -> list[tuple[list[str], list[list[str]]]]:
    """Every Markdown table as (headers, rows)."""
    out, block = [], []
    for line in md.splitlines() + [""]:
        if line.startswith("|"):
            block.append([c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]])
        elif block:
            out.append((block[0], block[2:]))
            block = []
    return out


def _table(md: str, first_header: str, contains: str) -> tuple[list[str], dict[str, dict[str, str]]]:
    """The table whose headers include ``contains``, as {first column: {header: cell}}."""
    for headers, rows in _tables(md):
        if headers[0] == first_header and any(contains in h for h in headers):
            return headers, {r[0]: dict(zip(headers, r)) for r in rows}
    raise AssertionError(f"no table with {contains!r}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("report")
    tiny = save_tiny("llama", root / "tiny")
    text = root / "eval.txt"
    rng = __import__("random").Random(0)
    text.write_text(" ".join(rng.choice(WORDS) for _ in range(1200)))
    dirs = {}
    for name, sparsity in (("wanda50", "0.5"), ("wanda70", "0.7")):
        out = root / name
        assert main(["prune", "--model", tiny, "--method", "wanda", "--sparsity", sparsity, "--calib", "self",
                     "--nsamples", "2", "--seqlen", "16", "--quiet", "--out", str(out)]) == 0
        assert main(["eval", "ppl", "--model", str(out), "--dataset", str(text), "--seqlen", "32", "--quiet",
                     "--json", str(out / "ppl.json")]) == 0
        dirs[name] = out
    # QK error of one run (tiny held-out set sampled from the text file), by the CLI
    assert main(["eval", "qk-error", "--model", str(dirs["wanda70"]), "--text", str(text), "--n", "2", "--seqlen",
                 "16", "--stages", "qk", "--quiet", "--json", str(dirs["wanda70"] / "qk-error.json")]) == 0
    # a zero-shot result in the layout of `secateur eval zeroshot --json` (real task data is not needed here)
    tasks = {"boolq": {"metric": "acc", "score": 0.6, "acc": 0.6, "acc_norm": 0.5, "n": 10},
             "hellaswag": {"metric": "acc_norm", "score": 0.3, "acc": 0.2, "acc_norm": 0.3, "n": 10}}
    se = 100 / 2 * math.sqrt(0.6 * 0.4 / 10 + 0.3 * 0.7 / 10)
    zs = {"protocol": ZS_PROTOCOL, "tasks": tasks, "settings": {"limit": 10, "strategy": "packed"},
          "summary": {"tasks": list(tasks), "is_suite7": False, "mean": 45.0, "se": se}}
    (dirs["wanda50"] / "zeroshot.json").write_text(json.dumps(zs))
    (dirs["wanda50"] / "notes.json").write_text(json.dumps({"hello": 1}))  # unrelated: ignored, listed
    return root, dirs


def _read(folder: Path, name: str) -> dict:
    return json.loads((folder / name).read_text())


def test_report_tables_match_the_json(runs, capsys):
    root, dirs = runs
    rep = root / "rep"
    assert main(["report", str(dirs["wanda50"]), str(dirs["wanda70"]), "--out", str(rep), "--title", "T1"]) == 0
    md = (rep / "report.md").read_text()
    page = (rep / "report.html").read_text()
    assert md.startswith("# T1") and "<title>T1</title>" in page

    ppl = {n: _read(d, "ppl.json") for n, d in dirs.items()}
    assert ppl["wanda50"]["protocol"] == "nonoverlap-32"
    header = f"eval.txt PPL [nonoverlap-32, all {ppl['wanda50']['windows']} windows]"
    headers, rows = _table(md, "run", header)
    assert list(rows) == ["wanda50", "wanda70"]  # by target sparsity
    for name, d in dirs.items():
        r = _read(d, REPORT_NAME)
        row = rows[name]
        assert row["method"] == "wanda"
        assert row["sparsity"] == f"{100 * r['target_sparsity']:.4g}%"
        assert row[header] == f"{ppl[name]['ppl']:.3f}"
        assert row["realized sparsity (targeted)"] == f"{100 * r['realized_sparsity']['targeted']:.2f}%"
        assert row["realized (all params)"] == f"{100 * r['realized_sparsity']['of_all_parameters']:.2f}%"
        assert row["prune time (s)"] == f"{r['timings']['phases']['prune']:.2f}"
        assert row["peak RSS (MiB)"] == f"{r['peak_rss_mb']:.0f}"
        assert f"{ppl[name]['ppl']:.3f}" in page
        assert r["calibration"]["sha256"] in md and r["calibration"]["sha256"] in page

    # method x sparsity pivot
    _, pivot = _table(md, "method", "70%")
    assert pivot["wanda"]["50%"] == f"{ppl['wanda50']['ppl']:.3f}"
    assert pivot["wanda"]["70%"] == f"{ppl['wanda70']['ppl']:.3f}"

    # zero-shot: per task x 100 and mean +- SE
    zs = _read(dirs["wanda50"], "zeroshot.json")
    _, zrows = _table(md, "run", "boolq (acc)")
    assert list(zrows) == ["wanda50"]
    assert zrows["wanda50"]["boolq (acc)"] == "60.00" and zrows["wanda50"]["hellaswag (acc_norm)"] == "30.00"
    assert zrows["wanda50"]["mean ± SE"] == f"{zs['summary']['mean']:.2f} ± {zs['summary']['se']:.2f}"

    # QK error
    qk = _read(dirs["wanda70"], "qk-error.json")
    _, qrows = _table(md, "run", "rel. QK error (%)")
    assert qrows["wanda70"]["rel. QK error (%)"] == f"{qk['e_qk']:.4f}"
    al = qk["removal"]
    assert qrows["wanda70"]["mean Q / K removed (%)"] == f"{100 * al['mean_rho_q']:.2f} / {100 * al['mean_rho_k']:.2f}"

    # manifests: protocol ids with windows, versions; the unrelated JSON is listed as ignored
    _, prow = _table(md, "run", "scored tokens")
    assert prow["wanda50"]["protocol"] == "nonoverlap-32"
    assert prow["wanda50"]["scored tokens"] == f"{ppl['wanda50']['scored_tokens']:,}"
    _, inputs = _table(md, "run", "ignored")
    assert inputs["wanda50"]["ignored"] == "notes.json"
    assert "zeroshot.json" in inputs["wanda50"]["files read"] and "qk-error.json" in inputs["wanda70"]["files read"]
    assert f"torch {_read(dirs['wanda50'], REPORT_NAME)['versions']['torch']}" in md

    # plots: files next to the Markdown, the same PNGs embedded in the HTML
    linked = re.findall(r"!\[[^\]]*\]\((plots/[^)]+)\)", md)
    if not HAS_MPL:
        assert not linked and "Plots skipped" in md
        return
    names = sorted(p.name for p in (rep / "plots").iterdir())
    assert sorted(Path(x).name for x in linked) == names
    assert len([n for n in names if n.startswith("ppl-vs-sparsity-")]) == 1
    assert len([n for n in names if n.startswith("allocation-")]) == 2
    assert "qk-error-per-block.png" in names and "qk-removal-per-block.png" in names
    for n in names:
        assert (rep / "plots" / n).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert page.count('src="data:image/png;base64,') == len(names)
    assert "wrote" in capsys.readouterr().out


def test_structured_run_kept_widths(runs):
    root, _ = runs
    out = root / "sp"
    assert main(["prune", "--model", str(root / "tiny"), "--method", "wanda", "--structured", "--compensation", "ls",
                 "--calib", "self", "--nsamples", "2", "--seqlen", "16", "--quiet", "--out", str(out)]) == 0
    rep = root / "rep-sp"
    assert main(["report", str(out), "--out", str(rep)]) == 0
    md = (rep / "report.md").read_text()
    d = _read(out, REPORT_NAME)["details"]
    _, rows = _table(md, "run", "params after")
    assert rows["sp"]["params before"] == f"{d['params_before']:,}"
    assert rows["sp"]["params after"] == f"{d['params_after']:,}"
    _, layers = _table(md, "layer", "attn_out")
    for rec in d["per_layer"]:
        assert layers[str(rec["layer"])][rec["group"]] == f"{rec['kept']}/{rec['width']}"


def test_jsonl_rows_latest_wins(tmp_path):
    calib = {"source": "c4", "n": 2, "seqlen": 256, "seed": 0, "sha256": "ab" * 32}
    w2 = {"protocol": "nonoverlap-2048", "windows": 2, "windows_total": 148, "scored_tokens": 4094}
    rows = [
        {"row": "dense", "preset": "smoke", "calibration": calib, "wikitext2": {**w2, "ppl": 15.0}},
        {"row": "wanda-50", "preset": "smoke", "calibration": calib, "wikitext2": {**w2, "ppl": 99.0}, "prune_s": 5},
        {"row": "wanda-50", "preset": "smoke", "calibration": calib, "wikitext2": {**w2, "ppl": 20.5},
         "realized_sparsity": 0.5, "prune_s": 12.25, "peak_rss_mb": 1000.4},
        {"row": "wanda-50", "preset": "other", "wikitext2": {**w2, "ppl": 1.0}},
        {"kind": "qk-error", "row": "wanda-50", "preset": "smoke", "e_qk": 12.5, "per_block": [10.0, 15.0]},
    ]
    path = tmp_path / "bench.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    rep = tmp_path / "rep"
    assert main(["report", str(path), "--preset", "smoke", "--out", str(rep)]) == 0
    md = (rep / "report.md").read_text()
    col = "WikiText-2 PPL [nonoverlap-2048, first 2/148 windows]"
    _, t = _table(md, "run", col)
    assert list(t) == ["dense", "wanda-50"]
    assert t["dense"][col] == "15.000" and t["dense"]["sparsity"] == "0%"
    assert t["wanda-50"][col] == "20.500" and t["wanda-50"]["sparsity"] == "50%"
    assert t["wanda-50"]["prune time (s)"] == "12.25" and t["wanda-50"]["peak RSS (MiB)"] == "1000"
    _, q = _table(md, "run", "rel. QK error (%)")
    assert q["wanda-50"]["rel. QK error (%)"] == "12.5000"
    assert "99.000" not in md and "1.000" not in md.split("## Protocols")[0]


def _bad_inputs(tmp: Path, runs_dir: Path) -> dict[str, list[str]]:
    (tmp / "empty").mkdir()
    (tmp / "bad.jsonl").write_text('{"row": "a"}\n{not json\n')
    (tmp / "rows.jsonl").write_text('{"hello": 1}\n')
    broken = tmp / "broken"
    broken.mkdir()
    (broken / REPORT_NAME).write_text((runs_dir / REPORT_NAME).read_text())
    (broken / "ppl.json").write_text('{"ppl": ')
    (tmp / "x.json").write_text("{}")
    return {"no secateur-report.json": [str(tmp / "empty")], "does not exist": [str(tmp / "missing")],
            "invalid JSON": [str(tmp / "bad.jsonl")], "no result rows": [str(tmp / "rows.jsonl")],
            "ppl.json: invalid JSON": [str(broken)], "not a secateur prune output": [str(tmp / "x.json")]}


@pytest.mark.parametrize("case", ["no secateur-report.json", "does not exist", "invalid JSON", "no result rows",
                                  "ppl.json: invalid JSON", "not a secateur prune output"])
def test_bad_input_exits_2_and_writes_nothing(runs, tmp_path, capsys, case):
    _, dirs = runs
    args = _bad_inputs(tmp_path, dirs["wanda50"])[case]
    before = sorted(p.name for p in tmp_path.iterdir())
    out = tmp_path / "rep"
    assert main(["report", str(dirs["wanda50"]), *args, "--out", str(out)]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("secateur: error:") and case in err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no report folder, no temporary left behind


def test_existing_out_and_out_over_an_input_are_refused(runs, tmp_path, capsys):
    _, dirs = runs
    out = tmp_path / "rep"
    out.mkdir()
    assert main(["report", str(dirs["wanda50"]), "--out", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err and list(out.iterdir()) == []
    files = sorted(p.name for p in dirs["wanda50"].iterdir())
    assert main(["report", str(dirs["wanda50"]), "--out", str(dirs["wanda50"]), "--overwrite"]) == 2
    assert "would replace the input" in capsys.readouterr().err
    assert sorted(p.name for p in dirs["wanda50"].iterdir()) == files


def test_schema_version_written_and_older_runs_read(runs, tmp_path, capsys):
    """The prune report, the eval JSON and the report index carry SCHEMA_VERSION; a run without it (written
    before it existed) reads as before; a newer schema is refused, not misread."""
    import shutil

    from secateur.runinfo import SCHEMA_VERSION
    from secateur.safe_write import REPORT_INDEX

    _, dirs = runs
    assert isinstance(SCHEMA_VERSION, int) and SCHEMA_VERSION >= 1
    assert _read(dirs["wanda50"], REPORT_NAME)["schema_version"] == SCHEMA_VERSION
    assert _read(dirs["wanda50"], "ppl.json")["schema_version"] == SCHEMA_VERSION
    rep = tmp_path / "rep"
    assert main(["report", str(dirs["wanda50"]), "--out", str(rep)]) == 0
    assert _read(rep, REPORT_INDEX)["schema_version"] == SCHEMA_VERSION
    md = (rep / "report.md").read_text()

    old = tmp_path / "wanda50"  # the same run as an older secateur wrote it: no schema_version anywhere
    shutil.copytree(dirs["wanda50"], old)
    for name in (REPORT_NAME, "ppl.json"):
        doc = _read(old, name)
        del doc["schema_version"]
        (old / name).write_text(json.dumps(doc))
    assert main(["report", str(old), "--out", str(tmp_path / "rep-old")]) == 0
    assert (tmp_path / "rep-old" / "report.md").read_text() == md.replace(str(dirs["wanda50"]), str(old))

    for name in (REPORT_NAME, "ppl.json"):  # a newer schema in either file: refused, nothing written
        doc = _read(old, name)
        (old / name).write_text(json.dumps(doc | {"schema_version": SCHEMA_VERSION + 1}))
        capsys.readouterr()
        assert main(["report", str(old), "--out", str(tmp_path / "rep-new")]) == 2
        err = capsys.readouterr().err
        assert f"{name}: schema_version {SCHEMA_VERSION + 1} is newer" in err and not (tmp_path / "rep-new").exists()
        (old / name).write_text(json.dumps(doc))


def test_peak_rss_is_the_process_own_not_its_parents():
    """A command started by a parent that once held a lot of memory reports its own peak (Linux ``ru_maxrss`` is
    inherited across fork and kept across exec; ``VmHWM`` is not)."""
    import subprocess
    import sys

    code = ("import sys; b = bytearray(600 * 2**20); b[::4096] = b'x' * len(b[::4096]); del b; import subprocess; "
            "print(subprocess.run([sys.executable, '-c', 'from secateur.runinfo import peak_rss_mb; "
            "print(peak_rss_mb())'], capture_output=True, text=True, check=True).stdout)")
    child_peak = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                      check=True).stdout.strip())
    assert child_peak < 400, child_peak  # a bare interpreter importing secateur.runinfo: far below the parent's 600
