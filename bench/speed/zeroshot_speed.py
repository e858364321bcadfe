"""Zero-shot scorer speed vs the LM Evaluation Harness on the same requests (SmolLM2-135M, CPU).

    nice python bench/speed/zeroshot_speed.py --limit 50            # ~10-20 min on 2 shared cores
    nice python bench/speed/zeroshot_speed.py --limit 5 --no-write  # smoke

Protocol: the first ``--limit`` documents of each task of the seven-task suite (local data, harness
prompts). For each task, in one process and alternating the order task by task so that machine load
hits both alike:
  * ours: ``secateur.eval.zeroshot.loglikelihoods`` (packed: one forward per document, lm_head on
    scored positions only), ``--batch-size`` documents per forward;
  * lm-eval: ``HFLM(pretrained=model, tokenizer=tok, batch_size=--harness-batch-size)``
    ``.loglikelihood(requests)`` on the identical ``(context, continuation)`` strings (its own
    tokenization, sorting, one-token logits cache);
  * optionally ``--plain``: our scorer with one row per request (the harness layout).
Throughput = request tokens / wall seconds, where request tokens = sum over requests of
len(context tokens) + len(continuation tokens) (the same count for every scorer). Both scorers' per-
request log-likelihoods are compared (max |diff|, argmax mismatches) as a by-product. One warm-up of
each scorer on two documents before timing. torch threads = ``--threads`` (default 1: on a shared
2-core machine two threads under contention run several times slower than one).
Writes results/speed/zeroshot-speed.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: bench.* imports
from bench.common import results_dir, stamped

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "results" / "speed"


def _time(fn):
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w, time.process_time() - c


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=50)
    ap.add_argument("--tasks", default=None, help="comma list (default: the seven-task suite)")
    ap.add_argument("--batch-size", type=int, default=4, help="our documents per forward")
    ap.add_argument("--harness-batch-size", type=int, default=4, help="lm-eval requests per forward (spec: 4)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--plain", action="store_true", help="also time our plain (one row per request) layout")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--no-write", action="store_true")
    return ap


def harness_scorer(lm, instance_cls):
    """lm-eval's loglikelihood over the items' requests, regrouped per item as (logprob, is_greedy) pairs."""

    def harness(items):
        reqs = [instance_cls(request_type="loglikelihood", doc={}, arguments=r, idx=j)
                for it in items for j, r in enumerate(it.requests)]
        flat = lm.loglikelihood(reqs, disable_tqdm=True)
        out, k = [], 0
        for it in items:
            out.append([(float(x[0]), bool(x[1])) for x in flat[k:k + len(it.requests)]])
            k += len(it.requests)
        return out

    return harness


def time_task(n, t, a, model, tok, data, harness) -> dict:
    """One task: both scorers (and ``--plain``) timed on the same requests, in an order alternated by task
    index ``n``; their log-likelihoods and predictions compared."""
    from secateur.eval.zeroshot import encode_pair, item_metrics, loglikelihoods
    from secateur.eval.zeroshot_tasks import load_items, task_spec

    items = load_items(t, data, a.limit)
    req_tok = sum(len(c) + len(x) for it in items for c, x in
                  (encode_pair(tok, *r) for r in it.requests))
    runs = {"ours": lambda items=items: loglikelihoods(model, tok, items, batch_size=a.batch_size),
            "lm_eval": lambda items=items: harness(items)}
    if a.plain:
        runs["ours_plain"] = lambda items=items: loglikelihoods(model, tok, items, batch_size=4 * a.batch_size,
                                                                strategy="plain")
    order = list(runs) if n % 2 == 0 else list(runs)[::-1]
    res, wall, cpu = {}, {}, {}
    for name in order:
        res[name], wall[name], cpu[name] = _time(runs[name])
    ours, theirs = res["ours"], res["lm_eval"]
    diff = max(abs(o[0] - h[0]) for oi, hi in zip(ours, theirs) for o, h in zip(oi, hi))
    metric = task_spec(t).metric
    mo = [item_metrics([r[0] for r in o], it.choices, it.gold) for o, it in zip(ours, items)]
    mh = [item_metrics([r[0] for r in h], it.choices, it.gold) for h, it in zip(theirs, items)]
    row = {"task": t, "items": len(items), "requests": sum(len(it.requests) for it in items),
           "request_tokens": req_tok, "wall_s": wall, "cpu_s": cpu,
           "tokens_per_s": {k: req_tok / v for k, v in wall.items()},
           "speedup_vs_lm_eval": wall["lm_eval"] / wall["ours"],
           "max_abs_ll_diff": diff,
           "pred_mismatch": sum(x["pred"] != y["pred"] for x, y in zip(mo, mh)),
           "pred_norm_mismatch": sum(x["pred_norm"] != y["pred_norm"] for x, y in zip(mo, mh)),
           "metric": metric, "score_ours": float(np.mean([x[metric] for x in mo])),
           "score_lm_eval": float(np.mean([x[metric] for x in mh]))}
    if "ours_plain" in wall:
        row["speedup_packed_vs_plain"] = wall["ours_plain"] / wall["ours"]
    return row


def summarize(rows: list[dict]) -> dict:
    """Totals over the tasks: request tokens, wall and CPU seconds, throughput and speedups."""
    tot_tok = sum(r["request_tokens"] for r in rows)
    tot = {k: sum(r["wall_s"][k] for r in rows) for k in rows[0]["wall_s"]}
    tot_cpu = {k: sum(r["cpu_s"][k] for r in rows) for k in rows[0]["cpu_s"]}
    summary = {"request_tokens": tot_tok, "wall_s": tot, "cpu_s": tot_cpu,
               "tokens_per_s": {k: tot_tok / v for k, v in tot.items()},
               "speedup_vs_lm_eval_wall": tot["lm_eval"] / tot["ours"],
               "speedup_vs_lm_eval_cpu": tot_cpu["lm_eval"] / tot_cpu["ours"]}
    if "ours_plain" in tot:
        summary["speedup_packed_vs_plain_wall"] = tot["ours_plain"] / tot["ours"]
    return summary


def main() -> None:
    a = _parser().parse_args()
    torch.set_num_threads(a.threads)

    from lm_eval.api.instance import Instance

    from secateur.eval.lmeval_bridge import harness_version, make_hflm
    from secateur.eval.zeroshot import loglikelihoods, parse_tasks, zeroshot_data_dir
    from secateur.eval.zeroshot_tasks import load_items
    from secateur.models.loading import load_model
    from secateur.runinfo import machine, versions

    tasks = parse_tasks(a.tasks)
    data = zeroshot_data_dir(a.data_dir)
    model, tok = load_model("smollm2-135m")
    lm = make_hflm(model, tok, batch_size=a.harness_batch_size)
    harness = harness_scorer(lm, Instance)

    warm = load_items(tasks[0], data, 2)
    loglikelihoods(model, tok, warm, batch_size=a.batch_size)
    harness(warm)

    load_before = os.getloadavg()
    rows = []
    for n, t in enumerate(tasks):
        row = time_task(n, t, a, model, tok, data, harness)
        rows.append(row)
        wall = row["wall_s"]
        print(f"{t:<14} items {row['items']:>4}  tokens {row['request_tokens']:>7}  ours {wall['ours']:7.1f}s "
              f"lm-eval {wall['lm_eval']:7.1f}s  x{row['speedup_vs_lm_eval']:.2f}  max|dll| "
              f"{row['max_abs_ll_diff']:.1e}", flush=True)
    load_after = os.getloadavg()

    summary = summarize(rows)
    cfg = model.config
    out = {
        "protocol": {"name": "zeroshot-speed", "limit": a.limit, "tasks": tasks, "num_fewshot": 0,
                     "our_batch_size_documents": a.batch_size, "lm_eval_batch_size_requests": a.harness_batch_size,
                     "model": "smollm2-135m (SmolLM2-135M-Instruct, Q4_1 GGUF dequantized)",
                     "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
                     "attn_implementation": getattr(cfg, "_attn_implementation", None),
                     "max_length": lm.max_length, "threads": a.threads, "data_dir": str(data),
                     "throughput": "request tokens (len ctx + len cont per request) / wall seconds"},
        "versions": {**versions(), "lm_eval": harness_version()},
        "machine": {**machine(), "loadavg_before": load_before, "loadavg_after": load_after},
        "tasks": rows, "summary": summary,
    }
    print(json.dumps(summary, indent=1))
    if a.no_write:
        return
    (results_dir("speed") / "zeroshot-speed.json").write_text(json.dumps(stamped(out), indent=1))
    (results_dir("speed") / "zeroshot-speed.md").write_text(render(out))
    print(f"wrote {RESULTS / 'zeroshot-speed.md'}")


def render(out: dict) -> str:
    p, s, m, v = out["protocol"], out["summary"], out["machine"], out["versions"]
    plain = "ours_plain" in s["wall_s"]
    lines = [
        "# Zero-shot scorer speed vs lm-eval (SmolLM2-135M, CPU)",
        "",
        f"Command: `python bench/speed/zeroshot_speed.py --limit {out['protocol']['limit']}`.",
        "",
        f"Same requests for both: the first {p['limit']} documents of each task ({', '.join(p['tasks'])}), "
        f"0-shot, harness prompts from the local data. Ours: packed (one forward per document, "
        f"{p['our_batch_size_documents']} documents per forward, lm_head on scored positions only). "
        f"lm-eval {v['lm_eval']}: `HFLM(pretrained=model).loglikelihood`, batch {p['lm_eval_batch_size_requests']} "
        f"requests. Throughput = request tokens (context + continuation tokens of every request) / wall "
        f"seconds. Model {p['model']}, {p['dtype']}, {p['attn_implementation']} attention, max length "
        f"{p['max_length']}, torch threads {p['threads']}; task order of the two scorers alternated.",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores (shared with other jobs: load average "
        f"{m['loadavg_before'][0]:.1f} before, {m['loadavg_after'][0]:.1f} after); torch {v['torch']}, "
        f"transformers {v['transformers']}, Python {v['python']}.",
        "",
        "| task | items | requests | request tokens | ours s | lm-eval s | ours tok/s | lm-eval tok/s | speedup |"
        + (" plain s | packed/plain |" if plain else "")
        + " max abs dll | pred diff (acc/acc_norm) | score ours / lm-eval |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if plain else "") + "---:|---:|---:|",
    ]
    for r in out["tasks"]:
        w, tps = r["wall_s"], r["tokens_per_s"]
        lines.append(
            f"| {r['task']} | {r['items']} | {r['requests']} | {r['request_tokens']} | {w['ours']:.1f} | "
            f"{w['lm_eval']:.1f} | {tps['ours']:.0f} | {tps['lm_eval']:.0f} | {r['speedup_vs_lm_eval']:.2f}x |"
            + (f" {w['ours_plain']:.1f} | {r['speedup_packed_vs_plain']:.2f}x |" if plain else "")
            + f" {r['max_abs_ll_diff']:.1e} | {r['pred_mismatch']}/{r['pred_norm_mismatch']} | "
            f"{100 * r['score_ours']:.1f} / {100 * r['score_lm_eval']:.1f} ({r['metric']}) |")
    w, tps = s["wall_s"], s["tokens_per_s"]
    lines.append(
        f"| **total** | | | {s['request_tokens']} | {w['ours']:.1f} | {w['lm_eval']:.1f} | {tps['ours']:.0f} | "
        f"{tps['lm_eval']:.0f} | **{s['speedup_vs_lm_eval_wall']:.2f}x** |"
        + (f" {w['ours_plain']:.1f} | {s['speedup_packed_vs_plain_wall']:.2f}x |" if plain else "") + " | | |")
    lines += ["", f"CPU-time ratio (lm-eval / ours): {s['speedup_vs_lm_eval_cpu']:.2f}x. Scores are on "
              f"{p['limit']} documents per task (not a benchmark result)."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
