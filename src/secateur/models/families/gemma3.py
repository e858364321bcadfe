"""Gemma-3 text models (``model_type = "gemma3_text"``, Gemma3ForCausalLM).

Llama's module names, plus what sets Gemma apart: an explicit head_dim and per-head q/k norms (MQA on the small
models: one KV head), FOUR norms per block (``post_attention_layernorm`` and ``post_feedforward_layernorm``
normalize the attention and MLP outputs *before* the residual add: ``h2 = h + post_attn_norm(o(a))``,
``out = h2 + post_ff_norm(down(m))``, :meth:`Gemma3Adapter.attn_residual` / :meth:`Gemma3Adapter.mlp_residual`),
sliding-window and global layers with their own RoPE base and mask (the block keyword arguments are captured per
layer type, :class:`~secateur.models.families.base.ByLayerType`), embeddings scaled by sqrt(hidden) inside the
embedding module, a GeGLU MLP and RMSNorms computing ``x * (1 + w)``.
"""

from __future__ import annotations

import inspect

import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

from secateur.models.families.base import ByLayerType, _Stop
from secateur.models.families.llama import LlamaAdapter
from secateur.models.hetero import FamilyLayout

_PER_TYPE = ("attention_mask", "position_embeddings")  # the block kwargs that differ between layer types


class Gemma3Adapter(LlamaAdapter):
    """Gemma-3: Llama's projections, post-norms inside the residual, per-layer-type masks and RoPE tables."""

    family = "gemma3_text"
    config_class, model_class = Gemma3TextConfig, Gemma3ForCausalLM
    layout = FamilyLayout(
        layers="model.layers", attn="self_attn", q="q_proj", k="k_proj", v="v_proj", out="o_proj", mlp="mlp",
        mlp_in=("gate_proj", "up_proj"), mlp_out="down_proj", heads_key="num_attention_heads",
        inter_key="intermediate_size", kv_heads_key="num_key_value_heads", gqa=True,
        mlp_width_attr="intermediate_size", qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias=False,
        qk_norm=True, norms_per_layer=4)
    gguf_architecture = "gemma3"
    plain_residual = False

    def mlp_norm(self, layer, h):
        return layer.pre_feedforward_layernorm(h)

    def attn_residual(self, layer, h, o_out):
        return h + layer.post_attention_layernorm(o_out)

    def mlp_residual(self, layer, h2, down_out):
        return h2 + layer.post_feedforward_layernorm(down_out)

    def capture_inputs(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """Block-0 input and the block kwargs, the mask and RoPE tables captured for every layer type: each
        block's forward is replaced by a recorder (returning its input) until the first block of every type has
        been called."""
        types = list(self.config.layer_types)
        first = {t: types.index(t) for t in dict.fromkeys(types)}
        last = max(first.values())
        got: dict = {}
        sig = inspect.signature(type(self.layers[0]).forward)

        def recorder(i: int):
            def forward(*args, **kwargs):
                bound = sig.bind_partial(None, *args, **kwargs).arguments
                bound.pop("self", None)
                bound.update(bound.pop("kwargs", {}))
                h = bound.pop("hidden_states")
                if i == 0:
                    got["h"], got["kw"] = h, bound
                if first.get(types[i]) == i:
                    got[types[i]] = bound
                if i == last:
                    raise _Stop
                return h
            return forward

        for i in range(last + 1):
            self.layers[i].forward = recorder(i)
        try:
            with torch.no_grad():
                self.model(input_ids=input_ids.to(self.device), use_cache=False)
        except _Stop:
            pass
        finally:
            for i in range(last + 1):
                del self.layers[i].forward
        kw = {k: v for k, v in got["kw"].items()
              if k not in ("hidden_states", "past_key_values", "cache", "past_key_value")}
        for key in _PER_TYPE:
            if key in kw:
                kw[key] = ByLayerType({t: got[t].get(key) for t in first})
        kw["use_cache"] = False
        return got["h"], kw

    def check_calibration_length(self, seqlen: int) -> None:
        """Every block gets its own type's mask (:meth:`capture_inputs`): any length within the positions."""


ADAPTER = Gemma3Adapter
