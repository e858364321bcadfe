"""CoCurve's issue-45 defaults (every position of each window, the breakpoint family, the paired one-SE choice) keep
the project's determinism: the same H, mask, lambda and split-half statistics with 1 and 2 threads (widths 256/512,
so GEMMs really split across threads; docs/protocols.md)."""

from __future__ import annotations

import hashlib

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from secateur.methods.cocurve import CoCurveConfig, prune
from secateur.models.adapters import get_adapter
from secateur.scoring.cocurve_sweep import SweepConfig
from secateur.testing import random_ids


def _run(threads: int) -> tuple:
    n = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=16,
                          num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256)
        m = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32).eval()
        rep = prune(m, get_adapter(m), random_ids(3, 32, 128, seed=1), random_ids(2, 32, 128, seed=2), 0.3,
                    CoCurveConfig(sweep=SweepConfig(top_r=16), max_candidates=8), materialize="none")
    finally:
        torch.set_num_threads(n)
    r, g = rep["_result"], rep["_graph"]
    assert g.meta["n_positions"] == 3 * 32 and rep["selection_info"]["lambda_family"]["family"] == "breakpoints"
    sha = [hashlib.sha256(t.numpy().tobytes()).hexdigest() for t in (g.H, *g.halves, r.removed)]
    return sha, r.lam, [c["heldout_per_sequence"] for c in rep["candidates"]], rep["split_half"]


def test_defaults_are_the_same_with_one_and_two_threads():
    assert _run(1) == _run(2)
