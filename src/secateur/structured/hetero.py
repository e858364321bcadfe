"""Per-layer widths for structurally pruned models: module surgery, null attention, custom HF classes.

This module is deliberately self-contained (it imports only ``torch`` and ``transformers``): ``export``
copies it verbatim into every heterogeneous checkpoint folder as ``secateur_hetero.py`` and points the
config's ``auto_map`` at it, so the folder loads in two ways with ONE ``from_pretrained`` call:

* with secateur installed: ``secateur.models.loading._register_custom_classes`` imports this module,
  which registers the ``secateur_<family>`` config/model classes with ``AutoConfig`` /
  ``AutoModelForCausalLM``; ``AutoModelForCausalLM.from_pretrained(dir)`` then uses the local classes
  (no ``trust_remote_code`` needed: transformers prefers registered local code);
* without secateur: ``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`` imports the
  copied file from the folder.

Layout of a heterogeneous config: the stock config of the family (original ``num_attention_heads``, so
``head_dim`` stays what it was; explicit ``head_dim`` for the Llama family) plus ``secateur_layers``,
one dict per decoder layer::

    {"n_heads": 6, "n_kv_heads": 2, "intermediate": 11008, "o_bias": false, "down_bias": false}

The model class builds the stock model, then :func:`apply_layer_spec` replaces each layer's projections
by modules of the recorded widths (under the meta device during ``from_pretrained``, so nothing is
allocated twice). A layer with ``n_heads == 0`` gets a :class:`NullAttention` (its output projection's
bias, or zero), a layer with ``intermediate == 0`` keeps zero-width MLP projections (the output is the
down-projection bias, or zero).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    OPTConfig,
    OPTForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.pytorch_utils import Conv1D

LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3")
PREFIX = "secateur_"  # keep in sync with adapters.HETERO_PREFIX; this file is self-contained (shipped as remote code)


def base_model_type(model_type: str) -> str:
    """``secateur_llama`` -> ``llama`` (stock types pass through)."""
    return model_type[len(PREFIX):] if model_type.startswith(PREFIX) else model_type


@dataclass
class LayerSpec:
    """Widths of one decoder layer (what ``secateur_layers`` stores)."""

    n_heads: int
    n_kv_heads: int
    intermediate: int
    o_bias: bool
    down_bias: bool

    def to_dict(self) -> dict:
        return asdict(self)


# --- module construction -------------------------------------------------------------------------

class SafeConv1D(Conv1D):
    """GPT-2 ``Conv1D`` that also accepts zero input features (the stock ``view(-1, 0)`` fails)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = torch.addmm(self.bias, x.reshape(math.prod(lead), x.shape[-1]), self.weight)
        return y.view(*lead, self.nf)


def empty_linear(in_f: int, out_f: int, bias: bool, like: torch.Tensor) -> nn.Linear:
    """An uninitialized ``nn.Linear`` on ``like``'s device and dtype (no init cost, meta-safe)."""
    with torch.device("meta"), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Initializing zero-element tensors")
        m = nn.Linear(in_f, out_f, bias=bias, dtype=like.dtype)
    return m.to_empty(device=like.device)


def empty_conv1d(nx: int, nf: int, like: torch.Tensor) -> Conv1D:
    """An uninitialized GPT-2 ``Conv1D`` (weight ``[nx, nf]``) on ``like``'s device and dtype."""
    cls = SafeConv1D if nx == 0 else Conv1D
    with torch.device("meta"), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Initializing zero-element tensors")
        m = cls(nf, nx)
    return m.to_empty(device=like.device).to(like.dtype)


def _has_bias(m: nn.Module) -> bool:
    return getattr(m, "bias", None) is not None


class NullAttention(nn.Module):
    """Attention with every head removed: returns the output projection's bias (or zeros).

    It keeps the zero-width projections under their usual names (state-dict keys and adapters keep
    working), calls the output projection on a zero-width input (so hooks on it still fire), and
    appends zero-head keys/values to a KV cache so sequence lengths stay consistent during decoding.
    """

    def __init__(self, src: nn.Module, out_name: str, head_dim: int) -> None:
        super().__init__()
        for name, child in src.named_children():
            setattr(self, name, child)
        self.out_name = out_name
        self.head_dim = head_dim
        self.layer_idx = getattr(src, "layer_idx", None)
        self.config = getattr(src, "config", None)

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values", kwargs.get("past_key_value")))
        if cache is not None and self.layer_idx is not None and hasattr(cache, "update"):
            cache = getattr(cache, "self_attention_cache", cache)
            b, t = hidden_states.shape[0], hidden_states.shape[-2]
            empty = hidden_states.new_zeros(b, 0, t, self.head_dim)
            cache.update(empty, empty, self.layer_idx)
        x = hidden_states.new_zeros(*hidden_states.shape[:-1], 0)
        return getattr(self, self.out_name)(x), None


# --- per-family surgery ----------------------------------------------------------------------------

def family_of(config) -> str:
    fam = base_model_type(getattr(config, "model_type", ""))
    if fam not in LLAMA_LIKE + ("opt", "gpt2"):
        raise ValueError(f"no structured-pruning layout for model type {fam!r}")
    return fam


def head_dim_of(config) -> int:
    hd = getattr(config, "head_dim", None)
    return hd or config.hidden_size // config.num_attention_heads


def attention_module(family: str, layer: nn.Module) -> nn.Module:
    return layer.attn if family == "gpt2" else layer.self_attn


def set_attention_module(family: str, layer: nn.Module, attn: nn.Module) -> None:
    if family == "gpt2":
        layer.attn = attn
    else:
        layer.self_attn = attn


def set_attention_widths(family: str, attn: nn.Module, n_heads: int, n_kv: int, head_dim: int) -> None:
    """Update the attributes the stock attention forward reads (projections already resized)."""
    if family in LLAMA_LIKE:
        attn.num_key_value_groups = n_heads // n_kv
        attn.num_heads = n_heads
        attn.num_key_value_heads = n_kv
    elif family == "opt":
        attn.num_heads = n_heads
    else:  # gpt2: c_attn output is split at split_size
        attn.num_heads = n_heads
        attn.split_size = n_heads * head_dim


def shape_attention(family: str, layer: nn.Module, n_heads: int, n_kv: int, head_dim: int,
                    o_bias: bool) -> None:
    """Give a layer's attention projections the widths ``n_heads`` / ``n_kv`` (values uninitialized)."""
    attn = attention_module(family, layer)
    if isinstance(attn, NullAttention) and n_heads > 0:
        raise ValueError("cannot grow attention heads back on a layer whose attention was removed")
    qh, kvh = n_heads * head_dim, n_kv * head_dim
    if family == "gpt2":
        like = attn.c_attn.weight
        hidden = attn.c_proj.weight.shape[1]
        attn.c_attn = empty_conv1d(hidden, 3 * qh, like)
        attn.c_proj = empty_conv1d(qh, hidden, like)
        out_name = "c_proj"
    else:
        out_name = "o_proj" if family in LLAMA_LIKE else "out_proj"
        old_o = getattr(attn, out_name)
        like, hidden = old_o.weight, old_o.weight.shape[0]
        attn.q_proj = empty_linear(hidden, qh, _has_bias(attn.q_proj), like)
        attn.k_proj = empty_linear(hidden, kvh, _has_bias(attn.k_proj), like)
        attn.v_proj = empty_linear(hidden, kvh, _has_bias(attn.v_proj), like)
        setattr(attn, out_name, empty_linear(qh, hidden, o_bias, like))
    if n_heads == 0:
        if not isinstance(attn, NullAttention):
            set_attention_module(family, layer, NullAttention(attn, out_name, head_dim))
    else:
        set_attention_widths(family, attn, n_heads, n_kv, head_dim)


def shape_mlp(family: str, layer: nn.Module, intermediate: int, down_bias: bool) -> None:
    """Give a layer's MLP the width ``intermediate`` (values uninitialized)."""
    f = intermediate
    if family in LLAMA_LIKE:
        m = layer.mlp
        like, hidden = m.down_proj.weight, m.down_proj.weight.shape[0]
        m.gate_proj = empty_linear(hidden, f, _has_bias(m.gate_proj), like)
        m.up_proj = empty_linear(hidden, f, _has_bias(m.up_proj), like)
        m.down_proj = empty_linear(f, hidden, down_bias, like)
        m.intermediate_size = f
    elif family == "opt":
        like, hidden = layer.fc2.weight, layer.fc2.weight.shape[0]
        layer.fc1 = empty_linear(hidden, f, _has_bias(layer.fc1), like)
        layer.fc2 = empty_linear(f, hidden, down_bias, like)
    else:
        m = layer.mlp
        like, hidden = m.c_proj.weight, m.c_proj.weight.shape[1]
        m.c_fc = empty_conv1d(hidden, f, like)
        m.c_proj = empty_conv1d(f, hidden, like)


def current_spec(family: str, layer: nn.Module, head_dim: int) -> LayerSpec:
    """The widths a layer has now (read from its modules)."""
    attn = attention_module(family, layer)
    if family == "gpt2":
        n_heads = attn.c_proj.weight.shape[0] // head_dim
        n_kv, o_bias = n_heads, True
        inter, down_bias = layer.mlp.c_proj.weight.shape[0], True
    else:
        o = attn.o_proj if family in LLAMA_LIKE else attn.out_proj
        n_heads = o.weight.shape[1] // head_dim
        n_kv = attn.k_proj.weight.shape[0] // head_dim
        o_bias = _has_bias(o)
        down = layer.mlp.down_proj if family in LLAMA_LIKE else layer.fc2
        inter, down_bias = down.weight.shape[1], _has_bias(down)
    return LayerSpec(n_heads, n_kv, inter, o_bias, down_bias)


def decoder_layers(family: str, model: nn.Module) -> nn.ModuleList:
    if family == "opt":
        return model.model.decoder.layers
    if family == "gpt2":
        return model.transformer.h
    return model.model.layers


def apply_layer_spec(model: nn.Module, specs: list[dict] | None = None) -> None:
    """Resize every decoder layer of a freshly built model to ``specs`` (default: config.secateur_layers)."""
    specs = specs if specs is not None else getattr(model.config, "secateur_layers", None)
    if not specs:
        return
    fam = family_of(model.config)
    hd = head_dim_of(model.config)
    layers = decoder_layers(fam, model)
    if len(specs) != len(layers):
        raise ValueError(f"secateur_layers has {len(specs)} entries for {len(layers)} layers")
    for layer, raw in zip(layers, specs):
        spec = LayerSpec(**raw) if isinstance(raw, dict) else raw
        now = current_spec(fam, layer, hd)
        if (now.n_heads, now.n_kv_heads, now.o_bias) != (spec.n_heads, spec.n_kv_heads, spec.o_bias):
            shape_attention(fam, layer, spec.n_heads, spec.n_kv_heads, hd, spec.o_bias)
        if (now.intermediate, now.down_bias) != (spec.intermediate, spec.down_bias):
            shape_mlp(fam, layer, spec.intermediate, spec.down_bias)


# --- custom config / model classes ----------------------------------------------------------------

class _HeteroModel:
    """Mixin: build the stock model, then resize its layers to ``config.secateur_layers``."""

    def __init__(self, config, *args, **kwargs) -> None:
        super().__init__(config, *args, **kwargs)
        apply_layer_spec(self)


class SecateurLlamaConfig(LlamaConfig):
    model_type = "secateur_llama"
    secateur_layers: list | None = None


class SecateurLlamaForCausalLM(_HeteroModel, LlamaForCausalLM):
    config_class = SecateurLlamaConfig


class SecateurMistralConfig(MistralConfig):
    model_type = "secateur_mistral"
    secateur_layers: list | None = None


class SecateurMistralForCausalLM(_HeteroModel, MistralForCausalLM):
    config_class = SecateurMistralConfig


class SecateurQwen2Config(Qwen2Config):
    model_type = "secateur_qwen2"
    secateur_layers: list | None = None


class SecateurQwen2ForCausalLM(_HeteroModel, Qwen2ForCausalLM):
    config_class = SecateurQwen2Config


class SecateurQwen3Config(Qwen3Config):
    model_type = "secateur_qwen3"
    secateur_layers: list | None = None


class SecateurQwen3ForCausalLM(_HeteroModel, Qwen3ForCausalLM):
    config_class = SecateurQwen3Config


class SecateurOPTConfig(OPTConfig):
    model_type = "secateur_opt"
    secateur_layers: list | None = None


class SecateurOPTForCausalLM(_HeteroModel, OPTForCausalLM):
    config_class = SecateurOPTConfig


class SecateurGPT2Config(GPT2Config):
    model_type = "secateur_gpt2"
    secateur_layers: list | None = None


class SecateurGPT2LMHeadModel(_HeteroModel, GPT2LMHeadModel):
    config_class = SecateurGPT2Config


HETERO_CLASSES: dict[str, tuple[type, type]] = {
    "llama": (SecateurLlamaConfig, SecateurLlamaForCausalLM),
    "mistral": (SecateurMistralConfig, SecateurMistralForCausalLM),
    "qwen2": (SecateurQwen2Config, SecateurQwen2ForCausalLM),
    "qwen3": (SecateurQwen3Config, SecateurQwen3ForCausalLM),
    "opt": (SecateurOPTConfig, SecateurOPTForCausalLM),
    "gpt2": (SecateurGPT2Config, SecateurGPT2LMHeadModel),
}


def register() -> None:
    """Register the ``secateur_<family>`` classes with the Auto factories (idempotent)."""
    for cfg, mdl in HETERO_CLASSES.values():
        AutoConfig.register(cfg.model_type, cfg, exist_ok=True)
        AutoModelForCausalLM.register(cfg, mdl, exist_ok=True)


# Register only as secateur's own module: the copy loaded through trust_remote_code must not replace the
# globally registered classes of a process that also imported secateur.
if __name__.startswith("secateur."):
    register()
