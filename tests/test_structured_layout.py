"""The per-family layout table: every tested family has an entry that matches its modules."""

from __future__ import annotations

import pytest
from transformers import PretrainedConfig

from secateur.models import hetero
from secateur.testing import FAMILIES, tiny_config, tiny_model


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_has_a_layout_matching_its_modules(family):
    assert family in hetero.LAYOUTS and family in hetero.HETERO_CLASSES
    assert hetero.family_of(tiny_config(family)) == family
    layout = hetero.layout_of(family)
    layers = hetero.decoder_layers(family, tiny_model(family))
    assert len(layers) == 2
    attn, mlp = hetero.attention_module(family, layers[0]), hetero.mlp_module(family, layers[0])
    for name in (*layout.qkv, layout.out):
        assert hasattr(attn, name)
    for name in (*layout.mlp_in, layout.mlp_out):
        assert hasattr(mlp, name)


def test_unknown_model_type_is_refused():
    cfg = PretrainedConfig()
    cfg.model_type = "falcon"
    with pytest.raises(ValueError, match="no structured-pruning layout for model type 'falcon'"):
        hetero.family_of(cfg)
