"""Idefics3's vision tower (``model_type = "idefics3_vision"``): ``Idefics3VisionTransformer``, the vision encoder of
``Idefics3ForConditionalGeneration`` (``model.vision_model``; issue 47). A SigLIP encoder without its attention-pool
head: patch tokens only, ``self_attn.{q,k,v,out}_proj``, ``layer_norm1/2``, ``mlp.fc1/fc2``, ``post_layernorm``;
its blocks are ``encoder.layers.N`` of the tower itself. The stem interpolates position ids from a patch mask (all
patches present when none is given): the adapter's staged forward stops at block 0 as for any encoder.

Inside the VLM the tower is built by ``Idefics3VisionTransformer._from_config`` (not an Auto factory), so the
per-layer ``secateur_idefics3_vision`` class is never chosen there. :func:`per_layer_init` makes the stock class
itself honour a per-layer config: when the vision config it is built from carries ``secateur_layers`` (what
``--towers joint`` writes for a tower whose layers keep different widths; ``Idefics3Config`` keeps the key through
save and load), its blocks are resized to them (:func:`secateur.models.hetero.apply_layer_spec`), so the VLM folder
reloads with one ``from_pretrained`` in a process that imported secateur. A config without the key builds the stock
tower unchanged."""

from __future__ import annotations

import functools
from dataclasses import replace

from torch import nn
from transformers import Idefics3VisionConfig
from transformers.models.idefics3.modeling_idefics3 import Idefics3VisionTransformer

from secateur.models import hetero
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


def per_layer_init(cls: type) -> None:
    """Wrap ``cls.__init__`` (a vision tower class a VLM builds from its own class) so that a config with
    ``secateur_layers`` resizes the blocks after the stock construction (module docstring). Idempotent."""
    if cls.__dict__.get("_secateur_per_layer"):
        return
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, config, *args, **kwargs):
        init(self, config, *args, **kwargs)
        if getattr(config, "secateur_layers", None):
            hetero.apply_layer_spec(self)

    cls.__init__ = __init__
    cls._secateur_per_layer = True


per_layer_init(Idefics3VisionTransformer)
ADAPTER = Idefics3VisionAdapter
