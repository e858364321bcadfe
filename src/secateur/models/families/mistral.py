"""Mistral: the Llama layout without biases."""

from __future__ import annotations

from dataclasses import replace

from transformers import MistralConfig, MistralForCausalLM

from secateur.models.families.llama import LlamaAdapter


class MistralAdapter(LlamaAdapter):
    """``model_type = "mistral"``: modules and staged forward as Llama's."""

    family = "mistral"
    config_class, model_class = MistralConfig, MistralForCausalLM
    layout = replace(LlamaAdapter.layout, qkv_bias=False, o_bias=False, mlp_bias=False)
    gguf_architecture = "mistral"


ADAPTER = MistralAdapter
