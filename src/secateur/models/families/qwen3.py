"""Qwen3: Llama's modules and staged forward, per-head q/k RMSNorms and an explicit head_dim."""

from transformers import Qwen3Config, Qwen3ForCausalLM

from secateur.models.families.llama import llama_like

ADAPTER = llama_like(Qwen3Config, Qwen3ForCausalLM, mlp_bias=False, qk_norm=True)
