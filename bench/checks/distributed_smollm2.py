"""SmolLM2-135M pruned in 1 and 2 processes: the same bits, and what the split costs or saves (issue 28).

    python bench/checks/distributed_smollm2.py        # -> results/distributed.md (+ .json)

Each run is the CLI (``secateur prune ... --procs N``; N = 1 runs without torch.distributed) on C4 8 x 512
(seed 0), Wanda 50% and SparseGPT 2:4; the export's weights and masks are hashed as ``bench/checks/digests.py`` does.
Wall time of the whole command (start-up, loading, calibration, prune, save) and rank 0's peak RSS (its report).
The machine's load is recorded: on a loaded machine the seconds are indicative, the digests are not.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: bench.* imports
from bench.checks.digests import folder_digest
from bench.common import rerunnable, stamped

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "results" / "distributed.json"
RUNS = {"wanda-50": ["--method", "wanda", "--sparsity", "0.5"], "sparsegpt-2:4": ["--method", "sparsegpt",
                                                                                   "--pattern", "2:4"]}


def main() -> None:
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for name, args in RUNS.items():
            for procs in (1, 2):
                out = Path(d) / f"{name}-{procs}"
                cmd = [sys.executable, "-m", "secateur", "prune", "--model", "smollm2-135m", *args, "--calib", "c4",
                       "--nsamples", "8", "--seqlen", "512", "--seed", "0", "--quiet", "--out", str(out)]
                if procs > 1:
                    cmd += ["--procs", str(procs)]
                load = os.getloadavg()[0]
                t = time.monotonic()
                subprocess.run(cmd, check=True, capture_output=True, env=os.environ | {"OMP_NUM_THREADS": "1"})
                wall = time.monotonic() - t
                rep = json.loads((out / "secateur-report.json").read_text())
                w, m = folder_digest(out)
                rows.append({"run": name, "procs": procs, "wall_s": round(wall, 1), "load_1min": round(load, 2),
                             "peak_rss_mb_rank0": rep.get("peak_rss_mb"), "weights_sha256": w[:16],
                             "masks_sha256": m[:16]})
                print(rows[-1], flush=True)
    rec = {"command": "python bench/checks/distributed_smollm2.py", "threads_per_process": 1,
           "rows": rows}
    rec = stamped(rec)
    OUT.write_text(json.dumps(rec, indent=1) + "\n")
    render(rec)


def render(rec: dict) -> None:
    lines = ["# Pruning in several processes: SmolLM2-135M at 1 and 2 processes (issue 28)", "",
             f"`{rerunnable(rec['command'])}` at {rec['commit']}; C4 8 x 512 (seed 0), one thread per process (2 "
             f"cores), "
             "gloo. Wall = the whole command; peak RSS of rank 0 from its report.", "",
             "| run | processes | wall (s) | load (1 min) | peak RSS rank 0 (MB) | weights sha256 | masks sha256 |",
             "|---|---|---|---|---|---|---|"]
    for r in rec["rows"]:
        lines.append(f"| {r['run']} | {r['procs']} | {r['wall_s']} | {r['load_1min']} | {r['peak_rss_mb_rank0']:.0f} | "
                     f"`{r['weights_sha256']}` | `{r['masks_sha256']}` |")
    same = all(a["weights_sha256"] == b["weights_sha256"] and a["masks_sha256"] == b["masks_sha256"]
               for a, b in zip(rec["rows"][::2], rec["rows"][1::2], strict=True))
    lines += ["", f"Digests at 2 processes equal to 1 process: **{'yes' if same else 'NO'}**. "
              "Each rank holds the whole model, so the per-rank peak is about the single process's; the split "
              "saves calibration activations (1/N per rank) and forward time, and costs one broadcast of every "
              "chunk's statistics. **Slower at 2 processes here**, for two reasons the rows cannot separate: the "
              "two cores were already running the CoCurve medium benchmark's two lanes (load 2-3 before each run: "
              "4 busy processes on 2 cores at N = 2), and every rank repeats every decision (SparseGPT's OBS solves "
              "run on both ranks: the round-robin owner is not built yet), so only the forwards are split. The "
              "speed of a split is to be measured on a quiet machine or on GPUs; what this page shows is the "
              "guarantee. The 7B-shaped streamed row is not measured: `--stream` is not yet split."]
    OUT.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    if sys.argv[1:] == ["--render"]:
        render(json.loads(OUT.read_text()))
    else:
        main()
