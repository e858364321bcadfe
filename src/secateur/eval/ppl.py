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
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from secateur.errors import SecateurError


def _nll_sum(model: nn.Module, ids: torch.Tensor, n_score: int, chunk: int = 512) -> float:
    """Sum of NLL of the last ``n_score`` next-token predictions of the window ``ids [1, T]``."""
    out = model.base_model(input_ids=ids, use_cache=False)
    return nll_from_hidden(model.get_output_embeddings(), out.last_hidden_state[0], ids, n_score, chunk)


def nll_from_hidden(head: nn.Module, h: torch.Tensor, ids: torch.Tensor, n_score: int, chunk: int = 512) -> float:
    """:func:`_nll_sum` from the final hidden states ``h [T, d]`` of the window ``ids [1, T]`` (shared with the
    block-streamed evaluator, :mod:`secateur.eval.ppl_stream`)."""
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
        raise SecateurError(f"--seqlen must be >= 2 (a window scores its seqlen - 1 next tokens), got {seqlen}")
    if stride is not None and not 1 <= stride <= seqlen:
        raise SecateurError(f"--stride must be in [1, --seqlen {seqlen}] (each window advances by stride tokens; "
                            f"omit it for non-overlapping windows), got {stride}")
    if max_windows is not None and max_windows < 1:
        raise SecateurError(f"--max-windows must be >= 1, got {max_windows}")


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


def protocol_id(seqlen: int, stride: int | None) -> str:
    return f"nonoverlap-{seqlen}" if stride is None or stride >= seqlen else f"sliding-{seqlen}-{stride}"


@torch.no_grad()
def perplexity(model: nn.Module, ids: torch.Tensor, seqlen: int = 2048, stride: int | None = None,
               max_windows: int | None = None, progress: bool = True) -> dict:
    """Perplexity of a 1-D token tensor. Returns the number, its protocol and the counts."""
    check_ppl_args(seqlen, stride, max_windows)
    if ids.numel() < seqlen:
        raise SecateurError(f"evaluation text has {ids.numel()} tokens, fewer than one window of {seqlen}")
    plan = window_plan(ids.numel(), seqlen, stride)
    full = len(plan)
    if max_windows is not None:
        plan = plan[:max_windows]
    device = next(model.parameters()).device
    nll, scored, legacy = 0.0, 0, 0.0
    t0 = time.perf_counter()
    for b, e, n in tqdm(plan, desc="perplexity", disable=not progress):
        s = _nll_sum(model, ids[b:e].unsqueeze(0).to(device), n)
        if not math.isfinite(s):
            raise SecateurError("the model produced non-finite losses (NaN/Inf)")
        nll += s
        scored += n
        legacy += s / n
    return {
        "ppl": math.exp(nll / scored),
        "legacy_ppl": math.exp(legacy / len(plan)) if stride is None or stride >= seqlen else None,
        "protocol": protocol_id(seqlen, stride),
        "seqlen": seqlen,
        "stride": stride,
        "windows": len(plan),
        "windows_total": full,
        "scored_tokens": scored,
        "corpus_tokens": int(ids.numel()),
        "seconds": time.perf_counter() - t0,
    }
