"""Where a SparseGPT (or COEC) prune spends its time (issue 29 §1): one ``api.prune`` under cProfile, its seconds
grouped into stages, each with its arithmetic and achieved GFLOP/s against this machine's measured matmul rate.

    python bench/speed/solver_profile.py --model smollm2-135m --nsamples 8 --seqlen 2048
    python bench/speed/solver_profile.py --model qwen2.5-0.5b --nsamples 8 --seqlen 512
    python bench/speed/solver_profile.py --model qwen2.5-0.5b --nsamples 8 --seqlen 512 --method rcpu --sparsity 0.3 \
        --compensation coec
    python bench/speed/solver_profile.py --render

Stages (exclusive seconds of the functions named, from the profile's per-function self time, so nothing counts
twice): forward (the blocks' own kernels: linear, attention, norms, activations), statistics (Gram and norm
accumulation), factorization (Cholesky, its inverse, eigendecompositions, solves), solver loop (the OBS loop's
Python and small kernels), selection (sort, top-k), copies and casts, other. The machine rate is the best of 5
float32 and float64 matmuls of 2048 x 2048 on this process's threads. Rows: results/speed/solver-profile.jsonl, page
results/speed/solver-profile.md. ``qwen2.5-0.5b`` is the GGUF ``bench/tools/get_models.py`` assembles.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: bench.* imports
from bench.common import append_row, model_path, read_rows, results_dir

OUT_JSON = results_dir("speed") / "solver-profile.jsonl"
OUT_MD = results_dir("speed") / "solver-profile.md"

# stage <- substrings of a profile entry (file:function or the built-in's name); first match wins
STAGES = [
    ("factorization", ("linalg_cholesky", "_tri_inv_upper", "chol_inverse_upper", "cholesky_inverse",
                       "linalg_eigh", "linalg_solve", "linalg_inv", "cholesky_solve", "triangular_solve", "linalg_svd",
                       "linalg_qr")),
    ("statistics", ("stats.py", "addmm_", "baddbmm")),
    ("selection", ("sort", "topk", "argsort", "kthvalue")),
    ("copies and casts", ("'to' of", "clone", "copy_", "contiguous", "method 'float'", "method 'double'")),
    ("forward", ("torch._C._nn.linear", "scaled_dot_product", "silu", "rms_norm", "layer_norm", "softmax",
                 "torch.matmul", "method 'matmul'", "rotary", "modeling_")),
    ("solver loop", ("sparsegpt.py", "coec", "compensate/")),
    ("calibration data", ("tokenizers", "windows.py", "tokenization_", "parquet", "pyarrow")),
    ("load and save", ("safetensors", "gguf", "serialization", "loading.py", "safe_write", "marshal", "_imp.")),
]


def machine_rate(threads: int) -> dict:
    """GFLOP/s of a 2048^3 matmul, best of 5, float32 and float64."""
    out = {}
    for dt in (torch.float32, torch.float64):
        a, b = torch.randn(2048, 2048, dtype=dt), torch.randn(2048, 2048, dtype=dt)
        best = min(_timed(torch.mm, a, b) for _ in range(5))
        out[str(dt).split(".")[1]] = round(2 * 2048**3 / best / 1e9, 1)
    return out | {"threads": threads}


def _timed(fn, *args) -> float:
    t = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t


def stage_of(key: tuple) -> str:
    file, _, func = key
    return _stage_of_name(f"{file}:{func}")


def _stage_of_name(name: str) -> str:
    for stage, needles in STAGES:
        if any(n in name for n in needles):
            return stage
    return "other"


def flops(model, nsamples: int, seqlen: int) -> dict:
    """The arithmetic of a SparseGPT prune (per block summed): forward 2 P T; Grams T d_in^2 per distinct input
    (q/k/v share one, gate/up one); factorization ~ (2/3) d_in^3 per projection (a Cholesky and a triangular
    inverse: ``linalg.chol_inverse_upper``); OBS lazy-batch updates ~ d_out d_in^2 per projection."""
    tokens = nsamples * seqlen
    fwd = gram = fact = obs = 0
    for layer in model.model.layers:
        lin = {n: m for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear)}
        fwd += 2 * tokens * sum(m.weight.numel() for m in lin.values())
        inputs = {}
        for n, m in lin.items():
            key = "qkv" if n.split(".")[-1] in ("q_proj", "k_proj", "v_proj") else (
                "gu" if n.split(".")[-1] in ("gate_proj", "up_proj") else n)
            inputs[key] = m.in_features
            obs += m.out_features * m.in_features ** 2
            fact += 2 * m.in_features**3 // 3
        gram += sum(tokens * d * d for d in inputs.values())
    return {"forward": fwd, "statistics": gram, "factorization": fact, "solver loop": obs}


def run(args) -> None:
    from secateur import api
    from secateur.runinfo import machine, versions

    torch.set_num_threads(args.threads)
    rate = machine_rate(args.threads)
    load_before = os.getloadavg()
    kw = dict(model=model_path(args.model), method=args.method, sparsity=args.sparsity, calib="c4",
              nsamples=args.nsamples, seqlen=args.seqlen, quiet=True)
    if args.compensation:
        kw["compensation"] = args.compensation
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    res = api.prune(**kw)
    prof.disable()
    wall = time.perf_counter() - t
    stats = pstats.Stats(prof)
    stages: dict[str, float] = {}
    top = []
    for key, (_cc, _nc, tt, _ct, _callers) in stats.stats.items():
        s = stage_of(key)
        stages[s] = stages.get(s, 0.0) + tt
        top.append((tt, f"{os.path.basename(key[0])}:{key[2]}", s))
    top.sort(reverse=True)
    work = flops(res.model, args.nsamples, args.seqlen) if args.method == "sparsegpt" else {}
    row = {"key": f"{args.model}/{args.method}/{args.sparsity}/{args.compensation}/{args.nsamples}x{args.seqlen}",
           "model": args.model, "method": args.method, "sparsity": args.sparsity, "compensation": args.compensation,
           "nsamples": args.nsamples, "seqlen": args.seqlen, "threads": args.threads, "wall_s": round(wall, 1),
           "stages_s": {k: round(v, 2) for k, v in sorted(stages.items(), key=lambda kv: -kv[1])},
           "top": [[round(tt, 2), name, s] for tt, name, s in top[:25]], "flop": work, "flop_version": 2,
           "machine_gflops": rate,
           "load_before": [round(x, 2) for x in load_before],
           "load_after": [round(x, 2) for x in os.getloadavg()], "machine": machine(), "versions": versions(),
           "report_phases": res.report.get("timings", {}).get("phases")}
    append_row(OUT_JSON, row)
    print(json.dumps({k: row[k] for k in ("key", "wall_s", "stages_s", "machine_gflops")}, indent=1))


def render() -> None:
    rows = read_rows(OUT_JSON)
    L = ["# Where the solver time goes (issue 29 §1)\n",
         "Made by `python bench/speed/solver_profile.py` (rows in `solver-profile.jsonl`): one `api.prune` under "
         "cProfile; "
         "exclusive (self) seconds of every function, grouped into stages by name (the groups in the script's "
         "`STAGES`); the profiler's own overhead lands in the Python-heavy stages (solver loop, other). "
         "GFLOP/s: the stage's arithmetic (formulas in `flops()`) over its seconds, against the machine's "
         "best 2048^3 matmul rate on the same threads.\n"]
    for r in rows:
        r["stages_s"] = _restaged(r)
        if r.get("flop") and r.get("flop_version") != 2:  # first rows: 4d^3/3 per distinct input (the factorization
            r["flop"]["factorization"] //= 2              # before chol_inverse_upper); 2d^3/3 is what ran (q/k/v and
                                                          # gate/up factorized apart add < 2% on these models)
        L.append(f"## {r['key']}\n")
        L.append(f"Commit `{r['commit']}`, {r['machine'].get('cpu', '?') if isinstance(r['machine'], dict) else '?'}"
                 f", {r['threads']} thread(s), load {r['load_before'][0]} before / {r['load_after'][0]} after; "
                 f"wall {r['wall_s']} s; machine matmul rate float32 {r['machine_gflops']['float32']} GFLOP/s, "
                 f"float64 {r['machine_gflops']['float64']} GFLOP/s.\n")
        L += ["| stage | seconds | share | arithmetic (GFLOP) | achieved GFLOP/s |", "|---|---:|---:|---:|---:|"]
        total = sum(r["stages_s"].values())
        for s, sec in r["stages_s"].items():
            f = (r.get("flop") or {}).get(s)
            L.append(f"| {s} | {sec:.1f} | {100 * sec / total:.0f}% | {'-' if not f else f'{f / 1e9:.0f}'} | "
                     f"{'-' if not f or not sec else f'{f / 1e9 / sec:.1f}'} |")
        L.append("\nTop functions (self seconds): " + "; ".join(f"`{n}` {t} ({s})" for t, n, s in r["top"][:10]) + "\n")
    OUT_MD.write_text("\n".join(L) + "\n")
    print(f"wrote {OUT_MD}")


def _restaged(r: dict) -> dict:
    """The row's stages with its top functions classified by today's ``STAGES`` (a row recorded before a name was
    added to a stage moves that function's seconds, e.g. ``_tri_inv_upper`` from other to factorization)."""
    st = dict(r["stages_s"])
    for i, (sec, name, old) in enumerate(r["top"]):
        new = _stage_of_name(name)
        if new != old:
            st[old] = st.get(old, 0.0) - sec
            st[new] = st.get(new, 0.0) + sec
            r["top"][i] = [sec, name, new]
    return dict(sorted(((k, round(v, 2)) for k, v in st.items()), key=lambda kv: -kv[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", help="smollm2-135m | qwen2.5-0.5b | a folder")
    ap.add_argument("--method", default="sparsegpt")
    ap.add_argument("--sparsity", type=float, default=0.5)
    ap.add_argument("--compensation", default=None)
    ap.add_argument("--nsamples", type=int, default=8)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=int(os.environ.get("BENCH_THREADS", "2")))
    ap.add_argument("--render", action="store_true")
    a = ap.parse_args()
    if not a.render:
        run(a)
    render()


if __name__ == "__main__":
    main()
