"""secateur export gguf: every tensor read back with gguf.GGUFReader equals the run's tensor (exactly in f32,
within the rounding of f16 / bf16 / q8_0), metadata, routes (llama / qwen2 / deci), refusals, atomic writes."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from conftest import save_run
from safetensors.torch import load_file

from secateur.cli import main
from secateur.errors import SecateurError
from secateur.export import gguf as gx
from secateur.models.adapters import get_adapter
from secateur.structured.selection import LayerKeep, Selection
from secateur.structured.slicing import Replacement
from secateur.testing import tiny_bpe_tokenizer, tiny_model

ARCH = {"llama": "llama", "qwen2": "qwen2"}
_ROLES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
          "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}


def hf_tensors(run) -> dict[str, np.ndarray]:
    files = sorted(Path(run).glob("*.safetensors"))
    out = {}
    for f in files:
        out |= {k: v.float().numpy() for k, v in load_file(str(f)).items()}
    return out


def fields(reader) -> dict:
    return {k: f.contents() for k, f in reader.fields.items()}


def hf_name(gname: str) -> str:
    if gname in ("token_embd.weight", "output_norm.weight", "output.weight"):
        return {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}[gname]
    _, i, role, kind = gname.split(".")
    return f"model.layers.{i}.{_ROLES[role]}.{kind}"


def read_back(path) -> tuple[dict, dict[str, tuple[np.ndarray, str]]]:
    """(metadata, {name: (values as float32 in HF row order before un-permutation, storage type)})."""
    r = gguf.GGUFReader(str(path))
    out = {}
    for t in r.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        vals = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(shape).astype(np.float32)
        out[t.name] = (vals, t.tensor_type.name)
    return fields(r), out


def unpermuted(meta: dict, name: str, vals: np.ndarray) -> np.ndarray:
    """Undo llama.cpp's q/k row order (llama and deci write it) with the layer's head counts."""
    arch = meta["general.architecture"]
    if arch not in ("llama", "deci") or not name.startswith("blk.") or name.split(".")[2] not in ("attn_q", "attn_k"):
        return vals
    i = int(name.split(".")[1])
    key = "head_count" if name.split(".")[2] == "attn_q" else "head_count_kv"
    n = meta[f"{arch}.attention.{key}"]
    return gx.unpermute_rows(vals, n[i] if isinstance(n, list) else n)


def check_tensors(run, path, bound) -> dict:
    """Every GGUF tensor equals its run tensor within ``bound(x, storage) -> max |x - y|`` (zero stand-ins: 0);
    every run tensor with data appears. Returns the metadata."""
    meta, got = read_back(path)
    want = hf_tensors(run)
    seen = set()
    for name, (vals, storage) in got.items():
        src = hf_name(name)
        y = unpermuted(meta, name, vals)
        if src not in want or want[src].shape != y.shape:  # the zero MLP standing in for a removed one
            assert name.split(".")[2].startswith(("ffn_", "attn_")) and not y.any(), name
            continue
        x = want[src]
        seen.add(src)
        if name.endswith("_norm.weight") or x.ndim == 1:
            assert storage == "F32", name
        assert np.all(np.abs(x - y) <= bound(x, storage)), (name, storage, float(np.abs(x - y).max()))
    used_norms = {n for n in want if "layernorm" in n}
    missing = {n for n in want if n not in seen and want[n].size and n not in used_norms}
    assert not missing, missing
    return meta


def exact(x, storage):
    assert storage == "F32"
    return np.zeros_like(x)


def rounding(x, storage):
    """Half an ulp of each format (round to nearest): f16 2^-11 |x| (2^-25 below the normal range), bf16 2^-8 |x|
    (float32's subnormal spacing is far below), q8_0 half a step amax/127 of each block of 32 plus the f16
    rounding of its scale (2^-11 amax)."""
    a = np.abs(x)
    if storage == "F32":
        return np.zeros_like(x)
    if storage == "F16":
        return np.maximum(a * 2.0 ** -11, 2.0 ** -25)
    if storage == "BF16":
        return a * 2.0 ** -8
    assert storage == "Q8_0"
    amax = np.abs(x.reshape(*x.shape[:-1], -1, 32)).max(-1, keepdims=True)
    return np.broadcast_to(amax / 254 + amax * 2.0 ** -11, (*x.shape[:-1], x.shape[-1] // 32, 32)).reshape(x.shape)


def check_common(meta, model_cfg, arch):
    assert meta["general.architecture"] == arch
    assert meta[f"{arch}.context_length"] == model_cfg.max_position_embeddings
    assert meta[f"{arch}.embedding_length"] == model_cfg.hidden_size
    assert meta[f"{arch}.rope.freq_base"] == pytest.approx(model_cfg.rope_parameters["rope_theta"])
    assert meta[f"{arch}.attention.layer_norm_rms_epsilon"] == pytest.approx(model_cfg.rms_norm_eps)
    assert meta[f"{arch}.vocab_size"] == model_cfg.vocab_size
    assert meta[f"{arch}.rope.dimension_count"] == 8 == meta[f"{arch}.attention.key_length"]
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.pre"] == "gpt-2"
    assert len(meta["tokenizer.ggml.tokens"]) == model_cfg.vocab_size
    assert meta["tokenizer.ggml.merges"] == ["Ġ t"]
    assert meta["tokenizer.ggml.bos_token_id"] == meta["tokenizer.ggml.eos_token_id"] == model_cfg.vocab_size - 1
    assert meta["tokenizer.ggml.token_type"][-1] == gguf.TokenType.CONTROL
    assert meta[gx.ROUTE_KEY] == arch


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_dense_f32_exact(family, tmp_path):
    m = tiny_model(family, layers=2)
    run = save_run(m, tmp_path / "run")
    r = gx.export_gguf(run, tmp_path / "m.gguf", "f32")
    assert r["arch"] == ARCH[family] and not r["fallbacks"]
    meta = check_tensors(run, tmp_path / "m.gguf", exact)
    check_common(meta, m.config, ARCH[family])
    a = ARCH[family]
    assert (meta[f"{a}.block_count"], meta[f"{a}.feed_forward_length"]) == (2, 64)
    assert (meta[f"{a}.attention.head_count"], meta[f"{a}.attention.head_count_kv"]) == (4, 2)


def test_llama_qk_rows_in_llama_cpp_order(tmp_path):
    """Row 2j of a head is HF row j, row 2j+1 is HF row j + d/2 (llama.cpp's adjacent-pair RoPE)."""
    m = tiny_model("llama", layers=1)
    run = save_run(m, tmp_path / "run")
    gx.export_gguf(run, tmp_path / "m.gguf", "f32")
    _, got = read_back(tmp_path / "m.gguf")
    q = m.model.layers[0].self_attn.q_proj.weight.detach().numpy()
    g = got["blk.0.attn_q.weight"][0]
    for h in range(4):
        for j in range(4):
            assert np.array_equal(g[8 * h + 2 * j], q[8 * h + j])
            assert np.array_equal(g[8 * h + 2 * j + 1], q[8 * h + j + 4])
    assert np.array_equal(read_back(tmp_path / "m.gguf")[1]["blk.0.attn_v.weight"][0],
                          m.model.layers[0].self_attn.v_proj.weight.detach().numpy())  # v is not permuted


@pytest.mark.parametrize("qtype", ["f16", "bf16", "q8_0"])
def test_storage_types_within_rounding(qtype, tmp_path):
    m = tiny_model("qwen2", layers=2)
    run = save_run(m, tmp_path / "run")
    r = gx.export_gguf(run, tmp_path / "m.gguf", qtype)
    meta = check_tensors(run, tmp_path / "m.gguf", rounding)
    _, got = read_back(tmp_path / "m.gguf")
    assert got["blk.0.ffn_gate.weight"][1] == qtype.upper() and got["blk.0.attn_norm.weight"][1] == "F32"
    assert meta["general.file_type"] == {"f16": 1, "bf16": 32, "q8_0": 7}[qtype]
    assert not r["fallbacks"]  # every row of the tiny model is 32 or 64 wide


def test_masked_run_exports_dense_with_zeros(tmp_path):
    from secateur import api

    m, tok = tiny_model("llama", layers=2), tiny_bpe_tokenizer()
    api.prune(model=m, tokenizer=tok, method="magnitude", sparsity=0.5, out=str(tmp_path / "run"), quiet=True)
    gx.export_gguf(tmp_path / "run", tmp_path / "m.gguf", "f32")
    check_tensors(tmp_path / "run", tmp_path / "m.gguf", exact)
    _, got = read_back(tmp_path / "m.gguf")
    assert (got["blk.0.ffn_up.weight"][0] == 0).mean() == pytest.approx(0.5, abs=0.01)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_uniform_slice_keeps_family_architecture(family, tmp_path):
    from secateur.budgets.select import select_units

    m = tiny_model(family, layers=2)
    kinds = ("kv_group", "channel") if family == "llama" else ("channel",)
    sel = select_units(get_adapter(m), "magnitude", 0.5, kinds=kinds)
    run = save_run(m, tmp_path / "run", sel)
    assert json.loads((tmp_path / "run" / "config.json").read_text())["model_type"] == family
    r = gx.export_gguf(run, tmp_path / "m.gguf", "f32")
    assert r["arch"] == ARCH[family]
    meta = check_tensors(run, tmp_path / "m.gguf", exact)
    a, cfg = ARCH[family], json.loads((tmp_path / "run" / "config.json").read_text())
    assert meta[f"{a}.feed_forward_length"] == cfg["intermediate_size"] < 64
    assert meta[f"{a}.attention.head_count_kv"] == cfg["num_key_value_heads"] == (1 if family == "llama" else 2)
    assert meta[f"{a}.attention.head_count"] == cfg["num_attention_heads"]


def test_uneven_llama_goes_to_deci(tmp_path):
    """Layer 0 loses one KV group, layer 1 its MLP (kept attention: a zero MLP of width 1), layer 2 both
    (llama.cpp's attention- and FFN-free layer: n_head 0, n_ff 0, no tensors), layer 3 part of its MLP."""
    m = tiny_model("llama", layers=4)
    sel = Selection(8, 4, {0: LayerKeep(heads=[0, 1], kv_heads=[0]), 1: LayerKeep(channels=[]),
                           2: LayerKeep(heads=[], kv_heads=[], channels=[]), 3: LayerKeep(channels=list(range(40)))})
    run = save_run(m, tmp_path / "run", sel)
    r = gx.export_gguf(run, tmp_path / "m.gguf", "f32")
    assert r["arch"] == "deci" and any("layer 1 has no MLP" in n for n in r["notes"])
    meta = check_tensors(run, tmp_path / "m.gguf", exact)
    check_common(meta, m.config, "deci")
    assert meta["deci.attention.head_count"] == [2, 4, 0, 4]
    assert meta["deci.attention.head_count_kv"] == [1, 2, 0, 2]
    assert meta["deci.feed_forward_length"] == [64, 1, 0, 40]
    _, got = read_back(tmp_path / "m.gguf")
    assert not any(n.startswith("blk.2.") for n in got)
    assert got["blk.1.ffn_down.weight"][0].shape == (32, 1) and not got["blk.1.ffn_down.weight"][0].any()


def test_uneven_qwen2_with_flap_biases_goes_to_deci(tmp_path):
    """Qwen2 keeps its heads (llama.cpp reads attn_q.bias with n_embd rows); uneven MLPs, one removed with its
    compensation bias kept as ffn_down.bias, an o_proj compensation bias (qwen2 reads none, deci does)."""
    m = tiny_model("qwen2", layers=3)
    g = torch.Generator().manual_seed(0)
    sel = Selection(8, 3, {0: LayerKeep(channels=list(range(48))), 1: LayerKeep(channels=[])})
    reps = {(1, "down"): Replacement(torch.zeros(32, 0), torch.randn(32, generator=g)),
            (2, "o"): Replacement(torch.randn(32, 32, generator=g), torch.randn(32, generator=g))}
    run = save_run(m, tmp_path / "run", sel, reps)
    r = gx.export_gguf(run, tmp_path / "m.gguf", "f16")
    assert r["arch"] == "deci"
    meta = check_tensors(run, tmp_path / "m.gguf", rounding)
    assert meta["deci.feed_forward_length"] == [48, 1, 64] and meta["deci.attention.head_count"] == [4, 4, 4]
    _, got = read_back(tmp_path / "m.gguf")
    assert "blk.1.ffn_down.bias" in got and "blk.2.attn_output.bias" in got


def test_qwen2_with_a_kv_group_removed_goes_to_deci(tmp_path):
    """qwen2 reads attn_q (and its bias) with the hidden size's rows; deci with the layer's heads."""
    m = tiny_model("qwen2", layers=2)
    run = save_run(m, tmp_path / "run", Selection(8, 2, {0: LayerKeep(heads=[0, 1], kv_heads=[0])}))
    r = gx.export_gguf(run, tmp_path / "m.gguf", "f32")
    assert r["arch"] == "deci"
    meta = check_tensors(run, tmp_path / "m.gguf", exact)
    assert meta["deci.attention.head_count"] == [2, 4] and meta["deci.attention.head_count_kv"] == [1, 2]
    assert read_back(tmp_path / "m.gguf")[1]["blk.0.attn_q.bias"][0].shape == (16,)


def test_removed_attention_in_layer_0_or_with_a_bias_is_one_zero_head(tmp_path):
    """llama.cpp takes the head size from layer 0's head count, and its attention-free layer reads no o bias: such
    a removed attention is one zero head (output exactly 0, plus the bias); elsewhere it has no tensors."""
    m = tiny_model("llama", layers=4)
    g = torch.Generator().manual_seed(0)
    reps = {(2, "o"): Replacement(torch.zeros(32, 0), torch.randn(32, generator=g))}
    sel = Selection(8, 4, {0: LayerKeep(heads=[], kv_heads=[]), 1: LayerKeep(heads=[], kv_heads=[]),
                           2: LayerKeep(heads=[], kv_heads=[], channels=[])})
    run = save_run(m, tmp_path / "run", sel, reps)
    r = gx.export_gguf(run, tmp_path / "m.gguf", "f32")
    assert r["arch"] == "deci" and sum("one zero head" in n for n in r["notes"]) == 2
    meta = check_tensors(run, tmp_path / "m.gguf", exact)
    assert meta["deci.attention.head_count"] == [1, 0, 1, 4] and meta["deci.attention.head_count_kv"] == [1, 0, 1, 2]
    assert meta["deci.feed_forward_length"] == [64, 64, 1, 64]  # layer 2 keeps its residual add for the bias
    _, got = read_back(tmp_path / "m.gguf")
    assert got["blk.0.attn_q.weight"][0].shape == (8, 32) and not got["blk.0.attn_output.weight"][0].any()
    assert not any(n.startswith("blk.1.attn") for n in got) and "blk.2.attn_output.bias" in got


@pytest.mark.parametrize("family", ["gpt2", "gemma3_text"])
def test_refuses_other_families(family, tmp_path):
    run = tmp_path / "run"
    tiny_model(family, layers=1).save_pretrained(run)
    with pytest.raises(SecateurError, match=f"is a '{family}' model") as e:
        gx.export_gguf(run, tmp_path / "m.gguf")
    assert "\n" not in str(e.value) and "llama, mistral, qwen2" in str(e.value)


def test_q8_0_falls_back_for_odd_rows(tmp_path):
    m = tiny_model("llama", layers=2)
    run = save_run(m, tmp_path / "run", Selection(8, 2, {0: LayerKeep(channels=list(range(40)))}))
    r = gx.export_gguf(run, tmp_path / "m.gguf", "q8_0")
    assert ("blk.0.ffn_down.weight", "f16", "its rows hold 40 values, not a multiple of 32") in r["fallbacks"]
    check_tensors(run, tmp_path / "m.gguf", rounding)
    assert read_back(tmp_path / "m.gguf")[1]["blk.0.ffn_down.weight"][1] == "F16"


def test_atomic_write_overwrite_rules_and_cli(tmp_path, monkeypatch, capsys):
    m = tiny_model("llama", layers=1)
    run = save_run(m, tmp_path / "run")
    out = tmp_path / "o" / "m.gguf"
    calls = {"n": 0}
    real = gx._encode

    def failing(a, qtype):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt  # Ctrl-C in the middle of the tensor data
        return real(a, qtype)

    monkeypatch.setattr(gx, "_encode", failing)
    with pytest.raises(KeyboardInterrupt):
        gx.export_gguf(run, out, "f32")
    assert not (tmp_path / "o").exists()  # no file, no temporary, not even the folder it created
    monkeypatch.setattr(gx, "_encode", real)
    assert main(["export", "gguf", str(run), "--out", str(out), "--type", "f32"]) == 0
    assert "llama, f32" in capsys.readouterr().out
    assert main(["export", "gguf", str(run), "--out", str(out)]) == 2
    assert "already exists; pass --overwrite" in capsys.readouterr().err
    assert main(["export", "gguf", str(run), "--out", str(out), "--overwrite"]) == 0
    assert read_back(out)[0]["general.file_type"] == 1 and sorted(p.name for p in out.parent.iterdir()) == ["m.gguf"]
    mine = tmp_path / "notes.gguf"
    mine.write_text("not a model")
    assert main(["export", "gguf", str(run), "--out", str(mine), "--overwrite"]) == 2
    assert "is not a GGUF file secateur wrote" in capsys.readouterr().err and mine.read_text() == "not a model"


@pytest.mark.parametrize(("family", "kinds"), [("llama", None), ("qwen2", None), ("llama", ("kv_group", "channel")),
                                               ("qwen2", ("channel",))])
def test_transformers_reads_the_file_back_to_identical_logits(family, kinds, tmp_path):
    """An independent GGUF reader: transformers' loader (its llama q/k un-permutation, its config mapping and
    tokenizer conversion) rebuilds the run from the f32 file with logits equal to the run's, bit for bit."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from secateur.budgets.select import select_units
    from secateur.testing import random_ids

    m = tiny_model(family, layers=2)
    sel = select_units(get_adapter(m), "magnitude", 0.5, kinds=kinds) if kinds else None
    run = save_run(m, tmp_path / "run", sel)
    gx.export_gguf(run, tmp_path / "m.gguf", "f32")
    back = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32).eval()
    ids = random_ids(2, 9)
    with torch.no_grad():
        assert torch.equal(back(ids).logits, m(ids).logits)
    text = "a t b\n12"
    assert AutoTokenizer.from_pretrained(tmp_path, gguf_file="m.gguf")(text)["input_ids"] == \
        tiny_bpe_tokenizer()(text)["input_ids"]
