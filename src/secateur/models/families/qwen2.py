"""Qwen2 / Qwen2.5: the Llama layout with q/k/v biases (always) and none elsewhere."""

from __future__ import annotations

from dataclasses import replace

from transformers import Qwen2Config, Qwen2ForCausalLM

from secateur.models.families.llama import LlamaAdapter


class Qwen2Adapter(LlamaAdapter):
    """``model_type = "qwen2"``: modules and staged forward as Llama's."""

    family = "qwen2"
    config_class, model_class = Qwen2Config, Qwen2ForCausalLM
    layout = replace(LlamaAdapter.layout, qkv_bias=True, o_bias=False, mlp_bias=False)
    gguf_architecture = "qwen2"


ADAPTER = Qwen2Adapter
