"""The efficiency table of the sliced SmolLM2 exports: where ``bench/speed/efficiency_smollm2.py`` measures them
(its folders and results files) and the markdown the structured and CoCurve result pages embed. Apart from
the measuring script so that those pages can render it without importing it (no import circle in bench/).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: bench.* imports
from bench.common import WORK, fmt, read_rows, results_dir

OUT_JSON = results_dir("speed") / "structured-efficiency.jsonl"
DIR = WORK / "efficiency"
SPARSITIES = (0.1, 0.2, 0.3, 0.4)
SETTINGS = {"prompt_len": 256, "new_tokens": 64, "warmup": 2, "repeats": 5, "batch_size": 1}


def folder(rho: float):
    return DIR / f"wanda-sp-{round(rho * 100)}"


COCURVE_DIR = WORK / "cocurve-smollm2"
COCURVE_RHOS = (0.2, 0.3, 0.4, 0.5)
MODEL_SETS = {  # name -> (results file, [(row name, model spec)])
    "wanda-sp": (OUT_JSON, [("dense", "smollm2-135m")]
                 + [(f"wanda-sp {rho:.0%}", str(folder(rho))) for rho in SPARSITIES]),
    "cocurve": (results_dir("speed") / "cocurve-efficiency.jsonl", [("dense", "smollm2-135m")]
                + [(f"{m} {rho:.0%}", str(COCURVE_DIR / f"out-{m}-{round(rho * 100)}"))
                   for rho in COCURVE_RHOS for m in ("cocurve", "cocurve-diag")]),
}


def table(models: str = "wanda-sp") -> list[str]:
    """Markdown lines for results/text/structured-smollm2.md (or cocurve-smollm2.md); empty when not measured."""
    out_json = MODEL_SETS[models][0]
    rows = read_rows(out_json)
    if not rows:
        return []
    what = "Wanda-sp rows" if models == "wanda-sp" else "CoCurve rows and their diagonal control"
    flag = "" if models == "wanda-sp" else f" --models {models}"
    # CoCurve: its rows stage
    build = "python bench/speed/efficiency_smollm2.py --build && " if models == "wanda-sp" else ""
    de = rows[0]["efficiency"]
    s = de["settings"]
    load = max(max(r["loadavg_before"][:1]) for r in rows)
    out = ["", f"## Efficiency of the sliced model ({what}; COEC Table 4 / CoCurve Table 5 layout)", "",
           f"Made by `{build}python bench/speed/efficiency_smollm2.py --measure{flag}` (`{out_json.name}`): "
           f"every model "
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
