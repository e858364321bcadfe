"""A DeciLM folder's forward in plain torch (float64), read from its ``config.json`` and ``model.safetensors`` alone:
the reference the exported folders are checked against in the main suite (no vLLM there) and the deploy tests.

It follows vLLM's ``DeciLMDecoderLayer`` (``vllm/model_executor/models/nemotron_nas.py``): per layer, a kept
attention is ``h + o(attn(rmsnorm(h)))`` with ``num_attention_heads`` query heads, ``num_attention_heads //
n_heads_in_group`` KV heads, half-split RoPE (``rope_theta``, plain RoPE only) and causal softmax scaled by
``head_dim ** -0.5``; a kept MLP is ``h + down(silu(gate(x)) * up(x))``, ``x = rmsnorm(h)``; a ``no_op`` sublayer is
skipped with its norm; biases where the global flags put them; final RMSNorm, then ``lm_head`` (or the embedding
when tied)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file

from secateur.export.vllm import blocks_of_config
from secateur.structured.selection import LayerKeep, Selection
from secateur.structured.slicing import Replacement
from secateur.testing import servable_model

HD = 32  # servable_model's head size


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """``x``: [N, heads, T, d]; rotate the two halves of each head (transformers' / vLLM's neox style)."""
    d, t = x.shape[-1], x.shape[-2]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.arange(t, dtype=torch.float64)[:, None] * inv[None, :]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def decilm_logits(folder: str | Path, ids: torch.Tensor) -> torch.Tensor:
    """Next-token logits ``[N, T, vocab]`` (float64) of the DeciLM folder for token ids ``[N, T]``."""
    folder = Path(folder)
    cfg = json.loads((folder / "config.json").read_text())
    w = {k: v.double() for k, v in load_file(str(folder / "model.safetensors")).items()}
    rope = cfg.get("rope_parameters") or {}
    assert rope.get("rope_type", "default") == "default", "the reference does plain RoPE only"
    theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    eps, hd, heads = float(cfg["rms_norm_eps"]), int(cfg["head_dim"]), int(cfg["num_attention_heads"])
    n, t = ids.shape
    h = w["model.embed_tokens.weight"][ids]
    causal = torch.full((t, t), float("-inf"), dtype=torch.float64).triu(1)

    def lin(x, name):
        y = x @ w[name + ".weight"].T
        return y + w[name + ".bias"] if name + ".bias" in w else y

    for i, b in enumerate(blocks_of_config(cfg)):
        p = f"model.layers.{i}."
        if b.n_heads:
            x = _rms(h, w[p + "input_layernorm.weight"], eps)
            q = lin(x, p + "self_attn.q_proj").view(n, t, b.n_heads, hd).transpose(1, 2)
            k = lin(x, p + "self_attn.k_proj").view(n, t, b.n_kv, hd).transpose(1, 2)
            v = lin(x, p + "self_attn.v_proj").view(n, t, b.n_kv, hd).transpose(1, 2)
            q, k = _rope(q, theta), _rope(k, theta)
            rep = heads // b.n_kv
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd) + causal, -1) @ v
            h = h + lin(a.transpose(1, 2).reshape(n, t, heads * hd), p + "self_attn.o_proj")
        if b.width:
            x = _rms(h, w[p + "post_attention_layernorm.weight"], eps)
            m = torch.nn.functional.silu(lin(x, p + "mlp.gate_proj")) * lin(x, p + "mlp.up_proj")
            h = h + lin(m, p + "mlp.down_proj")
    h = _rms(h, w["model.norm.weight"], eps)
    head = w["model.embed_tokens.weight"] if cfg.get("tie_word_embeddings") else w["lm_head.weight"]
    return h @ head.T


def float32_bound(cfg: dict, logits: torch.Tensor) -> float:
    """How far a float32 forward's logits may sit from the float64 reference: every matrix product of inner length
    ``K`` rounds each of its ``K`` additions with unit roundoff ``u = 2^-24``, a relative error of at most ``K u``
    of the sum of |terms| (Higham, Thm. 3.5); the residual stream adds each sublayer's error once, RMSNorm and
    softmax are 1-Lipschitz up to the norm weights (O(1) here), so the logits' error is at most about
    ``(number of products) x K_max x u x max|logit|``, with a factor 4 for the norm weights (drawn in [0.5, 1.5])
    and the exp/rsqrt roundings. For the tiny models (K <= 256, 7 products a layer, 4 layers, |logits| ~ 1) that is
    ~3e-3: far above the ~1e-6 actually seen, far below the O(0.1) of a wrong head order or a missed bias."""
    k_max = max(int(cfg["hidden_size"]), int(cfg.get("intermediate_size") or 0))
    products = 7 * int(cfg["num_hidden_layers"]) + 1
    return 4 * products * k_max * 2.0 ** -24 * max(1.0, float(logits.abs().max()))


# --- the runs the export and deploy tests share ------------------------------------------------------


def per_layer_llama(tmp_path: Path) -> Path:
    """Every DeciLM case on 5 layers of 4 query / 2 KV heads, with output biases FLAP's compensation would keep:
    layer 0 loses its attention and its MLP (both biases folded into the embedding: nothing before them); layer 1
    loses its attention (bias kept) but keeps 100 MLP channels (the first MLP with no attention before it: a zero
    attention stands in and carries the bias); layer 2 keeps one query head per KV group (2 heads over 2 KV heads)
    and loses its MLP (its bias folds into layer 2's o_proj); layer 3 loses its attention (folds into layer 2's
    o_proj too) and keeps 256 channels (``ffn_mult`` written too); layer 4 keeps KV group 1 (2 heads over 1) and 70
    channels with a compensated down_proj."""
    m = servable_model("llama", layers=5)
    g = torch.Generator().manual_seed(1)
    none = {"heads": [], "kv_heads": []}
    sel = Selection(HD, 5, {0: LayerKeep(**none, channels=[]), 1: LayerKeep(**none, channels=list(range(0, 200, 2))),
                            2: LayerKeep(heads=[0, 2], kv_heads=[0, 1], channels=[]), 3: LayerKeep(**none),
                            4: LayerKeep(heads=[2, 3], kv_heads=[1], channels=list(range(70)))})
    reps = {(i, r): Replacement(torch.zeros(128, 0), torch.randn(128, generator=g))
            for i, r in ((0, "o"), (0, "down"), (1, "o"), (2, "down"), (3, "o"))}
    reps[(4, "down")] = Replacement(torch.randn(128, 70, generator=g) * 0.05, torch.randn(128, generator=g))
    return _save(m, tmp_path / "run", sel, reps)


def per_layer_qwen2(tmp_path: Path) -> Path:
    """Qwen2 (q/k/v biases): layer 0 keeps KV group 0, layer 1 group 1, layer 2 its attention but not its MLP,
    layer 3 64 channels."""
    m = servable_model("qwen2")
    sel = Selection(HD, 4, {0: LayerKeep(heads=[0, 1], kv_heads=[0], channels=list(range(40, 240))),
                            1: LayerKeep(heads=[2, 3], kv_heads=[1]),
                            2: LayerKeep(heads=[0, 1], kv_heads=[0], channels=[]),
                            3: LayerKeep(heads=[0, 1], kv_heads=[0], channels=list(range(64)))})
    return _save(m, tmp_path / "run", sel)


def run_logits(run: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    import secateur.models.loading  # noqa: F401 - registers the per-layer classes

    m = AutoModelForCausalLM.from_pretrained(run, dtype=torch.float32).eval()
    with torch.no_grad():
        return m(ids).logits.double()


def _save(model, path: Path, sel, reps=None) -> Path:
    from conftest import save_run

    return save_run(model, path, sel, reps)
