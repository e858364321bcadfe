"""SparseGPT 50%: secateur against llm-compressor's ``oneshot`` on any model, alternated in one session (issue 29 §3).

    python bench/speed/sparsegpt_side_by_side.py --model qwen2.5-0.5b --nsamples 8 --seqlen 512 --threads 1
    python bench/speed/sparsegpt_side_by_side.py --render

Both sides prune the same float32 HF folder (secateur's cache of the model: ``models.loading.resolve``) on the same
calibration token ids: C4, Wanda's random-long-document rule, seed 0, made by secateur's ``calibration_set`` and
saved to ``bench/_work/calib-<model>-c4-<N>x<L>-seed0.pt``; llm-compressor reads that file (sha256 checked), and
secateur's run must report the same sha256 or the row is refused. The sides alternate (llm-compressor first in even
repeats, secateur first in odd ones), each in a fresh process with the same torch threads. llm-compressor runs in
its own venv (``bench/_work/llmc-venv``, see ``bench/speed/requirements-llmcompressor.txt``) through
``llmcompressor_compare.py --one`` (SparseGPTModifier, dampening 0.01, block 128, sequential pipeline over decoder
layers). Prune time: llm-compressor = its ``oneshot`` call; secateur = calibration data + prune phases of its
report (both exclude model loading and saving). WikiText-2 perplexity of both outputs by the same
``secateur eval ppl`` command (2048-token windows, the first ``--windows``).
Rows: results/speed/sparsegpt-side-by-side.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: bench.* imports
from bench.common import START_COMMIT, WORK, append_row, fmt, git_commit, model_path, read_rows, results_dir, run_logged

OUT_JSON = results_dir("speed") / "sparsegpt-side-by-side.jsonl"
OUT_MD = results_dir("speed") / "sparsegpt-side-by-side.md"
LLMC_PY = WORK / "llmc-venv" / "bin" / "python"
COMPARE = Path(__file__).resolve().parent / "llmcompressor_compare.py"


def calibration(model: str, nsamples: int, seqlen: int) -> tuple[Path, Path, str]:
    """(the model's HF folder, the ids file, its sha256): made once with secateur's own calibration rule."""
    import torch

    from secateur.data.windows import calibration_set
    from secateur.models.loading import resolve

    folder = Path(resolve(model_path(model))[0])
    path = WORK / f"calib-{model}-c4-{nsamples}x{seqlen}-seed0.pt"
    if not path.exists():
        from transformers import AutoTokenizer

        ids, man = calibration_set("c4", AutoTokenizer.from_pretrained(folder), nsamples, seqlen, 0)
        torch.save({"ids": ids, "manifest": man.to_dict()}, path)
    return folder, path, torch.load(path)["manifest"]["sha256"]


def theirs(folder: Path, calib: Path, out: Path, threads: int, log: Path) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        row_file = Path(tmp) / "row.json"
        cmd = [str(LLMC_PY), str(COMPARE), "--one", "sparsegpt-50", "--preset", "quick", "--row-file", str(row_file),
               "--threads", str(threads), "--model-dir", str(folder), "--calib-file", str(calib), "--out-dir", str(out)]
        rc, wall = run_logged(cmd, log)
        if rc:
            raise SystemExit(f"llm-compressor failed (exit {rc}); see {log}")
        rec = json.loads(row_file.read_text())
    return {"prune_s": rec["prune_s"], "prune_cpu_s": rec["prune_cpu_s"], "peak_rss_mb": rec["peak_rss_mb_after_prune"],
            "realized_sparsity": rec["realized_sparsity"], "versions": rec["versions"], "process_wall_s": wall}


# side "secateur-float64": the same CLI run with every SparseGPT solve in float64 (the precision before issue 29),
# to measure what the float32 solves change
FLOAT64 = ("import functools, sys, torch; import secateur.methods.unstructured as u; "
           "u.sparsegpt_prune = functools.partial(u.sparsegpt_prune, dtype=torch.float64); "
           "from secateur.cli import main; sys.exit(main(sys.argv[1:]))")


def ours(model: str, folder: Path, sha: str, out: Path, nsamples: int, seqlen: int, log: Path,
         float64: bool = False) -> dict:
    head = [sys.executable, "-c", FLOAT64] if float64 else [sys.executable, "-m", "secateur"]
    cmd = [*head, "prune", "--model", str(folder), "--method", "sparsegpt", "--sparsity",
           "0.5", "--calib", "c4", "--nsamples", str(nsamples), "--seqlen", str(seqlen), "--seed", "0", "--out",
           str(out), "--overwrite", "--quiet"]
    rc, wall = run_logged(cmd, log)
    if rc:
        raise SystemExit(f"secateur prune failed (exit {rc}); see {log}")
    rep = json.loads((out / "secateur-report.json").read_text())
    if rep["calibration"]["sha256"] != sha:
        raise SystemExit(f"secateur calibrated on other tokens ({rep['calibration']['sha256']} != {sha})")
    ph = rep["timings"]["phases"]
    return {"prune_s": ph["calibration_data"] + ph["prune"], "phases": ph, "peak_rss_mb": rep["peak_rss_mb"],
            "realized_sparsity": rep["realized_sparsity"], "versions": rep["versions"], "process_wall_s": wall,
            "solver_precision": rep["details"].get("solver_precision")}


def wikitext2(out: Path, windows: int, log: Path) -> float:
    res = out / "ppl.json"
    cmd = [sys.executable, "-m", "secateur", "eval", "ppl", "--model", str(out), "--dataset", "wikitext2", "--seqlen",
           "2048", "--max-windows", str(windows), "--json", str(res), "--quiet"]
    rc, _ = run_logged(cmd, log)
    if rc:
        raise SystemExit(f"evaluation failed (exit {rc}); see {log}")
    return json.loads(res.read_text())["ppl"]


def run(a: argparse.Namespace) -> None:
    folder, calib, sha = calibration(a.model, a.nsamples, a.seqlen)
    base = WORK / "side-by-side" / f"{a.model}-{a.nsamples}x{a.seqlen}"
    base.mkdir(parents=True, exist_ok=True)
    os.environ["OMP_NUM_THREADS"] = str(a.threads)
    for rep in range(a.start_repeat, a.start_repeat + a.repeats):  # even: the sides as given; odd: reversed
        sides = a.sides.split(",")
        order = sides if rep % 2 == 0 else sides[::-1]
        for side in order:
            name = side if rep == 0 else f"{side}-r{rep}"  # its own folder: an output holds the eval's ppl.json
            out, log = base / name, base / f"{name}.log"
            load = os.getloadavg()[0]
            got = (theirs(folder, calib, out, a.threads, log) if side == "llm-compressor"
                   else ours(a.model, folder, sha, out, a.nsamples, a.seqlen, log, side == "secateur-float64"))
            row = {"measured_at": git_commit(),
                   "model": a.model, "nsamples": a.nsamples, "seqlen": a.seqlen, "threads": a.threads, "repeat": rep,
                   "side": side, "calibration_sha256": sha, "load_before": round(load, 2),
                   "load_after": round(os.getloadavg()[0], 2), **got,
                   "wikitext2": wikitext2(out, a.windows, log), "windows": a.windows}
            append_row(OUT_JSON, row)
            print(f"{side}: {row['prune_s']:.1f} s, WikiText-2 {row['wikitext2']:.2f}", flush=True)
    render()


def _measured_at(r: dict) -> str:
    """The checkout a row's prune ran: recorded when the row began (``measured_at``), else the one at its write
    (rows before that field: the side ran after the bench started, so the start commit can be older)."""
    return r.get("measured_at") or r.get("commit_at_write") or r.get("commit", "?")


def render() -> None:
    rows = read_rows(OUT_JSON)
    lines = ["# SparseGPT 50%: secateur and llm-compressor side by side (issue 29)", "",
             f"Made by `python bench/speed/sparsegpt_side_by_side.py` (protocol in its docstring; rows in "
             f"`{OUT_JSON.name}`). Time ratio = secateur / llm-compressor of the same repeat.", "",
             "| model | calibration | threads | repeat | side | prune (s) | ratio | WikiText-2 | peak RSS (MB) | "
             "load before / after | measured at |", "|---|---|---:|---:|---|---:|---:|---:|---:|---|---|"]
    for r in rows:
        mate = next((o for o in rows if o["repeat"] == r["repeat"] and o["model"] == r["model"]
                     and o["nsamples"] == r["nsamples"] and o["seqlen"] == r["seqlen"]
                     and o["side"] == "llm-compressor"), None)
        ratio = r["prune_s"] / mate["prune_s"] if mate and r["side"] != "llm-compressor" else None
        lines.append(f"| {r['model']} | C4 {r['nsamples']} x {r['seqlen']} | {r['threads']} | {r['repeat']} | "
                     f"{r['side']} | {fmt(r['prune_s'], 1)} | {fmt(ratio, 2)} | {fmt(r['wikitext2'], 2)} "
                     f"(first {r['windows']} windows) | {fmt(r['peak_rss_mb'], 0)} | {r['load_before']} / "
                     f"{r['load_after']} | `{_measured_at(r)}` |")
    OUT_MD.write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--nsamples", type=int, default=8)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--start-repeat", type=int, default=0, help="number of the first repeat (a later session's pair)")
    ap.add_argument("--sides", default="llm-compressor,secateur",
                    help="in the order of even repeats: llm-compressor, secateur, secateur-float64")
    ap.add_argument("--windows", type=int, default=16, help="WikiText-2 windows of 2048 tokens evaluated")
    ap.add_argument("--render", action="store_true")
    a = ap.parse_args()
    render() if a.render else run(a)


if __name__ == "__main__":
    print(f"start commit {START_COMMIT}", flush=True)
    main()
