"""Zero-shot multiple-choice evaluation by log-likelihood, compatible with the LM Evaluation Harness.

Protocol (evaluation spec section 2.1; lm-eval 0.4.9-0.4.13 ``output_type: multiple_choice``, 0-shot,
no chat template, no extra BOS):

* Each document gives requests ``(context, continuation)`` (``secateur.eval.zeroshot_tasks``).
* Tokenization is the harness's ``_encode_pair``: trailing spaces of the context move to the
  continuation, ``whole = encode(context + continuation)``, ``ctx = encode(context)``,
  ``cont = whole[len(ctx):]``; the model input is ``(ctx + cont)[-(max_length + 1):][:-1]``
  (left truncation at ``max_length``, resolved like the harness: config ``n_positions`` /
  ``max_position_embeddings`` / ``n_ctx``, else 2048).
* ``ll(request) = sum_j log softmax(logits_{j-1})[cont_j]`` over the continuation tokens
  (log-softmax in float32 here; the harness uses the logits dtype, so fp16/bf16 runs may differ in
  the last digits).
* ``acc = [argmax_i ll_i == gold]``; ``acc_norm = [argmax_i ll_i / len(choice_i) == gold]`` where
  ``len`` is the **character** length of the choice string without the target delimiter -- that is
  what lm-eval computes (``completion_len = len(i) for i in choices``), not the byte length
  (``acc_bytes`` divides by UTF-8 bytes; it is reported too; on ASCII text they coincide). argmax
  ties go to the lowest index (``np.argmax``). WinoGrande is partial scoring: one context per
  option, the shared continuation scored, acc only.
* Suite score (QK-Wanda, COEC): ``mean_t a_t x 100`` over boolq (acc), rte (acc), hellaswag
  (acc_norm), winogrande (acc), arc_easy / arc_challenge / openbookqa (acc_norm), from unrounded
  per-task values, with the task-stratified binomial standard error
  ``SE = (100/T) sqrt(sum_t p_t (1 - p_t) / n_t)`` (spec 2.2).

Speed: the requests of one document share their context, so each document is run **once** as a
packed tree: the longest common token prefix of its inputs, followed by one branch per request
(``strategy="packed"``). A 4-D additive attention mask lets a branch see the prefix and itself
only, and ``position_ids`` restart every branch at the prefix length, so each branch computes
exactly the activations of its own full sequence. The lm_head runs only on the scored positions.
``strategy="plain"`` runs each request as its own right-padded row without a mask (the harness's
layout) -- the fallback for models that reject 4-D masks. Measured with SmolLM2-135M on CPU
(bench/speed/zeroshot_speed.py, results/speed/zeroshot-speed.md): packed is about 2x plain and 1.9x lm-eval's
HFLM on the same requests. A KV-cache variant (context once, cache copied per continuation) runs the
same tokens plus cache copies and two forwards per batch, so it was not kept.

Several processes (``secateur eval zeroshot --procs N``, torchrun; any initialized ``torch.distributed`` group):
the rows are packed, sorted and cut into batches exactly as in one process, then batch ``b`` (counted over the
tasks in turn) is run on rank ``b % N`` and every batch's per-request log-likelihoods are gathered in batch order
on every rank (:func:`secateur.calib.dist.gather_ordered`). The unit is the batch, not the document: a document's
numbers depend on the rows it is padded and batched with, so keeping the single process's batches keeps its bits.
Every rank returns the single process's result; rank 0 alone prints and writes ``--json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from secateur.calib.dist import gather_ordered, rank_world
from secateur.errors import SecateurError
from secateur.eval.zeroshot_tasks import SUITE7, TASKS, Item, load_items, task_spec

DEFAULT_MAX_LENGTH = 2048  # lm-eval's default when the config states no context length
PROTOCOL = "zeroshot-lmeval-mc-0shot"


# ---------------------------------------------------------------- tokenization (harness-exact)


def _encode(tokenizer, text: str, add_special_tokens: bool | None) -> list[int]:
    kw = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
    return list(tokenizer.encode(text, **kw))


def encode_pair(tokenizer, context: str, continuation: str,
                add_special_tokens: bool | None = None) -> tuple[list[int], list[int]]:
    """lm-eval ``TemplateLM._encode_pair`` for causal models (context must be non-empty)."""
    if not context:
        raise SecateurError("zero-shot request with an empty context")
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces > 0:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    whole = _encode(tokenizer, context + continuation, add_special_tokens)
    ctx = _encode(tokenizer, context, add_special_tokens)
    return ctx, whole[len(ctx):]


def resolve_max_length(model: nn.Module, max_length: int | None = None) -> int:
    if max_length:
        return int(max_length)
    cfg = getattr(model, "config", None)
    cfg = getattr(cfg, "text_config", None) or cfg
    for attr in ("n_positions", "max_position_embeddings", "n_ctx"):
        v = getattr(cfg, attr, None)
        if v:
            return int(v)
    return DEFAULT_MAX_LENGTH


# ---------------------------------------------------------------- packing


@dataclass
class _Group:
    """One document's requests as a packed row: prefix then branches."""

    tokens: list[int]  # the packed row
    positions: list[int]
    segments: list[int]  # 0 = shared prefix, i + 1 = branch of request i
    score_rows: list[list[int]]  # per request: row indices whose logits predict its continuation
    targets: list[list[int]]  # per request: the continuation tokens
    n_request_tokens: int  # sum over requests of len(ctx) + len(cont) (what the harness runs)


def _lcp(seqs: list[list[int]]) -> int:
    n = min(len(s) for s in seqs)
    first = seqs[0]
    for j in range(n):
        t = first[j]
        if any(s[j] != t for s in seqs[1:]):
            return j
    return n


def build_group(pairs: list[tuple[list[int], list[int]]], max_length: int, share: bool = True) -> list[_Group]:
    """Pack one document's ``(ctx_tokens, cont_tokens)`` requests (a list of one group if ``share``,
    else one group per request)."""
    seqs, ctx_lens, conts = [], [], []
    n_req_tok = 0
    for ctx, cont in pairs:
        if not ctx or not cont:
            raise SecateurError("zero-shot request with an empty context or continuation after tokenization")
        if len(cont) > max_length:
            raise SecateurError(f"continuation of {len(cont)} tokens exceeds max length {max_length}")
        full = (ctx + cont)[-(max_length + 1):]
        seqs.append(full[:-1])  # the harness input; position p predicts full[p + 1]
        ctx_lens.append(len(full) - len(cont))
        conts.append(cont)
        n_req_tok += len(ctx) + len(cont)
    if not share and len(seqs) > 1:
        return [build_group([p], max_length)[0] for p in pairs]
    p = _lcp(seqs)
    tokens, positions, segments = list(seqs[0][:p]), list(range(p)), [0] * p
    score_rows = []
    for i, (u, c) in enumerate(zip(seqs, ctx_lens)):
        off = len(tokens)
        tokens += u[p:]
        positions += range(p, len(u))
        segments += [i + 1] * (len(u) - p)
        score_rows.append([q if q < p else off + q - p for q in range(c - 1, len(u))])
    return [_Group(tokens, positions, segments, score_rows, conts, n_req_tok)]


def _tree_mask(segments: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask [B, 1, L, L]: query a sees key b iff b <= a and b is in the prefix or in a's own
    branch; padding (segment -1) sees only itself so no softmax row is empty."""
    B, L = segments.shape
    idx = torch.arange(L)
    causal = idx[None, :] <= idx[:, None]  # [L(query), L(key)]
    sq, sk = segments[:, :, None], segments[:, None, :]
    allowed = causal[None] & ((sk == 0) | (sk == sq)) & (sq >= 0) & (sk >= 0)
    allowed |= torch.eye(L, dtype=torch.bool)[None]
    mask = torch.zeros(B, 1, L, L, dtype=dtype)
    mask.masked_fill_(~allowed[:, None], torch.finfo(dtype).min)
    return mask


def _needs_full_logits(model: nn.Module) -> bool:
    """Models that post-process the lm_head output (soft-capping, scaling) go through model(...)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if model.base_model is model or head is None:
        return True
    cfg = model.config
    return any(getattr(cfg, a, None) not in (None, 1, 1.0)
               for a in ("final_logit_softcapping", "logit_scale", "logits_scaling"))


@torch.no_grad()
def _run_batch(model: nn.Module, groups: list[_Group], packed: bool, device) -> list[list[tuple[float, bool]]]:
    """Forward one batch of groups; per group, per request ``(loglikelihood, is_greedy)``."""
    L = max(len(g.tokens) for g in groups)
    B = len(groups)
    ids = torch.zeros(B, L, dtype=torch.long)
    pos = torch.zeros(B, L, dtype=torch.long)
    seg = torch.full((B, L), -1, dtype=torch.long)
    for b, g in enumerate(groups):
        n = len(g.tokens)
        ids[b, :n] = torch.tensor(g.tokens)
        pos[b, :n] = torch.tensor(g.positions)
        seg[b, :n] = torch.tensor(g.segments)
    rows, cols, tgts = [], [], []
    for b, g in enumerate(groups):
        for sr, tg in zip(g.score_rows, g.targets):
            rows += [b] * len(sr)
            cols += sr
            tgts += tg
    rows_t, cols_t = torch.tensor(rows), torch.tensor(cols)
    kwargs: dict = {"input_ids": ids.to(device), "use_cache": False}
    if packed:
        dtype = next(model.parameters()).dtype
        kwargs["attention_mask"] = _tree_mask(seg, dtype).to(device)
        kwargs["position_ids"] = pos.to(device)
    if _needs_full_logits(model):
        logits = model(**kwargs).logits[rows_t.to(device), cols_t.to(device)]
    else:
        hidden = model.base_model(**kwargs).last_hidden_state
        logits = model.get_output_embeddings()(hidden[rows_t.to(device), cols_t.to(device)])
    logits = logits.float()
    tgt = torch.tensor(tgts, device=logits.device)
    lp = F.log_softmax(logits, dim=-1).gather(1, tgt[:, None])[:, 0].double().cpu()
    greedy = (logits.argmax(-1) == tgt).cpu()
    out, k = [], 0
    for g in groups:
        res = []
        for tg in g.targets:
            n = len(tg)
            res.append((float(lp[k:k + n].sum()), bool(greedy[k:k + n].all())))
            k += n
        out.append(res)
    return out


def loglikelihoods(model: nn.Module, tokenizer, items: list[Item], batch_size: int = 4,
                   max_length: int | None = None, strategy: str = "packed", add_special_tokens: bool | None = None,
                   progress: bool = False, stats: dict | None = None) -> list[list[tuple[float, bool]]]:
    """Per item, per request ``(sum log p(continuation | context), is_greedy)``, harness tokenization.

    ``batch_size`` counts packed rows (one document each for ``packed``, one request each for
    ``plain``); rows are sorted by length (longest first) so padding stays small.
    """
    if strategy not in ("packed", "plain"):
        raise SecateurError(f"unknown strategy {strategy!r}; choose packed or plain")
    if batch_size < 1:
        raise SecateurError("batch size must be >= 1")
    max_len = resolve_max_length(model, max_length)
    device = next(model.parameters()).device
    packed = strategy == "packed"
    groups: list[tuple[int, int, _Group]] = []  # (item, first request, group)
    for i, it in enumerate(items):
        pairs = [encode_pair(tokenizer, c, x, add_special_tokens) for c, x in it.requests]
        r = 0
        for g in build_group(pairs, max_len, share=packed):
            groups.append((i, r, g))
            r += len(g.targets)
    order = sorted(range(len(groups)), key=lambda j: (-len(groups[j][2].tokens), j))
    results: list[list[tuple[float, bool] | None]] = [[None] * len(it.requests) for it in items]
    batches = [order[s:s + batch_size] for s in range(0, len(order), batch_size)]
    rank, world = rank_world()  # several processes: batch b of the run on rank b % N (module docstring)
    first = stats.get("batches", 0) if stats is not None else 0  # the batches of the tasks before this one
    mine = [b for b in range(len(batches)) if (first + b) % world == rank]
    was_training = model.training
    model.eval()
    t0 = time.perf_counter()
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=sum(len(batches[b]) for b in mine), desc="zero-shot", unit="row", file=sys.stderr)
    local: dict[int, list] = {}
    try:
        for b in mine:
            local[b] = _run_batch(model, [groups[j][2] for j in batches[b]], packed, device)
            if bar is not None:
                bar.update(len(batches[b]))
    finally:
        if bar is not None:
            bar.close()
        model.train(was_training)
    outs = gather_ordered(local, len(batches)) if world > 1 else [local[b] for b in range(len(batches))]
    for batch, res_b in zip(batches, outs, strict=True):
        for j, res in zip(batch, res_b, strict=True):
            i, r, _ = groups[j]
            results[i][r:r + len(res)] = res
    n_fwd = sum(len(g.tokens) for _, _, g in groups)  # every rank's rows: the single process's count
    if stats is not None:
        stats["seconds"] = stats.get("seconds", 0.0) + time.perf_counter() - t0
        stats["forward_tokens"] = stats.get("forward_tokens", 0) + n_fwd
        stats["request_tokens"] = stats.get("request_tokens", 0) + sum(g.n_request_tokens for _, _, g in groups)
        stats["requests"] = stats.get("requests", 0) + sum(len(it.requests) for it in items)
        stats["batches"] = first + len(batches)
    return results  # type: ignore[return-value]


# ---------------------------------------------------------------- metrics


def item_metrics(lls: list[float], choices: list[str], gold: int) -> dict:
    """acc / acc_norm / acc_bytes of one item exactly as lm-eval's ``process_results``."""
    ll = np.asarray(lls, dtype=np.float64)
    chars = np.array([float(len(c)) for c in choices])
    nbytes = np.array([float(len(c.encode("utf-8"))) for c in choices])
    pred, pred_norm, pred_bytes = int(np.argmax(ll)), int(np.argmax(ll / chars)), int(np.argmax(ll / nbytes))
    return {"pred": pred, "pred_norm": pred_norm, "acc": float(pred == gold), "acc_norm": float(pred_norm == gold),
            "acc_bytes": float(pred_bytes == gold)}


def suite_summary(per_task: dict[str, dict]) -> dict:
    """Unweighted mean x100 of each task's suite metric and ``SE = (100/T) sqrt(sum p(1-p)/n)``."""
    names = list(per_task)
    if not names:
        return {}
    p = np.array([per_task[t]["score"] for t in names], dtype=np.float64)
    n = np.array([per_task[t]["n"] for t in names], dtype=np.float64)
    T = len(names)
    return {"tasks": names, "is_suite7": sorted(names) == sorted(SUITE7), "mean": float(100.0 * p.mean()),
            "se": float(100.0 / T * math.sqrt(float(np.sum(p * (1 - p) / n))))}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def zeroshot_data_dir(data_dir) -> Path:
    """The folder of the zero-shot tasks (``--data-dir``, ``$SECATEUR_DATA`` or ../shared/data), or an error."""
    from secateur.data.sources import resolve_data_dir

    d = resolve_data_dir(data_dir)
    if d is None:
        raise SecateurError("no zero-shot data: pass --data-dir or set SECATEUR_DATA (a folder laid out like "
                            "../shared/data with zeroshot/, hellaswag/, rte-glue/)")
    return d


def parse_tasks(tasks: str | list[str] | tuple[str, ...] | None) -> list[str]:
    if tasks is None:
        return list(SUITE7)
    names = [t.strip() for t in tasks.split(",")] if isinstance(tasks, str) else list(tasks)
    names = [t for t in names if t]
    for t in names:
        task_spec(t)
    if len(set(names)) != len(names):
        raise SecateurError("a zero-shot task is listed twice")
    return names


def evaluate_zeroshot(model: nn.Module, tokenizer, tasks=None, limit: int | None = None, batch_size: int = 4,
                      data_dir=None, *, max_length: int | None = None, strategy: str = "packed",
                      add_special_tokens: bool | None = None, return_items: bool = False,
                      progress: bool = False) -> dict:
    """Score ``tasks`` (comma string or list; default the seven-task suite) on an in-memory model.

    ``limit`` keeps the first N documents of every task. Returns ``{"tasks": {name: {metric, score,
    acc, acc_norm, acc_bytes, n, stderr}}, "summary": {mean, se, ...}, "speed": ..., "protocol": ...}``;
    with ``return_items`` also per-item log-likelihoods and predictions under ``"items"``.
    """
    names = parse_tasks(tasks)
    if limit is not None and limit < 1:
        raise SecateurError("limit must be >= 1")
    d = zeroshot_data_dir(data_dir)
    per_task, items_out, files = {}, {}, {}
    stats: dict = {}
    for name in names:
        spec = task_spec(name)
        items = load_items(name, d, limit)
        lls = loglikelihoods(model, tokenizer, items, batch_size=batch_size, max_length=max_length,
                             strategy=strategy, add_special_tokens=add_special_tokens, progress=progress,
                             stats=stats)
        recs = []
        for it, res in zip(items, lls):
            m = item_metrics([r[0] for r in res], it.choices, it.gold)
            recs.append({"index": it.index, "gold": it.gold, "lls": [r[0] for r in res],
                         "is_greedy": [r[1] for r in res], **m})
        n = len(recs)
        agg = {k: float(np.mean([r[k] for r in recs])) for k in ("acc", "acc_norm", "acc_bytes")}
        score = agg[spec.metric]
        per_task[name] = {"metric": spec.metric, "score": score, **agg, "n": n, "n_full": spec.size,
                          "split": spec.split,
                          # lm-eval's reported stderr: sample standard deviation / sqrt(n)
                          "stderr": math.sqrt(score * (1 - score) / (n - 1)) if n > 1 else float("nan")}
        for rel in spec.files:
            p = d / rel
            if p.exists():
                files[rel] = _sha256(p)
        if return_items:
            items_out[name] = recs
    secs = stats.get("seconds", 0.0)
    out = {
        "protocol": PROTOCOL,
        "tasks": per_task,
        "summary": suite_summary(per_task),
        "settings": {"limit": limit, "batch_size": batch_size, "strategy": strategy,
                     "max_length": resolve_max_length(model, max_length), "num_fewshot": 0,
                     "target_delimiter": " ", "add_special_tokens": add_special_tokens,
                     "logsoftmax_dtype": "float32"},
        "data": {"dir": str(d), "sha256": files},
        "speed": {"seconds": secs, "requests": stats.get("requests", 0),
                  "request_tokens": stats.get("request_tokens", 0),
                  "forward_tokens": stats.get("forward_tokens", 0),
                  "request_tokens_per_s": stats.get("request_tokens", 0) / secs if secs else None,
                  "forward_tokens_per_s": stats.get("forward_tokens", 0) / secs if secs else None},
    }
    if return_items:
        out["items"] = items_out
    return out


def format_table(res: dict) -> str:
    lines = [f"{'task':<15}{'metric':<10}{'score':>8}{'acc':>8}{'acc_norm':>10}{'n':>7}"]
    for t, m in res["tasks"].items():
        lines.append(f"{t:<15}{m['metric']:<10}{100 * m['score']:>8.2f}{100 * m['acc']:>8.2f}"
                     f"{100 * m['acc_norm']:>10.2f}{m['n']:>7}")
    s = res["summary"]
    if s:
        label = "7-task mean" if s["is_suite7"] else f"{len(s['tasks'])}-task mean"
        lines.append(f"{label}: {s['mean']:.2f} +- {s['se']:.2f} (SE, task-stratified)")
    return "\n".join(lines)


# ---------------------------------------------------------------- CLI


def register_cli(eval_subparsers) -> argparse.ArgumentParser:
    """Add ``zeroshot`` to the ``secateur eval`` subcommands."""
    p = eval_subparsers.add_parser(
        "zeroshot", help="zero-shot multiple-choice accuracy (lm-eval compatible, offline data)",
        description="Zero-shot log-likelihood scoring of the seven-task suite (boolq, rte, hellaswag, winogrande, "
                    "arc_easy, arc_challenge, openbookqa; piqa optional) from local data, with the lm-eval "
                    "harness prompts, tokenization and metrics. Prints per-task metrics and the suite mean.")
    add_cli_args(p)
    p.set_defaults(func=cli_zeroshot)
    return p


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m",
                   help="HF id or folder, .gguf file, or alias smollm2-135m (default: %(default)s)")
    p.add_argument("--tasks", default=",".join(SUITE7),
                   help=f"comma list from {', '.join(TASKS)} (default: the seven-task suite)")
    p.add_argument("--limit", type=int, default=None, help="first N documents of every task (quick runs)")
    p.add_argument("--batch-size", type=int, default=4, help="packed documents per forward (default: %(default)s)")
    p.add_argument("--data-dir", default=None, help="local data folder (default: $SECATEUR_DATA or ../shared/data)")
    p.add_argument("--json", default=None, metavar="FILE", help="write results with their protocol as JSON")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16 (default: %(default)s)")
    p.add_argument("--device", default="cpu", help="torch device (default: %(default)s)")
    p.add_argument("--strategy", default="packed", choices=["packed", "plain"],
                   help="packed: one forward per document (default); plain: one row per request")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's; on a busy shared machine 1 is often fastest)")
    p.add_argument("--items", action="store_true", help="include per-item log-likelihoods in --json")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--procs", type=int, default=None, metavar="N",
                   help="run as N processes on this machine, each with its share of the batches (gloo on CPU, NCCL "
                        "with --device cuda): the same result, bit for bit; torchrun --nproc-per-node N -m secateur "
                        "eval zeroshot ... does the same across machines")


def cli_zeroshot(args) -> int:
    from secateur import launch
    from secateur.models.loading import load_model
    from secateur.runinfo import machine, versions

    tasks = parse_tasks(args.tasks)
    if args.limit is not None and args.limit < 1:
        raise SecateurError(f"--limit must be >= 1 (documents per task; omit it for all), got {args.limit}")
    if args.batch_size < 1 or (args.threads is not None and args.threads < 1):
        raise SecateurError("--batch-size and --threads must be >= 1; pass positive counts or omit them")
    if args.json is not None:  # the output first, as for prune: its message does not depend on the data
        from secateur.safe_write import check_writable_output

        check_writable_output(args.json, folder=False)
    zeroshot_data_dir(args.data_dir)  # fail before loading the model
    procs = launch.check_procs(getattr(args, "procs", None))
    if procs > 1 and launch.env_world()[1] == 1:  # --procs: this process starts the ranks and watches them
        if getattr(args, "argv", None) is None:
            raise SecateurError("--procs is run by the secateur command: use secateur eval zeroshot ... --procs N")
        return launch.supervise(args.argv, procs)
    if args.threads:
        torch.set_num_threads(args.threads)
    with launch.joined(args.device):
        model, tok = load_model(args.model, dtype=args.dtype, device=args.device)
        res = evaluate_zeroshot(model, tok, tasks, limit=args.limit, batch_size=args.batch_size,
                                data_dir=args.data_dir, strategy=args.strategy, return_items=args.items,
                                progress=not args.quiet)
    if procs > 1:
        res["processes"] = procs
    res["model"] = {"spec": args.model, "name_or_path": getattr(model.config, "_name_or_path", None),
                    "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
                    "attn_implementation": getattr(model.config, "_attn_implementation", None),
                    "tokenizer": type(tok).__name__, "device": args.device}
    res["versions"] = versions()
    res["machine"] = machine()
    print(format_table(res))
    sp = res["speed"]
    if sp["seconds"]:
        print(f"{sp['requests']} requests in {sp['seconds']:.1f}s ({sp['request_tokens_per_s']:.0f} request "
              f"tokens/s, {sp['forward_tokens_per_s']:.0f} forwarded tokens/s)")
    if args.json and launch.env_world()[0] == 0:  # several processes: rank 0 writes
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(res, indent=1))
        os.replace(tmp, path)
        print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m secateur.eval.zeroshot", description="zero-shot evaluation")
    add_cli_args(p)
    args = p.parse_args(argv)
    try:
        return cli_zeroshot(args)
    except SecateurError as e:
        from secateur.errors import one_line

        print(f"secateur: error: {one_line(str(e))}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
