"""What to keep: per-layer kept query heads, KV heads and MLP channels, plus removed blocks.

A :class:`Selection` is the hand-off between selection (scores + allocation) and materialization
(:func:`secateur.structured.slicing.apply_selection` / ``mask_selection``) and compensation: a compensator
reads ``kept_columns(layer, 'attn_out' | 'mlp_out')`` (ascending original input columns of o_proj /
down_proj) and returns the new ``[out, k]`` weight for exactly those columns, in that order.

Indices are relative to the model the selection was made on (layer ``i`` = ``adapter.layers[i]``, head
``h`` = its ``h``-th current query head). JSON round trip: ``to_dict`` / ``from_dict``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch

from secateur.errors import SecateurError
from secateur.structured.units import ATTN_KINDS, MLP_KINDS, Inventory


@dataclass
class LayerKeep:
    """Kept structures of one layer; ``None`` = that part is untouched."""

    heads: list[int] | None = None
    kv_heads: list[int] | None = None
    channels: list[int] | None = None

    def to_dict(self) -> dict:
        return {"heads": self.heads, "kv_heads": self.kv_heads, "channels": self.channels}


@dataclass
class Selection:
    head_dim: int
    n_layers: int
    layers: dict[int, LayerKeep] = field(default_factory=dict)
    removed_blocks: list[int] = field(default_factory=list)
    info: dict = field(default_factory=dict)

    @classmethod
    def from_removed(cls, inv: Inventory, removed: torch.Tensor, info: dict | None = None) -> Selection:
        """Turn a removal mask over ``inv`` into kept index lists (sorted ascending)."""
        if removed.numel() != len(inv):
            raise SecateurError(f"removal mask has {removed.numel()} entries for {len(inv)} units")
        sel = cls(inv.head_dim, inv.n_layers, info=dict(info or {}))
        for p in inv.pools:
            r = removed[p.offset:p.offset + p.n]
            if not bool(r.any()):
                continue
            shape = inv.shapes[p.layer]
            if not p.ranked:
                raise SecateurError(f"layer {p.layer}: the head_slot units were never ranked by a score "
                                    "(structured.units.rank_slots), so their membership is not chosen")
            keep = sel.layers.setdefault(p.layer, LayerKeep())
            gone = r[p.unit_of_member]
            dropped = set(p.members[gone].tolist())
            if p.kind == "head_slot":  # the KV heads go with the last slot (units docstring)
                keep.heads = [h for h in range(shape.n_heads) if h not in dropped]
                keep.kv_heads = list(range(shape.n_kv_heads)) if keep.heads else []
            elif p.kind in ATTN_KINDS:
                dropped_kv = set(p.kv[r].tolist()) - set(p.kv[~r].tolist())  # MQA heads share KV head 0
                keep.heads = [h for h in range(shape.n_heads) if h not in dropped]
                keep.kv_heads = [g for g in range(shape.n_kv_heads) if g not in dropped_kv]
            elif p.kind in MLP_KINDS:
                keep.channels = [c for c in range(shape.intermediate) if c not in dropped]
            else:
                sel.removed_blocks.append(p.layer)
        sel.removed_blocks.sort()
        return sel

    # --- compensator interface ----------------------------------------------------------------
    def kept_columns(self, layer: int, group: str) -> torch.Tensor | None:
        """Kept input columns of o_proj (``attn_out``) or down_proj (``mlp_out``); ``None`` = all."""
        k = self.layers.get(layer)
        if k is None:
            return None
        if group == "attn_out":
            if k.heads is None:
                return None
            m = self.head_dim
            return (torch.tensor(k.heads, dtype=torch.long)[:, None] * m + torch.arange(m)).reshape(-1)
        if group == "mlp_out":
            return None if k.channels is None else torch.tensor(k.channels, dtype=torch.long)
        raise SecateurError(f"group must be attn_out or mlp_out, not {group!r}")

    def realized_sparsity(self, params_before: int, params_after: int) -> dict:
        """The report's ``realized_sparsity`` of this selection once materialized: the fraction of the targeted
        units removed (``info['realized']``), of all parameters (the model's counts before and after slicing,
        tied weights once), and per layer."""
        info = self.info
        return {"targeted": info.get("realized"),
                "of_all_parameters": 1 - params_after / params_before if params_before else 0.0,
                "pruned_weights": params_before - params_after, "targeted_weights": info.get("total_removable"),
                "per_module": {str(k): v["realized"] for k, v in (info.get("per_layer") or {}).items()}}

    # --- serialization ------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"head_dim": self.head_dim, "n_layers": self.n_layers,
                "layers": {str(i): k.to_dict() for i, k in sorted(self.layers.items())},
                "removed_blocks": list(self.removed_blocks),
                "info": json.loads(json.dumps(self.info, default=str))}  # JSON-normal (str keys)

    @classmethod
    def from_dict(cls, d: dict) -> Selection:
        return cls(d["head_dim"], d["n_layers"], {int(i): LayerKeep(**k) for i, k in d["layers"].items()},
                   list(d.get("removed_blocks", [])), dict(d.get("info", {})))
