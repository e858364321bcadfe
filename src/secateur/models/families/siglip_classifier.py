"""SigLIP's image classifier (``model_type = "siglip"``): ``SiglipForImageClassification``, the vision tower of
:mod:`~secateur.models.families.siglip` under ``vision_model`` (its sizes in ``vision_config``), the mean of the
patch tokens into the classifier."""

from __future__ import annotations

from transformers import SiglipConfig, SiglipForImageClassification

from secateur.models.families.encoder import encoder_projections
from secateur.models.families.siglip import CompositeClassifierAdapter


class SiglipClassifierAdapter(CompositeClassifierAdapter):
    family = "siglip"
    config_class, model_class = SiglipConfig, SiglipForImageClassification
    projections = encoder_projections(CompositeClassifierAdapter.layout, "self_attn", "mlp")


ADAPTER = SiglipClassifierAdapter
