"""Pruning time of QK-Wanda relative to Wanda on the same calibration (QK-Wanda paper App. M protocol, CPU).

    nice -n 5 python bench/speed/qk_wanda_speed.py                      # 1 window x 2048 -> 32 x 64, 5 repeats
    python bench/speed/qk_wanda_speed.py --windows 4 --repeats 7 --modes dense-block
    python bench/speed/qk_wanda_speed.py --render                       # rebuild results/speed/qk-wanda-speed.md

Protocol (App. M, adapted): SmolLM2-135M float32, QK-only pruning at 50%: row-wise Wanda on W_Q, W_K versus
shared-budget QK-Wanda (base score), C4 calibration windows (seed 0) cut into 64-token sequences, both
methods in ONE process, alternating order every repeat, the original q/k weights restored outside the
timer before every run; one warm-up run of each method (on 2 sequences) first. A timed run = the whole
engine pass: embedding of the calibration ids, calibration forwards, statistics, scores, stable sorts and
mask selection, zeroing, propagation through the pruned blocks (model loading and tokenization excluded).
Median over repeats per method; ratio = median(QK-Wanda) / median(Wanda). Engine modes:

``dense-block``  the paper's Alg. 1 for both methods: dense block forward, select, zero, re-run the pruned
                 block; QK-Wanda takes Q/K from the dense forward (hooks on q_proj/k_proj).
``sequential``   one forward per block; q/k are pruned before the attention runs, so QK-Wanda recomputes
                 Q, K from X (two extra projections per chunk).

The machine is shared (2 cores, other jobs running): load averages are recorded before and after.
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
from bench.common import RESULTS, calib_tokens, fmt, results_dir, stamped

OUT_JSON = results_dir("speed") / "qk-wanda-speed.json"
OUT_MD = results_dir("speed") / "qk-wanda-speed.md"


def measure(windows: int, segment: int, repeats: int, modes: list[str], sparsity: float, chunk: int) -> dict:
    from secateur.methods.qk_wanda import QKWandaConfig, prune_qk_wanda, segment_calibration
    from secateur.methods.unstructured import UnstructuredConfig, prune_unstructured
    from secateur.models.adapters import get_adapter
    from secateur.models.loading import load_model
    from secateur.runinfo import machine, versions

    torch.backends.cuda.matmul.allow_tf32 = False
    model, tok = load_model("smollm2-135m")
    adapter = get_adapter(model)
    ids, manifest = calib_tokens(tok, "c4", windows, 2048)
    seg, seg_chunk = segment_calibration(ids, segment, chunk)
    qk_keys = [k for k in model.state_dict() if k.endswith(("q_proj.weight", "k_proj.weight"))]
    original = {k: model.state_dict()[k].clone() for k in qk_keys}

    def restore() -> None:
        sd = model.state_dict()
        with torch.no_grad():
            for k, v in original.items():
                sd[k].copy_(v)

    def wanda(x, mode):
        cfg = UnstructuredConfig(method="wanda", sparsity=sparsity, budget="row", targets=frozenset({"q", "k"}))
        return prune_unstructured(model, adapter, x, cfg, mode=mode, chunk_size=seg_chunk, progress=False)

    def qkw(x, mode):
        cfg = QKWandaConfig(sparsity=sparsity, budget="shared", variant="base")
        return prune_qk_wanda(model, adapter, x, cfg, mode=mode, chunk_size=seg_chunk, progress=False)

    methods = {"wanda": wanda, "qk-wanda": qkw}
    out = {"protocol": "qk-wanda-app-m-cpu", "model": "smollm2-135m (float32)", "sparsity": sparsity,
           "calibration": manifest | {"segment_len": segment, "sequences": list(seg.shape)},
           "chunk_sequences": seg_chunk, "repeats": repeats, "versions": versions(), "machine": machine(),
           "loadavg_before": os.getloadavg(), "modes": {}}
    for mode in modes:
        for fn in methods.values():  # warm-up (kernels, allocator), not timed
            restore()
            fn(seg[:2], mode)
        times: dict[str, list[float]] = {n: [] for n in methods}
        phases: dict[str, list[dict]] = {n: [] for n in methods}
        for r in range(repeats):
            order = list(methods) if r % 2 == 0 else list(methods)[::-1]
            for name in order:
                restore()
                t = time.perf_counter()
                res = methods[name](seg, mode)
                times[name].append(time.perf_counter() - t)
                phases[name].append(res.timings)
            print(mode, r, {n: round(v[-1], 2) for n, v in times.items()}, flush=True)
        med = {n: statistics.median(v) for n, v in times.items()}
        out["modes"][mode] = {"times_s": times, "median_s": med, "ratio": med["qk-wanda"] / med["wanda"],
                              "per_repeat_ratio": [q / w for q, w in zip(times["qk-wanda"], times["wanda"])],
                              "engine_phases": phases}
    restore()
    out["loadavg_after"] = os.getloadavg()
    return out


def render() -> None:
    res = json.loads(OUT_JSON.read_text())
    cal = res["calibration"]
    m = res["machine"]
    lines = ["# QK-Wanda pruning time vs Wanda (SmolLM2-135M, CPU)", "",
             "Made by `nice -n 5 python bench/speed/qk_wanda_speed.py` (raw numbers in `qk-wanda-speed.json`).", "",
             f"Protocol (QK-Wanda App. M, adapted to CPU): {res['model']}, QK-only pruning at "
             f"{res['sparsity']:.0%}: row-wise Wanda on W_Q/W_K vs shared-budget QK-Wanda (base score); "
             f"calibration {cal['n']} C4 window(s) x {cal['seqlen']} tokens (seed {cal['seed']}, token sha256 "
             f"`{cal['sha256'][:16]}...`) cut into {cal['sequences'][0]} sequences of {cal['segment_len']} tokens, "
             f"{res['chunk_sequences']} sequences per forward; both methods in one process, alternating order, "
             f"weights restored outside the timer, one warm-up each; {res['repeats']} repeats, median. A run = "
             "embedding + calibration forwards + statistics + scores + stable sorts + zeroing + propagation "
             "through the pruned blocks.", "",
             "| engine mode | Wanda median (s) | QK-Wanda median (s) | ratio of medians (target <= 1.05) | "
             "median of paired per-repeat ratios | per-repeat ratios | QK selection / Wanda selection (median s) |",
             "|---|---:|---:|---:|---:|---|---|"]
    for mode, r in res["modes"].items():
        per = ", ".join(f"{x:.3f}" for x in r["per_repeat_ratio"])
        sel = {n: statistics.median(p.get("prune", 0.0) for p in r["engine_phases"][n]) for n in ("wanda", "qk-wanda")}
        lines.append(f"| {mode} | {fmt(r['median_s']['wanda'], 2)} | {fmt(r['median_s']['qk-wanda'], 2)} | "
                     f"**{r['ratio']:.3f}** | {statistics.median(r['per_repeat_ratio']):.3f} | {per} | "
                     f"{sel['qk-wanda']:.2f} / {sel['wanda']:.2f} |")
    lines += ["", "Paper (A100/H200, Llama 3, 8192 x 64 tokens): ratios 1.004-1.081, means 1.013 (A100) and 1.031 "
              "(H200), in the dense-block procedure (dense forward, select, prune, pruned re-run).", "",
              "`dense-block` is the paper's procedure for both methods (QK-Wanda reuses the q/k projection outputs "
              "of the dense forward). In `sequential` mode (one forward per block, the toolkit's default) the q/k "
              "weights are pruned before the attention runs, so QK-Wanda has to recompute Q and K from X: two "
              "extra projections per chunk, an inherent cost of that mode (about "
              "d (D_Q + D_K) / (per-token block MACs) of a forward).", "",
              f"Machine: {m.get('cpu')}, {m.get('cores')} cores, {m.get('torch_threads')} torch threads, shared "
              f"with other jobs; load average before {fmt(res['loadavg_before'][0], 1)}, after "
              f"{fmt(res['loadavg_after'][0], 1)} (1-min). Versions: {json.dumps(res['versions'])}.", ""]
    OUT_MD.write_text("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--windows", type=int, default=1, help="C4 calibration windows of 2048 tokens")
    ap.add_argument("--segment-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--chunk", type=int, default=1, help="windows' worth of segments per forward")
    ap.add_argument("--modes", default="dense-block,sequential")
    ap.add_argument("--sparsity", type=float, default=0.5)
    ap.add_argument("--render", action="store_true")
    a = ap.parse_args()
    if not a.render:
        res = measure(a.windows, a.segment_len, a.repeats, a.modes.split(","), a.sparsity, a.chunk)
        RESULTS.mkdir(parents=True, exist_ok=True)
        OUT_JSON.write_text(json.dumps(stamped(res), indent=2, default=str))
    render()


if __name__ == "__main__":
    main()
