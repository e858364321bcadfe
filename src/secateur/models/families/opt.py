"""OPT (``model_type = "opt"``): learned positions, MHA, biases, no gated MLP."""

from __future__ import annotations

from torch import nn
from transformers import OPTConfig, OPTForCausalLM

from secateur.errors import SecateurError
from secateur.models.families.base import Adapter, Geometry, run_until
from secateur.models.hetero import FamilyLayout


class OPTAdapter(Adapter):
    """OPT (pre-LN variants; OPT-350m's post-LN layout is refused). Learned positions, MHA, biases."""

    family = "opt"
    config_class, model_class = OPTConfig, OPTForCausalLM
    layout = FamilyLayout(
        layers="model.decoder.layers", attn="self_attn", q="q_proj", k="k_proj", v="v_proj", out="out_proj", mlp="",
        mlp_in=("fc1",), mlp_out="fc2", heads_key="num_attention_heads", inter_key="ffn_dim",
        qkv_bias="enable_bias", o_bias="enable_bias", mlp_bias="enable_bias", layer_norm=True,
        positions="max_position_embeddings", position_offset=2)
    projections = (("self_attn.q_proj", "q"), ("self_attn.k_proj", "k"), ("self_attn.v_proj", "v"),
                   ("self_attn.out_proj", "o"), ("fc1", "up"), ("fc2", "down"))

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        if not getattr(model.config, "do_layer_norm_before", True):
            raise SecateurError("OPT with do_layer_norm_before=False (OPT-350m) is not supported")

    @property
    def base(self) -> nn.Module:
        return self.model.model.decoder

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.model.decoder.layers

    @property
    def geometry(self) -> Geometry:
        c = self.config
        return Geometry(hidden=c.hidden_size, n_heads=c.num_attention_heads, n_kv_heads=c.num_attention_heads,
                        head_dim=c.hidden_size // c.num_attention_heads, intermediate=c.ffn_dim, rope=False,
                        qkv_bias=c.enable_bias, o_bias=c.enable_bias, mlp_bias=c.enable_bias, qk_norm=False,
                        gated_mlp=False)


    def attn_norm(self, layer, h):
        return layer.self_attn_layer_norm(h)

    def attn_core(self, layer, x, kw):
        return run_until(lambda: layer.self_attn(hidden_states=x, **kw), layer.self_attn.out_proj)

    def mlp_norm(self, layer, h):
        return layer.final_layer_norm(h)

    def mlp_core(self, layer, x):
        return layer.activation_fn(layer.fc1(x))

    def final_hidden(self, h):
        d = self.model.model.decoder
        if d.final_layer_norm is not None:
            h = d.final_layer_norm(h)
        if d.project_out is not None:
            h = d.project_out(h)
        return h


ADAPTER = OPTAdapter
