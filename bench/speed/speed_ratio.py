"""How close pruning comes to its physical limit: one dense forward of the calibration set.

    python bench/speed/speed_ratio.py --nsamples 16 --repeats 3

In one process, alternating so that machine load affects every measurement alike: a dense forward of
the calibration set through the blocks (no LM head: pruning never needs it), then Wanda in the engine's
``sequential`` mode (one forward) and ``dense-block`` mode (the original Wanda order: two forwards),
then SparseGPT. Medians over repeats; the model is reloaded (untimed) before each prune.
Writes results/speed/speed-ratio-{N}x{L}.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: bench.* imports
from bench.common import RESULTS, calib_tokens, results_dir, stamped


def commit() -> str:
    import subprocess

    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nsamples", type=int, default=16)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--runs", default="wanda_sequential,wanda_dense_block,sparsegpt_sequential",
                    help="which prunes to time against the dense forward")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: other jobs may share the cores)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)

    from secateur.methods.unstructured import UnstructuredConfig, prune_unstructured
    from secateur.models.adapters import get_adapter
    from secateur.models.loading import load_model
    from secateur.runinfo import machine, versions

    model, tok = load_model("smollm2-135m")
    ids, manifest = calib_tokens(tok, "c4", a.nsamples, a.seqlen)
    runs: dict[str, list[float]] = {"dense_forward": [], **{k: [] for k in a.runs.split(",")}}
    engine_split: dict[str, dict] = {}
    load_before = os.getloadavg()
    for _ in range(a.repeats):
        model, _tok = load_model("smollm2-135m")
        with torch.no_grad():
            t = time.perf_counter()
            for c in ids.split(8):
                model.base_model(input_ids=c, use_cache=False)
            runs["dense_forward"].append(time.perf_counter() - t)
        for key, method, mode in [r for r in (("wanda_sequential", "wanda", "sequential"),
                                              ("wanda_dense_block", "wanda", "dense-block"),
                                              ("sparsegpt_sequential", "sparsegpt", "sequential"))
                                  if r[0] in a.runs.split(",")]:
            model, _tok = load_model("smollm2-135m")
            t = time.perf_counter()
            res = prune_unstructured(model, get_adapter(model), ids, UnstructuredConfig(method=method, sparsity=0.5),
                                     mode=mode, progress=False)
            runs[key].append(time.perf_counter() - t)
            engine_split[key] = res.timings
    med = {k: statistics.median(v) for k, v in runs.items()}
    ratios = {k: med[k] / med["dense_forward"] for k in med if k != "dense_forward"}
    out = {"calibration": manifest, "repeats": a.repeats, "seconds": runs, "median_s": med,
           "ratio_to_dense_forward": ratios,
           "loadavg_before_after": [load_before, os.getloadavg()],
           "engine_split_last": engine_split, "versions": versions(),
           "machine": machine()}
    RESULTS.mkdir(exist_ok=True)
    blob = json.dumps(stamped(out), indent=2, default=str)
    (results_dir("speed") / f"speed-ratio-{a.nsamples}x{a.seqlen}.json").write_text(blob)
    write_page(a, manifest, med, ratios, out)


def write_page(a: argparse.Namespace, manifest: dict, med: dict, ratios: dict, out: dict) -> None:
    """results/speed/speed-ratio-{N}x{L}.md from the medians and ratios (also printed)."""
    lines = ["# Pruning time against one dense forward of the calibration set", "",
             "Made by `python bench/speed/speed_ratio.py "
             f"--nsamples {a.nsamples} --seqlen {a.seqlen} --repeats {a.repeats} --threads {a.threads} "
             f"--runs {a.runs}` at commit {commit()} (SmolLM2-135M, float32, CPU).",
             f"Calibration: C4 {a.nsamples}x{a.seqlen} (sha256 {manifest['sha256'][:16]}...), seed 0. "
             "Dense forward = the decoder blocks over the calibration set (no LM head). Medians of "
             f"{a.repeats} alternating repeats.", "",
             "| run | median time (s) | ratio to dense forward |", "|---|---:|---:|",
             f"| dense forward | {med['dense_forward']:.1f} | 1.00 |"]
    for k, r in ratios.items():
        lines.append(f"| {k.replace('_', ' ')} | {med[k]:.1f} | {r:.2f} |")
    lb, la = out["loadavg_before_after"]
    lines += ["", f"1-min load average before / after: {lb[0]:.1f} / {la[0]:.1f} (2 cores; other jobs ran beside "
              "this one, which is why the repeats alternate)."]
    lines += ["", f"Target for Wanda: <= 1.5. Machine: {out['machine']['cpu']}, {out['machine']['cores']} cores; "
              f"versions {json.dumps(out['versions'])}.", ""]
    (results_dir("speed") / f"speed-ratio-{a.nsamples}x{a.seqlen}.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
