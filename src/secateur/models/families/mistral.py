"""Mistral: Llama's modules and staged forward, no biases."""

from transformers import MistralConfig, MistralForCausalLM

from secateur.models.families.llama import llama_like

ADAPTER = llama_like(MistralConfig, MistralForCausalLM, qkv_bias=False, o_bias=False, mlp_bias=False)
