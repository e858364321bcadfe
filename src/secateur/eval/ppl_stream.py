"""Block-streamed perplexity: a model larger than memory evaluated over its windows one block at a time.

Every window is embedded first; then each decoder block is loaded once (:func:`secateur.calib.engine.block_scope`:
a block-streamed model from :mod:`secateur.models.streaming` materializes it, an ordinary model is left as it is),
runs every window's hidden states (each window alone, batch 1, with the block kwargs its own length gives, as
:func:`secateur.eval.ppl.perplexity` runs it) and is freed. The final norm and the head then score each window with
:func:`secateur.eval.ppl.nll_from_hidden`, so the protocol, the windows and the sums are those of the ordinary path;
only the route through the blocks differs (the family's block forward instead of the model's own loop).
"""

from __future__ import annotations

import time

import torch
from torch import nn
from tqdm.auto import tqdm

from secateur.calib import engine
from secateur.eval.ppl import eval_windows, nll_from_hidden, ppl_result
from secateur.models.adapters import get_adapter


@torch.no_grad()
def perplexity_streamed(model: nn.Module, ids: torch.Tensor, seqlen: int = 2048, stride: int | None = None,
                        max_windows: int | None = None, progress: bool = True, tokenizer=None,
                        bos: str | None = None) -> dict:
    """:func:`secateur.eval.ppl.perplexity`, block by block over all windows (same result keys, ``streamed``;
    the same windows and BOS rule, :func:`secateur.eval.ppl.eval_windows`)."""
    ids, plan, rule, corpus = eval_windows(ids, seqlen, stride, max_windows, tokenizer, bos)
    full = len(plan)
    plan = plan[:max_windows] if max_windows is not None else plan
    adapter = get_adapter(model)
    device = adapter.device
    t0 = time.perf_counter()
    windows = [ids[b:e].unsqueeze(0).to(device) for b, e, _ in plan]
    kwargs: dict[int, dict] = {}  # block kwargs per window length (RoPE tables, masks): the tail may be shorter
    hs = []
    for w in windows:
        h, kw = adapter.capture_inputs(w)
        kwargs.setdefault(w.shape[1], kw)
        hs.append(h)
    for i in tqdm(range(adapter.n_layers), desc="perplexity (streamed blocks)", disable=not progress):
        layer = adapter.layers[i]
        with engine.block_scope(adapter, i):
            hs = [adapter.block_forward(layer, h, adapter.layer_kwargs(i, kwargs[h.shape[1]])) for h in hs]
    head = model.get_output_embeddings()
    sums = [(nll_from_hidden(head, adapter.final_hidden(h)[0], w, n), n) for w, h, (_, _, n) in zip(windows, hs, plan)]
    return ppl_result(sums, seqlen, stride, rule, full, corpus, t0) | {"streamed": True}
