"""The adapter interface every family implements: where blocks, projections, heads, KV groups, RoPE and
biases live, and the staged forward the calibration engine runs.

The calibration engine, scorers, compensators, slicers and evaluators only talk to models through this
interface; each family's subclass (one module in :mod:`secateur.models.families`) also carries the family's
:class:`~secateur.models.hetero.FamilyLayout` and stock Hugging Face classes.

Roles of projections (shared vocabulary across families):
  q, k, v  attention input projections (GPT-2: one fused ``qkv``)
  o        attention output projection (writes the residual stream)
  gate, up MLP input projections (OPT/GPT-2: ``up`` only)
  down     MLP output projection (writes the residual stream)

Groups (in forward order, each group shares one input):
  attn_in -> attn_out -> mlp_in -> mlp_out
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from secateur.errors import SecateurError
from secateur.models import hetero
from secateur.models.linear import LinearRef

GROUPS = ("attn_in", "attn_out", "mlp_in", "mlp_out")
HETERO_PREFIX = hetero.PREFIX  # model_type prefix of structured exports with per-layer widths


@dataclass(frozen=True)
class Geometry:
    """Per-block attention/MLP geometry (uniform across layers before structured pruning)."""

    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate: int
    rope: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    gated_mlp: bool

    @property
    def group_size(self) -> int:
        """Query heads per KV head (1 for MHA)."""
        return self.n_heads // self.n_kv_heads

    def kv_group_of_head(self, h: int) -> int:
        """Hugging Face's repeat_kv layout: query head h reads KV head h // group_size."""
        return h // self.group_size


class _Stop(Exception):
    pass


class ByLayerType(dict):
    """A block keyword argument whose value depends on the block's attention type (``config.layer_types``):
    ``{"sliding_attention": mask_s, "full_attention": mask_f}``. :meth:`Adapter.layer_kwargs` picks a block's
    value; :func:`secateur.calib.engine.kwargs_to` moves every value."""


def run_until(call: Callable[[], Any], stop_at: nn.Module) -> torch.Tensor:
    """Run ``call`` and return the input that reaches ``stop_at``, aborting the forward there.

    This lets the engine reuse the family's own attention/MLP code (RoPE, GQA, q/k norms, kernels)
    without computing the output projection twice.
    """
    captured: list[torch.Tensor] = []

    def hook(_mod: nn.Module, args: tuple) -> None:
        captured.append(args[0])
        raise _Stop

    handle = stop_at.register_forward_pre_hook(hook)
    try:
        call()
    except _Stop:
        pass
    finally:
        handle.remove()
    if not captured:
        raise RuntimeError(f"{type(stop_at).__name__} was never reached")
    return captured[0]


class Adapter:
    """Base adapter. A family's subclass declares the class attributes below and fills in names and the
    four stage functions.

    family:            the Hugging Face ``model_type`` it handles (also its layout's key, and the suffix of
                       its heterogeneous ``secateur_<family>`` exports)
    config_class:      the stock config class (heterogeneous exports extend it)
    model_class:       the stock causal-LM class (heterogeneous exports extend it)
    layout:            where the structured-pruning code finds layers and projections
                       (:class:`~secateur.models.hetero.FamilyLayout`)
    gguf_architecture: the GGUF ``general.architecture`` read as this family (None: no GGUF input)
    modality, main_input: what the model reads (``text`` / ``input_ids``; ``vision`` / ``pixel_values``): the
                       engine slices that tensor along dimension 0 into chunks, whatever it holds
    """

    family = "base"
    config_class: type | None = None
    model_class: type | None = None
    #: other stock model classes of the family, each with the Auto factory that loads it (a headless backbone)
    more_classes: tuple[tuple[type, str], ...] = ()
    #: the Auto factory of :attr:`model_class`
    auto_class = "AutoModelForCausalLM"
    #: what the model reads (``text``: token ids; ``vision``: images) and the keyword it reads it by
    modality = "text"
    main_input = "input_ids"
    layout: hetero.FamilyLayout | None = None
    gguf_architecture: str | None = None

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.config = model.config

    # --- structure --------------------------------------------------------------------------
    @property
    def base(self) -> nn.Module:
        raise NotImplementedError

    @property
    def layers(self) -> nn.ModuleList:
        raise NotImplementedError

    @property
    def base_prefix(self) -> str:
        """Qualified name of the block list inside the model (``model.layers``)."""
        for name, mod in self.model.named_modules():
            if mod is self.layers:
                return name
        raise RuntimeError("block list not found")

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def geometry(self) -> Geometry:
        raise NotImplementedError

    #: the block's prunable projections in forward order: (name inside the block, role)
    projections: tuple[tuple[str, str], ...] = ()

    def linears(self, layer: nn.Module) -> dict[str, LinearRef]:
        """All prunable projections of a block (:attr:`projections`), keyed by qualified name, in forward order."""
        conv1d = bool(self.layout and self.layout.conv1d)
        return {name: LinearRef(name, role, _resolve(layer, name, self.family), conv1d=conv1d)
                for name, role in self.projections}

    def role_refs(self, layer: nn.Module) -> dict[str, LinearRef]:
        """Projections keyed by role; fused projections are also split into their logical q/k/v."""
        return {r.role: r for r in self.linears(layer).values()}

    def groups(self, layer: nn.Module) -> dict[str, list[str]]:
        """Names of the projections sharing each group input."""
        by_role = {"q": "attn_in", "k": "attn_in", "v": "attn_in", "qkv": "attn_in", "o": "attn_out",
                   "gate": "mlp_in", "up": "mlp_in", "gate_up": "mlp_in", "down": "mlp_out"}
        out: dict[str, list[str]] = {g: [] for g in GROUPS}
        for name, ref in self.linears(layer).items():
            out[by_role[ref.role]].append(name)
        return out

    # --- staged forward ---------------------------------------------------------------------
    def attn_norm(self, layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def attn_core(self, layer: nn.Module, x: torch.Tensor, kw: dict) -> torch.Tensor:
        """Input of the attention output projection (heads concatenated)."""
        raise NotImplementedError

    def mlp_norm(self, layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def mlp_core(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """Input of the MLP output projection."""
        raise NotImplementedError

    def out_module(self, layer: nn.Module, group: str) -> nn.Module:
        """The residual-writing module of ``attn_out`` or ``mlp_out``."""
        role = {"attn_out": "o", "mlp_out": "down"}[group]
        return self.role_refs(layer)[role].module

    # Residual adds (the engine's ``h2 = attn_residual(h, o(a))``, ``out = mlp_residual(h2, down(m))``): a plain
    # sum unless the family normalizes a sublayer's output before adding it (Gemma's post-norms).
    plain_residual = True

    def attn_residual(self, layer: nn.Module, h: torch.Tensor, o_out: torch.Tensor) -> torch.Tensor:
        """The block's hidden state after attention, from its input ``h`` and the output projection's output."""
        return h + o_out

    def mlp_residual(self, layer: nn.Module, h2: torch.Tensor, down_out: torch.Tensor) -> torch.Tensor:
        """The block's output, from the post-attention hidden state ``h2`` and the down projection's output."""
        return h2 + down_out

    def layer_kwargs(self, index: int, kw: dict) -> dict:
        """Block ``index``'s keyword arguments from those :meth:`capture_inputs` returned (per-type values
        resolved, :class:`ByLayerType`); the identity for families whose blocks all take the same."""
        if not any(isinstance(v, ByLayerType) for v in kw.values()):
            return kw
        kind = self.config.layer_types[index]
        return {k: v[kind] if isinstance(v, ByLayerType) else v for k, v in kw.items()}

    def block_forward(self, layer: nn.Module, h: torch.Tensor, kw: dict) -> torch.Tensor:
        """Reference forward of one block (the family's own module)."""
        out = layer(h, **kw)
        return out[0] if isinstance(out, tuple) else out

    def final_hidden(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm (and projection) applied to the last block's output, before the LM head."""
        raise NotImplementedError

    # --- inputs -----------------------------------------------------------------------------
    def capture_inputs(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """Embeddings entering block 0 and the keyword arguments the model passes to its blocks."""
        got: dict[str, Any] = {}

        layer0 = self.layers[0]

        def hook(_mod: nn.Module, args: tuple, kwargs: dict) -> None:
            # bind positional arguments to names: some families pass the mask positionally
            bound = inspect.signature(layer0.forward).bind_partial(*args, **kwargs).arguments
            extra = bound.pop("kwargs", {})
            bound.update(extra)
            got["h"] = bound.pop("hidden_states")
            got["kw"] = bound
            raise _Stop

        handle = layer0.register_forward_pre_hook(hook, with_kwargs=True)
        try:
            self.forward_until_stop(input_ids)
        finally:
            handle.remove()
        return got["h"], block_kwargs(got["kw"])

    def forward_until_stop(self, input_ids: torch.Tensor) -> None:
        """Run the model on ``input_ids`` until a hook raises :class:`_Stop` (input capture)."""
        try:
            with torch.no_grad():
                self.model(input_ids=input_ids.to(self.device), use_cache=False)
        except _Stop:
            pass

    def sample_tokens(self, seqlen: int) -> int:
        """Tokens one calibration sample gives the blocks: ``--seqlen`` for text (a vision encoder: its patches and
        class tokens); memory plans and checkpoint estimates count with it."""
        return seqlen

    def describe_inputs(self, inputs: torch.Tensor) -> str:
        """The calibration set in words: ``8 x 2048 tokens`` (a vision encoder: ``8 images``)."""
        if self.modality == "vision":
            return f"{inputs.shape[0]} images"
        return f"{inputs.shape[0]} x {inputs.shape[1]} tokens"

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def check_calibration_length(self, seqlen: int) -> None:
        """Blocks reuse block 0's attention mask: refuse when per-layer masks would differ."""
        types = getattr(self.config, "layer_types", None)
        window = getattr(self.config, "sliding_window", None)
        if types and len(set(types)) > 1 and window and seqlen > window:
            raise SecateurError(
                f"sequence length {seqlen} exceeds the sliding window {window} of a model that mixes "
                "attention types; use --seqlen <= the window")

    # --- layout -----------------------------------------------------------------------------
    def check_layout(self) -> None:
        """Check :attr:`layout` against this (unpruned) model: every path resolves, to this adapter's own
        projections, with the ``[out, in]`` widths, biases and config keys :attr:`geometry` says.

        Raises ValueError naming the first mismatch (``llama layout: layer 0 self_attn has no projection
        'query'``). A new family's test runs it on the family's tiny model."""
        lay, g, cfg = self.layout, self.geometry, self.config
        where = f"{self.family} layout"
        if _resolve(self.model, hetero.layers_path(lay.layers, self.model), where) is not self.layers:
            raise ValueError(f"{where}: {lay.layers!r} is not the adapter's block list")
        layer, refs = self.layers[0], self.role_refs(self.layers[0])
        attn, mlp = _resolve(layer, lay.attn, where), _resolve(layer, lay.mlp, where)
        qh, kvh, d, f = g.n_heads * g.head_dim, g.n_kv_heads * g.head_dim, g.hidden, g.intermediate
        in_roles = ("gate_up",) if lay.fused_gate_up else ("gate", "up") if lay.gated else ("up",)
        if len(lay.mlp_in) != len(in_roles) or lay.gated != g.gated_mlp:
            raise ValueError(f"{where}: mlp_in {lay.mlp_in} does not match the adapter's MLP inputs {in_roles}")
        in_width = 2 * f if lay.fused_gate_up else f
        qkv = [(lay.q, "qkv", qh + 2 * kvh)] if lay.fused_qkv else [(lay.q, "q", qh), (lay.k, "k", kvh),
                                                                      (lay.v, "v", kvh)]
        # (parent module, its name, projection, role, [out, in], bias rule)
        want = [(attn, lay.attn, name, role, (out, d), lay.qkv_bias) for name, role, out in qkv]
        want.append((attn, lay.attn, lay.out, "o", (d, qh), lay.o_bias))
        want += [(mlp, lay.mlp, name, role, (in_width, d), lay.mlp_bias) for name, role in zip(lay.mlp_in, in_roles)]
        want.append((mlp, lay.mlp, lay.mlp_out, "down", (d, f), lay.mlp_bias))
        for parent, pname, name, role, shape, bias_rule in want:
            _check_projection(where, lay, cfg, parent, pname or "the layer", name, refs[role].module, shape,
                              bias_rule)
        keys = hetero.sizes_of(cfg).to_dict()
        for field, expect in (("heads_key", g.n_heads), ("inter_key", f), ("kv_heads_key", g.n_kv_heads)):
            key = getattr(lay, field)
            if key is None:  # no KV-head key: MHA
                continue
            if key not in keys:
                raise ValueError(f"{where}: the config has no key {key!r} ({field})")
            value = keys[key] or (lay.default_inner_mult * d if field == "inter_key" else None)
            if field == "inter_key" and lay.inter_ratio:
                value = value * d
            if value != expect:
                raise ValueError(f"{where}: config key {key!r} ({field}) reads {value!r}, the geometry says {expect}")
        if lay.qk_norm != g.qk_norm:
            raise ValueError(f"{where}: qk_norm={lay.qk_norm} but the model's q/k norms say {g.qk_norm}")
        if lay.positions and lay.positions not in keys:
            raise ValueError(f"{where}: the config has no position-table key {lay.positions!r}")


def block_kwargs(bound: dict) -> dict:
    """The keyword arguments a block is called with, as captured: without the hidden states and any cache, and
    with ``use_cache=False`` (the engine runs blocks one at a time, cache-free)."""
    kw = {k: v for k, v in bound.items() if k not in ("hidden_states", "past_key_values", "cache", "past_key_value")}
    kw["use_cache"] = False
    return kw


def _resolve(obj: Any, path: str, where: str) -> Any:
    for name in filter(None, path.split(".")):
        if not hasattr(obj, name):
            raise ValueError(f"{where}: {type(obj).__name__} has no attribute {name!r} (path {path!r})")
        obj = getattr(obj, name)
    return obj


def _check_projection(where: str, lay: hetero.FamilyLayout, cfg: Any, parent: nn.Module, pname: str, name: str,
                      ref_module: nn.Module, shape: tuple[int, int], bias_rule: bool | str) -> None:
    """One projection of :meth:`Adapter.check_layout`: present, the adapter's own, ``[out, in]`` = shape, biased
    as the layout's rule says."""
    mod = getattr(parent, name, None)
    if mod is None:
        raise ValueError(f"{where}: layer 0 {pname} has no projection {name!r}")
    if mod is not ref_module:
        raise ValueError(f"{where}: {pname}.{name} is not the module the adapter uses in its place")
    got = tuple(hetero.weight_oi(lay, mod).shape)
    if got != shape:
        raise ValueError(f"{where}: {pname}.{name} weight is {list(got)} as [out, in] (conv1d={lay.conv1d}), "
                         f"the geometry says {list(shape)}")
    has_bias = getattr(mod, "bias", None) is not None
    if has_bias != lay.flag(cfg, bias_rule):
        raise ValueError(f"{where}: {pname}.{name} has {'a' if has_bias else 'no'} bias but the layout's rule "
                         f"{bias_rule!r} says {lay.flag(cfg, bias_rule)}")
