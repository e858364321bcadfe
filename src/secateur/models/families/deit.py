"""DeiT (``model_type = "deit"``): ViT's block with a CLS and a distillation token; the classifier with teacher
averages the two heads' logits."""

from __future__ import annotations

from transformers import DeiTConfig, DeiTForImageClassification, DeiTForImageClassificationWithTeacher, DeiTModel

from secateur.models.families.encoder import EncoderAdapter, encoder_projections, vit_layout


class DeiTAdapter(EncoderAdapter):
    """DeiT: blocks ``deit.layers.N``, ViT's module names."""

    family = "deit"
    config_class, model_class = DeiTConfig, DeiTForImageClassificationWithTeacher
    more_classes = ((DeiTForImageClassification, "AutoModelForImageClassification"), (DeiTModel, "AutoModel"))
    layout = vit_layout("deit.layers")
    special_tokens = 2
    projections = encoder_projections(layout, "attention", "mlp")


ADAPTER = DeiTAdapter
