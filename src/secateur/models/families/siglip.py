"""SigLIP's vision tower (``model_type = "siglip_vision_model"``): ``SiglipVisionModel``, no CLS token (patch
tokens only), ``self_attn.{q,k,v,out}_proj``, ``layer_norm1/2``, ``post_layernorm`` and the attention-pool head
(never pruned). ``siglip.py`` also holds the composite classifier ``SiglipForImageClassification`` (``model_type =
"siglip"``: the sizes in ``vision_config``, the mean of the patch tokens into the classifier), registered as its
own family by ``siglip_classifier.py``."""

from __future__ import annotations

from dataclasses import replace

from torch import nn
from transformers import SiglipVisionConfig, SiglipVisionModel

from secateur.models.families.encoder import EncoderAdapter, encoder_projections
from secateur.models.hetero import FamilyLayout

LAYOUT = FamilyLayout(
    layers="vision_model.encoder.layers", attn="self_attn", q="q_proj", k="k_proj", v="v_proj", out="out_proj",
    mlp="mlp", mlp_in=("fc1",), mlp_out="fc2", heads_key="num_attention_heads", inter_key="intermediate_size",
    qkv_bias=True, o_bias=True, mlp_bias=True, layer_norm=True)


class SiglipVisionAdapter(EncoderAdapter):
    """SigLIP vision: blocks ``encoder.layers.N`` (``vision_model.encoder.layers.N`` inside a composite model)."""

    family = "siglip_vision_model"
    config_class, model_class = SiglipVisionConfig, SiglipVisionModel
    auto_class = "AutoModel"
    layout = LAYOUT
    special_tokens = 0
    projections = encoder_projections(layout, "self_attn", "mlp")
    _names = ("layer_norm1", "layer_norm2", "self_attn", "mlp", "post_layernorm")


ADAPTER = SiglipVisionAdapter


class CompositeClassifierAdapter(SiglipVisionAdapter):
    """A composite model's image classifier (``SiglipForImageClassification``, ``CLIPForImageClassification``): the
    vision tower's blocks under ``vision_model``, its sizes in ``config.vision_config`` (the layout's
    ``sub_config``), the classifier on the tower's output."""

    auto_class = "AutoModelForImageClassification"
    layout = replace(LAYOUT, sub_config="vision_config")

    @property
    def base(self) -> nn.Module:
        return self.model.vision_model
