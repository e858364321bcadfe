"""Perplexity under named protocols.

``PPL = exp(sum NLL / #scored tokens)``, full-vocabulary next-token cross-entropy, logits in float32
computed chunk by chunk from the final hidden states (the lm_head is never run on a whole window at
once), KV cache off.

Protocols (``protocol_id`` is recorded with every number):
  nonoverlap-L      windows [iL, (i+1)L) for i < floor(N/L); each scores its L-1 next tokens; the
                    incomplete tail is dropped (Wanda/SparseGPT/QK-Wanda). ``legacy_ppl`` is the
                    Wanda/SparseGPT normalization exp(mean over windows of the window mean NLL).
  sliding-L-S       HF sliding-window recipe: begin = 0, S, 2S, ...; each window scores only the tokens
                    not scored before; every token but the first is scored exactly once (CoCurve 2048/512).

BOS convention (``bos`` in the result, a suffix of the protocol): the corpus is tokenized without special
tokens; a tokenizer that prepends BOS to a text (:func:`bos_convention`: Gemma, Llama-2) gets one BOS in front
of the token stream, as when it tokenizes the corpus as one text: window 0 starts with BOS, the stream shifts by
one token (``nonoverlap-1024+bos-first``). A tokenizer that adds no BOS (SmolLM2, Qwen2, GPT-2) gets none and
keeps the bare protocol name (``nonoverlap-1024``, ``bos = "none"``). ``bos="every"`` (a comparison only) starts
every window with BOS followed by ``L - 1`` corpus tokens (``nonoverlap-1024+bos-every``).

Block-streamed (a model larger than memory: ``blocks=`` a streamed :class:`secateur.models.blocks.Blocks`,
:mod:`secateur.models.streaming`): the same windows and sums, walked block-major. Every window is embedded first;
then each decoder block is loaded once, runs every window's hidden states (each window alone, batch 1, with the
block kwargs its own length gives) and is freed; the final norm and the head then score each window with
:func:`nll_from_hidden`. Only the route through the blocks differs (the family's block forward instead of the
model's own loop).
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from secateur.errors import SecateurError
from secateur.models.adapters import get_adapter
from secateur.models.blocks import RESIDENT, Blocks


def _nll_sum(model: nn.Module, ids: torch.Tensor, n_score: int, chunk: int = 512) -> float:
    """Sum of NLL of the last ``n_score`` next-token predictions of the window ``ids [1, T]``."""
    out = model.base_model(input_ids=ids, use_cache=False)
    return nll_from_hidden(model.get_output_embeddings(), out.last_hidden_state[0], ids, n_score, chunk)


def nll_from_hidden(head: nn.Module, h: torch.Tensor, ids: torch.Tensor, n_score: int, chunk: int = 512) -> float:
    """:func:`_nll_sum` from the final hidden states ``h [T, d]`` of the window ``ids [1, T]`` (shared with the
    block-streamed route of :func:`perplexity`)."""
    T = ids.shape[1]
    start = T - 1 - n_score  # first position whose prediction is scored
    total = 0.0
    for s in range(start, T - 1, chunk):
        e = min(s + chunk, T - 1)
        logits = head(h[s:e]).float()
        total += F.cross_entropy(logits, ids[0, s + 1:e + 1], reduction="sum").item()
    return total


def check_ppl_args(seqlen: int, stride: int | None, max_windows: int | None) -> None:
    """The protocol's numbers (a zero stride would never advance; one larger than the window skips tokens)."""
    if seqlen < 2:
        raise SecateurError(f"--seqlen must be >= 2 (a window scores its seqlen - 1 next tokens), got {seqlen}; "
                            "pass e.g. --seqlen 2048")
    if stride is not None and not 1 <= stride <= seqlen:
        raise SecateurError(f"--stride must be in [1, --seqlen {seqlen}] (each window advances by stride tokens; "
                            f"omit it for non-overlapping windows), got {stride}")
    if max_windows is not None and max_windows < 1:
        raise SecateurError(f"--max-windows must be >= 1, got {max_windows}; omit it to evaluate every window")


def window_plan(n_tok: int, seqlen: int, stride: int | None) -> list[tuple[int, int, int]]:
    """``(begin, end, n_scored)`` per window."""
    if stride is None or stride >= seqlen:
        return [(i * seqlen, (i + 1) * seqlen, seqlen - 1) for i in range(n_tok // seqlen)]
    plan, prev_end, begin = [], 0, 0
    while begin < n_tok:
        end = min(begin + seqlen, n_tok)
        trg = end - prev_end if prev_end else end - begin - 1
        plan.append((begin, end, trg))
        prev_end = end
        if end == n_tok:
            break
        begin += stride
    return plan


BOS_RULES = ("none", "first", "every")


def protocol_id(seqlen: int, stride: int | None, bos: str = "none") -> str:
    base = f"nonoverlap-{seqlen}" if stride is None or stride >= seqlen else f"sliding-{seqlen}-{stride}"
    return base if bos == "none" else f"{base}+bos-{bos}"


def bos_convention(tokenizer) -> int | None:
    """The BOS id ``tokenizer`` prepends when it tokenizes a text (``add_special_tokens=True``), or None when it
    prepends none (or there is no tokenizer)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if tokenizer is None or bos is None:
        return None
    try:
        with_special = list(tokenizer("a", add_special_tokens=True)["input_ids"])
        without = list(tokenizer("a", add_special_tokens=False)["input_ids"])
    except (TypeError, ValueError, KeyError):
        return None
    return bos if with_special[:1] == [bos] and without[:1] != [bos] else None


def _bos_windows(ids: torch.Tensor, seqlen: int, stride: int | None, bos_id: int | None,
                 rule: str) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
    """The token stream the windows read and their plan under the BOS rule (see the module docstring)."""
    if rule == "every":
        if stride is not None and stride < seqlen:
            raise SecateurError("BOS on every window is defined for non-overlapping windows only")
        body = seqlen - 1
        n = ids.numel() // body
        rows = torch.cat([torch.full((n, 1), bos_id, dtype=ids.dtype), ids[:n * body].view(n, body)], 1)
        return rows.reshape(-1), [(i * seqlen, (i + 1) * seqlen, seqlen - 1) for i in range(n)]
    if rule == "first":
        ids = torch.cat([torch.tensor([bos_id], dtype=ids.dtype), ids])
    return ids, window_plan(ids.numel(), seqlen, stride)


def eval_windows(ids: torch.Tensor, seqlen: int, stride: int | None, max_windows: int | None, tokenizer,
                 bos: str | None) -> tuple[torch.Tensor, list[tuple[int, int, int]], str, int]:
    """The checked arguments, the token stream under the BOS rule, every window's plan, the rule and the corpus
    size: shared by :func:`perplexity` and the block-streamed evaluation."""
    check_ppl_args(seqlen, stride, max_windows)
    if ids.numel() < seqlen:
        raise SecateurError(f"evaluation text has {ids.numel()} tokens, fewer than one window of {seqlen}")
    bos_id = bos_convention(tokenizer)
    rule = bos if bos is not None else ("none" if bos_id is None else "first")
    if rule not in BOS_RULES:
        raise SecateurError(f"bos must be one of {', '.join(BOS_RULES)}, got {rule!r}")
    if rule != "none" and bos_id is None:
        bos_id = getattr(tokenizer, "bos_token_id", None)
        if bos_id is None:
            raise SecateurError(f"bos={rule!r} needs a tokenizer with a BOS token")
    corpus = int(ids.numel())
    ids, plan = _bos_windows(ids, seqlen, stride, bos_id, rule)
    return ids, plan, rule, corpus


@torch.no_grad()
def perplexity(model: nn.Module, ids: torch.Tensor, seqlen: int = 2048, stride: int | None = None,
               max_windows: int | None = None, progress: bool = True, tokenizer=None,
               bos: str | None = None, blocks: Blocks = RESIDENT) -> dict:
    """Perplexity of a 1-D token tensor (tokenized without special tokens). Returns the number, its protocol
    and the counts.

    ``tokenizer`` (the one that produced ``ids``) decides the BOS rule: ``first`` when it prepends BOS to a
    text, else ``none`` (module docstring); ``bos`` overrides it (``none``/``first``/``every``; the last two need
    a tokenizer with a BOS token). ``blocks``: where the blocks come from; a streamed source walks the windows
    block by block (module docstring; the result says ``streamed``); split over processes (``blocks.shard``), each
    rank scores windows ``w % N == rank`` and every rank returns the result of all of them, summed in window
    order (the same bits as one process)."""
    ids, plan, rule, corpus = eval_windows(ids, seqlen, stride, max_windows, tokenizer, bos)
    full = len(plan)
    plan = plan[:max_windows] if max_windows is not None else plan
    t0 = time.perf_counter()
    mine = [w for w in range(len(plan)) if blocks.shard.owns(w)]  # split over processes: window w on rank w % N
    if blocks.streamed:
        sums = _block_major_sums(model, ids, [plan[w] for w in mine], blocks, progress)
    else:
        device = next(model.parameters()).device
        sums = [(_nll_sum(model, ids[b:e].unsqueeze(0).to(device), n), n)
                for b, e, n in tqdm([plan[w] for w in mine], desc="perplexity", disable=not progress)]
    if blocks.shard.split:  # every window's sums on every rank, in window order: the single process's sum
        from secateur.calib.dist import gather_ordered

        sums = gather_ordered(dict(zip(mine, sums)), len(plan))
    res = ppl_result(sums, seqlen, stride, rule, full, corpus, t0)
    return res | {"streamed": True} if blocks.streamed else res


def _block_major_sums(model: nn.Module, ids: torch.Tensor, plan: list[tuple[int, int, int]], blocks: Blocks,
                      progress: bool) -> list[tuple[float, int]]:
    """Each window's (summed NLL, scored tokens), every block loaded once for all windows (module docstring)."""
    adapter = get_adapter(model)
    device = adapter.device
    windows = [ids[b:e].unsqueeze(0).to(device) for b, e, _ in plan]
    kwargs: dict[int, dict] = {}  # block kwargs per window length (RoPE tables, masks): the tail may be shorter
    hs = []
    for w in windows:
        h, kw = adapter.capture_inputs(w)
        kwargs.setdefault(w.shape[1], kw)
        hs.append(h)
    for i in tqdm(range(adapter.n_layers), desc="perplexity (streamed blocks)", disable=not progress):
        layer = adapter.layers[i]
        with blocks.scope(i):
            hs = [adapter.block_forward(layer, h, adapter.layer_kwargs(i, kwargs[h.shape[1]])) for h in hs]
    head = model.get_output_embeddings()
    return [(nll_from_hidden(head, adapter.final_hidden(h)[0], w, n), n) for w, h, (_, _, n) in zip(windows, hs, plan)]


def ppl_result(sums: list[tuple[float, int]], seqlen: int, stride: int | None, rule: str, full: int, corpus: int,
               t0: float) -> dict:
    """The perplexity and its protocol from each evaluated window's (summed NLL, scored tokens), summed in window
    order: ``exp(sum NLL / sum scored)``, and the legacy mean of per-window perplexity logs for non-overlapping
    windows."""
    if not all(math.isfinite(s) for s, _ in sums):
        raise SecateurError("the model produced non-finite losses (NaN/Inf)")
    nll, scored, legacy = 0.0, 0, 0.0
    for s, n in sums:
        nll += s
        scored += n
        legacy += s / n
    return {
        "ppl": math.exp(nll / scored),
        "legacy_ppl": math.exp(legacy / len(sums)) if stride is None or stride >= seqlen else None,
        "protocol": protocol_id(seqlen, stride, rule),
        "bos": rule,
        "seqlen": seqlen,
        "stride": stride,
        "windows": len(sums),
        "windows_total": full,
        "scored_tokens": scored,
        "corpus_tokens": corpus,
        "seconds": time.perf_counter() - t0,
    }
