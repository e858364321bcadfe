"""The same pruned model whatever the thread count (docs/protocols.md, "Determinism across threads").

Each method family runs on one tiny model with 1 and then 2 intra-op threads (in process: the thread count
only changes how MKL/LAPACK and torch's full reductions split their work, which is what differs between
machines) and the sha256 of every parameter must match. The pruned weights are zeros, so equal weights
mean equal masks; the compensated and sliced families (wanda-sp + LS / COEC) compare their final weights.
Widths 256/512 so LAPACK and GEMM actually split across threads (a 32-wide tiny model never does).
"""

from __future__ import annotations

import hashlib

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from secateur import api
from secateur.testing import tiny_tokenizer

RUNS = {
    "wanda": dict(method="wanda", sparsity=0.5),
    "sparsegpt": dict(method="sparsegpt", sparsity=0.5),
    "sparsegpt-2:4": dict(method="sparsegpt", pattern="2:4"),
    "qk-wanda": dict(method="qk-wanda", sparsity=0.5),
    "wanda-sp+ls": dict(method="wanda-sp", sparsity=0.3, compensation="ls"),
    "wanda-sp+coec": dict(method="wanda-sp", sparsity=0.3, compensation="coec", coec_rounds=2),
    # CoCurve at a quick size: its guard protects two layers at each end and caps a layer at 1.5 rho, so the
    # 30% budget needs 16 layers with 16 FFN groups each (12/16 x 0.45 >= 0.3); few samples and positions
    "cocurve": dict(method="cocurve", sparsity=0.3, nsamples=3, seqlen=64, model="deep",
                    heldout=1, positions=16, top_r=16, n_ffn_groups=16),
}


def _save_model(path, layers: int) -> str:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256)
    AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("threads")
    calib = root / "calib.txt"
    calib.write_text("The quick brown fox jumps over the lazy dog, again and again. 0123456789 " * 80)
    return {"small": _save_model(root / "m4", 4), "deep": _save_model(root / "m16", 16), "calib": str(calib)}


def _weights_sha(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


def _run(setup, key: str, threads: int) -> str:
    kw = {"nsamples": 4, "seqlen": 128} | RUNS[key]
    model = setup[kw.pop("model", "small")]
    n = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        rep = api.prune(model=model, calib=setup["calib"], quiet=True, **kw)
    finally:
        torch.set_num_threads(n)
    return _weights_sha(rep.model)


# 4 threads on a 2-core machine still makes MKL split its work in 4 (oversubscribed, slower, same question)
@pytest.mark.parametrize("key,threads", [(k, 2) for k in RUNS] + [("sparsegpt", 4), ("wanda-sp+ls", 4)])
def test_same_weights_with_one_and_more_threads(setup, key, threads):
    assert _run(setup, key, 1) == _run(setup, key, threads)
