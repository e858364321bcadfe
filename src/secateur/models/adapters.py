"""Model-family adapters: where blocks, projections, heads, KV groups, RoPE and biases live.

A new architecture is a new adapter and nothing else: the calibration engine, scorers, compensators,
slicers and evaluators only talk to models through this interface.

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
from secateur.models.linear import LinearRef

GROUPS = ("attn_in", "attn_out", "mlp_in", "mlp_out")
HETERO_PREFIX = "secateur_"  # model_type prefix of structured exports with per-layer widths


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
    """Base adapter. Subclasses fill in names and the four stage functions."""

    family = "base"
    model_types: tuple[str, ...] = ()

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

    def linears(self, layer: nn.Module) -> dict[str, LinearRef]:
        """All prunable projections of a block, keyed by qualified name, in forward order."""
        raise NotImplementedError

    def role_refs(self, layer: nn.Module) -> dict[str, LinearRef]:
        """Projections keyed by role; fused projections are also split into their logical q/k/v."""
        return {r.role: r for r in self.linears(layer).values()}

    def groups(self, layer: nn.Module) -> dict[str, list[str]]:
        """Names of the projections sharing each group input."""
        by_role = {"q": "attn_in", "k": "attn_in", "v": "attn_in", "qkv": "attn_in", "o": "attn_out",
                   "gate": "mlp_in", "up": "mlp_in", "down": "mlp_out"}
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
            with torch.no_grad():
                self.model(input_ids=input_ids.to(self.device), use_cache=False)
        except _Stop:
            pass
        finally:
            handle.remove()
        kw = {k: v for k, v in got["kw"].items()
              if k not in ("hidden_states", "past_key_values", "cache", "past_key_value")}
        kw["use_cache"] = False
        return got["h"], kw

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


class LlamaAdapter(Adapter):
    """Llama 2/3, Mistral, Qwen2 (q/k/v biases), Qwen3 (q/k RMSNorm): pre-norm, RoPE, GQA, gated MLP."""

    family = "llama"
    model_types = ("llama", "mistral", "qwen2", "qwen3")

    @property
    def base(self) -> nn.Module:
        return self.model.model

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.model.layers

    @property
    def geometry(self) -> Geometry:
        c = self.config
        attn = self.layers[0].self_attn
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        mlp = self.layers[0].mlp
        return Geometry(
            hidden=c.hidden_size, n_heads=c.num_attention_heads,
            n_kv_heads=getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
            head_dim=head_dim, intermediate=c.intermediate_size, rope=True,
            qkv_bias=attn.q_proj.bias is not None, o_bias=attn.o_proj.bias is not None,
            mlp_bias=mlp.down_proj.bias is not None, qk_norm=hasattr(attn, "q_norm"), gated_mlp=True)

    def linears(self, layer: nn.Module) -> dict[str, LinearRef]:
        a, m = layer.self_attn, layer.mlp
        return {
            "self_attn.q_proj": LinearRef("self_attn.q_proj", "q", a.q_proj),
            "self_attn.k_proj": LinearRef("self_attn.k_proj", "k", a.k_proj),
            "self_attn.v_proj": LinearRef("self_attn.v_proj", "v", a.v_proj),
            "self_attn.o_proj": LinearRef("self_attn.o_proj", "o", a.o_proj),
            "mlp.gate_proj": LinearRef("mlp.gate_proj", "gate", m.gate_proj),
            "mlp.up_proj": LinearRef("mlp.up_proj", "up", m.up_proj),
            "mlp.down_proj": LinearRef("mlp.down_proj", "down", m.down_proj),
        }

    def attn_norm(self, layer, h):
        return layer.input_layernorm(h)

    def attn_core(self, layer, x, kw):
        return run_until(lambda: layer.self_attn(hidden_states=x, **kw), layer.self_attn.o_proj)

    def mlp_norm(self, layer, h):
        return layer.post_attention_layernorm(h)

    def mlp_core(self, layer, x):
        m = layer.mlp
        return m.act_fn(m.gate_proj(x)) * m.up_proj(x)

    def final_hidden(self, h):
        return self.model.model.norm(h)


class OPTAdapter(Adapter):
    """OPT (pre-LN variants; OPT-350m's post-LN layout is refused). Learned positions, MHA, biases."""

    family = "opt"
    model_types = ("opt",)

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        if not getattr(model.config, "do_layer_norm_before", True):
            raise SecateurError("OPT with do_layer_norm_before=False (OPT-350m) is not supported")

    @property
    def base(self) -> nn.Module:
        return self.model.model.decoder

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.model.decoder.layers

    @property
    def geometry(self) -> Geometry:
        c = self.config
        return Geometry(hidden=c.hidden_size, n_heads=c.num_attention_heads, n_kv_heads=c.num_attention_heads,
                        head_dim=c.hidden_size // c.num_attention_heads, intermediate=c.ffn_dim, rope=False,
                        qkv_bias=c.enable_bias, o_bias=c.enable_bias, mlp_bias=c.enable_bias, qk_norm=False,
                        gated_mlp=False)

    def linears(self, layer):
        a = layer.self_attn
        return {
            "self_attn.q_proj": LinearRef("self_attn.q_proj", "q", a.q_proj),
            "self_attn.k_proj": LinearRef("self_attn.k_proj", "k", a.k_proj),
            "self_attn.v_proj": LinearRef("self_attn.v_proj", "v", a.v_proj),
            "self_attn.out_proj": LinearRef("self_attn.out_proj", "o", a.out_proj),
            "fc1": LinearRef("fc1", "up", layer.fc1),
            "fc2": LinearRef("fc2", "down", layer.fc2),
        }

    def attn_norm(self, layer, h):
        return layer.self_attn_layer_norm(h)

    def attn_core(self, layer, x, kw):
        return run_until(lambda: layer.self_attn(hidden_states=x, **kw), layer.self_attn.out_proj)

    def mlp_norm(self, layer, h):
        return layer.final_layer_norm(h)

    def mlp_core(self, layer, x):
        return layer.activation_fn(layer.fc1(x))

    def final_hidden(self, h):
        d = self.model.model.decoder
        if d.final_layer_norm is not None:
            h = d.final_layer_norm(h)
        if d.project_out is not None:
            h = d.project_out(h)
        return h


class GPT2Adapter(Adapter):
    """GPT-2: Conv1D ([in, out]) weights, fused c_attn (q|k|v row blocks), learned positions, MHA."""

    family = "gpt2"
    model_types = ("gpt2",)

    @property
    def base(self) -> nn.Module:
        return self.model.transformer

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.transformer.h

    @property
    def geometry(self) -> Geometry:
        c = self.config
        inner = c.n_inner or 4 * c.n_embd
        return Geometry(hidden=c.n_embd, n_heads=c.n_head, n_kv_heads=c.n_head, head_dim=c.n_embd // c.n_head,
                        intermediate=inner, rope=False, qkv_bias=True, o_bias=True, mlp_bias=True,
                        qk_norm=False, gated_mlp=False)

    def linears(self, layer):
        return {
            "attn.c_attn": LinearRef("attn.c_attn", "qkv", layer.attn.c_attn, conv1d=True),
            "attn.c_proj": LinearRef("attn.c_proj", "o", layer.attn.c_proj, conv1d=True),
            "mlp.c_fc": LinearRef("mlp.c_fc", "up", layer.mlp.c_fc, conv1d=True),
            "mlp.c_proj": LinearRef("mlp.c_proj", "down", layer.mlp.c_proj, conv1d=True),
        }

    def role_refs(self, layer):
        refs = {r.role: r for r in self.linears(layer).values()}
        fused = layer.attn.c_attn
        d = fused.weight.shape[1] // 3  # q|k|v blocks; narrower than n_embd once heads are sliced
        for i, role in enumerate(("q", "k", "v")):
            refs[role] = LinearRef(f"attn.c_attn[{role}]", role, fused, conv1d=True, rows=slice(i * d, (i + 1) * d))
        return refs

    def attn_norm(self, layer, h):
        return layer.ln_1(h)

    def attn_core(self, layer, x, kw):
        return run_until(lambda: layer.attn(x, **kw), layer.attn.c_proj)

    def mlp_norm(self, layer, h):
        return layer.ln_2(h)

    def mlp_core(self, layer, x):
        return layer.mlp.act(layer.mlp.c_fc(x))

    def final_hidden(self, h):
        return self.model.transformer.ln_f(h)


ADAPTERS: tuple[type[Adapter], ...] = (LlamaAdapter, OPTAdapter, GPT2Adapter)


def supported_model_types() -> list[str]:
    return sorted(t for a in ADAPTERS for t in a.model_types)


def get_adapter(model: nn.Module) -> Adapter:
    """The adapter for ``model``'s family, or a SecateurError naming the supported ones."""
    mt = getattr(model.config, "model_type", None)
    if isinstance(mt, str) and mt.startswith(HETERO_PREFIX):  # secateur's uneven-width exports
        mt = mt[len(HETERO_PREFIX):]
    for cls in ADAPTERS:
        if mt in cls.model_types:
            return cls(model)
    raise SecateurError(
        f"unsupported model family {mt!r}; supported: {', '.join(supported_model_types())}")
