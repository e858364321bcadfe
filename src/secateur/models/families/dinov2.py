"""DINOv2 (``model_type = "dinov2"``): ``norm1/2``, ``layer_scale1/2`` on each sublayer's output, and the GELU MLP
``mlp.fc1/fc2`` of width ``mlp_ratio * hidden``. The SwiGLU variant (``use_swiglu_ffn``) is refused in one line."""

from __future__ import annotations

from torch import nn
from transformers import Dinov2Config, Dinov2ForImageClassification, Dinov2Model

from secateur.errors import SecateurError
from secateur.models.families.encoder import EncoderAdapter, encoder_projections
from secateur.models.hetero import FamilyLayout


class Dinov2Adapter(EncoderAdapter):
    """DINOv2: blocks ``dinov2.encoder.layer.N``; the residual adds scale the sublayer output by ``lambda1``."""

    family = "dinov2"
    config_class, model_class = Dinov2Config, Dinov2ForImageClassification
    more_classes = ((Dinov2Model, "AutoModel"),)
    layout = FamilyLayout(
        layers="dinov2.encoder.layer", attn="attention", q="q_proj", k="k_proj", v="v_proj", out="o_proj", mlp="mlp",
        mlp_in=("fc1",), mlp_out="fc2", heads_key="num_attention_heads", inter_key="mlp_ratio",
        qkv_bias="qkv_bias", o_bias=True, mlp_bias=True, layer_norm=True, inter_ratio=True)
    projections = encoder_projections(layout, "attention", "mlp")
    _names = ("norm1", "norm2", "attention", "mlp", "layernorm")
    plain_residual = False

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        if getattr(self.vision_config, "use_swiglu_ffn", False):
            raise SecateurError("DINOv2 with use_swiglu_ffn=True (SwiGLU MLP) is not supported yet; use a DINOv2 "
                                "with the GELU MLP (the ViT-S/B/L backbones)")

    def attn_residual(self, layer, h, o_out):
        return h + layer.layer_scale1(o_out)

    def mlp_residual(self, layer, h2, down_out):
        return h2 + layer.layer_scale2(down_out)


ADAPTER = Dinov2Adapter
