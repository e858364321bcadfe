"""Side by side with llm-compressor: Wanda and SparseGPT (50% and 2:4) on SmolLM2-135M, same calibration tokens.

Runs in its own virtualenv so llm-compressor (and the transformers it pins) never touches secateur's:

    python3 -m venv bench/_work/llmc-venv
    bench/_work/llmc-venv/bin/pip install -r bench/speed/requirements-llmcompressor.txt
    nice -n 10 bench/_work/llmc-venv/bin/python bench/speed/llmcompressor_compare.py --preset quick
    nice -n 10 bench/_work/llmc-venv/bin/python bench/speed/llmcompressor_compare.py --preset full --rows wanda-50
    bench/_work/llmc-venv/bin/python bench/speed/llmcompressor_compare.py --render

Each row: one fresh process (its own peak RSS) loads the float32 HF folder written by
``secateur.models.loading.load_model("smollm2-135m")``, reads the cached calibration ids
``bench/_work/calib-c4-{N}x{L}-seed0.pt`` (the file ``bench/quality/unstructured_smollm2.py`` prunes with; the
sha256 of the ids is checked against its manifest), and runs llm-compressor's ``oneshot`` with
``WandaPruningModifier`` / ``SparseGPTModifier`` (targets: the LlamaDecoderLayer blocks, i.e. their
q/k/v/o/gate/up/down Linear layers, lm_head ignored; dampening 0.01, block size 128; sequential pipeline
over decoder layers, batch size 1, no shuffling, no truncation). Prune time = wall time of the
``oneshot`` call (data loader, tracing, calibration, pruning, propagation), excluding model loading.
The pruned weights are written as a plain HF folder and WikiText-2 perplexity is measured by secateur's
own CLI in secateur's venv (``python -m secateur.cli eval ppl``), so both sides share one protocol
exactly. secateur is never imported in the llm-compressor venv.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import platform
import re
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: bench.* imports
from bench.common import append_row, fmt, read_rows, results_dir  # bench/common.py: stdlib + torch only at import

ROOT = Path(__file__).resolve().parents[2]
WORK = ROOT / "bench" / "_work"
OUT_JSON = results_dir("deploy") / "llmcompressor-smollm2.jsonl"
OUR_JSON = results_dir("text") / "unstructured-smollm2.jsonl"
MAIN_PY = ROOT / ".venv" / "bin" / "python"


# Set by ``--one ... --model-dir D --calib-file F --out-dir O`` (bench/speed/sparsegpt_side_by_side.py: another model)
OVERRIDE: dict[str, Path] = {}


@functools.cache
def model_dir() -> Path:
    """SmolLM2's dequantized folder, as secateur caches it (asked of secateur's venv: this one may lack it)."""
    if "model_dir" in OVERRIDE:
        return OVERRIDE["model_dir"]
    code = "from secateur.models.loading import resolve; print(resolve('smollm2-135m')[0])"
    return Path(subprocess.check_output([str(MAIN_PY), "-c", code], text=True).strip().splitlines()[-1])

# Same presets as bench/common.py (duplicated: common.py imports torch, the renderer must not need it).
PRESETS = {
    "full": {"nsamples": 128, "seqlen": 2048, "max_windows": None},
    "quick": {"nsamples": 32, "seqlen": 2048, "max_windows": 32},
    "smoke": {"nsamples": 2, "seqlen": 256, "max_windows": 2},
}
# row -> (modifier, sparsity, mask_structure); row names match bench/quality/unstructured_smollm2.py.
ROWS = {
    "wanda-50": ("wanda", 0.5, "0:0"),
    "sparsegpt-50": ("sparsegpt", 0.5, "0:0"),
    "wanda-2:4": ("wanda", 0.5, "2:4"),
    "sparsegpt-2:4": ("sparsegpt", 0.5, "2:4"),
}
PPL_TOLERANCE = 0.02
# Facts about the runs that the row files cannot carry (rendered at the end of the .md).
NOTES: list[str] = [
    "Install: `llmcompressor` 0.14.0.1 (newest on PyPI at the time) installed next to torch 2.13.0+cpu with the "
    "constraint `torch==2.13.0` and no conflict; it pins transformers <=5.17 (secateur's venv: 5.24). It runs on "
    "CPU (it logs `No accelerator available! Compressing model on CPU instead`).",
    "Cost on this machine: llm-compressor's sequential pipeline runs every calibration sample through each decoder "
    "layer twice (a hooked calibration pass, then a propagation pass through the pruned layer) and through "
    "norm + lm_head at the end; its SparseGPT is the reference per-column Python loop, which dominates at small "
    "calibration sizes (smoke sparsegpt-2:4: 849 s of 890 s in `SGPT` pruning on a loaded machine).",
    "Coverage: preset quick wanda-50 ran in session 1 (2026-12-01, machine load average 10-15 on 2 cores, "
    "both sides under load, so its time ratio is indicative); quick sparsegpt-50 ran in session 2 with one "
    "torch thread (`--threads 1`) beside three other single-thread benchmarks (load average ~3-4), while "
    "secateur's sparsegpt-50 quick row ran in session 1 under load 8-15 (its time is therefore pessimistic). "
    "Quick wanda-2:4 and sparsegpt-2:4 ran in session 3 on both sides with one torch thread, each beside one "
    "other single-thread benchmark (load average ~2); secateur's 2:4 rows were re-timed under the same "
    "conditions (`--retime`). Preset full was not run on the llm-compressor side (its Wanda-50 alone would be "
    "about 3 h on this machine); all four configurations also ran end to end at preset smoke.",
]  # "on par": our perplexity at most 2% above theirs
# `compress_s` of the three session-1 rows, which predate that field: the renderer summed it from the run's log
# (bench/_work/logs, git-ignored scratch, since deleted); these are the values it rendered then (first page:
# commit f7c3552). Used only when a row lacks `compress_s` and its log is gone.
COMPRESS_S_FROM_LOGS = {("quick", "wanda-50"): 60.9, ("smoke", "wanda-50"): 37.1, ("smoke", "sparsegpt-2:4"): 849.3}


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def machine() -> dict:
    cpu = platform.machine()
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform()}


def calib_path(preset: str) -> Path:
    if "calib_file" in OVERRIDE:
        return OVERRIDE["calib_file"]
    p = PRESETS[preset]
    return WORK / f"calib-c4-{p['nsamples']}x{p['seqlen']}-seed0.pt"


def row_dir(row: str, preset: str) -> Path:
    if "out_dir" in OVERRIDE:
        return OVERRIDE["out_dir"]
    return WORK / "llmc-out" / f"{preset}-{row.replace(':', 'of')}"


# ---------------------------------------------------------------------------------------------------
# llm-compressor side (runs inside the llm-compressor venv)
# ---------------------------------------------------------------------------------------------------

def prune_one(row: str, preset: str, threads: int | None) -> dict:
    import torch

    if threads:
        torch.set_num_threads(threads)
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.pruning import SparseGPTModifier, WandaPruningModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    method, sparsity, structure = ROWS[row]
    ids, manifest = checked_calibration(preset)
    n, seqlen = ids.shape

    model = AutoModelForCausalLM.from_pretrained(model_dir(), dtype=torch.float32, attn_implementation="sdpa")
    model.eval()
    tok = AutoTokenizer.from_pretrained(model_dir())
    ds = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
    layer_cls = type(model.model.layers[0]).__name__
    common = dict(sparsity=sparsity, mask_structure=structure, targets=[layer_cls], ignore=["re:.*lm_head"])
    if method == "wanda":
        modifier = WandaPruningModifier(**common)
    else:
        modifier = SparseGPTModifier(**common, block_size=128, dampening_frac=0.01)
    rss_loaded = peak_rss_mb()

    load_before, cpu0 = os.getloadavg(), resource.getrusage(resource.RUSAGE_SELF)
    t = time.perf_counter()
    oneshot(model=model, tokenizer=tok, dataset=ds, recipe=[modifier], num_calibration_samples=n,
            max_seq_length=seqlen, batch_size=1, shuffle_calibration_samples=False, pipeline="sequential",
            sequential_targets=[layer_cls], output_dir=None)
    prune_s = time.perf_counter() - t
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    rss_pruned = peak_rss_mb()

    zeros, total, bad_groups = zero_counts(model, structure)

    out = row_dir(row, preset)
    save_plain(model, out)
    return {
        "row": row, "preset": preset, "tool": "llmcompressor",
        "modifier": type(modifier).__name__,
        "modifier_args": {k: v for k, v in modifier.model_dump().items()
                          if k in ("sparsity", "mask_structure", "targets", "ignore", "block_size",
                                   "dampening_frac")},
        "calibration": {**manifest, "sha256_checked": True},
        "prune_s": prune_s,
        # CPU seconds of the oneshot call and the machine's load average around it: the machine is shared.
        "prune_cpu_s": (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime),
        "loadavg_1m_before_after": [load_before[0], os.getloadavg()[0]],
        "peak_rss_mb_loaded": rss_loaded,
        "peak_rss_mb_after_prune": rss_pruned,
        "realized_sparsity": zeros / total,
        "nm_violations": bad_groups if structure == "2:4" else None,
        "pruned_model": str(out),
        "versions": versions(),
        "machine": {**machine(), "torch_threads": torch.get_num_threads()},
    }


def checked_calibration(preset: str):
    """The cached calibration ids and their manifest; exits when the ids' sha256 is not the manifest's."""
    import numpy as np
    import torch

    blob = torch.load(calib_path(preset))
    ids, manifest = blob["ids"], blob["manifest"]
    sha = hashlib.sha256(np.ascontiguousarray(ids.cpu().numpy().astype("<i8")).tobytes()).hexdigest()
    if sha != manifest["sha256"]:
        raise SystemExit(f"calibration ids sha256 {sha} != manifest {manifest['sha256']}")
    return ids, manifest


def zero_counts(model, structure: str) -> tuple[int, int, int]:
    """Realized sparsity over the targeted Linear weights, and a 2:4 check along the input dimension:
    (zeros, weights, 4-groups with fewer than 2 zeros)."""
    import torch

    zeros = total = bad_groups = 0
    for layer in model.model.layers:
        for mod in layer.modules():
            if isinstance(mod, torch.nn.Linear):
                w = mod.weight.detach()
                zeros += int((w == 0).sum())
                total += w.numel()
                if structure == "2:4":
                    bad_groups += int(((w.reshape(w.shape[0], -1, 4) == 0).sum(-1) < 2).sum())
    return zeros, total, bad_groups


def versions() -> dict:
    """The llm-compressor side's library versions (all already imported by prune_one)."""
    import compressed_tensors
    import llmcompressor
    import torch
    import transformers

    return {"llmcompressor": llmcompressor.__version__, "compressed_tensors": compressed_tensors.__version__,
            "torch": torch.__version__, "transformers": transformers.__version__,
            "python": sys.version.split()[0]}


def save_plain(model, out: Path) -> None:
    """Write a plain float32 HF folder (no compressed-tensors config) that secateur's loader reads."""
    from safetensors.torch import save_file

    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # tied to model.embed_tokens.weight
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    for f in model_dir().iterdir():
        if f.suffix in (".json", ".jinja") and f.name != "model.safetensors.index.json":
            shutil.copy(f, out / f.name)


# ---------------------------------------------------------------------------------------------------
# evaluation (secateur's CLI in secateur's venv) and orchestration
# ---------------------------------------------------------------------------------------------------

def eval_ppl(folder: Path, preset: str, main_py: Path, log) -> dict:
    out = folder / "ppl.json"
    cmd = [str(main_py), "-m", "secateur.cli", "eval", "ppl", "--model", str(folder), "--dataset", "wikitext2",
           "--seqlen", "2048", "--json", str(out), "--quiet"]
    if PRESETS[preset]["max_windows"] is not None:
        cmd += ["--max-windows", str(PRESETS[preset]["max_windows"])]
    log.write("$ " + " ".join(cmd) + "\n")
    log.flush()
    t = time.perf_counter()
    rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                         env=os.environ | {"TOKENIZERS_PARALLELISM": "false"})
    if rc != 0:
        raise RuntimeError(f"eval failed (exit {rc}): {' '.join(cmd)}")
    res = json.loads(out.read_text())
    res["eval_wall_s"] = time.perf_counter() - t
    res["command"] = " ".join(cmd)
    return res


def run_row(row: str, preset: str, main_py: Path, threads: int | None) -> None:
    log_path = WORK / "logs" / f"llmc-{preset}-{row.replace(':', 'of')}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = WORK / "llmc-out" / f"{preset}-{row.replace(':', 'of')}.row.json"
    tmp.parent.mkdir(parents=True, exist_ok=True)
    tmp.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--one", row, "--preset", preset, "--row-file", str(tmp)]
    if threads:
        cmd += ["--threads", str(threads)]
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT,
                             env=os.environ | {"TOKENIZERS_PARALLELISM": "false"})
        if rc != 0:
            rec = {"row": row, "preset": preset, "tool": "llmcompressor", "error": f"oneshot process exit {rc}",
                   "error_tail": log_path.read_text()[-3000:]}
        else:
            rec = json.loads(tmp.read_text())
            try:
                w = eval_ppl(Path(rec["pruned_model"]), preset, main_py, log)
                rec["wikitext2"] = {k: w.get(k) for k in ("ppl", "legacy_ppl", "protocol", "windows", "windows_total",
                                                          "scored_tokens", "tokens_sha256", "seconds",
                                                          "eval_wall_s", "command")}
            except Exception as e:  # keep the pruning numbers even when the evaluation fails
                rec["error"] = f"eval: {e}"
    rec["log"] = str(log_path.relative_to(ROOT))
    rec["compress_s"] = compress_seconds(log_path)
    append_row(OUT_JSON, rec)
    print(f"{row}: {rec.get('error') or 'ok'} (log {log_path})", flush=True)


def compress_seconds(log_path: Path) -> float | None:
    """Sum of llm-compressor's per-module ``compress | METRIC - time Xs`` lines (pruning proper, no forwards)."""
    if not log_path.exists():
        return None
    pat = r"(?:compress|SGPT) \| METRIC - time ([0-9.]+)s"
    vals = [float(m.group(1)) for m in re.finditer(pat, log_path.read_text())]
    return sum(vals) if vals else None


def latest(rows: list[dict], preset: str, row: str) -> dict | None:
    sel = [r for r in rows if r.get("preset") == preset and r.get("row") == row]
    return sel[-1] if sel else None


def render() -> None:
    theirs_all, ours_all = read_rows(OUT_JSON), read_rows(OUR_JSON)
    lines = _intro_lines()
    for preset in ("full", "quick", "smoke"):  # smoke = 2x256 debug runs, 2 windows
        theirs = [latest(theirs_all, preset, r) for r in ROWS]
        if not any(theirs):
            continue
        first = next(t for t in theirs if t)
        lines += _compare_table(preset, theirs, first, ours_all) + _details_table(preset, theirs)
        lines += _preset_footer(preset, first, ours_all)
        lines.append("")
    lines += _versions_lines(theirs_all, ours_all)
    lines += ["", *NOTES, ""]
    (results_dir("deploy") / "llmcompressor-smollm2.md").write_text("\n".join(lines))


def _intro_lines() -> list[str]:
    """Title, where the rows come from, and the protocol both sides share."""
    return ["# secateur vs llm-compressor: Wanda and SparseGPT on SmolLM2-135M", "",
            "Made by `bench/_work/llmc-venv/bin/python bench/speed/llmcompressor_compare.py` (rows in "
            "`llmcompressor-smollm2.jsonl`; secateur's rows come from `unstructured-smollm2.jsonl`, made by "
            "`bench/quality/unstructured_smollm2.py`).", "",
            "Protocol, both sides: SmolLM2-135M-Instruct float32 (the HF folder written by "
            "`secateur.models.loading.load_model('smollm2-135m')`); the same calibration token ids (file "
            "`bench/_work/calib-c4-{N}x{L}-seed0.pt`: C4 local validation file, Wanda's random-long-document "
            "rule, seed 0; sha256 checked on both sides); all decoder Linear layers (q,k,v,o,gate,up,down) "
            "pruned, lm_head/embeddings dense; SparseGPT dampening 0.01 x mean(diag H), block size 128. "
            "WikiText-2 raw test, HF rows joined with \"\\n\\n\", no special tokens, non-overlapping 2048-token "
            "windows each scoring 2047 tokens, PPL = exp(sum NLL / scored tokens); llm-compressor's pruned model "
            "is evaluated by the very same `secateur eval ppl` command. llm-compressor: `oneshot` with "
            "`pipeline=\"sequential\"` (one subgraph per LlamaDecoderLayer, calibration pass then a propagation "
            "pass through the pruned layer), batch size 1, no shuffling. Prune time: secateur = calibration "
            "forward + statistics + scoring + masking (+ OBS updates); llm-compressor = the `oneshot` call; "
            "both exclude model loading. Peak RSS: the pruning process after pruning (model load included, "
            "perplexity evaluation excluded). Time ratio = secateur time / llm-compressor time (< 1: secateur "
            "faster). Each row ran in its own process on a shared 2-core machine (other jobs were running, so "
            "times are indicative).", ""]


def _compare_table(preset: str, theirs: list[dict | None], first: dict, ours_all: list[dict]) -> list[str]:
    """A preset's heading and the side-by-side table (ppl, prune time, peak RSS, sparsity), then the re-timed rows."""
    p = PRESETS[preset]
    sha = (first.get("calibration") or {}).get("sha256", "?")[:16]
    win = "all" if p["max_windows"] is None else f"first {p['max_windows']}"
    lines = [f"## Preset `{preset}`: calibration {p['nsamples']}x{p['seqlen']} tokens (sha256 {sha}...), "
             f"WikiText-2 {win} windows", "",
             "| row | ppl secateur | ppl llm-compressor | ppl ok (<= +2%) | prune s secateur | "
             "prune s llm-compressor | time ratio | peak RSS MiB secateur | peak RSS MiB llm-compressor | "
             "sparsity secateur | sparsity llm-compressor |",
             "|---|---:|---:|:---:|---:|---:|---:|---:|---:|---:|---:|"]
    retimed_rows: list[str] = []
    for row, t in zip(ROWS, theirs):
        o = latest(ours_all, preset, row)
        t = t or {}
        tp = (t.get("wikitext2") or {}).get("ppl")
        op = (o or {}).get("wikitext2", {}).get("ppl")
        ok = "-" if tp is None or op is None else ("yes" if op <= tp * (1 + PPL_TOLERANCE) else "NO")
        # a row re-timed under the llm-compressor run's conditions (`--retime`) replaces the original time
        retimed = (o or {}).get("retimed")
        ts, os_ = t.get("prune_s"), (retimed or {}).get("prune_s", (o or {}).get("prune_s"))
        if retimed:
            retimed_rows.append(f"{row} ({retimed['date']}, {retimed['threads']} thread, 1-min load "
                                f"{retimed['loadavg_1min_before_after'][0]:.1f} / "
                                f"{retimed['loadavg_1min_before_after'][1]:.1f}; original row "
                                f"{fmt(o.get('prune_s'), 1)} s under load 8-15)")
        ratio = None if not ts or os_ is None else os_ / ts
        lines.append(f"| {row} | {fmt(op, 3)} | {fmt(tp, 3)} | {ok} | {fmt(os_, 1)} | {fmt(ts, 1)} | "
                     f"{fmt(ratio, 2)} | {fmt((o or {}).get('peak_rss_mb_after_prune'), 0)} | "
                     f"{fmt(t.get('peak_rss_mb_after_prune'), 0)} | {fmt((o or {}).get('realized_sparsity'), 4)}"
                     f" | {fmt(t.get('realized_sparsity'), 4)} |")
    if retimed_rows:
        lines += ["", "secateur prune times re-measured with `bench/quality/unstructured_smollm2.py --preset "
                      f"{preset} --retime ROW` beside the llm-compressor run (same calibration, fresh process): "
                  + "; ".join(retimed_rows) + "."]
    return lines


def _details_table(preset: str, theirs: list[dict | None]) -> list[str]:
    """llm-compressor's own details: oneshot time, pruning proper, CPU seconds, load average, eval time."""
    lines = ["", "llm-compressor details: `oneshot` wall time, of it the per-module pruning proper (sum of its "
                 "`compress`/`SGPT` METRIC times; the rest is calibration and propagation forwards), CPU seconds "
                 "of the call, 1-minute load average before/after (2 cores, shared).", "",
             "| row | status | oneshot s | pruning proper s | CPU s | load avg | ppl eval s |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for row, t in zip(ROWS, theirs):
        if not t:
            lines.append(f"| {row} | not run | - | - | - | - | - |")
            continue
        comp = t.get("compress_s")
        if comp is None and t.get("log"):
            comp = compress_seconds(ROOT / t["log"])
        if comp is None:
            comp = COMPRESS_S_FROM_LOGS.get((preset, row))
        load = t.get("loadavg_1m_before_after")
        load_s = "-" if not load else f"{load[0]:.1f} / {load[1]:.1f}"
        lines.append(f"| {row} | {'FAILED: ' + t['error'] if t.get('error') else 'ok'} | {fmt(t.get('prune_s'), 1)}"
                     f" | {fmt(comp, 1)} | {fmt(t.get('prune_cpu_s'), 1)} | {load_s} | "
                     f"{fmt((t.get('wikitext2') or {}).get('seconds'), 1)} |")
    return lines


def _preset_footer(preset: str, first: dict, ours_all: list[dict]) -> list[str]:
    """secateur rows missing for the preset, and the perplexity protocol and command."""
    lines: list[str] = []
    missing = [r for r in ROWS if latest(ours_all, preset, r) is None]
    if missing:
        lines += ["", f"secateur rows not yet in `unstructured-smollm2.jsonl` for this preset: "
                      f"{', '.join(missing)} (run `bench/quality/unstructured_smollm2.py --preset {preset}`)."]
    ppl_proto = (first.get("wikitext2") or {}).get("protocol")
    if ppl_proto:
        lines += ["", f"Perplexity protocol tag: `{ppl_proto}`; eval command: "
                      f"`{(first.get('wikitext2') or {}).get('command')}`."]
    return lines


def _versions_lines(theirs_all: list[dict], ours_all: list[dict]) -> list[str]:
    """Both sides' library versions and the machine, from the newest row that records them."""
    lines: list[str] = []
    any_t = next((r for r in reversed(theirs_all) if r.get("versions")), None)
    any_o = next((r for r in reversed(ours_all) if r.get("versions")), None)
    if any_t:
        m = any_t["machine"]
        lines += [f"llm-compressor side versions: {json.dumps(any_t['versions'])}."]
        lines += [f"Machine: {m.get('cpu')}, {m.get('cores')} cores, {m.get('torch_threads')} torch threads, no GPU."]
    if any_o:
        lines += [f"secateur side versions: {json.dumps(any_o['versions'])}."]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="quick", choices=list(PRESETS))
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--main-python", default=str(MAIN_PY), help="secateur venv python (runs the evaluation)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads in the pruning process")
    ap.add_argument("--render", action="store_true")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--row-file", default=None, help=argparse.SUPPRESS)
    for name in ("model-dir", "calib-file", "out-dir"):  # --one on another model (sparsegpt_side_by_side.py)
        ap.add_argument(f"--{name}", type=Path, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    OVERRIDE.update({k: v for k, v in (("model_dir", a.model_dir), ("calib_file", a.calib_file),
                                       ("out_dir", a.out_dir)) if v is not None})
    if a.render:
        return render()
    if a.one:
        Path(a.row_file).write_text(json.dumps(prune_one(a.one, a.preset, a.threads), default=str))
        return
    if not calib_path(a.preset).exists():
        raise SystemExit(f"{calib_path(a.preset)} missing: make it with bench/common.calib_tokens in secateur's venv")
    for row in a.rows.split(","):
        run_row(row, a.preset, Path(a.main_python), a.threads)
        render()


if __name__ == "__main__":
    main()
