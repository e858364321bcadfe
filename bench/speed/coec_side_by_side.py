"""RCPU 30% with COEC against RCPU's native compensation, alternated in one session (issue 29 section 3).

    python bench/speed/coec_side_by_side.py --model qwen2.5-0.5b --threads 2
    python bench/speed/coec_side_by_side.py --render

Every side prunes the same float32 HF folder on the same calibration token ids (C4 8 x 512, seed 0: the file
``bench/speed/sparsegpt_side_by_side.calibration`` makes; the report's sha256 must match) with the same selection
(``--method rcpu --sparsity 0.3``, the families preset) and a different compensation: ``native`` (RCPU's left
rotation + global scale), ``coec-r5`` (``--compensation coec --coec-rounds 5``, the row of results/text/families.md),
``coec`` (the paper's 50 rounds). The sides alternate (reversed in odd repeats), each in a fresh process with
``--threads`` torch threads (with more than one, COEC's solves run beside the walk: see
``secateur.methods.compensation_pass.BlockCompensation``). Prune time: the calibration data and prune phases of the
report (model loading and saving excluded); compensation: the summed solve seconds and the seconds the walk waited
for them. WikiText-2 by ``secateur eval ppl`` (2048-token windows, the first ``--windows``). Rows:
results/speed/coec-side-by-side.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: bench.* imports
from bench.common import START_COMMIT, WORK, append_row, fmt, git_commit, read_rows, results_dir, run_logged
from bench.speed.sparsegpt_side_by_side import calibration, wikitext2

OUT_JSON = results_dir("speed") / "coec-side-by-side.jsonl"
OUT_MD = results_dir("speed") / "coec-side-by-side.md"
SIDES = {"native": [], "coec-r5": ["--compensation", "coec", "--coec-rounds", "5"],
         "coec": ["--compensation", "coec"]}


def prune(folder: Path, sha: str, side: str, out: Path, nsamples: int, seqlen: int, log: Path) -> dict:
    cmd = [sys.executable, "-m", "secateur", "prune", "--model", str(folder), "--method", "rcpu", "--sparsity", "0.3",
           *SIDES[side], "--calib", "c4", "--nsamples", str(nsamples), "--seqlen", str(seqlen), "--seed", "0",
           "--out", str(out), "--overwrite", "--quiet"]
    rc, wall = run_logged(cmd, log)
    if rc:
        raise SystemExit(f"secateur prune failed (exit {rc}); see {log}")
    rep = json.loads((out / "secateur-report.json").read_text())
    if rep["calibration"]["sha256"] != sha:
        raise SystemExit(f"secateur calibrated on other tokens ({rep['calibration']['sha256']} != {sha})")
    ph, d = rep["timings"]["phases"], rep["details"]
    summary = d.get("compensation_summary") or {}
    return {"prune_s": ph["calibration_data"] + ph["prune"], "phases": ph, "peak_rss_mb": rep["peak_rss_mb"],
            "compensation_seconds": d.get("compensation_seconds"),
            "compensation_wall_s": (rep["timings"].get("engine") or {}).get("compensation_wall_s"),
            "statistics_memory_mode": (d.get("statistics_memory") or {}).get("mode"),
            "recon_after_mean": {g: s.get("recon_after_mean") for g, s in summary.items()},
            "rounds_mean": {g: s.get("rounds_mean") for g, s in summary.items()},
            "realized_sparsity": (rep.get("realized_sparsity") or {}).get("targeted"), "process_wall_s": wall}


def run(a: argparse.Namespace) -> None:
    folder, calib, sha = calibration(a.model, a.nsamples, a.seqlen)
    base = WORK / "coec-side-by-side" / f"{a.model}-{a.nsamples}x{a.seqlen}"
    base.mkdir(parents=True, exist_ok=True)
    os.environ["OMP_NUM_THREADS"] = str(a.threads)
    for rep in range(a.repeats):
        sides = a.sides.split(",")
        for side in sides if rep % 2 == 0 else sides[::-1]:
            out, log = base / side, base / f"{side}.log"
            load = os.getloadavg()[0]
            got = prune(folder, sha, side, out, a.nsamples, a.seqlen, log)
            row = {"measured_at": git_commit(), "model": a.model, "nsamples": a.nsamples, "seqlen": a.seqlen,
                   "threads": a.threads, "repeat": rep, "side": side, "flags": SIDES[side],
                   "calibration_sha256": sha, "load_before": round(load, 2),
                   "load_after": round(os.getloadavg()[0], 2), **got,
                   "wikitext2": wikitext2(out, a.windows, log), "windows": a.windows}
            append_row(OUT_JSON, row)
            print(f"{side}: {row['prune_s']:.1f} s, WikiText-2 {row['wikitext2']:.2f}", flush=True)
    render()


def render() -> None:
    rows = read_rows(OUT_JSON)
    lines = ["# RCPU 30%: COEC against the native compensation, side by side (issue 29)", "",
             "Made by `python bench/speed/coec_side_by_side.py` (protocol in its docstring; rows in "
             f"`{OUT_JSON.name}`). Ratio = the side's prune time / the native side's of the same repeat, threads "
             "and checkout. Compensation: summed solve seconds / seconds the walk waited for them (with more "
             "than one thread the solves run beside the walk, so the second is smaller).", "",
             "| model | calibration | threads | repeat | side | prune (s) | ratio | compensation (s): solves / "
             "waited | WikiText-2 | peak RSS (MB) | load before / after | measured at |",
             "|---|---|---:|---:|---|---:|---:|---|---:|---:|---|---|"]
    for r in rows:
        mate = next((o for o in rows if o["side"] == "native" and o["repeat"] == r["repeat"]
                     and o["threads"] == r["threads"] and o["model"] == r["model"]
                     and o["measured_at"] == r["measured_at"]), None)
        ratio = r["prune_s"] / mate["prune_s"] if mate and r["side"] != "native" else None
        lines.append(f"| {r['model']} | C4 {r['nsamples']} x {r['seqlen']} | {r['threads']} | {r['repeat']} | "
                     f"{r['side']} | {fmt(r['prune_s'], 1)} | {fmt(ratio, 2)} | "
                     f"{fmt(r['compensation_seconds'], 0)} / {fmt(r['compensation_wall_s'], 0)} | "
                     f"{fmt(r['wikitext2'], 2)} (first {r['windows']} windows) | {fmt(r['peak_rss_mb'], 0)} | "
                     f"{r['load_before']} / {r['load_after']} | `{r['measured_at']}` |")
    OUT_MD.write_text("\n".join(lines) + "\n")
    print(f"wrote {OUT_MD}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--nsamples", type=int, default=8)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--sides", default="native,coec-r5", help=f"comma-separated, from {', '.join(SIDES)}")
    ap.add_argument("--windows", type=int, default=16, help="WikiText-2 windows of 2048 tokens evaluated")
    ap.add_argument("--render", action="store_true")
    a = ap.parse_args()
    render() if a.render else run(a)


if __name__ == "__main__":
    print(f"start commit {START_COMMIT}", flush=True)
    main()
