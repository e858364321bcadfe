"""bfloat16 / float16 end to end (issue 16 §2), through the CLI on tiny models stored in bfloat16.

Weights stay in the run's dtype and the export keeps it; statistics and solvers run in float32/float64.
Where a method's decisions read only the weights (magnitude, magnitude-sp, random), a model whose weights are
bfloat16 values gives the SAME masks/selection whether it is run in bfloat16 or float32: every bfloat16 value is
exactly representable in float32 and the scores are computed in float32 from those values. Methods that read
activations (Wanda, SparseGPT, the structured scores, every compensator) see a bfloat16 forward and may choose
differently; for them the test checks the run completes, the export is in the run's dtype, reloads with one
``from_pretrained`` and gives finite logits. Their quality difference is measured on real models
(results/text/families.md, bf16 rows).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from secateur.cli import main
from secateur.testing import tiny_model, tiny_tokenizer

TEXT = "The quick brown fox jumps over the lazy dog, again and again. 0123456789 " * 40
CALIB = ["--nsamples", "4", "--seqlen", "64", "--chunk-size", "2"]
EVERY_METHOD = {
    "magnitude": ["--method", "magnitude", "--sparsity", "0.5"],
    "wanda": ["--method", "wanda", "--sparsity", "0.5"],
    "sparsegpt-2:4": ["--method", "sparsegpt", "--pattern", "2:4"],
    "qk-wanda": ["--method", "qk-wanda", "--sparsity", "0.5"],
    "wanda-sp-ls": ["--method", "wanda-sp", "--sparsity", "0.3", "--compensation", "ls"],
    "flap": ["--method", "flap", "--sparsity", "0.2"],
    "rcpu-coec": ["--method", "rcpu", "--sparsity", "0.3", "--compensation", "coec", "--coec-rounds", "2"],
    "corp": ["--method", "corp", "--sparsity", "0.3"],
    "shortgpt": ["--method", "shortgpt", "--sparsity", "0.25"],
}


def _bf16_model(tmp_path, family: str) -> str:
    path = tmp_path / f"{family}-bf16"
    tiny_model(family, layers=4).to(torch.bfloat16).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return str(path)


def _prune(tmp_path, model: str, args: list[str], dtype: str, name: str):
    text = tmp_path / "calib.txt"
    text.write_text(TEXT)
    out = tmp_path / name
    rc = main(["prune", "--model", model, "--calib", str(text), *CALIB, *args, "--dtype", dtype, "--quiet",
               "--out", str(out)])
    assert rc == 0
    return out


def _tensors(out) -> dict[str, torch.Tensor]:
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "opt", "gpt2"])
def test_weight_only_decisions_do_not_depend_on_dtype(tmp_path, family):
    model = _bf16_model(tmp_path, family)
    for args, what in ((EVERY_METHOD["magnitude"], "masks"),
                       (["--method", "magnitude-sp", "--sparsity", "0.3"], "selection"),
                       (["--method", "random", "--sparsity", "0.3"], "selection")):
        a = _prune(tmp_path, model, args, "float32", f"{args[1]}-f32")
        b = _prune(tmp_path, model, args, "bfloat16", f"{args[1]}-bf16")
        if what == "masks":
            with np.load(a / "secateur-masks.npz") as za, np.load(b / "secateur-masks.npz") as zb:
                assert za.files == zb.files
                for k in za.files:
                    assert np.array_equal(za[k], zb[k]), k
        else:
            sa = json.loads((a / "secateur_selection.json").read_text())
            sb = json.loads((b / "secateur_selection.json").read_text())
            assert sa["layers"] == sb["layers"]
        # same kept weights: the bf16 export equals the f32 export rounded to bf16 (the values were bf16 already)
        ta, tb = _tensors(a), _tensors(b)
        assert ta.keys() == tb.keys()
        for k in ta:
            assert tb[k].dtype == torch.bfloat16 and ta[k].dtype == torch.float32
            assert torch.equal(ta[k].to(torch.bfloat16), tb[k]), k


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("method", list(EVERY_METHOD))
def test_every_method_runs_and_exports_in_bfloat16(tmp_path, family, method):
    out = _prune(tmp_path, _bf16_model(tmp_path, family), EVERY_METHOD[method], "bfloat16", "out")
    tensors = _tensors(out)
    floats = {k: t for k, t in tensors.items() if t.is_floating_point()}
    assert floats and all(t.dtype == torch.bfloat16 for t in floats.values())
    assert all(torch.isfinite(t.float()).all() for t in floats.values())
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    assert reloaded.dtype == torch.bfloat16
    with torch.no_grad():
        logits = reloaded(torch.arange(1, 17).unsqueeze(0)).logits
    assert torch.isfinite(logits.float()).all()


@pytest.mark.parametrize("method", ["wanda", "sparsegpt-2:4", "rcpu-coec"])
def test_float16_runs(tmp_path, method):
    out = _prune(tmp_path, _bf16_model(tmp_path, "llama"), EVERY_METHOD[method], "float16", "out")
    floats = [t for t in _tensors(out).values() if t.is_floating_point()]
    assert all(t.dtype == torch.float16 and torch.isfinite(t.float()).all() for t in floats)
