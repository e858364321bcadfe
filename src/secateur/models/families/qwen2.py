"""Qwen2 / Qwen2.5: Llama's modules and staged forward, q/k/v biases (always) and none elsewhere."""

from transformers import Qwen2Config, Qwen2ForCausalLM

from secateur.models.families.llama import llama_like

ADAPTER = llama_like(Qwen2Config, Qwen2ForCausalLM, qkv_bias=True, o_bias=False, mlp_bias=False)
