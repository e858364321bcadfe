"""ViT (``model_type = "vit"``): ``ViTForImageClassification`` (CLS token into the classifier) and ``ViTModel``."""

from __future__ import annotations

from transformers import ViTConfig, ViTForImageClassification, ViTModel

from secateur.models.families.encoder import EncoderAdapter, encoder_projections, vit_layout


class ViTAdapter(EncoderAdapter):
    """ViT: blocks ``vit.layers.N`` (``layers.N`` in a ``ViTModel``), ``layernorm_before/after``."""

    family = "vit"
    config_class, model_class = ViTConfig, ViTForImageClassification
    more_classes = ((ViTModel, "AutoModel"),)
    layout = vit_layout("vit.layers")
    projections = encoder_projections(layout, "attention", "mlp")


ADAPTER = ViTAdapter
