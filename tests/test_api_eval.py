"""The Python API's evaluators mirror the CLI's: a spec/folder is loaded, an in-memory model needs its tokenizer."""

import pytest
from conftest import DATA_DIR
from shape_flops import shape_flops
from transformers import AutoModelForCausalLM

from secateur import api
from secateur.errors import SecateurError
from secateur.eval.efficiency import count_params
from secateur.testing import save_tiny

HAS_ZS_DATA = (DATA_DIR / "zeroshot" / "boolq.jsonl").exists()


def test_eval_efficiency_from_a_folder(tmp_path):
    path = save_tiny("llama", tmp_path / "m")
    e = api.eval_efficiency(path, prompt_len=8, new_tokens=2, warmup=0, repeats=1)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert e["params"] == count_params(model)
    assert e["flops_per_token"] == shape_flops(model) and e["prefill_tokens_per_s"] > 0 and e["decode_tokens_per_s"] > 0


def test_in_memory_model_needs_its_tokenizer(tmp_path):
    model = AutoModelForCausalLM.from_pretrained(save_tiny("llama", tmp_path / "m"))
    for fn in (api.eval_ppl, api.eval_zeroshot):
        with pytest.raises(SecateurError, match="tokenizer"):
            fn(model)


@pytest.mark.skipif(not HAS_ZS_DATA, reason=f"no zero-shot data at {DATA_DIR}")
def test_eval_zeroshot_from_a_folder(tmp_path):
    r = api.eval_zeroshot(save_tiny("llama", tmp_path / "m"), tasks="boolq", limit=2, progress=False)
    assert set(r["tasks"]) == {"boolq"} and 0.0 <= r["summary"]["mean"] <= 100.0 and r["model"].endswith("m")
