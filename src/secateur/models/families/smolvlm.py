"""SmolVLM's vision tower (``model_type = "smolvlm_vision"``): ``SmolVLMVisionTransformer``, Idefics3's encoder under
SmolVLM's names (``SmolVLMForConditionalGeneration.model.vision_model``; issue 47)."""

from __future__ import annotations

from transformers import SmolVLMVisionConfig
from transformers.models.smolvlm.modeling_smolvlm import SmolVLMVisionTransformer

from secateur.models.families.idefics3 import Idefics3VisionAdapter, per_layer_init


class SmolVLMVisionAdapter(Idefics3VisionAdapter):
    family = "smolvlm_vision"
    config_class, model_class = SmolVLMVisionConfig, SmolVLMVisionTransformer


per_layer_init(SmolVLMVisionTransformer)  # SmolVLMModel builds its tower from this class too
ADAPTER = SmolVLMVisionAdapter
