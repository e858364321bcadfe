"""Phi-3 (``model_type = "phi3"``): Llama's block with fused projections.

``self_attn.qkv_proj`` holds rows ``[q; k; v]`` with GQA sizes (``H_Q m``, ``H_K m``, ``H_K m``) and
``mlp.gate_up_proj`` rows ``[gate; up]``; :meth:`Phi3Adapter.role_refs` splits them into the logical q/k/v and
gate/up projections (row slices of the fused modules, as GPT-2's ``c_attn``), which is how unstructured methods
and QK-Wanda see them; structured slicing keeps the same rows of each part (``FamilyLayout.fused_qkv`` /
``fused_gate_up``).
"""

from __future__ import annotations

from torch import nn
from transformers import Phi3Config, Phi3ForCausalLM

from secateur.models.families.base import Geometry
from secateur.models.families.llama import LlamaAdapter
from secateur.models.hetero import FamilyLayout
from secateur.models.linear import LinearRef


class Phi3Adapter(LlamaAdapter):
    """Phi-3: Llama's block (norms, RoPE attention, final norm) with GQA through a fused qkv_proj and SwiGLU
    through a fused gate_up_proj."""

    family = "phi3"
    config_class, model_class = Phi3Config, Phi3ForCausalLM
    layout = FamilyLayout(
        layers="model.layers", attn="self_attn", q="qkv_proj", k="qkv_proj", v="qkv_proj", out="o_proj",
        mlp="mlp", mlp_in=("gate_up_proj",), mlp_out="down_proj", heads_key="num_attention_heads",
        inter_key="intermediate_size", kv_heads_key="num_key_value_heads", gqa=True, fused_qkv=True,
        fused_gate_up=True)
    gguf_architecture = None  # transformers reads phi3 GGUFs, but secateur's GGUF path is not tested on one
    projections = (("self_attn.qkv_proj", "qkv"), ("self_attn.o_proj", "o"), ("mlp.gate_up_proj", "gate_up"),
                   ("mlp.down_proj", "down"))

    @property
    def geometry(self) -> Geometry:
        c = self.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return Geometry(
            hidden=c.hidden_size, n_heads=c.num_attention_heads,
            n_kv_heads=getattr(c, "num_key_value_heads", None) or c.num_attention_heads, head_dim=head_dim,
            intermediate=c.intermediate_size, rope=True, qkv_bias=False, o_bias=False, mlp_bias=False,
            qk_norm=False, gated_mlp=True)


    def role_refs(self, layer: nn.Module) -> dict[str, LinearRef]:
        refs = {r.role: r for r in self.linears(layer).values()}
        a, m = layer.self_attn, layer.mlp
        qw = a.o_proj.weight.shape[1]  # the current widths (narrower once heads are sliced)
        kvw = (a.qkv_proj.weight.shape[0] - qw) // 2
        for role, rows in (("q", slice(0, qw)), ("k", slice(qw, qw + kvw)), ("v", slice(qw + kvw, qw + 2 * kvw))):
            refs[role] = LinearRef(f"self_attn.qkv_proj[{role}]", role, a.qkv_proj, rows=rows)
        f = m.down_proj.weight.shape[1]
        for role, rows in (("gate", slice(0, f)), ("up", slice(f, 2 * f))):
            refs[role] = LinearRef(f"mlp.gate_up_proj[{role}]", role, m.gate_up_proj, rows=rows)
        return refs

    def mlp_core(self, layer, x):
        m = layer.mlp
        gate, up = m.gate_up_proj(x).chunk(2, dim=-1)
        return up * m.activation_fn(gate)


ADAPTER = Phi3Adapter
