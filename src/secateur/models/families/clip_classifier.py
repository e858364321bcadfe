"""CLIP's image classifier (``model_type = "clip"``): ``CLIPForImageClassification``, the vision tower of
:mod:`~secateur.models.families.clip` under ``vision_model`` (its sizes in ``vision_config``), the mean of the patch
tokens (the CLS token left out) into the classifier."""

from __future__ import annotations

from transformers import CLIPConfig, CLIPForImageClassification

from secateur.models.families.encoder import encoder_projections
from secateur.models.families.siglip import CompositeClassifierAdapter


class CLIPClassifierAdapter(CompositeClassifierAdapter):
    family = "clip"
    config_class, model_class = CLIPConfig, CLIPForImageClassification
    projections = encoder_projections(CompositeClassifierAdapter.layout, "self_attn", "mlp")
    special_tokens = 1  # CLS

    def final_hidden(self, h):
        return h  # CLIP's post_layernorm normalizes the pooled CLS token, not the sequence


ADAPTER = CLIPClassifierAdapter
