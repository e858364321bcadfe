"""CLIP's vision tower (``model_type = "clip_vision_model"``): ``CLIPVisionModel``, SigLIP's block names, a CLS
token, ``pre_layrnorm`` in the stem and ``post_layernorm`` on the pooled CLS token."""

from __future__ import annotations

from transformers import CLIPVisionConfig, CLIPVisionModel

from secateur.models.families.siglip import LAYOUT, SiglipVisionAdapter


class CLIPVisionAdapter(SiglipVisionAdapter):
    """CLIP vision: SigLIP's layout; the final norm applies to the pooled CLS token only."""

    family = "clip_vision_model"
    config_class, model_class = CLIPVisionConfig, CLIPVisionModel
    layout = LAYOUT
    special_tokens = 1  # CLS (SigLIP has none)

    def final_hidden(self, h):
        return h  # CLIP's post_layernorm normalizes the pooled CLS token, not the sequence


ADAPTER = CLIPVisionAdapter
