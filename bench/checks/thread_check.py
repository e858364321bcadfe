"""SparseGPT on SmolLM2 (C4 4 x 128, 50%) with 1 and 2 torch threads: mask bits that differ, and ppl.

Each thread count runs in a fresh process (OMP_NUM_THREADS and torch.set_num_threads both set), saves its
masks, and the parent compares them. Writes results/reliability/thread-check.json (docs/protocols.md, "Determinism
across threads"). ``--ppl-windows N``: WikiText-2 nonoverlap-2048, first N windows (0 = skip).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: bench.* imports
from bench.common import stamped

ROOT = Path(__file__).resolve().parents[2]
WORK = ROOT / "bench" / "_work"


def child(threads: int, out: Path, ppl_windows: int) -> None:
    torch.set_num_threads(threads)
    from secateur.data.windows import calibration_set
    from secateur.methods.unstructured import UnstructuredConfig, prune_unstructured
    from secateur.models.adapters import get_adapter
    from secateur.models.loading import load_model

    model, tok = load_model("smollm2-135m")
    ids, _ = calibration_set("c4", tok, 4, 128, 0)
    t0 = time.perf_counter()
    res = prune_unstructured(model, get_adapter(model), ids, UnstructuredConfig("sparsegpt", 0.5), progress=False)
    row = {"threads": torch.get_num_threads(), "prune_s": round(time.perf_counter() - t0, 1)}
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode() + p.detach().contiguous().numpy().tobytes())
    row["weights_sha256"] = h.hexdigest()
    if ppl_windows:
        from secateur.api import eval_ppl

        row["wikitext2_ppl"] = eval_ppl(model, tokenizer=tok, dataset="wikitext2", max_windows=ppl_windows)["ppl"]
    torch.save(res.masks, out.with_suffix(".pt"))
    out.write_text(json.dumps(row))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", type=int)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--ppl-windows", type=int, default=4)
    ap.add_argument("--label", default="after")
    a = ap.parse_args()
    if a.child:
        return child(a.child, a.out, a.ppl_windows)
    WORK.mkdir(parents=True, exist_ok=True)
    rows = []
    for t in (1, 2):
        out = WORK / f"thread-check-{t}.json"
        env = os.environ | {"OMP_NUM_THREADS": str(t), "MKL_NUM_THREADS": str(t), "TOKENIZERS_PARALLELISM": "false"}
        subprocess.run([sys.executable, __file__, "--child", str(t), "--out", str(out),
                        "--ppl-windows", str(a.ppl_windows)], check=True, env=env)
        rows.append(json.loads(out.read_text()))
    m1, m2 = (torch.load(WORK / f"thread-check-{t}.pt") for t in (1, 2))
    total = sum(v.numel() for v in m1.values())
    flips = sum(int((m1[k] != m2[k]).sum()) for k in m1)
    res = {"label": a.label, "model": "smollm2-135m", "method": "sparsegpt", "sparsity": 0.5,
           "calibration": "c4 4 x 128, seed 0", "ppl_protocol": f"wikitext2 nonoverlap-2048, first {a.ppl_windows}",
           "mask_bits": total, "mask_bits_differing": flips, "fraction_differing": flips / total,
           "weights_equal": rows[0]["weights_sha256"] == rows[1]["weights_sha256"], "runs": rows,
           "cpu": os.uname().machine, "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    path = ROOT / "results" / "reliability" / "thread-check.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    old[a.label] = stamped(res)
    path.write_text(json.dumps(old, indent=1) + "\n")
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
