"""FLOPs per token counted from a model's module shapes alone, independently of ``secateur.eval.efficiency``.

Matmuls: ``2 in out`` per Linear / Conv1D (+ ``2 out`` for a bias); every other weight (embedding tables,
norms) counts 2 per parameter: COEC's ``2 x params`` convention that the evaluator implements (Table 4), here
rebuilt module by module, each tensor once (tied lm_head / embedding). Attention over ``context`` tokens adds
``4 H_Q m context`` per layer, ``H_Q`` read from the layer's own query projection (sliced layers differ).
"""

from __future__ import annotations

from torch import nn
from transformers.pytorch_utils import Conv1D


def _sizes(mod: nn.Module) -> list[tuple[object, int]]:
    """(tensor, element count from the module's shape attributes) of the module's own weights."""
    if isinstance(mod, nn.Linear):
        w = [(mod.weight, mod.in_features * mod.out_features)]
        return w + ([(mod.bias, mod.out_features)] if mod.bias is not None else [])
    if isinstance(mod, Conv1D):  # GPT-2: weight (nx, nf)
        return [(mod.weight, mod.nx * mod.nf), (mod.bias, mod.nf)]
    if isinstance(mod, nn.Embedding):
        return [(mod.weight, mod.num_embeddings * mod.embedding_dim)]
    if isinstance(mod, nn.LayerNorm):
        n = mod.normalized_shape[0]
        return [(t, n) for t in (mod.weight, mod.bias) if t is not None]
    if "RMSNorm" in type(mod).__name__:
        return [(mod.weight, mod.weight.shape[0])]
    return []


def _heads(layer: nn.Module, head_dim: int) -> int:
    attn = getattr(layer, "self_attn", None) or layer.attn
    if hasattr(attn, "q_proj"):
        return attn.q_proj.out_features // head_dim
    if hasattr(attn, "qkv_proj"):  # Phi-3: fused [q; k; v], q as wide as o_proj's input
        return attn.o_proj.in_features // head_dim
    return attn.c_attn.nf // 3 // head_dim  # GPT-2: fused q, k, v


def shape_flops(model: nn.Module, context: int = 0) -> float:
    seen: dict[int, int] = {}
    for mod in model.modules():
        for t, n in _sizes(mod):
            seen.setdefault(id(t), n)
    params = {id(p) for p in model.parameters()}
    assert set(seen) == params, "a parameter outside Linear/Conv1D/Embedding/norm modules: extend the count"
    flops = 2.0 * sum(seen.values())
    if context:
        cfg = model.config
        heads = getattr(cfg, "num_attention_heads", None) or cfg.n_head
        m = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        layers = model.get_decoder().layers if hasattr(model.get_decoder(), "layers") else model.transformer.h
        flops += sum(4.0 * _heads(layer, m) * m * context for layer in layers)
    return flops
