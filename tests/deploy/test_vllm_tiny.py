"""The exports of tiny runs served by vLLM itself (``make test-vllm``, inside ``.venv-vllm``; skipped where vllm does
not import): vLLM's prompt log-probs equal the run's under transformers, and its greedy continuations the run's,
for a per-layer Llama and Qwen2 run (DeciLM: vLLM's own ``DeciLMForCausalLM``), a masked run (dense folder) and a
uniform structured run (stock config). One ``vllm.LLM`` per case (module-scoped; a tiny engine starts in ~3 s)."""

from __future__ import annotations

import gc
import json
import os

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: no spawn, one model
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
vllm = pytest.importorskip("vllm", reason="vLLM is not installed here: make test-vllm runs these in .venv-vllm")

import torch  # noqa: E402
from decilm_ref import HD, float32_bound, per_layer_llama, per_layer_qwen2, run_logits  # noqa: E402

from secateur.export.vllm import export_vllm  # noqa: E402
from secateur.structured.selection import LayerKeep, Selection  # noqa: E402
from secateur.testing import random_ids, servable_model, tiny_bpe_tokenizer  # noqa: E402

N_NEW = 8


def masked_run(tmp):
    from secateur.export.hf import save_run

    m = servable_model("llama", layers=3)
    masks = {}
    with torch.no_grad():
        for i, layer in enumerate(m.model.layers):
            for name in ("self_attn.q_proj", "mlp.down_proj"):
                w = layer.get_submodule(name).weight
                mask = torch.rand(w.shape, generator=torch.Generator().manual_seed(i)) < 0.5
                w[mask] = 0
                masks[f"model.layers.{i}.{name}"] = mask
    return save_run(m, tiny_bpe_tokenizer(128), tmp / "run", {"kind": "unstructured", "method": "wanda"}, masks)


def uniform_run(tmp):
    from conftest import save_run

    run = save_run(servable_model("llama", layers=3), tmp / "run",
                   Selection(HD, 3, {i: LayerKeep(heads=[2, 3], kv_heads=[1], channels=list(range(0, 256, 3)))
                                     for i in range(3)}))
    (run / "secateur-report.json").write_text(json.dumps({"kind": "structured", "method": "wanda-sp"}))
    return run


CASES = {"decilm-llama": (per_layer_llama, "decilm"), "decilm-qwen2": (per_layer_qwen2, "decilm"),
         "dense-masked": (masked_run, "dense"), "stock-uniform": (uniform_run, "stock")}


@pytest.fixture(scope="module", params=sorted(CASES))
def served(request, tmp_path_factory):
    build, route = CASES[request.param]
    tmp = tmp_path_factory.mktemp(request.param)
    run = build(tmp)
    r = export_vllm(run, tmp / "served")
    assert r["route"] == route
    llm = vllm.LLM(model=str(tmp / "served"), dtype="float32", max_model_len=256, enforce_eager=True,
                   skip_tokenizer_init=True, trust_remote_code=True, seed=0)
    yield run, tmp / "served", llm
    del llm
    gc.collect()


def _generate(llm, ids: torch.Tensor, new: int, prompt_logprobs: bool):
    from vllm.inputs import TokensPrompt

    sp = vllm.SamplingParams(max_tokens=new, temperature=0.0, prompt_logprobs=0 if prompt_logprobs else None,
                             detokenize=False, ignore_eos=True)
    return llm.generate([TokensPrompt(prompt_token_ids=row) for row in ids.tolist()], sp, use_tqdm=False)


def test_prompt_logprobs_match_the_run(served):
    """vLLM's log-prob of every prompt token equals the run's (transformers, float32) within 4 x the float32 bound
    of :func:`decilm_ref.float32_bound`: two float32 forwards (vLLM's and the run's), each within the bound of the
    exact logits, and a log-prob ``l - logsumexp(l)`` moves by at most twice its logits' largest error."""
    run, folder, llm = served
    ids = random_ids(3, 40, vocab=128, seed=5)
    want = torch.log_softmax(run_logits(run, ids), -1)
    out = _generate(llm, ids, 1, True)
    got = torch.tensor([[o.prompt_logprobs[t][int(ids[n, t])].logprob for t in range(1, ids.shape[1])]
                        for n, o in enumerate(out)], dtype=torch.float64)
    ref = want[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    cfg = json.loads((folder / "config.json").read_text())
    err = float((got - ref).abs().max())
    assert err <= 4 * float32_bound(cfg, run_logits(run, ids)), err


def test_greedy_continuations_match_the_run(served):
    """vLLM's greedy tokens equal the run's greedy tokens (argmax of transformers' logits, one token at a time); a
    step where the run's top two logits lie within the float32 bound of each other may go either way and ends the
    comparison."""
    run, folder, llm = served
    ids = random_ids(2, 12, vocab=128, seed=7)
    out = _generate(llm, ids, N_NEW, False)
    cfg = json.loads((folder / "config.json").read_text())
    for n, o in enumerate(out):
        seq = ids[n:n + 1]
        for tok in o.outputs[0].token_ids:
            logits = run_logits(run, seq)[0, -1]
            top = torch.topk(logits, 2)
            if float(top.values[0] - top.values[1]) <= 2 * float32_bound(cfg, logits):
                break
            assert tok == int(top.indices[0])
            seq = torch.cat([seq, torch.tensor([[tok]])], 1)


def test_transformers_backend_does_not_serve_the_per_layer_run_folder(tmp_path):
    """vLLM's Transformers backend (``model_impl="transformers"``) builds the base model through ``AutoModel``,
    which secateur's per-layer folders do not name (their ``auto_map``: AutoConfig and AutoModelForCausalLM): it
    refuses the run folder as it is, so the DeciLM export is the route. This test says so if that changes."""
    run = per_layer_qwen2(tmp_path)
    with pytest.raises(Exception, match="Unrecognized configuration class") as e:
        vllm.LLM(model=str(run), dtype="float32", max_model_len=256, enforce_eager=True, skip_tokenizer_init=True,
                 trust_remote_code=True, model_impl="transformers", seed=0)
    assert "AutoModel" in str(e.value)
    gc.collect()
