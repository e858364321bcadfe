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
from dataclasses import replace

import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

from secateur.models.families.base import ByLayerType, _Stop, block_kwargs
from secateur.models.families.llama import LlamaAdapter

_PER_TYPE = ("attention_mask", "position_embeddings")  # the block kwargs that differ between layer types


class Gemma3Adapter(LlamaAdapter):
    """Gemma-3: Llama's projections, post-norms inside the residual, per-layer-type masks and RoPE tables."""

    family = "gemma3_text"
    config_class, model_class = Gemma3TextConfig, Gemma3ForCausalLM
    layout = replace(LlamaAdapter.layout, mlp_bias=False, qk_norm=True, norms_per_layer=4)
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
            self.forward_until_stop(input_ids)
        finally:
            for i in range(last + 1):
                del self.layers[i].forward
        kw = block_kwargs(got["kw"])
        for key in _PER_TYPE:
            if key in kw:
                kw[key] = ByLayerType({t: got[t].get(key) for t in first})
        return got["h"], kw

    def check_calibration_length(self, seqlen: int) -> None:
        """Every block gets its own type's mask (:meth:`capture_inputs`): any length within the positions."""


ADAPTER = Gemma3Adapter
