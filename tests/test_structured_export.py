"""Export: one from_pretrained(dir) reloads pruned models with identical logits (stock and hetero routes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from shape_flops import shape_flops
from transformers import AutoModelForCausalLM, LlamaConfig

from secateur.budgets.select import select_units
from secateur.errors import SecateurError
from secateur.eval.efficiency import count_params, count_params_from_config, flops_per_token, measure_efficiency
from secateur.export.sliced import save_pruned
from secateur.linalg import one_thread
from secateur.models.adapters import get_adapter
from secateur.structured.selection import LayerKeep, Selection
from secateur.structured.slicing import Replacement, apply_selection
from secateur.testing import FAMILIES, random_ids, tiny_model


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def reload_and_compare(model, path, ids):
    loaded = AutoModelForCausalLM.from_pretrained(path).eval()
    assert torch.equal(logits(loaded, ids), logits(model, ids))
    return loaded


@pytest.mark.parametrize("family", FAMILIES)
def test_uniform_widths_use_stock_config(family, tmp_path):
    m = tiny_model(family, layers=3)
    a = get_adapter(m)
    kinds = ("kv_group", "channel") if family not in ("opt", "gpt2") else ("channel",)
    sel = select_units(a, "magnitude", 0.5, kinds=kinds)
    apply_selection(m, a, sel)
    r = save_pruned(m, tmp_path / "out")
    assert r["route"] == "stock"
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["model_type"] == family and "secateur_layers" not in cfg and "auto_map" not in cfg
    loaded = reload_and_compare(m, tmp_path / "out", random_ids(2, 11))
    assert type(loaded).__module__.startswith("transformers.models.")
    assert count_params(loaded) == count_params(m) == count_params_from_config(loaded.config)


@pytest.mark.parametrize("family", FAMILIES)
def test_uneven_widths_use_hetero_classes(family, tmp_path):
    m = tiny_model(family, layers=4)
    a = get_adapter(m)
    sel = select_units(a, "random", 0.4, kinds=("kv_group", "channel"), allocation="global", seed=2)
    apply_selection(m, a, sel)
    assert len({json.dumps(s) for s in m.config.secateur_layers}) > 1
    r = save_pruned(m, tmp_path / "out", extra_files={"secateur_selection.json": sel.to_dict()})
    assert r["route"] == "hetero"
    folder = tmp_path / "out"
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["model_type"] == f"secateur_{family}" and (folder / "secateur_hetero.py").exists()
    assert cfg["auto_map"]["AutoModelForCausalLM"].startswith("secateur_hetero.")
    assert Selection.from_dict(json.loads((folder / "secateur_selection.json").read_text())).to_dict() == \
        sel.to_dict()
    loaded = reload_and_compare(m, folder, random_ids(2, 11))
    assert count_params(loaded) == count_params_from_config(loaded.config) == count_params(m)


def test_llama_uniform_heads_not_dividing_hidden_fall_back_to_hetero(tmp_path):
    cfg = LlamaConfig(vocab_size=128, num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    sel = Selection(8, 2, {i: LayerKeep(heads=[0, 2, 3], kv_heads=[0, 2, 3]) for i in range(2)})
    apply_selection(m, get_adapter(m), sel)
    assert save_pruned(m, tmp_path / "o")["route"] == "hetero"  # 32 % 3 != 0: stock Llama refuses
    reload_and_compare(m, tmp_path / "o", random_ids(1, 7))


@pytest.mark.parametrize("family", ["llama", "qwen3", "opt", "gpt2"])
def test_removed_attention_blocks_and_biases_reload(family, tmp_path):
    m = tiny_model(family, layers=4)
    a = get_adapter(m)
    kv = [0] if family in ("llama", "qwen3") else [0, 1]
    sel = Selection(8, 4, {0: LayerKeep(heads=[0, 1], kv_heads=kv), 1: LayerKeep(heads=[], kv_heads=[]),
                           3: LayerKeep(channels=[])}, removed_blocks=[2])
    g = torch.Generator().manual_seed(0)
    reps = {(0, "o"): Replacement(torch.randn(32, 16, generator=g), torch.randn(32, generator=g)),
            (3, "down"): Replacement(torch.zeros(32, 0), torch.randn(32, generator=g))}
    apply_selection(m, a, sel, reps)
    assert save_pruned(m, tmp_path / "o")["route"] == "hetero"
    ids = random_ids(2, 8)
    loaded = reload_and_compare(m, tmp_path / "o", ids)
    assert loaded.config.num_hidden_layers == 3
    with torch.no_grad():  # decoding with a KV cache through the null attention works after reload
        a1 = loaded.generate(ids[:1], max_new_tokens=4, do_sample=False)
        a2 = m.generate(ids[:1], max_new_tokens=4, do_sample=False)
    assert torch.equal(a1, a2)


@pytest.mark.parametrize(("family", "kind", "cls"), [("gpt2", "head", "SecateurGPT2LMHeadModel"),
                                                    ("qwen3", "kv_group", "SecateurQwen3ForCausalLM")])
def test_trust_remote_code_without_secateur(family, kind, cls, tmp_path):
    m = tiny_model(family, layers=3)
    a = get_adapter(m)
    apply_selection(m, a, select_units(a, "random", 0.4, kinds=(kind, "channel"), allocation="global"))
    assert save_pruned(m, tmp_path / "o")["route"] == "hetero"
    ids = random_ids(1, 7)
    # bitwise equality across processes holds only for the same kernels: one thread on both sides (a loaded
    # machine can otherwise give the two processes different OpenMP splits of the same reduction)
    with one_thread():
        ref_logits = logits(m, ids)
    torch.save({"ids": ids, "logits": ref_logits}, tmp_path / "ref.pt")
    code = (
        "import sys, torch\n"
        "torch.set_num_threads(1)\n"
        "from transformers import AutoModelForCausalLM\n"
        f"ref = torch.load({str(tmp_path / 'ref.pt')!r})\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(tmp_path / 'o')!r}, trust_remote_code=True).eval()\n"
        "assert 'secateur' not in sys.modules\n"
        "with torch.no_grad():\n"
        "    assert torch.equal(m(ref['ids']).logits, ref['logits'])\n"
        "print('OK', type(m).__name__)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["HF_MODULES_CACHE"] = str(tmp_path / "modules")
    env |= {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"OK {cls}" in out.stdout


def test_atomic_write_and_overwrite(tmp_path):
    m = tiny_model("llama", layers=2)
    a = get_adapter(m)
    apply_selection(m, a, select_units(a, "magnitude", 0.5))
    save_pruned(m, tmp_path / "o")
    with pytest.raises(SecateurError, match="exists"):
        save_pruned(m, tmp_path / "o")
    save_pruned(m, tmp_path / "o", overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"]  # no temporary folders left
    reload_and_compare(m, tmp_path / "o", random_ids(1, 5))


def test_measure_efficiency_on_sliced_model():
    m = tiny_model("qwen2", layers=3)
    a = get_adapter(m)
    dense = count_params(m)
    apply_selection(m, a, select_units(a, "random", 0.5, allocation="global", seed=1))
    r = measure_efficiency(m, prompt_len=12, new_tokens=3, warmup=1, repeats=1)
    assert r["params"] == count_params(m) < dense
    assert r["params"] == count_params_from_config(m.config)
    assert r["flops_per_token"] == shape_flops(m)  # counted from the sliced module shapes, not from params
    assert r["peak_memory_kind"].startswith("cpu_rss") and r["peak_memory_bytes"] > 0
    assert r["prefill_tokens_per_s"] > 0 and r["decode_tokens_per_s"] > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_flops_per_token_match_module_shapes(family):
    """FLOPs/token (and the attention term over a context) equal a count from the module shapes alone, for the
    dense model and for an uneven slice (layers keep different head and channel counts, one keeps no heads)."""
    m = tiny_model(family, layers=3)
    for sliced in (False, True):
        if sliced:
            a = get_adapter(m)
            apply_selection(m, a, select_units(a, "random", 0.5, allocation="global", seed=1))
            heads = [s["n_heads"] for s in m.config.secateur_layers]
            assert len(set(heads)) > 1 and 0 in heads, heads  # the slice is uneven
        for ctx in (0, 37):
            want = shape_flops(m, ctx)
            assert flops_per_token(m, attention_context=ctx) == want, (sliced, ctx)
            assert flops_per_token(count_params_from_config(m.config), m.config, attention_context=ctx) == want
    assert shape_flops(m, 37) > shape_flops(m) > 0
    with pytest.raises(SecateurError, match="attention FLOPs need the model config"):
        flops_per_token(count_params(m), attention_context=37)


def test_bf16_iterative_pruning_reloads_exactly(tmp_path):
    tiny_model("qwen2", layers=4).save_pretrained(tmp_path / "dense")
    # loaded in bf16 (not .to(bf16), which would also round the RoPE inv_freq buffer)
    m = AutoModelForCausalLM.from_pretrained(tmp_path / "dense", dtype=torch.bfloat16).eval()
    a = get_adapter(m)
    apply_selection(m, a, select_units(a, "random", 0.3, allocation="global", seed=3))
    apply_selection(m, a, select_units(a, "magnitude", 0.2))  # second round on the pruned model
    save_pruned(m, tmp_path / "o")
    loaded = reload_and_compare(m, tmp_path / "o", random_ids(1, 9))
    assert next(loaded.parameters()).dtype == torch.bfloat16
