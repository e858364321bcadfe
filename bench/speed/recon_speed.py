"""The cost of the compensators' calibration-error diagnostic at 7B widths: the direct form against
:class:`secateur.compensate.base.ReconError` (``W0 C`` formed once), alternated in one process.

Every compensated projection reports ``recon_before`` / ``recon_after`` and the no-worse guard rescores the
weights as cast to the model dtype. The direct form, ``tr(D C D^T) / tr(W0 C W0^T)`` with ``D = W0 - W~ P_K``,
costs two ``d_out x d x d`` products per relative error, three errors per projection: six. ReconError forms
``W0 C`` once; the slice error reads only the pruned columns and each other error one ``d_out x k x k``
product. Problem: a Llama-2-7B down_proj (``d_out`` 4096, ``d`` 11008, 30% of the inputs pruned: ``k`` 7706),
seeded random weights and a random positive definite second moment (float64); the candidate ``W~`` is the
ridge refit (:func:`secateur.compensate.ls_refit`), the way Wanda-sp + LS calls it. Both forms are timed on the
same three errors (slice, refit, refit cast to bfloat16), alternated ``--repeats`` times; the table records
the largest absolute difference of the relative errors (the bound ReconError's docstring states: a few
``d eps``).

    python bench/speed/recon_speed.py            # -> results/speed/recon-speed.json / .md
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: bench.* imports
from bench.common import results_dir, stamped


def direct(w0: torch.Tensor, c: torch.Tensor, kept: torch.Tensor, w_new: torch.Tensor) -> float:
    """The direct form (what every compensator computed before ReconError)."""
    w = w0.to(torch.float64)
    d = w.clone()
    d[:, kept] -= w_new.to(torch.float64)
    return float(((d @ c) * d).sum()) / float(((w @ c) * w).sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d-out", type=int, default=4096)
    ap.add_argument("--d", type=int, default=11008)
    ap.add_argument("--keep", type=float, default=0.7)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    from secateur.compensate import InputStats, ls_refit
    from secateur.compensate.base import ReconError
    from secateur.runinfo import machine, versions

    g = torch.Generator().manual_seed(0)
    x = torch.randn(a.d, 2048, generator=g, dtype=torch.float64)
    c = x @ x.T / 2048 + 0.1 * torch.eye(a.d, dtype=torch.float64)  # full rank, spread spectrum
    del x
    w0 = (0.02 * torch.randn(a.d_out, a.d, generator=g)).to(torch.bfloat16)
    kept = torch.randperm(a.d, generator=g)[: round(a.keep * a.d)].sort().values
    st = InputStats(c)
    w_new = ls_refit(w0, st, kept).weight  # in bfloat16, as written
    cands = [w0[:, kept], w_new.double(), w_new]
    times: dict[str, list[float]] = {"direct": [], "recon_error": []}
    diff = 0.0
    for _ in range(a.repeats):
        t = time.perf_counter()
        ref = [direct(w0, c, kept, wc) for wc in cands]
        times["direct"].append(time.perf_counter() - t)
        t = time.perf_counter()
        r = ReconError(w0, st)
        new = [r.before(kept), r.relative(kept, cands[1]), r.relative(kept, cands[2])]
        times["recon_error"].append(time.perf_counter() - t)
        del r
        diff = max(diff, *(abs(p - q) for p, q in zip(ref, new)))
    row = {"problem": {"d_out": a.d_out, "d": a.d, "kept": int(kept.numel()), "errors": 3},
           "seconds": times, "median_s": {k: sorted(v)[len(v) // 2] for k, v in times.items()},
           "relative_errors": ref, "max_abs_difference": diff, "threads": torch.get_num_threads(),
           "loadavg_1m_before": os.getloadavg()[0], "versions": versions(), "machine": machine()}
    (results_dir("speed") / "recon-speed.json").write_text(json.dumps(stamped(row), indent=1) + "\n")
    m = row["median_s"]
    md = ["# Calibration-error diagnostic: direct form vs ReconError", "",
          "Made by `python bench/speed/recon_speed.py` (`recon-speed.json`): one Llama-2-7B down_proj "
          f"({a.d_out} x {a.d}, {int(kept.numel())} inputs kept), the three errors a compensated projection "
          "reports (slice, ridge refit, refit cast to bfloat16), both forms alternated "
          f"{a.repeats} times in one process, {row['threads']} torch threads, 1-minute load average "
          f"{row['loadavg_1m_before']:.2f} before (above the core count: other jobs shared the cores).", "",
          "| form | seconds (median) | per error |", "|---|---:|---:|",
          f"| direct `tr(D C D^T) / tr(W0 C W0^T)` | {m['direct']:.1f} | {m['direct'] / 3:.1f} |",
          f"| `ReconError` (W0 C once) | {m['recon_error']:.1f} | {m['recon_error'] / 3:.1f} |", "",
          f"Speed-up {m['direct'] / m['recon_error']:.2f}x; the relative errors ({', '.join(f'{v:.6f}' for v in ref)}) "
          f"agree to {diff:.1e} (absolute).", ""]
    (results_dir("speed") / "recon-speed.md").write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
