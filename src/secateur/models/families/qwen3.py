"""Qwen3: the Llama layout with per-head q/k RMSNorms and an explicit head_dim."""

from __future__ import annotations

from dataclasses import replace

from transformers import Qwen3Config, Qwen3ForCausalLM

from secateur.models.families.llama import LlamaAdapter


class Qwen3Adapter(LlamaAdapter):
    """``model_type = "qwen3"``: modules and staged forward as Llama's."""

    family = "qwen3"
    config_class, model_class = Qwen3Config, Qwen3ForCausalLM
    layout = replace(LlamaAdapter.layout, mlp_bias=False, qk_norm=True)
    gguf_architecture = "qwen3"


ADAPTER = Qwen3Adapter
