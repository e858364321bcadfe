"""Issue 30: recovery (LoRA distillation from the dense model) of pruned SmolLM2-135M.
Writes results/text/recovery-smollm2.{jsonl,md} and results/text/recovery-smollm2-curve.png.

    python bench/quality/recovery_smollm2.py                    # every row not yet done (resumable), then render
    python bench/quality/recovery_smollm2.py --rows wanda-50    # some rows
    python bench/quality/recovery_smollm2.py --render
    BENCH_THREADS=2 python bench/quality/recovery_smollm2.py --model qwen2.5-0.5b --rows wanda_sp-30   # Qwen section

Protocol (every stage through the public commands, each in its own process so its peak RSS is its own):
* prune: ``secateur prune --calib c4 --nsamples 16 --seqlen 2048 --seed 0`` (the papers use 128 x 2048; 16 keeps
  a row to minutes here) with the row's method;
* recover: ``secateur recover RUN --data c4 --tokens 65536`` (the defaults: LoRA r 16, alpha 32 on every attention
  and MLP projection; top-64 KL to the dense model; windows of 512, one per step; AdamW 1e-3 cosine), the curve row
  also ``--heldout-every 32`` (held-out perplexity of 4 x 512 C4 tokens from documents disjoint from training).
  Rows record the defaults they ran under (``DEFAULTS``); a row of earlier defaults (batch 4, lr 2e-4, session 13)
  is kept and shown apart;
* evaluate, before and after: perplexity at ``nonoverlap-2048`` on the first ``EVAL_WINDOWS`` windows of
  WikiText-2, C4 and PTB (test splits; 8 windows = 16,384 tokens each), and the seven-task zero-shot mean on the
  first 200 documents per task. The dense model is evaluated the same way once.

Each stage leaves its output under bench/_work/recovery-smollm2/<row>/ and is skipped when it is there, so a stopped
run continues (a killed prune or recovery from its checkpoint: ``--resume``); a row is appended to the JSONL
when its last stage is done. ``BENCH_THREADS`` (default 1) threads per process.

``--model qwen2.5-0.5b`` (the Qwen2.5-Coder-0.5B GGUF of ``bench/tools/get_models.py``): the same protocol, sized to
an hour on 2 cores (``PRESETS``: 32,768 recovery tokens, the first 4 windows of each corpus, 50 documents per
zero-shot task); its rows carry ``model`` and render as their own section, under bench/_work/recovery-<model>/.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: bench.* imports
from bench.common import START_COMMIT, WORK, append_row, fmt, fmt_zs, model_path, read_rows, results_dir, run_logged

OUT_JSON = results_dir("text") / "recovery-smollm2.jsonl"
OUT_MD = results_dir("text") / "recovery-smollm2.md"
OUT_PNG = results_dir("text") / "recovery-smollm2-curve.png"
DIR = WORK / "recovery-smollm2"
MODEL = "smollm2-135m"  # the page's model; --model picks a section's
PRUNE = ["--calib", "c4", "--nsamples", "16", "--seqlen", "2048", "--seed", "0"]
RECOVER = ["--data", "c4", "--tokens", "65536"]
#: per model: recovery tokens, perplexity windows per corpus, zero-shot documents per task, the section's title
PRESETS = {"smollm2-135m": (65536, 8, 200, "SmolLM2-135M"), "qwen2.5-0.5b": (32768, 4, 50, "Qwen2.5-Coder-0.5B")}
CURVE_ROW, CURVE_EVERY = "wanda_sp-30", 32
DEFAULTS = "batch 1, lr 1e-3"  # the recover defaults the rows ran under (session 13's rows: "batch 4, lr 2e-4")
OLD_DEFAULTS = "batch 4, lr 2e-4"
EVAL_WINDOWS = 8
CORPORA = ("wikitext2", "c4", "ptb")
ZS_LIMIT = 200


def _use(model: str) -> None:
    """Point the module's settings at ``model``'s preset (the page's defaults are SmolLM2's)."""
    global MODEL, DIR, RECOVER, EVAL_WINDOWS, ZS_LIMIT
    tokens, EVAL_WINDOWS, ZS_LIMIT, _ = PRESETS[model]
    MODEL, RECOVER = model, ["--data", "c4", "--tokens", str(tokens)]
    DIR = WORK / ("recovery-smollm2" if model == "smollm2-135m" else f"recovery-{model}")


def _of(r: dict) -> str:
    return r.get("model", "smollm2-135m")  # the SmolLM2 rows predate the field
ROWS = {  # name: the prune flags of the row
    "wanda_sp-30": ["--method", "wanda-sp", "--sparsity", "0.3"],
    "wanda-50": ["--method", "wanda", "--sparsity", "0.5"],
    "flap-20": ["--method", "flap", "--sparsity", "0.2"],
    "wanda_sp-30+coec": ["--method", "wanda-sp", "--sparsity", "0.3", "--compensation", "coec"],
    "cocurve-30": ["--method", "cocurve", "--sparsity", "0.3"],
}
#: rows whose calibration is not ``PRUNE``'s: CoCurve's graph costs ~0.4 dense forwards per ablated unit and
#: position window (results/speed/cocurve-sweep-cost.md), ~1.4 h on 2 cores at 16 x 2048; it runs at the medium protocol
#: of results/text/cocurve-smollm2-medium.md instead (graph on 16 x 512 C4 tokens, the last 16 of 32 windows held out
#: for the lambda choice, 32 positions per window: the paper's position stride at 512 tokens)
ROW_PRUNE = {"cocurve-30": ["--calib", "c4", "--nsamples", "32", "--seqlen", "512", "--heldout", "16",
                            "--positions", "32", "--seed", "0"]}


def _threads() -> str:
    return os.environ.get("BENCH_THREADS", "1")


def _env_cmd(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "secateur", *args]


def _stage(name: str, out: Path, cmd: list[str], log: Path) -> dict:
    """Run ``cmd`` unless ``out`` exists; ``{seconds, load_before}`` (None when skipped)."""
    if out.exists():
        return {}
    load = os.getloadavg()[0]
    os.environ["OMP_NUM_THREADS"] = _threads()
    rc, s = run_logged(cmd, log)
    if rc != 0:
        raise SystemExit(f"{name} failed (exit {rc}); see {log}")
    print(f"{name}: {s:.0f} s (load before {load:.2f})", flush=True)
    return {"seconds": round(s, 1), "load_before": round(load, 2)}


def evaluate(model: str, out: Path) -> None:
    """The evaluation of one model (run in a child process): ppl on the three corpora and the zero-shot cell."""
    import torch

    from bench.common import zeroshot_cell
    from secateur import api
    from secateur.models.loading import load_model

    torch.set_num_threads(int(_threads()))
    t0 = time.perf_counter()
    m, tok = load_model(model)
    ppl = {}
    for corpus in CORPORA:
        r = api.eval_ppl(m, corpus, seqlen=2048, max_windows=EVAL_WINDOWS, tokenizer=tok, progress=False)
        ppl[corpus] = {"ppl": r["ppl"], "windows": r.get("windows"), "protocol": r.get("protocol"),
                       "tokens_sha256": r.get("tokens_sha256")}
    zs = zeroshot_cell(m, tok, limit=ZS_LIMIT)
    res = {"model": model, "ppl": ppl, "zeroshot": zs, "seconds": round(time.perf_counter() - t0, 1),
           "threads": torch.get_num_threads()}
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(res, indent=1))
    os.replace(tmp, out)


def _eval_stage(model: str, out: Path, log: Path) -> None:
    _stage(f"eval {out.parent.name}/{out.stem}", out,
           [sys.executable, __file__, "--model", MODEL, "--eval-one", model, "--eval-out", str(out)], log)


def _dense_row() -> dict | None:
    """The dense model's evaluation, a committed row (key ``dense``), so ``--render`` needs no work folder."""
    return next((r["eval"] for r in read_rows(OUT_JSON) if r.get("key") == "dense" and _of(r) == MODEL), None)


def dense() -> dict:
    if (dz := _dense_row()) is not None:
        return dz
    d = DIR / "dense"
    d.mkdir(parents=True, exist_ok=True)
    _eval_stage(model_path(MODEL), d / "eval.json", d / "log.txt")
    dz = json.loads((d / "eval.json").read_text())
    append_row(OUT_JSON, {"key": "dense", "model": MODEL, "threads": int(_threads()), "eval": dz})
    return dz


def _defaults(r: dict) -> str:
    return r.get("defaults", OLD_DEFAULTS)


def row(name: str) -> None:
    if any(r.get("key") == name and _defaults(r) == DEFAULTS and _of(r) == MODEL for r in read_rows(OUT_JSON)):
        print(f"{name}: done", flush=True)
        return
    d = DIR / name
    d.mkdir(parents=True, exist_ok=True)
    log = d / "log.txt"
    pruned, recovered = d / "pruned", d / "recovered"
    prune = ROW_PRUNE.get(name, PRUNE)
    _stage(f"prune {name}", pruned, _env_cmd(["prune", "--model", model_path(MODEL), *ROWS[name], *prune, "--out",
                                              str(pruned), "--quiet", "--resume"]), log)
    _eval_stage(str(pruned), d / "eval-pruned.json", log)
    rec = RECOVER + (["--heldout-every", str(CURVE_EVERY)] if name == CURVE_ROW and MODEL == "smollm2-135m" else [])
    _stage(f"recover {name}", recovered, _env_cmd(["recover", str(pruned), *rec, "--out", str(recovered), "--quiet",
                                                           "--resume"]),
           log)
    _eval_stage(str(recovered), d / "eval-recovered.json", log)
    report = json.loads((recovered / "secateur-report.json").read_text())
    prune_report = json.loads((pruned / "secateur-report.json").read_text())
    r = report["recovery"]
    append_row(OUT_JSON, {
        "key": name, "model": MODEL, "defaults": DEFAULTS, "prune_flags": ROWS[name] + prune, "recover_flags": rec,
        "threads": int(_threads()),
        "realized_sparsity": prune_report.get("realized_sparsity"), "params": prune_report.get("params"),
        "prune_wall_s": prune_report.get("timings", {}).get("total_s"), "prune_peak_rss_mb":
        prune_report.get("peak_rss_mb"),
        "recovery": {"command": r["command"], "tokens": r["settings"]["tokens"], "steps": r["steps"],
                     "wall_s": r["wall_s"], "train_s": r["train_s"], "peak_rss_mb": r["peak_rss_mb"],
                     "heldout": r["heldout"], "curve": r.get("curve"), "loss_first": r["loss"]["first"],
                     "loss_last": r["loss"]["last"], "adapter_params": r["settings"]["adapter_params"],
                     "masks": r.get("masks") and {k: v for k, v in r["masks"].items() if k != "realized_sparsity"}},
        "before": json.loads((d / "eval-pruned.json").read_text()),
        "after": json.loads((d / "eval-recovered.json").read_text()),
    })
    print(f"{name}: row written", flush=True)


def _ppl(e: dict, corpus: str) -> float:
    return e["ppl"][corpus]["ppl"]


def _gap(before: float, after: float, dense_: float) -> str:
    """Share of the pruning gap recovery closed, in log-perplexity (the loss): (log b - log a) / (log b - log d)."""
    import math

    if before <= dense_:
        return "-"
    return f"{100 * (math.log(before) - math.log(after)) / (math.log(before) - math.log(dense_)):.0f}%"


def render() -> None:
    _use("smollm2-135m")
    every = [r for r in read_rows(OUT_JSON) if r.get("key") != "dense" and _of(r) == MODEL]
    rows = [r for r in every if _defaults(r) == DEFAULTS]
    old = [r for r in every if _defaults(r) != DEFAULTS]
    dz = _dense_row()
    L = ["# Recovery of pruned SmolLM2-135M: LoRA distillation from the dense model (issue 30)\n",
         "Made by `python bench/quality/recovery_smollm2.py` (rows in `recovery-smollm2.jsonl`; protocol in its "
         "docstring). "
         "Prune: C4 16 x 2048 calibration (seed 0). Recover: `secateur recover RUN --data c4 --tokens 65536` "
         "(LoRA r 16 / alpha 32 on every attention and MLP projection, top-64 KL to the dense model, 512-token "
         "windows, one per step, AdamW 1e-3 cosine, seed 0; C4 training documents disjoint from every evaluation "
         f"split). Evaluation: perplexity at nonoverlap-2048 on the first {EVAL_WINDOWS} windows of each test "
         f"split; zero-shot: seven-task mean on the first {ZS_LIMIT} documents per task (task-stratified SE). "
         "Gap closed: the share of the pruned model's excess log-perplexity over the dense model that recovery "
         "removed, (log before - log after) / (log before - log dense).\n"]
    if dz:
        L.append(f"Dense: WikiText-2 {_ppl(dz, 'wikitext2'):.2f}, C4 {_ppl(dz, 'c4'):.2f}, PTB "
                 f"{_ppl(dz, 'ptb'):.2f}, zero-shot {fmt_zs(dz['zeroshot'])}.\n")
    L += ["Realized: the share of the targeted weights removed / of all parameters (the CLI's `--sparsity 0.3` for "
          "Wanda-sp keeps every one of SmolLM2's 3 KV groups per layer under uniform ceil rounding, so 30% of the MLP "
          "channels go and 22.5% of the targeted weights).\n",
          *_table(rows, dz)]
    L += _claim(rows, dz)
    if old:
        L += ["", f"Earlier defaults ({OLD_DEFAULTS}: 32 steps of 4 windows), the same prune and evaluation:", "",
              *_table(old, dz), *_claim(old, dz)]
    curves = {d: next((r["recovery"]["curve"] for r in rs if r["key"] == CURVE_ROW and r["recovery"].get("curve")),
                      None) for d, rs in ((DEFAULTS, rows), (OLD_DEFAULTS, old))}
    curves = {d: c for d, c in curves.items() if c}
    if curves:
        _plot(curves)
        L.append(f"\nHeld-out perplexity of `{CURVE_ROW}` against recovery tokens (4 x 512 held-out C4 tokens from "
                 "documents disjoint from training): "
                 + "; ".join(f"{d} (every {c['every']} steps): " + ", ".join(f"{p[1]}: {p[2]:.2f}" for p in c["points"])
                             for d, c in curves.items()) + f". ![curve]({OUT_PNG.name})\n")
    for model in PRESETS:
        if model != "smollm2-135m":
            L += _section(model)
    OUT_MD.write_text("\n".join(L) + "\n")
    print(f"wrote {OUT_MD}")


def _section(model: str) -> list[str]:
    """Another model's section: its protocol, dense evaluation, rows and claim shape (none if no rows yet)."""
    _use(model)
    rows = [r for r in read_rows(OUT_JSON) if r.get("key") != "dense" and _of(r) == model]
    if not rows:
        return []
    dz, tokens = _dense_row(), PRESETS[model][0]
    L = ["", f"## {PRESETS[model][3]}", "",
         f"`python bench/quality/recovery_smollm2.py --model {model}`: the protocol above, sized to this machine: "
         f"`--tokens {tokens}`, perplexity on the first {EVAL_WINDOWS} windows of each test split, zero-shot on the "
         f"first {ZS_LIMIT} documents per task; {rows[0]['threads']} threads per process.", ""]
    if dz:
        L.append(f"Dense: WikiText-2 {_ppl(dz, 'wikitext2'):.2f}, C4 {_ppl(dz, 'c4'):.2f}, PTB "
                 f"{_ppl(dz, 'ptb'):.2f}, zero-shot {fmt_zs(dz['zeroshot'])}.\n")
    return L + _table(rows, dz) + _claim(rows, dz)


def _table(rows: list[dict], dz: dict | None) -> list[str]:
    """The before/after table of ``rows``."""
    L = ["| row | realized | stage | WikiText-2 | C4 | PTB | zero-shot | gap closed (WT2 / C4 / PTB) | recovery "
         "tokens | recovery wall (s) | peak RSS (MB) | load | commit |",
         "|---|---|---|---:|---:|---:|---|---|---:|---:|---:|---|---|"]
    for r in rows:
        rs = r.get("realized_sparsity") or {}
        real = (f"{100 * rs['targeted']:.1f}% / {100 * rs['of_all_parameters']:.1f}%"
                if "targeted" in rs and "of_all_parameters" in rs else None)
        rec = r["recovery"]
        for stage in ("before", "after"):
            e = r[stage]
            gap = " / ".join(_gap(_ppl(r["before"], c), _ppl(e, c), _ppl(dz, c)) for c in CORPORA) \
                if (dz and stage == "after") else ""
            L.append(f"| {r['key']} | {fmt(real) if stage == 'before' else ''} | {stage} | "
                     + " | ".join(f"{_ppl(e, c):.2f}" for c in CORPORA)
                     + f" | {fmt_zs(e['zeroshot'])} | {gap} | "
                     + (f"{rec['tokens']} | {rec['wall_s']:.0f} | {rec['peak_rss_mb']:.0f} | "
                        f"{r['load_avg_1_5_15'][0]} | `{r['commit']}` |" if stage == "after" else
                        f" | | {fmt(r.get('prune_peak_rss_mb'), 0)} | | |"))
    return L


def _claim(rows: list[dict], dz: dict | None) -> list[str]:
    """The paper's claim shape (CoCurve, Sec. 5: LoRA after 50% selection brings perplexities of 41.7-4616.9 down
    to 12.6-38.0, most of the gap to dense) against each row: the share of the gap closed, and the teacher KL."""
    import math

    if not rows or not dz:
        return []
    out = ["", "Claim shape (most of the gap to the dense model closed by recovery):"]
    for r in rows:
        gaps = [(math.log(_ppl(r["before"], c)) - math.log(_ppl(r["after"], c)))
                / (math.log(_ppl(r["before"], c)) - math.log(_ppl(dz, c))) for c in CORPORA
                if _ppl(r["before"], c) > _ppl(dz, c)]
        h = r["recovery"].get("heldout") or {}
        kl = (f"; held-out top-64 KL to the teacher {h['pruned']:.3f} -> {h['output']:.3f}"
              if h.get("pruned") is not None else "")
        verdict = "holds" if gaps and min(gaps) >= 0.5 else "does not hold at this budget"
        out.append(f"* `{r['key']}`: {100 * min(gaps):.0f}% to {100 * max(gaps):.0f}% of the log-perplexity gap "
                   f"closed{kl}: **{verdict}** ({r['recovery']['tokens']} tokens, {r['recovery']['steps']} steps).")
    return out


def _plot(curves: dict[str, dict]) -> None:
    """Held-out perplexity against recovery tokens, one line per recovery defaults."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    for label, curve in curves.items():
        pts = curve["points"]
        ax.plot([p[1] for p in pts], [p[2] for p in pts], marker="o", label=label)
    ax.set_xlabel("recovery tokens")
    ax.set_ylabel("held-out C4 perplexity")
    ax.set_title(f"{CURVE_ROW}: recovery curve")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(OUT_PNG, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", choices=list(PRESETS))
    ap.add_argument("--rows", default=",".join(ROWS), help="comma-separated rows, in order")
    ap.add_argument("--render", action="store_true", help="only render the page from the committed rows")
    ap.add_argument("--dense", action="store_true", help="only evaluate the dense model (a row), then render")
    ap.add_argument("--eval-one", help=argparse.SUPPRESS)
    ap.add_argument("--eval-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    _use(args.model)
    if args.eval_one:
        return evaluate(args.eval_one, Path(args.eval_out))
    if not args.render:
        print(f"start {time.strftime('%FT%TZ', time.gmtime())} {START_COMMIT} load {os.getloadavg()[0]:.2f}")
        dense()
        for name in ([] if args.dense else args.rows.split(",")):
            if name not in ROWS:
                raise SystemExit(f"--rows: unknown row {name!r}; choose from {', '.join(ROWS)}")
            row(name)
    render()


if __name__ == "__main__":
    main()
