"""Peak memory against model size (issue 16 section 3): SmolLM2-135M, Qwen2.5-0.5B and a 7B-shaped Llama.

    python bench/tools/get_models.py && python bench/tools/make_7b.py      # the real GGUFs and the 7B-shaped folder,
    once
    nice -n 5 python bench/speed/scale.py --rows smollm2|wanda,...    # rows appended to results/speed/scale.jsonl
    python bench/speed/scale.py --render                              # results/speed/scale.md

Every secateur row is one fresh ``secateur prune`` process (its report's ``peak_rss_mb`` is the process's
``ru_maxrss``: model load, calibration, pruning and export included). llm-compressor rows run its ``oneshot``
(Wanda modifier, sequential pipeline) in its own virtualenv (``bench/speed/requirements-llmcompressor.txt``; never
secateur's) on the same float32 HF folder and the same calibration token ids (a cached file whose sha256 both
sides check); its peak RSS is that process's ``ru_maxrss`` after pruning (model load included, saving excluded).

Protocol (preset ``scale-quick``): calibration C4 8 x 512, seed 0 (Wanda's random-window rule on the local C4
validation file); Wanda 50% on every decoder Linear; Wanda-sp 30% with least-squares compensation; COEC at
30% on RCPU's selection. Model bytes: the safetensors files the run reads (GGUF inputs: the dequantized float32
cache folder; the 7B-shaped model: bfloat16). Streamed rows (``--stream``) also record the memory plan printed
before the run. For the 7B-shaped model each export is reloaded on the meta device (every tensor's shape in the
files equals the shape the exported config builds) and evaluated by streaming on 2 WikiText-2 windows of 512.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: bench.* imports
from bench.common import WORK, append_row, fmt, read_rows, results_dir
from bench.common import run_logged as _run

JSONL = results_dir("speed") / "scale.jsonl"
MD = results_dir("speed") / "scale.md"
PRESET = {"name": "scale-quick", "calib": "c4 8 x 512, seed 0", "ppl": "wikitext2 nonoverlap-512, first 2 windows"}
CALIB = ["--calib", "c4", "--nsamples", "8", "--seqlen", "512", "--seed", "0"]
SECATEUR = [sys.executable, "-m", "secateur.cli"]
LLMC_PY = WORK / "llmc-venv" / "bin" / "python"


def cache() -> Path:
    return Path(os.environ.get("SECATEUR_CACHE", Path.home() / ".cache" / "secateur"))


#: model -> (spec passed to ``--model``, dtype)
MODELS = {
    "smollm2-135m": ("smollm2-135m", "float32"),
    "qwen2.5-0.5b": (str(cache() / "models" / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"), "float32"),
    "llama2-7b-shaped": (str(cache() / "models" / "llama2-7b-shaped"), "bfloat16"),
    # the same widths, 2 blocks (make_7b.py --layers 2): COEC's per-block cost at 7B widths without 32 blocks of it
    "llama2-7b-widths-2blocks": (str(cache() / "models" / "llama2-7b-shaped-2blocks"), "bfloat16"),
}
#: run -> (tool, CLI arguments after ``prune``)
RUNS: dict[str, tuple[str, list[str]]] = {
    "wanda": ("secateur", ["--method", "wanda", "--sparsity", "0.5"]),
    "wanda-stream": ("secateur", ["--method", "wanda", "--sparsity", "0.5", "--stream"]),
    "llmc-wanda": ("llm-compressor", []),
    "wanda-sp-ls": ("secateur", ["--method", "wanda-sp", "--sparsity", "0.3", "--compensation", "ls"]),
    "wanda-sp-ls-stream": ("secateur", ["--method", "wanda-sp", "--sparsity", "0.3", "--compensation", "ls",
                                        "--stream"]),
    # COEC capped at 5 alternation rounds (paper: 50), as in bench/quality/families.py: memory is what these rows show
    "rcpu-coec": ("secateur", ["--method", "rcpu", "--sparsity", "0.3", "--compensation", "coec", "--coec-rounds",
                               "5"]),
    "rcpu-coec-r1": ("secateur", ["--method", "rcpu", "--sparsity", "0.3", "--compensation", "coec",
                                  "--coec-rounds", "1"]),
    "rcpu-coec-r1-stream": ("secateur", ["--method", "rcpu", "--sparsity", "0.3", "--compensation", "coec",
                                         "--coec-rounds", "1", "--stream"]),
    "rcpu-coec-stream": ("secateur", ["--method", "rcpu", "--sparsity", "0.3", "--compensation", "coec",
                                      "--coec-rounds", "5", "--stream"]),
}


def model_folder(model: str) -> Path:
    """The safetensors folder a run of ``model`` reads (GGUF and aliases: secateur's dequantized cache)."""
    spec, dtype = MODELS[model]
    code = f"from secateur.models.loading import resolve; print(resolve({spec!r}, {dtype!r})[0])"
    return Path(subprocess.check_output([sys.executable, "-c", code], text=True).strip().splitlines()[-1])


def model_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def _last_line(log: Path) -> str:
    lines = [ln for ln in log.read_text().splitlines() if ln.strip()]
    return lines[-1][:240] if lines else "(no message)"


def meta_reload_check(out: Path) -> dict:
    """Build the exported config on the meta device and compare every tensor's shape with the files' headers."""
    code = (
        "import json\n"
        "import torch\n"
        "from secateur.models.streaming import LazyWeights, _file_key, build_meta, saved_tensors\n"
        f"out = {str(out)!r}\n"
        "m = build_meta(__import__('pathlib').Path(out), torch.bfloat16)\n"
        "w = LazyWeights(out)\n"
        "names = saved_tensors(m)\n"
        "keys = {k: _file_key(k, w, m.base_model_prefix) for k in names}\n"
        "bad = [k for k, t in names.items() if keys[k] is None or tuple(w.info[keys[k]].shape) != tuple(t.shape)]\n"
        "print(json.dumps({'tensors': len(names), 'mismatched': bad[:5], 'hetero': "
        "type(m.config).__name__.startswith('Secateur')}))\n"
    )
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
        return json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else {"error": r.stderr[-300:]}
    except (subprocess.TimeoutExpired, ValueError, IndexError) as e:
        return {"error": str(e)[:300]}


def _ppl_stream(out: Path, dtype: str, work: Path, log: Path) -> dict:
    js = work / "ppl.json"
    rc, secs = _run([*SECATEUR, "eval", "ppl", "--model", str(out), "--dataset", "wikitext2", "--seqlen", "512",
                     "--max-windows", "2", "--dtype", dtype, "--stream", "--json", str(js), "--quiet"], log)
    if rc != 0:
        return {"error": f"eval ppl exit {rc}: {_last_line(log)}"}
    r = json.loads(js.read_text())
    return {k: r.get(k) for k in ("ppl", "protocol", "windows", "bos")} | {"seconds": round(secs, 1)}


def planned_peak_gib(log: Path) -> float | None:
    """The peak the run's memory plan printed before it started: the plan's terms + the process's own RSS then."""
    import re

    lines = log.read_text().splitlines()
    start = max((i for i, ln in enumerate(lines) if ln.startswith("$ ") and " prune " in ln), default=0)
    for ln in lines[start:]:  # the prune's plan, not the streamed evaluation's that follows it
        m = re.search(r"peak about ([\d.]+) (GiB|MiB)(?: on top of this process's ([\d.]+) (GiB|MiB))?", ln)
        if m:
            gib = lambda v, u: float(v) / (1024 if u == "MiB" else 1)  # noqa: E731
            return gib(m[1], m[2]) + (gib(m[3], m[4]) if m[3] else 0.0)
    return None


def secateur_row(model: str, run: str, log: Path) -> dict:
    spec, dtype = MODELS[model]
    _, args = RUNS[run]
    rec: dict = {}
    with tempfile.TemporaryDirectory(dir=WORK) as d:
        out = Path(d) / "out"
        rc, secs = _run([*SECATEUR, "prune", "--model", spec, "--dtype", dtype, *CALIB, *args, "--out", str(out),
                         "--quiet"], log)
        rec["prune_wall_s"] = round(secs, 1)
        if rc != 0:
            return rec | {"error": f"prune exit {rc}: {_last_line(log)}"}
        rep = json.loads((out / "secateur-report.json").read_text())
        rec["peak_rss_mb"] = rep.get("peak_rss_mb")
        rec["calibration_sha256"] = (rep.get("calibration") or {}).get("sha256")
        rec["realized_sparsity"] = {k: v for k, v in (rep.get("realized_sparsity") or {}).items()
                                    if not isinstance(v, dict)}  # the per-module table stays in the report
        rec["phases"] = (rep.get("timings") or {}).get("phases")
        rec["memory_plan"] = rep.get("memory_plan")
        rec["planned_peak_gib"] = planned_peak_gib(log) if rec["memory_plan"] else None
        rec["statistics_memory"] = (rep.get("details") or {}).get("statistics_memory")
        rec["out_bytes"] = model_bytes(out)
        if model.startswith("llama2-7b"):
            rec["meta_reload"] = meta_reload_check(out)
            rec["wikitext2_stream"] = _ppl_stream(out, dtype, Path(d), log)
    return rec


def calib_file(model: str) -> Path:
    """The calibration ids of ``CALIB`` for ``model``'s tokenizer, cached once with their manifest."""
    path = WORK / f"calib-scale-{model}-c4-8x512-seed0.pt"
    if not path.exists():
        code = (
            "import torch, sys\n"
            "from transformers import AutoTokenizer\n"
            "from secateur.data.windows import calibration_set\n"
            f"tok = AutoTokenizer.from_pretrained({str(model_folder(model))!r})\n"
            "ids, man = calibration_set('c4', tok, 8, 512, 0)\n"
            f"torch.save({{'ids': ids, 'manifest': man.to_dict()}}, {str(path)!r})\n"
        )
        subprocess.check_call([sys.executable, "-c", code])
    return path


LLMC_CHILD = r'''
import hashlib, json, resource, sys, time
import numpy as np, torch
from datasets import Dataset
from llmcompressor import oneshot
from llmcompressor.modifiers.pruning import WandaPruningModifier
from transformers import AutoModelForCausalLM, AutoTokenizer
import llmcompressor, transformers
folder, calib = sys.argv[1], sys.argv[2]
blob = torch.load(calib)
ids, man = blob["ids"], blob["manifest"]
sha = hashlib.sha256(np.ascontiguousarray(ids.numpy().astype("<i8")).tobytes()).hexdigest()
assert sha == man["sha256"], (sha, man["sha256"])
model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").eval()
tok = AutoTokenizer.from_pretrained(folder)
ds = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
cls = type(model.model.layers[0]).__name__
mod = WandaPruningModifier(sparsity=0.5, mask_structure="0:0", targets=[cls], ignore=["re:.*lm_head"])
t = time.perf_counter()
oneshot(model=model, tokenizer=tok, dataset=ds, recipe=[mod], num_calibration_samples=ids.shape[0],
        max_seq_length=ids.shape[1], batch_size=1, shuffle_calibration_samples=False, pipeline="sequential",
        sequential_targets=[cls], output_dir=None)
secs = time.perf_counter() - t
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print("SCALE-ROW " + json.dumps({"prune_s": secs, "peak_rss_mb": rss,
      "calibration_sha256": sha, "versions": {"llmcompressor": llmcompressor.__version__,
      "transformers": transformers.__version__, "torch": torch.__version__}}))
'''


def llmc_row(model: str, log: Path) -> dict:
    if not LLMC_PY.exists():
        return {"error": f"{LLMC_PY} missing: see bench/speed/requirements-llmcompressor.txt"}
    folder, calib = model_folder(model), calib_file(model)
    with tempfile.NamedTemporaryFile("w", suffix=".py", dir=WORK, delete=False) as f:
        f.write(LLMC_CHILD)
    try:
        t = time.perf_counter()
        with open(log, "a") as lf:
            r = subprocess.run([str(LLMC_PY), f.name, str(folder), str(calib)], stdout=subprocess.PIPE,
                               stderr=lf, text=True, env=os.environ | {"TOKENIZERS_PARALLELISM": "false"})
        secs = time.perf_counter() - t
    finally:
        os.unlink(f.name)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("SCALE-ROW ")), None)
    if r.returncode != 0 or line is None:
        return {"error": f"llm-compressor exit {r.returncode}: {_last_line(log)}"}
    return json.loads(line.split(" ", 1)[1]) | {"wall_s": round(secs, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="", help="comma-separated model|run keys")
    ap.add_argument("--render", action="store_true")
    ap.add_argument("--compact", action="store_true", help="rewrite the JSONL: per-module tables dropped, the "
                    "printed plan filled in from the run logs (rows made before those fields were recorded)")
    a = ap.parse_args()
    if a.compact:
        compact()
    elif not a.render:
        WORK.mkdir(parents=True, exist_ok=True)
        done = {r["key"] for r in read_rows(JSONL)}
        logs = WORK / "scale"
        logs.mkdir(parents=True, exist_ok=True)
        for key in filter(None, a.rows.split(",")):
            model, run = key.split("|")
            if key in done:
                continue
            log = logs / f"{model}-{run}.log"
            folder = model_folder(model)
            rec = {"key": key, "model": model, "run": run, "tool": RUNS[run][0], "preset": PRESET,
                   "args": RUNS[run][1], "dtype": MODELS[model][1], "model_bytes": model_bytes(folder),
                   "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                   "loadavg_1m_before": os.getloadavg()[0]}
            rec |= llmc_row(model, log) if RUNS[run][0] == "llm-compressor" else secateur_row(model, run, log)
            rec["loadavg_1m_after"] = os.getloadavg()[0]
            append_row(JSONL, rec, unique_key=True)
            print(json.dumps(rec), flush=True)
    render()


def compact() -> None:
    rows = read_rows(JSONL)
    for r in rows:
        rs = r.get("realized_sparsity")
        if isinstance(rs, dict):
            r["realized_sparsity"] = {k: v for k, v in rs.items() if not isinstance(v, dict)}
        log = WORK / "scale" / f"{r['model']}-{r['run']}.log"
        if r.get("memory_plan") and r.get("planned_peak_gib") is None and log.exists():
            r["planned_peak_gib"] = planned_peak_gib(log)
    JSONL.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _per_block(r: dict) -> str:
    ph = r.get("phases") or {}
    layers = {"smollm2-135m": 30, "qwen2.5-0.5b": 24, "llama2-7b-shaped": 32, "llama2-7b-widths-2blocks": 2}[r["model"]]
    return fmt(ph["prune"] / layers, 1) if isinstance(ph.get("prune"), (int, float)) else "-"


def render() -> None:
    rows = read_rows(JSONL)
    L = ["# Peak memory against model size", "",
         f"Produced by `bench/speed/scale.py` (preset `{PRESET['name']}`: calibration {PRESET['calib']}; 7B-shaped "
         f"exports evaluated by streaming on {PRESET['ppl']}). Peak RSS is the pruning process's `ru_maxrss` "
         "(model load, calibration, pruning and export included; llm-compressor: load and `oneshot`). "
         "Model bytes: the safetensors the run reads (float32 for the GGUF models, dequantized; bfloat16 for the "
         "7B-shaped Llama: `bench/tools/make_7b.py`, Llama-2-7B config, seeded random weights).", "",
         "| model | run | tool | model GB | peak RSS GiB | planned GiB | peak / model | prune s | s per block | "
         "realized | WikiText-2 (stream, 2 x 512) | note |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mb = r["model_bytes"] / 1e9
        rss = r.get("peak_rss_mb")
        rs = r.get("realized_sparsity")
        real = fmt(rs.get("targeted"), 3) if isinstance(rs, dict) else "-"
        w = r.get("wikitext2_stream") or {}
        note = r.get("error") or ""
        if r.get("meta_reload"):
            mr = r["meta_reload"]
            note += (f"meta reload: {mr.get('tensors')} tensors, shapes "
                     f"{'match' if mr.get('mismatched') == [] else mr}")
        sm = r.get("statistics_memory")
        if isinstance(sm, dict) and sm.get("grams_bytes"):
            note += (f" Grams alive at once {sm['grams_bytes'] / 1e9:.2f} GB (all layers: "
                     f"{sm['grams_bytes_all_layers'] / 1e9:.2f} GB), COEC tempered copy "
                     f"{sm['tempered_bytes'] / 1e9:.2f} GB")
        plan = r.get("planned_peak_gib")
        L.append(f"| {r['model']} | {r['run']} | {r['tool']} | {mb:.2f} | "
                 f"{fmt(rss / 1024, 2) if rss else '-'} | {fmt(plan, 2) if plan else '-'} | "
                 f"{fmt(rss * 2**20 / r['model_bytes'], 2) if rss else '-'} | "
                 f"{fmt(r.get('prune_wall_s') or r.get('prune_s'), 0)} | {_per_block(r)} | {real} | "
                 f"{fmt(w.get('ppl')) if w.get('ppl') else w.get('error', '-')} | {note.strip() or '-'} |")
    L += ["", "Machine: 2 cores, 24 GiB (shared with other work while these ran: load averages are in "
          "`results/speed/scale.jsonl`), torch 2.13.0+cpu. Rows not listed were not run yet; `bench/speed/scale.py` "
          "resumes.", "",
          "Notes: `planned GiB` is the memory plan the run printed before it started plus the process's own RSS "
          "then; the measured peak is up to 0.35 GiB above it (the calibration text and the tokenizer are not in the "
          "formula). `llama2-7b-widths-2blocks` is the 7B config with 2 blocks (`bench/tools/make_7b.py --layers "
          "2`): a "
          "streamed run's peak is one block's, so it shows the 32-block model's per-block memory (Grams of one "
          "block: 1.10 GB, against 35 GB for all 32 layers at once); its prune seconds include about 7 minutes "
          "when it was paused (SIGSTOP) while llama.cpp speed was measured. The full 7B-shaped Wanda-sp + LS run "
          "(2026-12-02/03, Intel Xeon, nothing else running) took 68.0 s per block (its Cholesky solves ran on 2 "
          "threads: solve_spd had lost its one-thread pin, fixed after; pinned as intended they take about 5 s more "
          "per block): each compensated projection's "
          "error diagnostic now forms W0 C once (`compensate.base.ReconError`; before, six d_out x d x d products per "
          "down_proj took 146 of 271 s on the 2-block model, cProfile; `bench/speed/recon_speed.py`). Its peak, "
          "6.95 GiB, "
          "exceeded its plan (5.41 GiB) by 1.54 GiB: the diagnostic holds W0 C, W0 and C_KK in float64 beside the "
          "ridge solve; the plan now counts 4 LS solver matrices of the widest input instead of 2 (7.21 GiB for that "
          "run). COEC at 7B widths (`rcpu-coec-r1-stream`, "
          "one alternation round) peaked at 9.31 GiB against a plan of 7.27 GiB: the plan then counted 4 solver "
          "matrices of the widest input and missed LAPACK's eigh workspace (about 2 n^2 doubles, 1.8 GiB at "
          "n = 11008); the plan now counts 6 (9.08 GiB for this run). Its prune seconds include about 17 minutes "
          "paused (SIGSTOP) for llama.cpp timings, and the eigendecompositions of two 11008-wide down_proj inputs "
          "dominate the rest. The Qwen "
          "streamed Wanda row was rerun after the untied-head change (the head, 0.55 GB in float32, is no longer "
          "held): 2.68 GiB before, under a load average of 6-13."]
    MD.write_text("\n".join(L) + "\n")


if __name__ == "__main__":
    main()
