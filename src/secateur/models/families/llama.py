"""Llama 2/3 (``model_type = "llama"``), and the adapter the Llama-like families extend."""

from __future__ import annotations

from dataclasses import replace

from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from secateur.models.families.base import Adapter, Geometry, run_until
from secateur.models.hetero import FamilyLayout


class LlamaAdapter(Adapter):
    """Llama 2/3: pre-norm, RoPE, GQA, gated MLP; the base of the Llama-like families (Mistral, Qwen2, Qwen3)."""

    family = "llama"
    config_class, model_class = LlamaConfig, LlamaForCausalLM
    layout = FamilyLayout(
        layers="model.layers", attn="self_attn", q="q_proj", k="k_proj", v="v_proj", out="o_proj", mlp="mlp",
        mlp_in=("gate_proj", "up_proj"), mlp_out="down_proj", heads_key="num_attention_heads",
        inter_key="intermediate_size", kv_heads_key="num_key_value_heads", gqa=True,
        mlp_width_attr="intermediate_size", qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias="mlp_bias")
    gguf_architecture = "llama"
    projections = (("self_attn.q_proj", "q"), ("self_attn.k_proj", "k"), ("self_attn.v_proj", "v"),
                   ("self_attn.o_proj", "o"), ("mlp.gate_proj", "gate"), ("mlp.up_proj", "up"),
                   ("mlp.down_proj", "down"))

    @property
    def base(self) -> nn.Module:
        return self.model.model

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.model.layers

    @property
    def geometry(self) -> Geometry:
        c = self.config
        attn = self.layers[0].self_attn
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        mlp = self.layers[0].mlp
        return Geometry(
            hidden=c.hidden_size, n_heads=c.num_attention_heads,
            n_kv_heads=getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
            head_dim=head_dim, intermediate=c.intermediate_size, rope=True,
            qkv_bias=attn.q_proj.bias is not None, o_bias=attn.o_proj.bias is not None,
            mlp_bias=mlp.down_proj.bias is not None, qk_norm=hasattr(attn, "q_norm"), gated_mlp=True)


    def attn_norm(self, layer, h):
        return layer.input_layernorm(h)

    def attn_core(self, layer, x, kw):
        return run_until(lambda: layer.self_attn(hidden_states=x, **kw), layer.self_attn.o_proj)

    def mlp_norm(self, layer, h):
        return layer.post_attention_layernorm(h)

    def mlp_core(self, layer, x):
        m = layer.mlp
        return m.act_fn(m.gate_proj(x)) * m.up_proj(x)

    def final_hidden(self, h):
        return self.model.model.norm(h)


ADAPTER = LlamaAdapter


def llama_like(config_class: type, model_class: type, **layout_changes) -> type[LlamaAdapter]:
    """The adapter of a family with Llama's modules and staged forward: its own stock classes (``family`` is the
    config's ``model_type``, also its GGUF architecture) and Llama's layout with ``layout_changes``
    (:class:`~secateur.models.hetero.FamilyLayout` fields, e.g. ``qkv_bias=True``)."""
    family = config_class.model_type
    return type(f"{config_class.__name__.removesuffix('Config')}Adapter", (LlamaAdapter,), {
        "__doc__": f"``model_type = {family!r}``: Llama's modules and staged forward, its own layout.",
        "__module__": f"{__name__.rpartition('.')[0]}.{family}",
        "family": family, "config_class": config_class, "model_class": model_class,
        "layout": replace(LlamaAdapter.layout, **layout_changes), "gguf_architecture": family})
