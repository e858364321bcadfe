"""GPT-2 (``model_type = "gpt2"``): Conv1D storage, a fused q|k|v projection, learned positions."""

from __future__ import annotations

from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

from secateur.models.families.base import Adapter, Geometry, run_until
from secateur.models.hetero import FamilyLayout
from secateur.models.linear import LinearRef


class GPT2Adapter(Adapter):
    """GPT-2: Conv1D ([in, out]) weights, fused c_attn (q|k|v row blocks), learned positions, MHA."""

    family = "gpt2"
    config_class, model_class = GPT2Config, GPT2LMHeadModel
    layout = FamilyLayout(
        layers="transformer.h", attn="attn", q="c_attn", k="c_attn", v="c_attn", out="c_proj", mlp="mlp",
        mlp_in=("c_fc",), mlp_out="c_proj", heads_key="n_head", inter_key="n_inner", fused_qkv=True, conv1d=True,
        qkv_bias=True, o_bias=True, mlp_bias=True, layer_norm=True, positions="n_positions", default_inner_mult=4)
    gguf_architecture = "gpt2"
    projections = (("attn.c_attn", "qkv"), ("attn.c_proj", "o"), ("mlp.c_fc", "up"), ("mlp.c_proj", "down"))

    @property
    def base(self) -> nn.Module:
        return self.model.transformer

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.transformer.h

    @property
    def geometry(self) -> Geometry:
        c = self.config
        inner = c.n_inner or 4 * c.n_embd
        return Geometry(hidden=c.n_embd, n_heads=c.n_head, n_kv_heads=c.n_head, head_dim=c.n_embd // c.n_head,
                        intermediate=inner, rope=False, qkv_bias=True, o_bias=True, mlp_bias=True,
                        qk_norm=False, gated_mlp=False)


    def role_refs(self, layer):
        refs = {r.role: r for r in self.linears(layer).values()}
        fused = layer.attn.c_attn
        d = fused.weight.shape[1] // 3  # q|k|v blocks; narrower than n_embd once heads are sliced
        for i, role in enumerate(("q", "k", "v")):
            refs[role] = LinearRef(f"attn.c_attn[{role}]", role, fused, conv1d=True, rows=slice(i * d, (i + 1) * d))
        return refs

    def attn_norm(self, layer, h):
        return layer.ln_1(h)

    def attn_core(self, layer, x, kw):
        return run_until(lambda: layer.attn(x, **kw), layer.attn.c_proj)

    def mlp_norm(self, layer, h):
        return layer.ln_2(h)

    def mlp_core(self, layer, x):
        return layer.mlp.act(layer.mlp.c_fc(x))

    def final_hidden(self, h):
        return self.model.transformer.ln_f(h)


ADAPTER = GPT2Adapter
