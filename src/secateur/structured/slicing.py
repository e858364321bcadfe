"""Materialize a :class:`Selection`: physical slicing into a smaller dense model, or masking (zeroing).

Physical slicing (``apply_selection``), per layer:

* attention: rows of q (the kept query heads), k, v (the kept KV heads) and their biases; the matching
  o_proj columns. Every kept KV head must keep the same number of its query heads (GQA stays valid: whole
  KV groups, or head slots that take one head from every group; :func:`_check_gqa`). Qwen3's
  ``q_norm``/``k_norm`` act on ``head_dim`` and are untouched. The attributes the stock attention forward
  reads are updated (``num_key_value_groups`` for the Llama family, ``num_heads`` for OPT,
  ``num_heads``/``split_size`` for GPT-2's fused ``c_attn``), so stock eager/SDPA kernels run. A layer that
  loses every head gets a :class:`~secateur.models.hetero.NullAttention` (output = o_proj bias or zero).
* MLP: rows of gate/up (OPT ``fc1``, GPT-2 ``c_fc`` in Conv1D storage) and their biases; the matching
  down-projection columns.
* whole blocks: dropped from the layer list; ``layer_idx`` renumbered, ``num_hidden_layers`` and
  ``layer_types`` updated.

``replacements`` lets a compensator supply the new o_proj / down_proj weight for the kept columns
(``[out, k]``, columns in ``Selection.kept_columns`` order) and optionally the full new bias (not a delta;
a bias-free projection gets a bias parameter). ``mask_selection`` produces the equivalent masked dense
model (zeroed rows/columns, same replacements), which is what slicing must reproduce exactly.

After slicing, ``model.config.secateur_layers`` records the per-layer widths; ``export.save_pruned``
decides between a stock config and the heterogeneous classes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from secateur.errors import SecateurError
from secateur.models import hetero
from secateur.models.adapters import Adapter
from secateur.models.families import family_of, layout_of
from secateur.structured.selection import LayerKeep, Selection
from secateur.structured.units import family, head_dim, layer_shape

_GROUP_ALIASES = {"o": "attn_out", "attn_out": "attn_out", "down": "mlp_out", "mlp_out": "mlp_out"}


@dataclass
class Replacement:
    """New output-projection parameters for the kept columns: ``weight [out, k]``; ``bias [out]`` replaces
    the projection's bias entirely (``None`` keeps the existing one). ``kept``: the input columns the
    weight's columns correspond to, in order (``None``: ascending, as ``Selection.kept_columns``)."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None
    kept: torch.Tensor | None = None

    def ordered(self, kept: torch.Tensor) -> torch.Tensor:
        """The weight with columns in the order of ``kept`` (ascending selection order)."""
        if self.kept is None:
            return self.weight
        mine = torch.as_tensor(self.kept, dtype=torch.long).view(-1).cpu()
        if mine.numel() != kept.numel() or not torch.equal(mine.sort().values, kept.sort().values):
            raise SecateurError("the replacement's kept columns differ from the selection's kept columns")
        if kept.numel() == 0:
            return self.weight
        pos = torch.full((int(kept.max()) + 1,), -1, dtype=torch.long)
        pos[mine] = torch.arange(mine.numel())
        return self.weight[:, pos[kept]]


def _as_replacement(x) -> Replacement:
    """Accept a :class:`Replacement`, a ``(weight, bias)`` tuple, a weight tensor, or any object with
    ``weight`` / ``bias`` (/ ``kept``) attributes such as ``secateur.compensate.Compensation``."""
    if isinstance(x, Replacement):
        return x
    if isinstance(x, tuple):
        return Replacement(*x)
    if torch.is_tensor(x):
        return Replacement(x)
    if hasattr(x, "weight"):
        return Replacement(x.weight, getattr(x, "bias", None), getattr(x, "kept", None))
    raise SecateurError(f"a replacement must be a Replacement, (weight, bias) or a tensor, not {type(x)}")


def _normalize_replacements(replacements: Mapping | None) -> dict[tuple[int, str], Replacement]:
    out: dict[tuple[int, str], Replacement] = {}
    for (i, g), r in (replacements or {}).items():
        if g not in _GROUP_ALIASES:
            raise SecateurError(f"replacement group must be o/attn_out or down/mlp_out, not {g!r}")
        out[(int(i), _GROUP_ALIASES[g])] = _as_replacement(r)
    return out


def _rows(idx: list[int], m: int) -> torch.Tensor:
    t = torch.tensor(idx, dtype=torch.long)
    return (t[:, None] * m + torch.arange(m)).reshape(-1)


def add_bias(module: nn.Module, bias: torch.Tensor | None = None) -> nn.Module:
    """Give a ``Linear`` (or ``LinearRef.module``) a bias parameter, zeros unless ``bias`` is given.

    For compensators that add a constant (FLAP bias, CORP intercept) to bias-free o_proj/down_proj.
    Exports then use the heterogeneous classes when the family's stock config has no such bias."""
    module = getattr(module, "module", module)
    w = module.weight
    out_f = w.shape[1] if isinstance(module, Conv1D) else w.shape[0]
    with torch.no_grad():
        if module.bias is None:
            module.bias = nn.Parameter(torch.zeros(out_f, dtype=w.dtype, device=w.device))
        if bias is not None:
            module.bias.copy_(bias.reshape(out_f))
    return module


# --- weight access in [out, in] -------------------------------------------------------------------------

def _oi(module: nn.Module) -> torch.Tensor:
    """The weight as ``[out, in]`` (a view)."""
    return module.weight.T if isinstance(module, Conv1D) else module.weight


def _copy(module: nn.Module, w_oi: torch.Tensor, bias: torch.Tensor | None) -> None:
    with torch.no_grad():
        _oi(module).copy_(w_oi)
        if bias is not None:
            module.bias.copy_(bias)


def _bias(module: nn.Module, idx: torch.Tensor | None = None) -> torch.Tensor | None:
    b = getattr(module, "bias", None)
    if b is None:
        return None
    return b.detach().clone() if idx is None else b.detach()[idx].clone()


def _out_module(fam: str, layer: nn.Module) -> nn.Module:
    return getattr(hetero.attention_module(fam, layer), layout_of(fam).out)


def _qkv_rows(fam: str, attn: nn.Module, q_rows: torch.Tensor, kv_rows: torch.Tensor
              ) -> list[tuple[str, torch.Tensor]]:
    """(projection name, output rows) of q, k, v; a fused q|k|v projection gets one row set, its k and v
    blocks offset by a third of its width."""
    layout = layout_of(fam)
    if layout.fused_qkv:  # rows [q; k; v]: q as wide as the output projection's input, k and v the rest halved
        qw = hetero.in_features(layout, getattr(attn, layout.out))
        kvw = (_oi(getattr(attn, layout.q)).shape[0] - qw) // 2
        return [(layout.q, torch.cat([q_rows, qw + kv_rows, qw + kvw + kv_rows]))]
    return [(layout.q, q_rows), (layout.k, kv_rows), (layout.v, kv_rows)]


def _check_gqa(heads: list[int], kv: list[int], n_heads: int, n_kv: int, layer: int) -> None:
    """Hugging Face's ``repeat_kv`` (and llama.cpp) read kept query head ``p`` against kept KV head
    ``p // r``: every kept KV head must keep the same number ``r >= 1`` of its own query heads, listed in
    the order of ``kv`` (whole KV groups: ``r = g``; head slots: ``r = g - removed slots``; MQA: any heads)."""
    gs = n_heads // n_kv
    ok = len(set(heads)) == len(heads) and len(set(kv)) == len(kv) and (not heads) == (not kv)
    if ok and heads:
        r, rem = divmod(len(heads), len(kv))
        ok = rem == 0 and all(0 <= h < n_heads and h // gs == kv[p // r] for p, h in enumerate(heads))
    if not ok:
        raise SecateurError(
            f"layer {layer}: kept query heads {list(heads)} are not the same number of heads from each of the kept "
            f"KV groups {list(kv)} (group size {gs}), in KV order; Hugging Face attention needs KV groups of one size")


# --- slicing --------------------------------------------------------------------------------------------

def _slice_attention(fam: str, layer: nn.Module, heads: list[int], kv: list[int], m: int,
                     repl: Replacement | None) -> None:
    attn = hetero.attention_module(fam, layer)
    qi, kvi = _rows(heads, m), _rows(kv, m)
    out_mod = _out_module(fam, layer)
    qkv = [(name, _oi(getattr(attn, name)).detach()[idx].clone(), _bias(getattr(attn, name), idx))
           for name, idx in _qkv_rows(fam, attn, qi, kvi)]
    wo, bo = _kept_columns(out_mod, qi, repl, "o_proj")
    hetero.shape_attention(fam, layer, len(heads), len(kv), m, o_bias=bo is not None)
    attn = hetero.attention_module(fam, layer)
    for name, w_, b_ in qkv:
        _copy(getattr(attn, name), w_, b_)
    _copy(_out_module(fam, layer), wo, bo)


def _kept_columns(out: nn.Module, idx: torch.Tensor, repl: Replacement | None,
                  what: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The output projection's kept input columns ``idx`` and its bias, or the compensator's replacement (its
    weight in the kept columns' order; its bias when it has one)."""
    w, b = _oi(out).detach()[:, idx].clone(), _bias(out)
    if repl is None:
        return w, b
    if tuple(repl.weight.shape) != tuple(w.shape):
        raise SecateurError(f"{what} replacement has shape {tuple(repl.weight.shape)}, expected "
                            f"{tuple(w.shape)} (kept columns)")
    return repl.ordered(idx), (repl.bias if repl.bias is not None else b)


def _mlp_modules(fam: str, layer: nn.Module) -> tuple[list[tuple[nn.Module, str]], tuple[nn.Module, str]]:
    """(input projections, output projection) as (parent, attribute) pairs."""
    layout, mlp = layout_of(fam), hetero.mlp_module(fam, layer)
    return [(mlp, name) for name in layout.mlp_in], (mlp, layout.mlp_out)


def _in_rows(fam: str, layer: nn.Module, channels: torch.Tensor) -> torch.Tensor:
    """Rows of the MLP input projections for ``channels`` (both halves of a fused gate|up projection)."""
    if not layout_of(fam).fused_gate_up:
        return channels
    _, (dp, dn) = _mlp_modules(fam, layer)
    f = hetero.in_features(layout_of(fam), getattr(dp, dn))
    return torch.cat([channels, f + channels])


def _slice_mlp(fam: str, layer: nn.Module, channels: list[int], repl: Replacement | None) -> None:
    ci = torch.tensor(channels, dtype=torch.long)
    ins, (dp, dn) = _mlp_modules(fam, layer)
    ri = _in_rows(fam, layer, ci)
    saved = [(p, n, _oi(getattr(p, n)).detach()[ri].clone(), _bias(getattr(p, n), ri)) for p, n in ins]
    wd, bd = _kept_columns(getattr(dp, dn), ci, repl, "down_proj")
    hetero.shape_mlp(fam, layer, len(channels), down_bias=bd is not None)
    for p, n, w_, b_ in saved:
        _copy(getattr(p, n), w_, b_)
    _copy(getattr(dp, dn), wd, bd)


def remove_blocks(model: nn.Module, blocks: list[int]) -> None:
    """Drop whole decoder layers; renumber ``layer_idx``; update ``num_hidden_layers`` / ``layer_types``."""
    cfg = model.config
    fam = family_of(cfg)
    if getattr(cfg, "scale_attn_by_inverse_layer_idx", False):
        raise SecateurError("GPT-2 with scale_attn_by_inverse_layer_idx scales by layer position; removing "
                            "blocks would change the remaining blocks")
    layers = hetero.decoder_layers(fam, model)
    drop = set(blocks)
    keep = [lay for i, lay in enumerate(layers) if i not in drop]
    if not keep:
        raise SecateurError("cannot remove every block")
    hetero.set_decoder_layers(fam, model, nn.ModuleList(keep))
    for new_idx, lay in enumerate(keep):
        for mod in lay.modules():
            if isinstance(getattr(mod, "layer_idx", None), int):
                mod.layer_idx = new_idx
    types = getattr(cfg, "layer_types", None)
    if types is not None:
        cfg.layer_types = [t for i, t in enumerate(types) if i not in drop]
    hetero.sizes_of(cfg).num_hidden_layers = len(keep)


def sync_config(model: nn.Module) -> None:
    """Record the actual per-layer widths in ``config.secateur_layers`` (and an explicit ``head_dim``)."""
    cfg = model.config
    fam = family_of(cfg)
    m = hetero.head_dim_of(cfg)
    if layout_of(fam).gqa:  # stock configs of these families carry an explicit head_dim
        cfg.head_dim = m
    cfg.secateur_layers = [hetero.current_spec(fam, lay, m).to_dict() for lay in hetero.decoder_layers(fam, model)]


def apply_selection(model: nn.Module, adapter: Adapter, selection: Selection,
                    replacements: Mapping | None = None) -> nn.Module:
    """Slice ``model`` in place into a smaller dense model (see module docstring); returns it.

    ``replacements``: ``{(layer, 'o'|'attn_out'|'down'|'mlp_out'): Replacement | (weight, bias) | weight}``
    with original layer indices; a replacement may target a projection whose columns are all kept.
    """
    reps = _normalize_replacements(replacements)
    slice_layers(adapter, selection, reps, sorted(set(selection.layers) | {i for i, _ in reps}))
    return finish_slicing(model, selection)


def slice_layers(adapter: Adapter, selection: Selection, replacements: Mapping | None, layers: list[int],
                 layer_of=None) -> None:
    """Slice decoder layers ``layers`` (original indices; removed blocks and layers the selection and the
    replacements leave alone are skipped) in place: :func:`apply_selection` one layer at a time, as a
    block-streamed run does while the block is loaded. ``layer_of(i)``: the module to slice instead of
    ``adapter.layers[i]`` (a copy, to learn the sliced shapes). :func:`finish_slicing` completes the model."""
    fam = family(adapter)
    m = head_dim(adapter)
    if selection.head_dim != m or selection.n_layers != adapter.n_layers:
        raise SecateurError(f"selection was made for {selection.n_layers} layers with head_dim "
                            f"{selection.head_dim}; the model has {adapter.n_layers} and {m}")
    reps = _normalize_replacements(replacements)
    with torch.no_grad():
        for i in layers:
            if i in selection.removed_blocks or (i not in selection.layers and (i, "attn_out") not in reps
                                                 and (i, "mlp_out") not in reps):
                continue
            if not 0 <= i < adapter.n_layers:
                raise SecateurError(f"layer {i} out of range")
            keep = selection.layers.get(i, LayerKeep())
            layer = adapter.layers[i] if layer_of is None else layer_of(i)
            shape = layer_shape(adapter, i)  # a copy's shape is the layer's (not sliced yet)
            ro, rd = reps.get((i, "attn_out")), reps.get((i, "mlp_out"))
            if keep.heads is not None or ro is not None:
                heads = keep.heads if keep.heads is not None else list(range(shape.n_heads))
                kv = keep.kv_heads if keep.kv_heads is not None else list(range(shape.n_kv_heads))
                if shape.n_kv_heads:
                    _check_gqa(heads, kv, shape.n_heads, shape.n_kv_heads, i)
                _slice_attention(fam, layer, heads, kv, m, ro)
            if keep.channels is not None or rd is not None:
                ch = keep.channels if keep.channels is not None else list(range(shape.intermediate))
                _slice_mlp(fam, layer, ch, rd)


def finish_slicing(model: nn.Module, selection: Selection) -> nn.Module:
    """After every layer is sliced: drop removed blocks, record the per-layer widths (:func:`sync_config`)."""
    if selection.removed_blocks:
        remove_blocks(model, selection.removed_blocks)
    sync_config(model)
    return model


# --- masking --------------------------------------------------------------------------------------------

def _zero_rows(module: nn.Module, rows: torch.Tensor) -> None:
    if rows.numel():
        _oi(module).index_fill_(0, rows, 0.0)
        if getattr(module, "bias", None) is not None:
            module.bias.index_fill_(0, rows, 0.0)


def _zero_cols(module: nn.Module, cols: torch.Tensor) -> None:
    if cols.numel():
        _oi(module).index_fill_(1, cols, 0.0)


def _write_out(module: nn.Module, kept: torch.Tensor, repl: Replacement | None) -> None:
    if repl is None:
        return
    w = _oi(module)
    if tuple(repl.weight.shape) != (w.shape[0], kept.numel()):
        raise SecateurError(f"replacement has shape {tuple(repl.weight.shape)}, expected "
                            f"{(w.shape[0], kept.numel())}")
    w[:, kept] = repl.ordered(kept).to(w.dtype)
    if repl.bias is not None:
        add_bias(module, repl.bias)


def mask_selection(model: nn.Module, adapter: Adapter, selection: Selection,
                   replacements: Mapping | None = None) -> nn.Module:
    """Zero (in place) every row/column that :func:`apply_selection` would remove, and write the same
    replacements; removed blocks get zero o_proj/down_proj weights and biases (the residual passes
    through). The result computes the same function as the sliced model."""
    fam = family(adapter)
    m = head_dim(adapter)
    reps = _normalize_replacements(replacements)
    with torch.no_grad():
        for i in sorted(set(selection.layers) | {i for i, _ in reps}):
            layer = adapter.layers[i]
            shape = layer_shape(adapter, i)
            keep = selection.layers.get(i, LayerKeep())
            attn = hetero.attention_module(fam, layer)
            out_mod = _out_module(fam, layer)
            heads = keep.heads if keep.heads is not None else list(range(shape.n_heads))
            kv = keep.kv_heads if keep.kv_heads is not None else list(range(shape.n_kv_heads))
            hs, ks = set(heads), set(kv)
            gone_h = _rows([h for h in range(shape.n_heads) if h not in hs], m)
            gone_kv = _rows([g for g in range(shape.n_kv_heads) if g not in ks], m)
            for name, rows in _qkv_rows(fam, attn, gone_h, gone_kv):
                _zero_rows(getattr(attn, name), rows)
            _zero_cols(out_mod, gone_h)
            _write_out(out_mod, _rows(heads, m), reps.get((i, "attn_out")))
            ch = keep.channels if keep.channels is not None else list(range(shape.intermediate))
            cs = set(ch)
            gone_c = torch.tensor([c for c in range(shape.intermediate) if c not in cs], dtype=torch.long)
            ins, (dp, dn) = _mlp_modules(fam, layer)
            for p, n in ins:
                _zero_rows(getattr(p, n), _in_rows(fam, layer, gone_c))
            _zero_cols(getattr(dp, dn), gone_c)
            _write_out(getattr(dp, dn), torch.tensor(ch, dtype=torch.long), reps.get((i, "mlp_out")))
        for b in selection.removed_blocks:
            layer = adapter.layers[b]
            _, (dp, dn) = _mlp_modules(fam, layer)
            for mod in (_out_module(fam, layer), getattr(dp, dn)):
                mod.weight.zero_()
                if getattr(mod, "bias", None) is not None:
                    mod.bias.zero_()
    return model
