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


def test_eval_ppl_names_the_tokenizers_bos_convention(tmp_path):
    """``eval ppl`` follows the tokenizer: no BOS added -> today's protocol; BOS added -> ``+bos-first``."""
    from secateur.testing import tiny_model, tiny_tokenizer

    text = tmp_path / "eval.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    model = tiny_model("llama")
    plain = api.eval_ppl(model, str(text), seqlen=32, max_windows=2, tokenizer=tiny_tokenizer(), progress=False)
    first = api.eval_ppl(model, str(text), seqlen=32, max_windows=2, tokenizer=tiny_tokenizer(bos=True),
                         progress=False)
    assert (plain["protocol"], plain["bos"]) == ("nonoverlap-32", "none")
    assert (first["protocol"], first["bos"]) == ("nonoverlap-32+bos-first", "first")
    assert first["tokens_sha256"] == plain["tokens_sha256"] and first["ppl"] != plain["ppl"]
