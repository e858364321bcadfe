"""Selection units derived from the adapter geometry, with their removable parameter counts.

Kinds (one attention kind and one MLP kind per layer at most, plus optional whole blocks):

``kv_group``   one KV head and every query head reading it (GQA): q rows of its query heads, k/v rows
               of its KV head, o_proj columns of its query heads. The only attention unit that keeps
               Hugging Face's GQA layout valid (every kept KV head keeps its full group of query heads).
``head``       one query head; where each KV head serves one query head (MHA: OPT, GPT-2,
               Llama-family with ``n_kv == n_heads``), where it is the same structure as ``kv_group``, and
               under MQA (one KV head, Gemma-3 270M), where it is q rows + o columns and the KV head stays
               while any query head does. A ``kv_group`` there would be the whole attention, so on an MQA
               layer either attention kind enumerates query heads (pools of kind ``head``).
``head_slot``  one query head of EVERY KV group at once (GQA, group size ``g > 1``): q rows of those
               ``n_kv`` heads and their o_proj columns; k/v stay. A layer has ``g`` slots; removing ``r``
               of them leaves ``g - r`` query heads in every group, so the group size stays uniform (what
               Hugging Face's ``repeat_kv`` and llama.cpp need) and the result is a stock GQA config with
               ``num_attention_heads = n_kv (g - r)``. Which head of each group forms slot ``j`` comes from
               the scores (:func:`rank_slots`): inside each group the query heads are ranked by their
               per-head score, ascending, stable (ties: lower head index first), and slot ``j`` takes the
               ``j``-th lowest head of every group; its score aggregates its heads' scores as a KV group
               does (:mod:`secateur.scoring.structured`). The pool is built in index order (slot ``j`` =
               head ``j`` of every group, the ranking of equal scores) and a scorer re-ranks it; a
               selection refuses a pool no scorer ranked. Emptying rule, as for MQA query heads: the KV
               heads belong to no slot's cost and go with the last slot (removing every slot removes the
               attention: :class:`~secateur.models.hetero.NullAttention`); uniform (ceil) allocation always
               keeps one slot. Under MQA a slot is one query head (a pool of kind ``head``); a layer with
               one query head per KV head (MHA) has no slots and is refused (use ``head``).
``channel``    one MLP intermediate channel: gate/up rows (OPT ``fc1`` rows, GPT-2 ``c_fc`` columns in
               Conv1D storage) and the matching down-projection column.
``ffn_group``  ``n_ffn_groups`` channel groups per layer (CoCurve: 16). Default: contiguous index blocks
               ``[floor(k f/n), floor((k+1) f/n))`` (CoCurve [A1]); ``ffn_order`` chunks a per-layer
               permutation instead (the ``sorted`` ablation).
``block``      a whole decoder layer (ShortGPT).

Removable parameters (CoCurve §1 "c_u"; biases included, output-projection biases excluded because they
stay): attention unit ``d m (2|H_g| + 2)`` + q bias ``|H_g| m`` + k/v biases ``2m`` where present (a head
slot or an MQA query head: ``n_kv`` resp. one query head, no KV head: ``2 d m n_kv`` + q bias); MLP
channel ``3d`` (gated) or ``2d`` + gate/up biases; a block counts every parameter of the layer.

An :class:`Inventory` stores units compactly as per-(layer, kind) :class:`Pool` objects (CSR member lists)
so that per-channel inventories of 7B models (~500k units) stay cheap; unit ``i`` of the inventory is
unit ``i - pool.offset`` of its pool. Unit order (the tie-break order everywhere): layer-major, then
attention, MLP, block.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from secateur.errors import SecateurError
from secateur.models import hetero
from secateur.models.adapters import Adapter
from secateur.models.families import layout_of

ATTN_KINDS = ("kv_group", "head", "head_slot")
MLP_KINDS = ("channel", "ffn_group")
KINDS = ATTN_KINDS + MLP_KINDS + ("block",)


def family(adapter: Adapter) -> str:
    """The adapter's family (``llama``/``mistral``/``qwen2``/``qwen3``/``opt``/``gpt2``), the key of its layout."""
    return adapter.family


def head_dim(adapter: Adapter) -> int:
    return hetero.head_dim_of(adapter.config)


@dataclass(frozen=True)
class LayerShape:
    """Actual widths of one (possibly already pruned) decoder layer, read from its modules."""

    hidden: int
    head_dim: int
    n_heads: int
    n_kv_heads: int
    intermediate: int
    q_bias: bool
    kv_bias: bool
    o_bias: bool
    in_biases: int  # number of biased MLP input projections (gate/up, fc1, c_fc)
    down_bias: bool
    gated: bool

    @property
    def group_size(self) -> int:
        return self.n_heads // self.n_kv_heads if self.n_kv_heads else 0

    def attn_unit_params(self, n_q: int, n_kv: int = 1) -> int:
        """Removable parameters of ``n_q`` query heads plus ``n_kv`` KV heads."""
        d, m = self.hidden, self.head_dim
        p = d * m * (2 * n_q + 2 * n_kv)
        p += n_q * m * self.q_bias + 2 * n_kv * m * self.kv_bias
        return p

    @property
    def channel_params(self) -> int:
        return self.hidden * (3 if self.gated else 2) + self.in_biases

    @property
    def removable(self) -> int:
        """All removable projection parameters of the layer (attention units + MLP channels)."""
        return self.attn_unit_params(self.n_heads, self.n_kv_heads) + self.intermediate * self.channel_params


def layer_shape(adapter: Adapter, index: int) -> LayerShape:
    fam = family(adapter)
    layer = adapter.layers[index]
    m = head_dim(adapter)
    spec = hetero.current_spec(fam, layer, m)
    layout = layout_of(fam)
    attn = hetero.attention_module(fam, layer)
    q, k = getattr(attn, layout.q), getattr(attn, layout.k)
    mlp = hetero.mlp_module(fam, layer)
    in_biases = sum(getattr(mlp, name).bias is not None for name in layout.mlp_in) * (1 + layout.fused_gate_up)
    return LayerShape(hetero.in_features(layout, q), m, spec.n_heads, spec.n_kv_heads, spec.intermediate,
                      q.bias is not None, k.bias is not None, spec.o_bias, in_biases, spec.down_bias,
                      layout.gated)


def block_params(layer: nn.Module) -> int:
    return sum(p.numel() for p in layer.parameters())


@dataclass
class Pool:
    """The units of one kind in one layer.

    ``members`` are query heads (attention kinds), channels (MLP kinds) or ``[layer]`` (block), grouped
    by unit in CSR form: unit ``u`` owns ``members[ptr[u]:ptr[u+1]]`` (ascending); ``kv`` (``kv_group`` /
    ``head``) is the KV head of each unit (``None`` for ``head_slot``: a slot spans every KV head).
    ``ranked``: ``False`` while a ``head_slot`` pool still has its provisional index-order membership
    (:func:`rank_slots` sets it from scores).
    """

    layer: int
    kind: str
    offset: int
    cost: torch.Tensor  # [n] int64 removable parameters
    members: torch.Tensor
    ptr: torch.Tensor
    kv: torch.Tensor | None = None
    ranked: bool = True

    @property
    def n(self) -> int:
        return self.cost.numel()

    @property
    def group(self) -> str:
        return "attn_out" if self.kind in ATTN_KINDS else "mlp_out" if self.kind in MLP_KINDS else "block"

    @property
    def unit_of_member(self) -> torch.Tensor:
        """Local unit id of every member (for segment sums)."""
        return torch.repeat_interleave(torch.arange(self.n), self.ptr.diff())

    def unit_members(self, u: int) -> torch.Tensor:
        return self.members[self.ptr[u]:self.ptr[u + 1]]


@dataclass(frozen=True)
class Unit:
    """A readable description of one unit (see :meth:`Inventory.unit`)."""

    index: int
    kind: str
    layer: int
    local: int
    heads: tuple[int, ...] = ()
    kv_heads: tuple[int, ...] = ()
    channels: tuple[int, ...] = ()
    params: int = 0


@dataclass
class Inventory:
    pools: list[Pool]
    shapes: dict[int, LayerShape]
    n_layers: int
    head_dim: int
    block_sizes: dict[int, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return sum(p.n for p in self.pools)

    @property
    def costs(self) -> torch.Tensor:
        return torch.cat([p.cost for p in self.pools]) if self.pools else torch.zeros(0, dtype=torch.long)

    @property
    def layer_of(self) -> torch.Tensor:
        return torch.cat([torch.full((p.n,), p.layer, dtype=torch.long) for p in self.pools])

    @property
    def total_cost(self) -> int:
        return int(self.costs.sum())

    def layer_costs(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for p in self.pools:
            out[p.layer] = out.get(p.layer, 0) + int(p.cost.sum())
        return out

    def pool_at(self, i: int) -> Pool:
        for p in self.pools:
            if p.offset <= i < p.offset + p.n:
                return p
        raise IndexError(i)

    def unit(self, i: int) -> Unit:
        p = self.pool_at(i)
        u = i - p.offset
        mem = tuple(int(x) for x in p.unit_members(u))
        if p.kind == "head_slot":
            kv = tuple(range(self.shapes[p.layer].n_kv_heads))
            return Unit(i, p.kind, p.layer, u, heads=mem, kv_heads=kv, params=int(p.cost[u]))
        if p.kind in ATTN_KINDS:
            return Unit(i, p.kind, p.layer, u, heads=mem, kv_heads=(int(p.kv[u]),), params=int(p.cost[u]))
        if p.kind in MLP_KINDS:
            return Unit(i, p.kind, p.layer, u, channels=mem, params=int(p.cost[u]))
        return Unit(i, p.kind, p.layer, u, params=int(p.cost[u]))


def _attn_pool(shape: LayerShape, layer: int, kind: str, offset: int) -> Pool | None:
    if shape.n_heads == 0:
        return None
    gs = shape.group_size
    if gs != 1 and shape.n_kv_heads == 1:  # MQA: query heads go, the one KV head stays (either kind)
        n = shape.n_heads
        return Pool(layer, "head", offset, torch.full((n,), shape.attn_unit_params(1, 0), dtype=torch.long),
                    torch.arange(n), torch.arange(n + 1), torch.zeros(n, dtype=torch.long))
    if kind == "head" and gs != 1:
        raise SecateurError(
            f"single query heads are not removable units in a GQA layer ({shape.n_heads} query heads share "
            f"{shape.n_kv_heads} KV heads); use kv_group or head_slot units")
    if kind == "head_slot":
        if gs == 1:
            raise SecateurError(
                f"head_slot units remove one query head of every KV group, but layer {layer} has one query head "
                f"per KV head ({shape.n_heads} of each, MHA); use head units")
        n, kv = gs, shape.n_kv_heads  # provisional membership: slot j = head j of every group (rank_slots)
        return Pool(layer, kind, offset, torch.full((n,), shape.attn_unit_params(kv, 0), dtype=torch.long),
                    (torch.arange(kv)[None, :] * gs + torch.arange(gs)[:, None]).reshape(-1),
                    torch.arange(n + 1) * kv, None, ranked=False)
    n = shape.n_kv_heads
    cost = torch.full((n,), shape.attn_unit_params(gs, 1), dtype=torch.long)
    return Pool(layer, kind, offset, cost, torch.arange(n * gs), torch.arange(n + 1) * gs, torch.arange(n))


def rank_slots(pool: Pool, head_scores: torch.Tensor) -> None:
    """Set a ``head_slot`` pool's membership from per-query-head scores (``head_scores[h]``, higher = keep,
    indexed by the layer's query heads): inside each KV group ``k`` (heads ``k g .. k g + g - 1``) the heads
    are sorted ascending by score, stable (equal scores: lower head index first), and slot ``j`` takes the
    ``j``-th of every group. Slot scores then follow by aggregating ``head_scores`` over the new members."""
    if pool.kind != "head_slot":
        raise SecateurError(f"rank_slots takes a head_slot pool, not {pool.kind!r}")
    g = pool.n
    n_kv = pool.members.numel() // g
    s = torch.as_tensor(head_scores).detach().to("cpu", torch.float64).reshape(-1)
    if s.numel() != g * n_kv:
        raise SecateurError(f"layer {pool.layer}: {s.numel()} head scores for {g * n_kv} query heads")
    order = torch.argsort(s.view(n_kv, g), dim=1, stable=True)  # [group, rank]
    heads = torch.arange(n_kv)[:, None] * g + order
    pool.members = heads.T.reshape(-1).contiguous()  # slot-major; within a slot ascending (group order)
    pool.ranked = True


def _mlp_pool(shape: LayerShape, layer: int, kind: str, offset: int, n_groups: int,
              order: torch.Tensor | None) -> Pool | None:
    f = shape.intermediate
    if f == 0:
        return None
    if kind == "channel":
        return Pool(layer, kind, offset, torch.full((f,), shape.channel_params, dtype=torch.long),
                    torch.arange(f), torch.arange(f + 1))
    g = min(n_groups, f)
    bounds = torch.tensor([k * f // g for k in range(g + 1)])
    perm = torch.arange(f) if order is None else torch.as_tensor(order, dtype=torch.long)
    if perm.numel() != f or not torch.equal(perm.sort().values, torch.arange(f)):
        raise SecateurError(f"ffn_order for layer {layer} is not a permutation of its {f} channels")
    # members sorted inside each group, so a group is a set (its order carries no meaning)
    members = torch.cat([perm[bounds[k]:bounds[k + 1]].sort().values for k in range(g)])
    return Pool(layer, kind, offset, bounds.diff() * shape.channel_params, members, bounds)


def inventory(adapter: Adapter, kinds: tuple[str, ...] | list[str] = ("kv_group", "channel"),
              n_ffn_groups: int = 16, ffn_order: dict[int, torch.Tensor] | None = None,
              layers: list[int] | None = None) -> Inventory:
    """Enumerate the units of ``kinds`` in ``layers`` (default: all) of the adapter's model."""
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        raise SecateurError(f"unknown unit kind(s) {bad}; choose from {', '.join(KINDS)}")
    if sum(k in ATTN_KINDS for k in kinds) > 1 or sum(k in MLP_KINDS for k in kinds) > 1:
        raise SecateurError("choose at most one attention unit kind and one MLP unit kind")
    idx = list(range(adapter.n_layers)) if layers is None else sorted(layers)
    shapes = {i: layer_shape(adapter, i) for i in idx}
    pools: list[Pool] = []
    block_sizes: dict[int, int] = {}
    offset = 0
    for i in idx:
        s = shapes[i]
        cand: list[Pool | None] = []
        for k in kinds:
            if k in ATTN_KINDS:
                cand.append(_attn_pool(s, i, k, 0))
        for k in kinds:
            if k in MLP_KINDS:
                cand.append(_mlp_pool(s, i, k, 0, n_ffn_groups, (ffn_order or {}).get(i)))
        if "block" in kinds:
            block_sizes[i] = block_params(adapter.layers[i])
            cand.append(Pool(i, "block", 0, torch.tensor([block_sizes[i]]), torch.tensor([i]),
                             torch.tensor([0, 1])))
        for p in cand:
            if p is not None:
                p.offset = offset
                offset += p.n
                pools.append(p)
    return Inventory(pools, shapes, adapter.n_layers, head_dim(adapter), block_sizes)
