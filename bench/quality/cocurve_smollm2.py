"""CoCurve on SmolLM2-135M at 20/30/40/50%: CoCurve vs its diagonal control and the structured baselines.

    nice -n 5 python bench/quality/cocurve_smollm2.py --stage graph --preset quick --ranks 2   # H once (gloo)
    nice -n 5 python bench/quality/cocurve_smollm2.py --stage rows --preset quick --rhos 0.2,0.3 &
    nice -n 5 python bench/quality/cocurve_smollm2.py --stage rows --preset quick --rhos 0.4,0.5
    python bench/quality/cocurve_smollm2.py --render                                          # results/*.md + plot

Protocol (every row shares it): units = 3 KV groups + 16 contiguous FFN groups per layer (570 units);
cost = removable parameters (structured inventory); guards = layers 0, 1, 28, 29 protected, per-layer
cap 1.5 rho; budget = the shared greedy solver (``allocate_global``; CoCurve's own conditional greedy
for CoCurve). Calibration: C4 (local validation documents [0, 1500)), Wanda's random-long-document rule,
seed 0; the first ``n_graph`` windows build H / the baselines' statistics, the last ``n_heldout`` are
the disjoint held-out split C' (lambda choice and the KL column). Perplexity: sliding 2048/512
(``perplexity(..., stride=512)``) on WikiText-2 test, C4 held-out documents [1500, 2000) and PTB test,
the first ``ppl_windows`` windows. Held-out KL: full vocabulary, mean over every held-out token, masked
model. H does not depend on rho: it is built once (``--stage graph``) and reused for every budget.

Baseline scores (src/secateur/scoring/structured.py): Wanda-sp ``sum_j ||W_:,j|| ||X_j||`` and magnitude
(Frobenius norm of every weight a unit owns) ranked per parameter (score / cost); FLAP = AL-AM
standardized WIFV scores (may be negative, so ranked raw), random = seeded uniform scores (raw). No
bias compensation for any method (masks only, as in the paper).

Presets (``PRESETS``; a preset may also name its ``rhos``, ``methods``, ``coec_methods``, an independent test
split ``n_test`` and the rows measured on every perplexity window, ``full_ppl``):

* ``quick``: what 2 shared cores allow (4 x 256 graph tokens; the committed results).
* ``medium`` (issue 26; about 3 h on 2 quiet cores, ``--dry-run`` prints its plan; ``bench/quality/cocurve_medium.sh``
  runs it resumably): graph on
  16 x 512 C4 tokens (seed 0), lambda chosen on 16 x 512 disjoint held-out tokens, held-out KL reported on a
  third, independent 16 x 512 test split (never used to choose anything); the three splits are drawn from
  disjoint C4 documents (``DOC_SPLIT``). Scaling rule from the paper's
  2048-token protocol: the position stride is kept (P_tok 128 at T 2048 = one position every 16 tokens ->
  P_tok 32 at T 512), top-r 256 is kept (a vocabulary support size, not a length). Rows at 20% and 30%:
  CoCurve, its diagonal control, Wanda-sp, FLAP, random (same units, guard and budget), then CoCurve + COEC
  and Wanda-sp + COEC (``--stage coec``). Perplexity at ``nonoverlap-2048`` on the first 16 windows of each
  corpus, every WikiText-2 window for the 30% CoCurve row; zero-shot for four 30% rows.
* ``full``: the paper's protocol (128 x 2048 graph, P_tok 128, r 256, 16 held-out) + a 16 x 2048 test split,
  every perplexity window; sized for one GPU (``bench/quality/device_cocurve_full.sh``).
* ``smoke`` / ``tiny``: plumbing checks (``tiny``: the random tiny Llama of ``device_cocurve_full.sh TINY=1``).

Where it runs (flags, or the same environment variables for spawned ranks): ``--device`` (``COCURVE_DEVICE``,
default cpu: the model is loaded there and every library call follows the model's device), ``--model``
(``COCURVE_MODEL``, default the ``smollm2-135m`` alias; a ``.gguf`` file or a folder), ``--inputs``
(``COCURVE_INPUTS``: a token file written by ``--stage pack``, so no corpus or tokenizer pass is needed
there), ``--results`` / ``--work`` (``COCURVE_RESULTS`` / ``COCURVE_WORK``: where rows and graphs go).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: bench.* imports
from bench.quality.cocurve import base as run
from bench.quality.cocurve.base import COEC_METHODS, METHODS, PRESETS, _configure, preset_methods, preset_rhos
from bench.quality.cocurve.graph import _graph_worker, stage_graph, stage_pack, stage_tiny_setup
from bench.quality.cocurve.page import render
from bench.quality.cocurve.plan import dry_run
from bench.quality.cocurve.rows import stage_coec, stage_rows, stage_zs


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", default=None,
                    help="comma-separated, in order: tiny-setup, pack, probe, graph, rows, coec, zs")
    ap.add_argument("--preset", default="quick", choices=sorted(PRESETS))
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--rhos", default=None, help="default: the preset's rhos, else 0.2,0.3,0.4,0.5")
    ap.add_argument("--methods", default=None, help="default: the preset's methods (--stage coec: coec_methods)")
    ap.add_argument("--no-dense", action="store_true")
    ap.add_argument("--zs", action="store_true", help="--stage coec: add the zero-shot column (first 100 docs/task)")
    ap.add_argument("--render", action="store_true")
    ap.add_argument("--resume", action="store_true",
                    help="--stage graph: continue a killed sweep from its per-block checkpoint (bit-identical H)")
    ap.add_argument("--dry-run", action="store_true", help="print the preset's plan and estimated cost; run nothing")
    ap.add_argument("--device", default=None, help="where the model runs (default cpu; $COCURVE_DEVICE)")
    ap.add_argument("--model", default=None, help="model spec (default the smollm2-135m alias; $COCURVE_MODEL)")
    ap.add_argument("--inputs", default=None, help="token file of --stage pack ($COCURVE_INPUTS); pack: its output")
    ap.add_argument("--results", default=None, help="rows and pages folder (default results/text/; $COCURVE_RESULTS)")
    ap.add_argument("--work", default=None, help="graphs and exports (default bench/_work/cocurve-smollm2)")
    ap.add_argument("--probe-seqs", type=int, default=1, help="--stage probe: sequences swept and timed")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="--stage probe: exit 3 when the projected sweep exceeds this many seconds")
    return ap


def main() -> None:
    args = _parser().parse_args()
    for flag, var in (("device", "COCURVE_DEVICE"), ("model", "COCURVE_MODEL"), ("results", "COCURVE_RESULTS"),
                      ("work", "COCURVE_WORK")):
        if getattr(args, flag) is not None:
            os.environ[var] = str(Path(getattr(args, flag)).resolve()) if flag in ("results", "work") else \
                getattr(args, flag)
    stages = args.stage.split(",") if args.stage else []
    if args.inputs is not None and "pack" not in stages:
        os.environ["COCURVE_INPUTS"] = str(Path(args.inputs).resolve())
    _configure()  # spawned ranks read the same variables
    run.RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    p = PRESETS[args.preset]
    rhos = [float(x) for x in args.rhos.split(",")] if args.rhos else preset_rhos(p)
    methods = args.methods.split(",") if args.methods else preset_methods(p)
    coec = ([m for m in methods if m in COEC_METHODS] if args.methods
            else list(p.get("coec_methods", COEC_METHODS)))
    if args.dry_run:
        dry_run(args.preset, rhos, [m for m in methods if m in METHODS],
                [m for m in coec if m in COEC_METHODS] if "coec_methods" in p or args.methods else [], args.ranks)
        return
    for stage in stages:
        if stage == "pack":
            stage_pack(args.preset, Path(args.inputs or run.DIR / f"inputs-{args.preset}.pt"))
        elif stage == "tiny-setup":
            stage_tiny_setup(run.DIR)
        elif stage == "probe":  # the sweep on the first --probe-seqs sequences, timed; nothing saved
            torch.set_num_threads(1)
            _graph_worker(0, 1, args.preset, args.probe_seqs)
            if args.budget_s is not None:
                projected = json.loads((run.RESULTS_DIR / f"cocurve-probe-{args.preset}.json").read_text())
                if projected["projected_sweep_s"] > args.budget_s:
                    print(f"projected sweep {projected['projected_sweep_s']:.0f} s > --budget-s {args.budget_s}: "
                          "stopping before the sweep", flush=True)
                    raise SystemExit(3)
        elif stage == "graph":
            stage_graph(args.preset, args.ranks, args.resume)
        elif stage == "rows":
            stage_rows(args.preset, rhos, [m for m in methods if m in METHODS], not args.no_dense)
        elif stage == "coec":
            stage_coec(args.preset, rhos, tuple(coec) or COEC_METHODS, zs=args.zs)
        elif stage == "zs":  # the main table's zero-shot column (first 100 docs/task), cell by cell
            stage_zs(args.preset, rhos, [m for m in methods if m in METHODS])
        else:
            raise SystemExit(f"unknown stage {stage!r}: tiny-setup, pack, probe, graph, rows, coec, zs")
    if args.render:
        render()


if __name__ == "__main__":
    main()
