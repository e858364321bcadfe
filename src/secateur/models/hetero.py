"""Per-layer widths for structurally pruned models: module surgery, null attention, custom HF classes.

This module is deliberately self-contained (it imports only ``torch`` and ``transformers``): ``export``
copies it into every heterogeneous checkpoint folder as ``secateur_hetero.py`` (with the checkpoint's family
appended, :func:`standalone_source`) and points the config's ``auto_map`` at it, so the folder loads in two
ways with ONE ``from_pretrained`` call:

* with secateur installed: ``secateur.models.files.register_custom_classes`` imports the family
  registry (:mod:`secateur.models.families`), which defines every family here and so registers the
  ``secateur_<family>`` config/model classes with ``AutoConfig`` / ``AutoModelForCausalLM``;
  ``AutoModelForCausalLM.from_pretrained(dir)`` then uses the local classes (no ``trust_remote_code``
  needed: transformers prefers registered local code);
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

This file knows no family by itself: each family's adapter (:mod:`secateur.models.families`) declares its
:class:`FamilyLayout` (module paths, projection names, fused/Conv1D storage, bias rules, config keys) and its
stock classes, and the family registry passes them to :func:`define_family`, which fills :data:`LAYOUTS` and
creates the ``Secateur<Stock>`` classes. The surgery here reads :data:`LAYOUTS` instead of branching on the
model type. The copy shipped with an export is this source plus one :func:`define_family` call for the
checkpoint's family (:func:`standalone_source`).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import transformers
from torch import nn
from transformers import AutoConfig
from transformers.pytorch_utils import Conv1D

PREFIX = "secateur_"  # model_type prefix of the heterogeneous classes (adapters.HETERO_PREFIX reads it)


def base_model_type(model_type: str) -> str:
    """``secateur_llama`` -> ``llama`` (stock types pass through)."""
    return model_type[len(PREFIX):] if model_type.startswith(PREFIX) else model_type


@dataclass
class LayerSpec:
    """Widths of one decoder layer (what ``secateur_layers`` stores). ``qk_dim``: the width of each query/key head
    when CORP narrowed them below the value heads' (0: the head width; recorded only when set)."""

    n_heads: int
    n_kv_heads: int
    intermediate: int
    o_bias: bool
    down_bias: bool
    qk_dim: int = 0

    def to_dict(self) -> dict:
        d = asdict(self)
        if not self.qk_dim:
            del d["qk_dim"]
        return d


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


def _eager_attention(module, query, key, value, attention_mask, scaling: float, dropout: float = 0.0, **_):
    """Softmax attention with query/key heads of one width and value heads of another: ``[b, h, T, d_qk]`` x
    ``[b, h, S, d_qk]`` -> weights ``[b, h, T, S]`` -> ``[b, T, h, d_v]`` (the layout transformers' functions
    return)."""
    w = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        w = w + attention_mask
    w = nn.functional.softmax(w, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(w, value).transpose(1, 2).contiguous(), w


class NarrowQKAttention(nn.Module):
    """Bidirectional attention whose query/key heads keep ``qk_dim`` of their ``head_dim`` dimensions (CORP Q/K,
    seed 002 Sec. 3.3): q, k project to ``n_heads * qk_dim``, v and the output projection keep ``n_heads * head_dim``;
    the logits keep the original ``1 / sqrt(head_dim)`` scale, at which the compensation folded into W_Q / W_K was
    fitted. Stock attention classes reshape q, k and v with one head width, so this module replaces the family's
    attention in the layers CORP narrowed, keeping the projections under their names (state-dict keys unchanged);
    it calls the attention function the config names (``sdpa`` / ``eager``: both take a value width other than the
    query's) through ``ALL_ATTENTION_FUNCTIONS``, so the dense masked model's output is reproduced to rounding."""

    def __init__(self, src: nn.Module, names: tuple[str, str, str, str], n_heads: int, qk_dim: int,
                 head_dim: int, scaling: float) -> None:
        super().__init__()
        for name, child in src.named_children():
            setattr(self, name, child)
        self.names, self.num_heads, self.qk_dim, self.head_dim = names, n_heads, qk_dim, head_dim
        self.scaling, self.is_causal = scaling, False
        self.config = getattr(src, "config", None)
        self.attention_dropout = 0.0

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, *args, **kwargs):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        q, k, v, o = (getattr(self, n) for n in self.names)
        lead = hidden_states.shape[:-1]
        query = q(hidden_states).view(*lead, self.num_heads, self.qk_dim).transpose(1, 2)
        key = k(hidden_states).view(*lead, self.num_heads, self.qk_dim).transpose(1, 2)
        value = v(hidden_states).view(*lead, self.num_heads, self.head_dim).transpose(1, 2)
        impl = getattr(self.config, "_attn_implementation", None) or "eager"
        fn = _eager_attention if impl == "eager" else ALL_ATTENTION_FUNCTIONS.get_interface(impl, _eager_attention)
        if impl != "eager" and self.qk_dim < self.head_dim:
            # torch's fused SDPA kernels take one head width for q, k and v; with a narrower q/k they fall back to
            # the math path (measured 1.3-1.6x slower at ViT sizes on a CPU). Zero columns added to q and k leave
            # every logit as it is (each pad multiplies to 0) and keep the fused kernel.
            pad = self.head_dim - self.qk_dim
            query, key = nn.functional.pad(query, (0, pad)), nn.functional.pad(key, (0, pad))
        out, weights = fn(self, query, key, value, attention_mask, scaling=self.scaling, dropout=0.0)
        return o(out.reshape(*lead, self.num_heads * self.head_dim)), weights


# --- family layouts --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class FamilyLayout:
    """Where a family keeps its decoder layers and projections, and the few rules that differ.

    Every structured-pruning module (surgery here, ``slicing``, ``units``, ``scores``, ``export``,
    ``efficiency``) reads it instead of branching on the model type; each family's adapter declares one
    (``Adapter.layout``) and :func:`define_family` records it in :data:`LAYOUTS`.

    Names are attribute names (``""`` = the object itself); weights are ``nn.Linear`` (``[out, in]``)
    unless ``conv1d`` (GPT-2 ``Conv1D``, ``[in, out]``, always biased). Bias rules: ``True`` / ``False``
    (always / never), or the name of a boolean config flag (e.g. ``"attention_bias"``).
    """

    layers: str                   # dotted path from the *ForCausalLM to the decoder-layer ModuleList
    attn: str                     # the attention module of a layer
    q: str                        # query projection; with fused_qkv, the fused q|k|v projection
    k: str
    v: str
    out: str                      # attention output projection
    mlp: str                      # the MLP module of a layer ("" = the layer itself, OPT)
    mlp_in: tuple[str, ...]       # MLP input projections (two = gated)
    mlp_out: str                  # MLP output (down) projection
    heads_key: str                # config keys (as in config.to_dict())
    inter_key: str
    kv_heads_key: str | None = None
    gqa: bool = False             # separate KV heads and an explicit head_dim in the config
    fused_qkv: bool = False       # q, k, v are one projection, rows [q; k; v] (thirds under MHA; Phi-3: GQA sizes)
    fused_gate_up: bool = False   # the one MLP input projection holds rows [gate; up] (Phi-3's gate_up_proj)
    conv1d: bool = False          # Conv1D storage ([in, out]) for every projection
    mlp_width_attr: str | None = None   # MLP attribute holding the intermediate width
    qkv_bias: bool | str = False
    o_bias: bool | str = False
    mlp_bias: bool | str = False  # MLP input and output projections
    qk_norm: bool = False         # per-head q/k norms (weight of size head_dim each)
    layer_norm: bool = False      # LayerNorm (weight and bias) instead of RMSNorm (weight)
    positions: str | None = None  # config key of a learned position-embedding table
    position_offset: int = 0
    default_inner_mult: int = 0   # intermediate = mult * hidden when the config leaves it unset
    norms_per_layer: int = 2      # hidden-size norms per block (Gemma-3: 4, with its post-attention/MLP norms)
    inter_ratio: bool = False     # inter_key holds intermediate / hidden (DINOv2's integer mlp_ratio)
    sub_config: str = ""          # the sub-config holding the sizes (composite classifiers: "vision_config")

    @property
    def qkv(self) -> tuple[str, ...]:
        return (self.q,) if self.fused_qkv else (self.q, self.k, self.v)

    @property
    def gated(self) -> bool:
        return len(self.mlp_in) > 1 or self.fused_gate_up

    @property
    def n_mlp_in(self) -> int:
        """Logical MLP input projections (a fused gate|up counts two)."""
        return 2 if self.fused_gate_up else len(self.mlp_in)

    def flag(self, config, rule: bool | str) -> bool:
        """Resolve a bias rule against ``config``."""
        return rule if isinstance(rule, bool) else bool(getattr(config, rule, False))


LAYOUTS: dict[str, FamilyLayout] = {}            # family (stock model_type) -> layout
HETERO_CLASSES: dict[str, tuple[type, type]] = {}  # family -> (Secateur<Stock>Config, Secateur<Stock>Model)
STOCK_CLASSES: dict[str, tuple[type, type]] = {}   # family -> the stock (config, model) classes they extend
HETERO_MODELS: dict[str, type] = {}  # stock model class name -> its Secateur<Stock> class (every class of a family)
AUTO_CLASSES: dict[str, str] = {}    # stock model class name -> the Auto factory that loads it


# --- per-family surgery ----------------------------------------------------------------------------

def _family_of(config) -> str:
    fam = base_model_type(getattr(config, "model_type", ""))
    if fam not in LAYOUTS:
        raise ValueError(f"no structured-pruning layout for model type {fam!r}")
    return fam


def sizes_of(config):
    """The config that holds the blocks' sizes: the config itself, or a composite model's sub-config
    (``SiglipConfig.vision_config``) when its family's layout names one."""
    layout = LAYOUTS.get(base_model_type(getattr(config, "model_type", "") or ""))
    return getattr(config, layout.sub_config) if layout is not None and layout.sub_config else config


def head_dim_of(config) -> int:
    config = sizes_of(config)
    hd = getattr(config, "head_dim", None)
    return hd or config.hidden_size // config.num_attention_heads


def _get(obj, path: str):
    for name in filter(None, path.split(".")):
        obj = getattr(obj, name)
    return obj


def weight_oi(layout: FamilyLayout, module: nn.Module) -> torch.Tensor:
    """A projection's weight as ``[out, in]`` (a transposed view for ``Conv1D`` storage)."""
    return module.weight.T if layout.conv1d else module.weight


def in_features(layout: FamilyLayout, module: nn.Module) -> int:
    w = module.weight
    return w.shape[0] if layout.conv1d else w.shape[1]


def out_features(layout: FamilyLayout, module: nn.Module) -> int:
    w = module.weight
    return w.shape[1] if layout.conv1d else w.shape[0]


def empty_proj(layout: FamilyLayout, in_f: int, out_f: int, bias: bool, like: torch.Tensor) -> nn.Module:
    """An uninitialized projection in the family's storage (``Conv1D`` is always biased)."""
    return empty_conv1d(in_f, out_f, like) if layout.conv1d else empty_linear(in_f, out_f, bias, like)


def attention_module(family: str, layer: nn.Module) -> nn.Module:
    return getattr(layer, LAYOUTS[family].attn)


def set_attention_module(family: str, layer: nn.Module, attn: nn.Module) -> None:
    setattr(layer, LAYOUTS[family].attn, attn)


def mlp_module(family: str, layer: nn.Module) -> nn.Module:
    """The module holding the MLP projections (the layer itself for OPT)."""
    return _get(layer, LAYOUTS[family].mlp)


def set_attention_widths(family: str, attn: nn.Module, n_heads: int, n_kv: int, head_dim: int) -> None:
    """Update the attributes the stock attention forward reads (projections already resized)."""
    layout = LAYOUTS[family]
    attn.num_heads = n_heads
    if layout.gqa:
        attn.num_key_value_groups = n_heads // n_kv
        attn.num_key_value_heads = n_kv
    if layout.fused_qkv:  # the fused output is split at split_size
        attn.split_size = n_heads * head_dim
    if layout.fused_qkv and layout.gqa and getattr(attn, "config", None) is not None:
        # Phi-3 splits q|k|v at config.num_attention_heads * head_dim: the layer gets its own config copy
        own = object.__new__(type(attn.config))  # a shallow copy (this file imports only torch and transformers)
        own.__dict__.update(attn.config.__dict__)
        attn.config = own
        attn.config.num_attention_heads, attn.config.num_key_value_heads = n_heads, n_kv


def shape_attention(family: str, layer: nn.Module, n_heads: int, n_kv: int, head_dim: int,
                    o_bias: bool) -> None:
    """Give a layer's attention projections the widths ``n_heads`` / ``n_kv`` (values uninitialized)."""
    layout = LAYOUTS[family]
    attn = attention_module(family, layer)
    if isinstance(attn, NullAttention) and n_heads > 0:
        raise ValueError("cannot grow attention heads back on a layer whose attention was removed")
    qh, kvh = n_heads * head_dim, n_kv * head_dim
    old_o = getattr(attn, layout.out)
    like, hidden = old_o.weight, out_features(layout, old_o)
    if layout.fused_qkv:
        fused = getattr(attn, layout.q)
        setattr(attn, layout.q, empty_proj(layout, hidden, qh + 2 * kvh, _has_bias(fused), like))
    else:
        for name, width in ((layout.q, qh), (layout.k, kvh), (layout.v, kvh)):
            setattr(attn, name, empty_proj(layout, hidden, width, _has_bias(getattr(attn, name)), like))
    setattr(attn, layout.out, empty_proj(layout, qh, hidden, o_bias, like))
    if n_heads == 0:
        if not isinstance(attn, NullAttention):
            set_attention_module(family, layer, NullAttention(attn, layout.out, head_dim))
    else:
        set_attention_widths(family, attn, n_heads, n_kv, head_dim)


def narrow_qk(family: str, layer: nn.Module, qk_dim: int, head_dim: int) -> NarrowQKAttention:
    """Give a layer's query/key projections ``qk_dim`` of every head's ``head_dim`` dimensions (values
    uninitialized) and its attention the :class:`NarrowQKAttention` forward; the logit scale stays
    ``1 / sqrt(head_dim)``. Only for the bidirectional, separate-q/k/v layouts (vision encoders)."""
    layout = LAYOUTS[family]
    attn = attention_module(family, layer)
    if layout.fused_qkv or layout.qk_norm or not 0 < qk_dim <= head_dim:
        raise ValueError(f"{family}: query/key heads cannot be narrowed to {qk_dim} of {head_dim} dimensions")
    n_heads = out_features(layout, getattr(attn, layout.v)) // head_dim
    hidden = in_features(layout, getattr(attn, layout.q))
    for name in (layout.q, layout.k):
        old = getattr(attn, name)
        setattr(attn, name, empty_proj(layout, hidden, n_heads * qk_dim, _has_bias(old), old.weight))
    if isinstance(attn, NarrowQKAttention):
        attn.qk_dim = qk_dim
        return attn
    names = (layout.q, layout.k, layout.v, layout.out)
    new = NarrowQKAttention(attn, names, n_heads, qk_dim, head_dim, head_dim ** -0.5)
    set_attention_module(family, layer, new)
    return new


def shape_mlp(family: str, layer: nn.Module, intermediate: int, down_bias: bool) -> None:
    """Give a layer's MLP the width ``intermediate`` (values uninitialized)."""
    layout = LAYOUTS[family]
    f = intermediate
    m = mlp_module(family, layer)
    down = getattr(m, layout.mlp_out)
    like, hidden = down.weight, out_features(layout, down)
    for name in layout.mlp_in:
        width = 2 * f if layout.fused_gate_up else f
        setattr(m, name, empty_proj(layout, hidden, width, _has_bias(getattr(m, name)), like))
    setattr(m, layout.mlp_out, empty_proj(layout, f, hidden, down_bias, like))
    if layout.mlp_width_attr:
        setattr(m, layout.mlp_width_attr, f)


def current_spec(family: str, layer: nn.Module, head_dim: int) -> LayerSpec:
    """The widths a layer has now (read from its modules)."""
    layout = LAYOUTS[family]
    attn = attention_module(family, layer)
    o = getattr(attn, layout.out)
    n_heads = in_features(layout, o) // head_dim
    if layout.fused_qkv:  # rows [q; k; v]: the KV heads are what q leaves, halved
        n_kv = (out_features(layout, getattr(attn, layout.q)) - n_heads * head_dim) // (2 * head_dim)
    else:  # v keeps the head width when CORP narrowed q/k
        n_kv = out_features(layout, getattr(attn, layout.v)) // head_dim
    down = getattr(mlp_module(family, layer), layout.mlp_out)
    qk = attn.qk_dim if isinstance(attn, NarrowQKAttention) else 0
    return LayerSpec(n_heads, n_kv, in_features(layout, down), _has_bias(o), _has_bias(down), qk)


def layers_path(path: str, model: nn.Module) -> str:
    """The block list's path in ``model``: the layout's path from the task model (``vit.layers``), or, in a headless
    backbone that lacks the task model's first attribute (``ViTModel``, ``LlamaModel``), the rest of it."""
    head, _, rest = path.partition(".")
    return rest if rest and not hasattr(model, head) else path


def decoder_layers(family: str, model: nn.Module) -> nn.ModuleList:
    return _get(model, layers_path(LAYOUTS[family].layers, model))


def set_decoder_layers(family: str, model: nn.Module, layers: nn.ModuleList) -> None:
    parent, _, name = layers_path(LAYOUTS[family].layers, model).rpartition(".")
    setattr(_get(model, parent), name, layers)


def apply_layer_spec(model: nn.Module, specs: list[dict] | None = None) -> None:
    """Resize every decoder layer of a freshly built model to ``specs`` (default: config.secateur_layers)."""
    specs = specs if specs is not None else getattr(model.config, "secateur_layers", None)
    if not specs:
        return
    fam = _family_of(model.config)
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
        if spec.qk_dim and spec.qk_dim != now.qk_dim:
            narrow_qk(fam, layer, spec.qk_dim, hd)


# --- custom config / model classes ----------------------------------------------------------------

class _HeteroModel:
    """Mixin: build the stock model, then resize its layers to ``config.secateur_layers``."""

    def __init__(self, config, *args, **kwargs) -> None:
        super().__init__(config, *args, **kwargs)
        apply_layer_spec(self)


def define_family(family: str, layout: FamilyLayout, config_class: type, model_class: type,
                  more: tuple[tuple[type, str], ...] = (), auto: str = "AutoModelForCausalLM") -> None:
    """Record ``family``'s layout and create its ``Secateur<Stock>`` config/model classes (module globals, so
    ``auto_map`` can name them); registered with the Auto factories when this is secateur's own module.
    ``model_class`` loads through the Auto factory named ``auto``; ``more``: other model classes of the family with
    theirs (a headless backbone: ``(ViTModel, "AutoModel")``)."""
    cfg = type(f"Secateur{config_class.__name__}", (config_class,), {
        "__module__": __name__, "__annotations__": {"secateur_layers": "list | None"},
        "model_type": PREFIX + family, "secateur_layers": None})
    LAYOUTS[family] = layout
    STOCK_CLASSES[family] = (config_class, model_class)
    globals()[cfg.__name__] = cfg
    if _OWN_MODULE:
        AutoConfig.register(cfg.model_type, cfg, exist_ok=True)
    by_factory: dict[str, list[type]] = {}
    for stock, factory in ((model_class, auto), *more):
        mdl = type(f"Secateur{stock.__name__}", (_HeteroModel, stock), {"__module__": __name__, "config_class": cfg})
        HETERO_MODELS[stock.__name__], AUTO_CLASSES[stock.__name__] = mdl, factory
        globals()[mdl.__name__] = mdl
        if stock is model_class:
            HETERO_CLASSES[family] = (cfg, mdl)
        _share_conversions(stock, mdl)
        by_factory.setdefault(factory, []).append(mdl)
    if _OWN_MODULE:  # several classes under one factory (DeiT's two classifiers): chosen by config.architectures
        for factory, classes in by_factory.items():
            getattr(transformers, factory).register(cfg, classes[0] if len(classes) == 1 else tuple(classes),
                                                    exist_ok=True)


def define_backbone(family: str, base_class: type) -> None:
    """A text family's headless decoder (``LlamaModel``) as a per-layer ``Secateur<Base>`` class of the family's
    per-layer config, registered with ``AutoModel``: the language model a vision-language model builds from its
    ``text_config`` (``AutoModel.from_config``), so a VLM whose language tower has per-layer widths (``secateur prune
    --towers joint``) reloads with one ``from_pretrained`` (issue 47)."""
    cfg = HETERO_CLASSES[family][0]
    mdl = type(f"Secateur{base_class.__name__}", (_HeteroModel, base_class),
               {"__module__": __name__, "config_class": cfg})
    HETERO_MODELS[base_class.__name__], AUTO_CLASSES[base_class.__name__] = mdl, "AutoModel"
    globals()[mdl.__name__] = mdl
    _share_conversions(base_class, mdl)
    if _OWN_MODULE:
        transformers.AutoModel.register(cfg, mdl, exist_ok=True)


def _share_conversions(stock: type, mdl: type) -> None:
    """Give ``Secateur<Stock>`` the checkpoint key conversions of its stock class (transformers looks them up by class
    name: ViT folders are saved in the older ``encoder.layer.N`` format and renamed on load)."""
    try:
        from transformers.conversion_mapping import (
            get_checkpoint_conversion_mapping,
            register_checkpoint_conversion_mapping,
        )
    except ImportError:  # a transformers without checkpoint conversions
        return
    mapping = get_checkpoint_conversion_mapping(stock.__name__)
    if mapping:
        register_checkpoint_conversion_mapping(mdl.__name__, mapping, overwrite=True)


def _class_ref(cls: type, imports: list[str]) -> str:
    """Source naming a stock class: ``transformers.LlamaConfig`` when exported at the top level, else the bare
    name with its ``from ... import`` line added to ``imports``."""
    if getattr(transformers, cls.__name__, None) is cls:
        return f"transformers.{cls.__name__}"
    imports.append(f"from {cls.__module__} import {cls.__name__}  # noqa: E402\n")
    return cls.__name__


def standalone_source(family: str, model_class: type | None = None) -> str:
    """This module's source plus the definition of ``family`` alone: the self-contained
    ``secateur_hetero.py`` of an exported folder (loads with ``trust_remote_code`` without secateur).
    ``model_class``: the stock model class the folder holds (default: the family's main one)."""
    imports: list[str] = []
    stock_cfg, stock_mdl = STOCK_CLASSES[family]
    model_class = model_class or stock_mdl
    cfg, mdl = _class_ref(stock_cfg, imports), _class_ref(model_class, imports)
    auto = AUTO_CLASSES.get(model_class.__name__, "AutoModelForCausalLM")
    return (Path(__file__).read_text()
            + "\n\n# --- the family of this checkpoint (appended by secateur's exporter) ---\n\n"
            + "".join(imports) + f"define_family({family!r}, {LAYOUTS[family]!r},\n"
            + f"              {cfg}, {mdl}, auto={auto!r})\n")


# The Auto factories learn the classes only from secateur's own module: the copy loaded through
# trust_remote_code must not replace the globally registered classes of a process that also imported secateur.
_OWN_MODULE = __name__.startswith("secateur.")
