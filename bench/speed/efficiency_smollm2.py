"""Deployment measurements of sliced SmolLM2-135M (issue 5; COEC Table 4 / CoCurve Table 5 layout).

    python bench/speed/efficiency_smollm2.py --build      # slice + export Wanda-sp 10-40% (light; any time)
    python bench/speed/efficiency_smollm2.py --measure    # each model in a fresh process, on a quiet machine
    python bench/speed/efficiency_smollm2.py --measure --models cocurve   # the exported CoCurve rows (issue 7)

The models are the Wanda-sp rows of ``bench/quality/structured_smollm2.py`` (preset quick-wt2v16-w2, same cached
statistics; compensation does not change a sliced model's shapes, so these numbers hold for every
compensator at the same sparsity), exported with ``save_pruned`` and reloaded from their folders. Each one is
measured by ``secateur eval efficiency --model DIR`` in its own process, so the peak resident memory is that
of one model plus the Python/torch runtime (no other model or statistics in the process). The load average
before each measurement is recorded: run ``--measure`` when no other job shares the cores.

``--models cocurve`` measures the CoCurve and diagonal-control exports of ``bench/quality/cocurve_smollm2.py``
(heterogeneous per-layer widths, saved by its rows stage) the same way, into ``results/speed/cocurve-efficiency.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: bench.* imports
from bench.speed.efficiency_table import DIR, MODEL_SETS, SETTINGS, SPARSITIES, folder

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: bench.* imports
from bench.common import stamped


def build() -> None:
    from bench.quality import structured_smollm2 as s5
    from secateur.export.sliced import save_pruned
    from secateur.methods.structured import StructuredConfig, prune_structured

    b = s5.Bench()
    for rho in SPARSITIES:
        if (folder(rho) / "config.json").exists():
            continue
        model, adapter = b.fresh()
        prune_structured(model, adapter, b.ids, StructuredConfig(score="wanda_sp", sparsity=rho), stats=b.stats)
        print(rho, save_pruned(model, folder(rho), b.tok, overwrite=True), flush=True)


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

    out_json.write_text("".join(json.dumps(stamped(r | {"versions": versions(), "machine": machine()})) + "\n"
                                for r in rows))


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
            from bench.quality import structured_smollm2

            structured_smollm2.render()
        else:
            from bench.quality import cocurve_smollm2

            cocurve_smollm2.render()


if __name__ == "__main__":
    main()
