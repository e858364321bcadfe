"""Idefics3's vision tower (``model_type = "idefics3_vision"``): ``Idefics3VisionTransformer``, the vision encoder of
``Idefics3ForConditionalGeneration`` (``model.vision_model``; issue 47). A SigLIP encoder without its attention-pool
head: patch tokens only, ``self_attn.{q,k,v,out}_proj``, ``layer_norm1/2``, ``mlp.fc1/fc2``, ``post_layernorm``;
its blocks are ``encoder.layers.N`` of the tower itself. The stem interpolates position ids from a patch mask (all
patches present when none is given): the adapter's staged forward stops at block 0 as for any encoder.

Inside the VLM the tower is built by ``Idefics3VisionTransformer._from_config`` (not an Auto factory), so a tower with
per-layer widths cannot be reloaded inside a VLM folder (:mod:`secateur.models.towers` refuses it); alone, the
per-layer class exists as for every family."""

from __future__ import annotations

from dataclasses import replace

from torch import nn
from transformers import Idefics3VisionConfig
from transformers.models.idefics3.modeling_idefics3 import Idefics3VisionTransformer

from secateur.models.families.encoder import EncoderAdapter, encoder_projections
from secateur.models.families.siglip import LAYOUT as SIGLIP_LAYOUT

LAYOUT = replace(SIGLIP_LAYOUT, layers="encoder.layers")


class Idefics3VisionAdapter(EncoderAdapter):
    """Idefics3 vision: SigLIP's block names, blocks ``encoder.layers.N`` of the tower, no special token."""

    family = "idefics3_vision"
    config_class, model_class = Idefics3VisionConfig, Idefics3VisionTransformer
    auto_class = "AutoModel"
    layout = LAYOUT
    special_tokens = 0
    projections = encoder_projections(layout, "self_attn", "mlp")
    _names = ("layer_norm1", "layer_norm2", "self_attn", "mlp", "post_layernorm")

    @property
    def base(self) -> nn.Module:
        return self.model  # its base_model_prefix ("model") names the VLM's attribute, not one of the tower's


ADAPTER = Idefics3VisionAdapter
