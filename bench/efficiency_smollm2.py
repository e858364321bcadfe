"""Deployment measurements of sliced SmolLM2-135M (issue 5; COEC Table 4 / CoCurve Table 5 layout).

    python bench/efficiency_smollm2.py --build      # slice + export Wanda-sp 10-40% (light; any time)
    python bench/efficiency_smollm2.py --measure    # each model in a fresh process, on a quiet machine
    python bench/efficiency_smollm2.py --measure --models cocurve   # the exported CoCurve rows (issue 7)

The models are the Wanda-sp rows of ``bench/structured_smollm2.py`` (preset quick-wt2v16-w2, same cached
statistics; compensation does not change a sliced model's shapes, so these numbers hold for every
compensator at the same sparsity), exported with ``save_pruned`` and reloaded from their folders. Each one is
measured by ``secateur eval efficiency --model DIR`` in its own process, so the peak resident memory is that
of one model plus the Python/torch runtime (no other model or statistics in the process). The load average
before each measurement is recorded: run ``--measure`` when no other job shares the cores.

``--models cocurve`` measures the CoCurve and diagonal-control exports of ``bench/cocurve_smollm2.py``
(heterogeneous per-layer widths, saved by its rows stage) the same way, into ``results/cocurve-efficiency.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from common import RESULTS, WORK, fmt, read_rows

OUT_JSON = RESULTS / "structured-efficiency.jsonl"
DIR = WORK / "efficiency"
SPARSITIES = (0.1, 0.2, 0.3, 0.4)
SETTINGS = {"prompt_len": 256, "new_tokens": 64, "warmup": 2, "repeats": 5, "batch_size": 1}


def folder(rho: float):
    return DIR / f"wanda-sp-{round(rho * 100)}"


def build() -> None:
    import structured_smollm2 as s5

    from secateur.export.sliced import save_pruned
    from secateur.methods.structured import StructuredConfig, prune_structured

    b = s5.Bench()
    for rho in SPARSITIES:
        if (folder(rho) / "config.json").exists():
            continue
        model, adapter = b.fresh()
        prune_structured(model, adapter, b.ids, StructuredConfig(score="wanda_sp", sparsity=rho), stats=b.stats)
        print(rho, save_pruned(model, folder(rho), b.tok, overwrite=True), flush=True)


COCURVE_DIR = WORK / "cocurve-smollm2"
COCURVE_RHOS = (0.2, 0.3, 0.4, 0.5)
MODEL_SETS = {  # name -> (results file, [(row name, model spec)])
    "wanda-sp": (OUT_JSON, [("dense", "smollm2-135m")]
                 + [(f"wanda-sp {rho:.0%}", str(folder(rho))) for rho in SPARSITIES]),
    "cocurve": (RESULTS / "cocurve-efficiency.jsonl", [("dense", "smollm2-135m")]
                + [(f"{m} {rho:.0%}", str(COCURVE_DIR / f"out-{m}-{round(rho * 100)}"))
                   for rho in COCURVE_RHOS for m in ("cocurve", "cocurve-diag")]),
}


def measure(models: str = "wanda-sp") -> None:
    out_json, specs = MODEL_SETS[models]
    rows = []
    for name, spec in specs:
        out = DIR / f"{name.replace(' ', '-').replace('%', '')}.json"
        load = os.getloadavg()
        cmd = [sys.executable, "-m", "secateur.cli", "eval", "efficiency", "--model", spec, "--json", str(out),
               *[a for k, v in SETTINGS.items() for a in (f"--{k.replace('_', '-')}", str(v))]]
        subprocess.run(cmd, check=True, env=os.environ | {"TOKENIZERS_PARALLELISM": "false"})
        res = json.loads(out.read_text())[0]
        rows.append({"model": name, "spec": spec, "loadavg_before": load, "efficiency": res})
        print(name, {k: res[k] for k in ("params", "peak_memory_bytes", "prefill_tokens_per_s",
                                        "decode_tokens_per_s")}, "load", load, flush=True)
    from secateur.runinfo import machine, versions

    out_json.write_text("".join(json.dumps(r | {"versions": versions(), "machine": machine()}) + "\n"
                                for r in rows))


def table(models: str = "wanda-sp") -> list[str]:
    """Markdown lines for results/structured-smollm2.md (or cocurve-smollm2.md); empty when not measured."""
    out_json = MODEL_SETS[models][0]
    rows = read_rows(out_json)
    if not rows:
        return []
    what = "Wanda-sp rows" if models == "wanda-sp" else "CoCurve rows and their diagonal control"
    flag = "" if models == "wanda-sp" else f" --models {models}"
    build = "python bench/efficiency_smollm2.py --build && " if models == "wanda-sp" else ""  # CoCurve: its rows stage
    de = rows[0]["efficiency"]
    s = de["settings"]
    load = max(max(r["loadavg_before"][:1]) for r in rows)
    out = ["", f"## Efficiency of the sliced model ({what}; COEC Table 4 / CoCurve Table 5 layout)", "",
           f"Made by `{build}python bench/efficiency_smollm2.py --measure{flag}` (`{out_json.name}`): every model "
           "exported, reloaded from its folder and measured by `secateur eval efficiency` in its own process; "
           f"batch {s['batch_size']}, prompt {s['prompt_len']} tokens, "
           f"{s['new_tokens']} greedy decode tokens with KV cache, {s['warmup']} warm-up + median of "
           f"{s['repeats']} runs, {s['device']}, {s['dtype']}, attention `{s['attn_implementation']}`, "
           f"{rows[0]['machine'].get('torch_threads')} torch threads; 1-minute load average before each "
           f"measurement at most {load:.2f}. Peak memory = resident-set high-water mark of the process during "
           f"one prefill + decode (`{de['peak_memory_kind']}`): the weights plus the Python/torch runtime. "
           "FLOPs/token = 2 x params (COEC's convention).", "",
           "| model | params (M) | ratio | GFLOPs/token | peak memory (MiB) | ratio | prefill tok/s | speed-up | "
           "decode tok/s | speed-up |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        e = r["efficiency"]
        out.append(f"| {r['model']} | {e['params'] / 1e6:.2f} | {e['params'] / de['params']:.3f} | "
                   f"{e['flops_per_token'] / 1e9:.3f} | {e['peak_memory_bytes'] / 2**20:.0f} | "
                   f"{e['peak_memory_bytes'] / de['peak_memory_bytes']:.3f} | {e['prefill_tokens_per_s']:.0f} | "
                   f"{e['prefill_tokens_per_s'] / de['prefill_tokens_per_s']:.2f}x | "
                   f"{fmt(e['decode_tokens_per_s'], 1)} | "
                   f"{e['decode_tokens_per_s'] / de['decode_tokens_per_s']:.2f}x |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", action="store_true")
    ap.add_argument("--measure", action="store_true")
    ap.add_argument("--models", choices=sorted(MODEL_SETS), default="wanda-sp")
    a = ap.parse_args()
    if a.build:
        build()
    if a.measure:
        measure(a.models)
        if a.models == "wanda-sp":
            import structured_smollm2

            structured_smollm2.render()
        else:
            import cocurve_smollm2

            cocurve_smollm2.render()


if __name__ == "__main__":
    main()
