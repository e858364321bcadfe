"""The family registry: every family's adapter declares a layout that matches its modules' shapes, the
registry and the tiny-model fixtures name the same families, broken layouts are refused, and the copy of
``hetero.py`` an export ships knows its family's layout without secateur."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import sys
from dataclasses import replace

import pytest
from transformers import AutoConfig, PretrainedConfig

from secateur.errors import SecateurError
from secateur.eval.efficiency import count_params, count_params_from_config
from secateur.models import hetero
from secateur.models.adapters import adapter_class, get_adapter, supported_model_types
from secateur.models.families import ADAPTERS, check_adapter, family_of, layout_of
from secateur.models.families.gpt2 import GPT2Adapter
from secateur.models.families.llama import LlamaAdapter
from secateur.testing import FAMILIES, TINY_CONFIGS, VISION_FAMILIES, tiny_config, tiny_model


def test_registry_and_fixtures_name_the_same_families():
    assert sorted(FAMILIES + VISION_FAMILIES) == supported_model_types() == sorted(ADAPTERS)
    assert sorted(FAMILIES) == sorted(TINY_CONFIGS) == sorted(f for f, a in ADAPTERS.items() if a.modality == "text")
    assert sorted(hetero.LAYOUTS) == sorted(hetero.HETERO_CLASSES) == sorted(ADAPTERS)


@pytest.mark.parametrize("family", FAMILIES)
def test_layout_paths_resolve_to_the_adapters_projections_with_its_geometry(family):
    model = tiny_model(family)
    a = get_adapter(model)
    assert type(a) is adapter_class(tiny_config(family)) is ADAPTERS[family]
    assert a.family == family_of(model.config) == family and layout_of(family) is a.layout is hetero.LAYOUTS[family]
    a.check_layout()
    layout, g = a.layout, a.geometry
    layers = hetero.decoder_layers(family, model)
    assert layers is a.layers and len(layers) == 2
    for layer in layers:
        spec = hetero.current_spec(family, layer, g.head_dim)
        assert (spec.n_heads, spec.n_kv_heads, spec.intermediate) == (g.n_heads, g.n_kv_heads, g.intermediate)
        assert (spec.o_bias, spec.down_bias) == (g.o_bias, g.mlp_bias)
        o = getattr(hetero.attention_module(family, layer), layout.out)
        assert o is a.role_refs(layer)["o"].module
        assert tuple(hetero.weight_oi(layout, o).shape) == (g.hidden, g.n_heads * g.head_dim)
        down = getattr(hetero.mlp_module(family, layer), layout.mlp_out)
        assert tuple(hetero.weight_oi(layout, down).shape) == (g.hidden, g.intermediate)
    # the layout's bias rules, positions and norms give the parameter count of the real model
    assert count_params_from_config(model.config) == count_params(model)


@pytest.mark.parametrize("family", FAMILIES)
def test_heterogeneous_classes_extend_the_adapters_stock_classes(family):
    cls = ADAPTERS[family]
    h_cfg, h_mdl = hetero.HETERO_CLASSES[family]
    assert h_cfg.__mro__[1] is cls.config_class and cls.model_class in h_mdl.__mro__
    assert h_cfg.model_type == f"secateur_{family}" and h_mdl.config_class is h_cfg
    assert AutoConfig.for_model(f"secateur_{family}").__class__ is h_cfg
    assert getattr(hetero, h_cfg.__name__) is h_cfg and getattr(hetero, h_mdl.__name__) is h_mdl
    assert adapter_class(h_cfg()) is cls  # a heterogeneous export is handled by its family's adapter


@pytest.mark.parametrize(("base", "family", "change", "message"), [
    (LlamaAdapter, "llama", {"q": "query"}, "layer 0 self_attn has no projection 'query'"),
    (LlamaAdapter, "llama", {"attn": "attention"}, "has no attribute 'attention'"),
    (LlamaAdapter, "llama", {"layers": "model.blocks"}, "has no attribute 'blocks'"),
    (LlamaAdapter, "llama", {"mlp_in": ("up_proj", "gate_proj")}, "mlp.up_proj is not the module the adapter uses"),
    (LlamaAdapter, "llama", {"mlp_in": ("up_proj",)}, "does not match the adapter's MLP inputs"),
    (LlamaAdapter, "llama", {"inter_key": "ffn_dim"}, r"the config has no key 'ffn_dim' \(inter_key\)"),
    (LlamaAdapter, "llama", {"heads_key": "num_key_value_heads"},
     r"config key 'num_key_value_heads' \(heads_key\) reads 2, the geometry says 4"),
    (LlamaAdapter, "llama", {"qk_norm": True}, "qk_norm=True"),
    (ADAPTERS["qwen2"], "qwen2", {"qkv_bias": False}, "self_attn.q_proj has a bias but the layout's rule False"),
    (GPT2Adapter, "gpt2", {"conv1d": False}, r"attn.c_attn weight is \[32, 96\] as \[out, in\] \(conv1d=False\)"),
    (GPT2Adapter, "gpt2", {"fused_qkv": False}, r"weight is \[96, 32\] as \[out, in\] \(conv1d=True\), the "
                                                r"geometry says \[32, 32\]"),
])
def test_a_broken_layout_is_refused_with_the_mismatch_named(base, family, change, message):
    broken = type("Broken", (base,), {"layout": replace(base.layout, **change)})
    with pytest.raises(ValueError, match=f"{family} layout: .*{message}"):
        broken(tiny_model(family)).check_layout()


def test_registration_refuses_an_incomplete_adapter():
    no_layout = type("NoLayout", (LlamaAdapter,), {"family": "llama2", "layout": None})
    with pytest.raises(TypeError, match="NoLayout must declare .*missing: layout"):
        check_adapter(no_layout)
    wrong_type = type("WrongType", (LlamaAdapter,), {"family": "mistral"})
    with pytest.raises(TypeError, match="family is 'mistral' but its config class LlamaConfig has model_type 'llama'"):
        check_adapter(wrong_type)


def test_unknown_model_type_is_refused():
    cfg = PretrainedConfig()
    cfg.model_type = "falcon"
    with pytest.raises(SecateurError,
                       match="unsupported model family .falcon.; supported: gemma3_text, gpt2, llama, mistral"):
        family_of(cfg)


@pytest.mark.parametrize("family", FAMILIES)
def test_shipped_copy_knows_its_family_alone(family, tmp_path):
    source = hetero.standalone_source(family)
    imported = {n.module if isinstance(n, ast.ImportFrom) else a.name for n in ast.walk(ast.parse(source))
                if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
    assert {m.split(".")[0] for m in imported} <= {"__future__", "math", "warnings", "dataclasses", "pathlib",
                                                   "torch", "transformers"}
    path = tmp_path / "secateur_hetero.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"copy_{family}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # what transformers' dynamic-module loader does
    try:
        spec.loader.exec_module(mod)
    finally:
        del sys.modules[spec.name]
    assert list(mod.LAYOUTS) == [family]
    assert dataclasses.asdict(mod.LAYOUTS[family]) == dataclasses.asdict(hetero.LAYOUTS[family])
    c, m = mod.HETERO_CLASSES[family]
    assert (c.__name__, m.__name__) == tuple(k.__name__ for k in hetero.HETERO_CLASSES[family])
    assert getattr(mod, m.__name__) is m and c.model_type == f"secateur_{family}"
    assert AutoConfig.for_model(f"secateur_{family}").__class__ is hetero.HETERO_CLASSES[family][0]  # not replaced
