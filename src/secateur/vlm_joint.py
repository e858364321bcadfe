"""One budget over both towers of a vision-language model (issue 47; CoCurve's VLM claim): ``secateur prune --towers
joint``.

CoCurve's second claim (the paper's VLM section) is that ONE teacher-KL graph over the units of the vision AND the
language tower, with ONE budget and no tower-specific ratio, co-prunes a VLM. This module builds that:

* **Joint inventory** (:func:`joint_inventory`): the units of each tower's blocks as its own family enumerates them
  (:mod:`secateur.structured.units`; CoCurve: KV groups / heads + 16 FFN channel groups per layer, the baselines: KV
  groups / heads + single MLP channels), concatenated vision first, the language tower's layers numbered after the
  vision tower's (``layer + L_vision``). ``c_u`` = removable parameters (CoCurve §1). The projector, the embeddings,
  the LM head, norms and the vision stem are outside every unit: never pruned. One budget
  ``sum_{u in S} c_u >= rho sum_u c_u`` over the joint inventory; the guard is CoCurve's per tower (the first and last
  two layers of EACH tower protected, per-layer cap ``min(1, 1.5 rho)``, :meth:`JointInventory.guard`).
* **CoCurve / CoCurve-diag** (:func:`joint_graph`, :func:`select_joint`): every unit is ablated through the WHOLE VLM
  (its output columns zeroed by forward pre-hooks, :func:`secateur.budgets.heldout.masked` on its tower; image +
  caption in, no shortcut) and the features are measured on the caption tokens only (the positions that predict a
  caption token or its EOS, :func:`secateur.data.captions.caption_target`) against the dense VLM's teacher on its
  top-r support: the same Fisher features and Gram estimator as text (cocurve.md §3; the paper's Prop. 3),

      phi_u(x, t) = sqrt(p~) (dz_u - sum_k p~_k dz_u,k),  dz_u = z_0 - z_{-u} on V_r(x, t)
      H = (1 / sum_i P_i) sum_{pairs i} sum_{caption positions t} Phi^T Phi       (P_i: pair i's caption positions)

  so vision and language units sit in ONE ``H`` (its vision-language block is the cross-tower edges), and the greedy
  with edge term (the paper's Algorithm 2: ``R_lambda(S) = 1/2 sum_u H_uu + lambda sum_{u<v} H_uv``, breakpoint
  family, Prop. 7) chooses across towers. The sweep is :func:`secateur.scoring.cocurve_sweep.source_sweep` (the text
  sweep's teacher, features, fold and split halves; the VLM only says how to compute logits). Lambda is chosen on the
  last ``--heldout`` pairs (the paper's lambda pairs, disjoint from the graph pairs) by the full-vocabulary teacher KL
  on their caption tokens (:class:`CaptionKL`; the paired one-SE rule of text CoCurve). CoCurve-diag is the same
  graph at lambda = 0.
* **Baselines** (Wanda-sp, FLAP, magnitude-sp, random; :func:`joint_scores`): each tower's unit scores as its
  family computes them (Wanda-sp ``||W_:,j|| ||X_j||``, FLAP WIFV ``Var_j ||W_:,j||^2``, magnitude ``||W_:,j||``,
  summed over a unit's columns; :func:`secateur.scoring.structured.unit_scores`) from that tower's own calibration
  inputs (the pairs' images for the vision tower, the VLM-merged image + caption embeddings for the language tower),
  then ranked per parameter (``score / c_u``) over the joint inventory with one global budget
  (:func:`secateur.budgets.allocate.allocate_global`, same guard). The scores of the two towers are compared RAW per
  parameter, as the paper's baselines do: nothing rescales one tower against the other (FLAP's per-layer
  standardization and its bias compensation are not applied here).
* **Where the budget went**: ``report["vlm"]["budget"]["by_tower"]`` (removable and removed parameters, fraction per
  tower; printed by the CLI). :func:`matched_ratio` turns a joint run's realized removed parameters into the ratio of
  one tower that removes the same count (the joint-vs-language-only comparison at matched parameters:
  ``--towers joint:language`` at that ratio runs the same machinery over the language tower's units alone).
* **Slicing**: the chosen mask is sliced tower by tower (:func:`secateur.structured.slicing.apply_selection` on each
  tower's own model) and each tower's new widths go into the VLM's config (:func:`secateur.vlm_config.write_back`):
  the stock config where every layer keeps the same widths, else the family's per-layer config
  (``secateur_<family>`` with ``secateur_layers``, :mod:`secateur.models.hetero`, whose headless decoder
  :func:`~secateur.models.hetero.define_backbone` registers with ``AutoModel``), so the saved VLM reloads with one
  ``AutoModelForImageTextToText.from_pretrained`` in a process that has imported secateur and computes what the
  masked VLM computed (the removed units' contributions are exactly zero in both; only float32 summation order
  differs).

One process, resident, no checkpoint, no compensation (``--procs``, ``--stream``, ``--resume``, ``--compensation``
refused in one line).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from secateur.budgets.allocate import Guard, allocate_global
from secateur.budgets.heldout import masked, standard_error
from secateur.errors import SecateurError
from secateur.models.adapters import Adapter, get_adapter
from secateur.models.towers import TOWERS, tower_model, vlm_inputs
from secateur.structured.units import Inventory, inventory

COCURVE = ("cocurve", "cocurve-diag")
#: joint baselines: registry name -> structured score (secateur.scoring.structured.unit_scores)
BASELINES = {"wanda-sp": "wanda_sp", "flap": "flap", "magnitude-sp": "magnitude", "random": "random"}
METHODS = COCURVE + tuple(BASELINES)
BASELINE_KINDS = ("kv_group", "channel")
COCURVE_KINDS = ("kv_group", "ffn_group")


# --- the joint inventory ------------------------------------------------------------------------------------------

@dataclass
class TowerPart:
    """One tower inside a joint inventory: its own model (sharing the VLM's modules), adapter and inventory, and
    where its units and layers start in the joint numbering."""

    name: str
    model: nn.Module
    adapter: Adapter
    inv: Inventory
    offset: int  # first joint unit index
    layer_offset: int  # joint layer of its layer 0

    def take(self, removed: torch.Tensor) -> torch.Tensor:
        return removed[self.offset:self.offset + len(self.inv)]


@dataclass
class JointInventory:
    """The towers' parts and ``inv``: their pools in joint numbering (units and layers shifted), an
    :class:`~secateur.structured.units.Inventory` for budgets, allocation and reports only (its ``head_dim`` is 0:
    column ownership lives in each part's own inventory)."""

    parts: list[TowerPart]
    inv: Inventory

    def __len__(self) -> int:
        return len(self.inv)

    def part(self, name: str) -> TowerPart:
        return next(p for p in self.parts if p.name == name)

    def protected(self, first: int = 2, last: int = 2) -> tuple[int, ...]:
        """Joint layers of each tower's first ``first`` and last ``last`` layers."""
        out: set[int] = set()
        for p in self.parts:
            n = p.inv.n_layers
            out |= {p.layer_offset + i for i in range(n) if i < first or i >= n - last}
        return tuple(sorted(out))

    def guard(self, rho: float, first: int = 2, last: int = 2, cap_factor: float = 1.5) -> Guard:
        """CoCurve's guard (cocurve.md §1) per tower: first/last two layers of each tower protected, per-layer cap
        ``min(1, 1.5 rho)`` of the layer's removable parameters."""
        return Guard(protect=self.protected(first, last), cap=min(1.0, cap_factor * rho))

    @contextmanager
    def masked(self, removed: torch.Tensor) -> Iterator[None]:
        """Within the block the VLM computes as if the removed units of both towers were zeroed (weights
        untouched): each tower's column masks (:func:`secateur.budgets.heldout.masked`)."""
        if removed.numel() != len(self):
            raise SecateurError(f"removal mask has {removed.numel()} entries for {len(self)} joint units")
        with ExitStack() as stack:
            for p in self.parts:
                r = p.take(removed)
                if bool(r.any()):
                    stack.enter_context(masked(p.adapter, p.inv, r))
            yield

    def by_tower(self, removed: torch.Tensor) -> dict[str, dict]:
        """Where the budget went: per tower, its removable and removed parameters and units, and the fraction."""
        out = {}
        for p in self.parts:
            r, c = p.take(removed), p.inv.costs
            rem, tot = int(c[r].sum()), int(c.sum())
            out[p.name] = {"removable": tot, "removed_params": rem, "fraction": rem / tot if tot else 0.0,
                           "units": len(p.inv), "removed_units": int(r.sum()), "layers": p.inv.n_layers,
                           "first_joint_layer": p.layer_offset}
        return out

    def budget(self, removed: torch.Tensor, rho: float) -> dict:
        """The one budget's arithmetic: totals, realized fraction, per tower and per layer (``per_layer``: each
        tower's layers in order, ``layer`` the tower's own index)."""
        c = self.inv.costs
        rem, tot = int(c[removed].sum()), int(c.sum())
        per_layer = []
        for p in self.parts:
            r, pc, lo = p.take(removed), p.inv.costs, p.inv.layer_of
            for li in range(p.inv.n_layers):
                on = lo == li
                t, x = int(pc[on].sum()), int(pc[on & r].sum())
                per_layer.append({"tower": p.name, "layer": li, "removable": t, "removed_params": x,
                                  "fraction": x / t if t else 0.0})
        return {"target": rho, "removable": tot, "removed_params": rem, "realized": rem / tot,
                "max_unit_cost": int(c.max()), "by_tower": self.by_tower(removed), "per_layer": per_layer}


def joint_inventory(vlm: nn.Module, towers: tuple[str, ...] = TOWERS, kinds: tuple[str, ...] = COCURVE_KINDS,
                    n_ffn_groups: int = 16) -> JointInventory:
    """The units of ``towers`` (in the data's order: vision first) as one inventory (module docstring)."""
    parts: list[TowerPart] = []
    pools, shapes = [], {}
    off = loff = 0
    for t in [t for t in TOWERS if t in towers]:
        model = tower_model(vlm, t)
        adapter = get_adapter(model)
        inv = inventory(adapter, kinds, n_ffn_groups=n_ffn_groups)
        pools += [replace(p, layer=p.layer + loff, offset=p.offset + off) for p in inv.pools]
        shapes.update({li + loff: s for li, s in inv.shapes.items()})
        parts.append(TowerPart(t, model, adapter, inv, off, loff))
        off += len(inv)
        loff += inv.n_layers
    if not parts:
        raise SecateurError(f"no tower to prune; name some of {', '.join(TOWERS)}")
    return JointInventory(parts, Inventory(pools, shapes, loff, 0))


# --- image-caption pairs and the caption-token teacher ------------------------------------------------------------

@dataclass
class CaptionData:
    """Image-caption pairs in the VLM's layout: ``ids [N, T]``, ``pixels [N, C, H, W]`` and ``target [N, T]`` (True
    on the caption's tokens and its EOS, :func:`secateur.data.captions.caption_ids`)."""

    ids: torch.Tensor
    pixels: torch.Tensor
    target: torch.Tensor

    def __post_init__(self) -> None:
        if self.ids.shape != self.target.shape or self.ids.shape[0] != self.pixels.shape[0]:
            raise SecateurError(f"{self.ids.shape[0]} captions for {self.pixels.shape[0]} images; pass one caption "
                                "per image")
        self._rows = [torch.nonzero(self.target[i, 1:]).flatten() for i in range(len(self))]
        if any(r.numel() == 0 for r in self._rows):
            raise SecateurError("a caption pair has no caption token to score; check the captions")

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def rows(self, i: int) -> torch.Tensor:
        """Positions of pair ``i`` whose logits predict a caption token (the token at ``t + 1`` is a target)."""
        return self._rows[i]

    def split(self, n_first: int) -> tuple[CaptionData, CaptionData]:
        a = CaptionData(self.ids[:n_first], self.pixels[:n_first], self.target[:n_first])
        b = CaptionData(self.ids[n_first:], self.pixels[n_first:], self.target[n_first:])
        return a, b


@torch.no_grad()
def caption_logits(vlm: nn.Module, data: CaptionData, s: int, e: int) -> torch.Tensor:
    """float32 logits ``[R, V]`` of pairs ``s .. e-1`` at their caption positions (pair-major), one VLM forward."""
    z = vlm(**vlm_inputs(vlm, data.ids[s:e], data.pixels[s:e]), use_cache=False).logits.float()
    return torch.cat([z[j, data.rows(s + j)] for j in range(e - s)])


class CaptionKL:
    """Dense VLM teacher on held-out pairs; :meth:`evaluate` is :meth:`secateur.budgets.heldout.HeldoutKL.evaluate`
    on caption tokens only: per pair the mean over its caption positions of ``KL(p_0 || p)`` (full vocabulary,
    float32 log-softmax differences, summed in float64), then the mean and SE over pairs."""

    def __init__(self, vlm: nn.Module, data: CaptionData) -> None:
        self.vlm, self.data = vlm, data
        self.logp0 = [torch.log_softmax(caption_logits(vlm, data, i, i + 1), -1) for i in range(len(data))]

    @torch.no_grad()
    def evaluate(self, model: nn.Module | None = None) -> dict:
        """``model``: another VLM to score against the dense teacher (a sliced and saved one); default the
        teacher's own VLM as it currently computes (masks)."""
        per_seq = []
        for i, lp in enumerate(self.logp0):
            lq = torch.log_softmax(caption_logits(model or self.vlm, self.data, i, i + 1), -1)
            per_seq.append(float((lp.exp() * (lp - lq)).sum(-1).to(torch.float64).sum()) / lp.shape[0])
        return {"kl": sum(per_seq) / len(per_seq), "se": standard_error(per_seq), "per_sequence": per_seq,
                "tokens": int(sum(lp.shape[0] for lp in self.logp0))}


class VLMSource:
    """:class:`secateur.scoring.cocurve_sweep.AblationSource` of a VLM: window ``i`` = caption pair ``i``, scored at
    its caption positions; a unit ablation = the whole VLM's forward with that unit's columns masked."""

    def __init__(self, vlm: nn.Module, ji: JointInventory, data: CaptionData) -> None:
        self.vlm, self.ji, self.data = vlm, ji, data

    def positions(self, i: int) -> int:
        return int(self.data.rows(i).numel())

    def dense_logits(self, s: int, e: int) -> torch.Tensor:
        return caption_logits(self.vlm, self.data, s, e)

    def ablated_logits(self, s: int, e: int, units: list[int]) -> torch.Tensor:
        out = []
        for u in units:
            removed = torch.zeros(len(self.ji), dtype=torch.bool)
            removed[u] = True
            with self.ji.masked(removed):
                out.append(caption_logits(self.vlm, self.data, s, e))
        return torch.stack(out)


# --- CoCurve over the joint inventory -------------------------------------------------------------------------------

def joint_graph(vlm: nn.Module, ji: JointInventory, data: CaptionData, cfg=None):
    """The single-unit ablation sweep over both towers -> one :class:`~secateur.scoring.cocurve_graph.CoPruningGraph`
    (checked PSD, split-half diagnostic in ``meta``). Units of the protected layers are not ablated (zero rows)
    unless ``cfg.ablate_protected``."""
    from secateur.methods.cocurve import CoCurveConfig, graph_split_half
    from secateur.scoring.cocurve_graph import CoPruningGraph
    from secateur.scoring.cocurve_sweep import source_sweep

    cfg = cfg or CoCurveConfig()
    units = None
    if not cfg.ablate_protected:
        prot = set(ji.protected(cfg.protect_first, cfg.protect_last))
        units = torch.tensor([int(li) not in prot for li in ji.inv.layer_of.tolist()], dtype=torch.bool)
    sweep = replace(cfg.sweep, positions_per_seq=None, subsample_check=None)
    t0 = time.perf_counter()
    sw = source_sweep(VLMSource(vlm, ji, data), len(data), ji.inv.layer_of, sweep, units)
    meta = {"config": cfg.to_dict(), "timings": sw.timings, "sweep_wall_s": time.perf_counter() - t0,
            "calibration": {"n": len(data), "caption_positions": sw.timings["positions_per_window"]},
            "n_positions": sw.n_positions, "support_mass": sw.support_mass, "n_units": len(ji),
            "n_ablated": int(sw.ablated.sum()), "towers": {p.name: [p.offset, p.offset + len(p.inv)]
                                                          for p in ji.parts}}
    g = CoPruningGraph.from_inventory(ji.inv, sw.H, ablated=sw.ablated, kl_single=sw.kl_single, meta=meta,
                                      halves=sw.halves)
    g.meta["lambda_min"] = g.check_psd()
    g.meta["split_half"] = graph_split_half(g, sw.half_positions)
    return g


def _pairs_sha256(data: CaptionData) -> str:
    import hashlib

    return hashlib.sha256(data.ids.numpy().tobytes() + data.pixels.float().numpy().tobytes()).hexdigest()


def reused_graph(path: str, ji: JointInventory, pairs_sha: str, cfg):
    """The graph of an earlier joint run (``cocurve_graph.npz``), checked to be this run's: the same graph pairs
    (sha256 of their ids and pixels), sweep settings and units (costs, layers); a graph over both towers also serves
    a one-tower run (``--towers joint:language``): its block of that tower's units, the same ablations and teacher,
    so the very entries a one-tower sweep computes."""
    from secateur.scoring.cocurve_graph import CoPruningGraph

    try:
        g = CoPruningGraph.load(path)
    except (OSError, ValueError, KeyError) as e:
        raise SecateurError(f"cocurve_graph {path}: not a readable graph ({e}); pass a run's cocurve_graph.npz") \
            from None
    meta = g.meta
    if (meta.get("calibration") or {}).get("sha256") != pairs_sha:
        raise SecateurError(f"cocurve_graph {path} was built on other caption pairs (another --nsamples, --seed or "
                            "--heldout); rebuild it or match them")
    keys = ("n_ffn_groups", "protect_first", "protect_last", "ablate_protected")
    was, now = meta.get("config") or {}, cfg.to_dict()
    same = ("top_r", "renormalize", "center")  # the sweep's other knobs change the summation order only
    if any(was.get(k) != now[k] for k in keys) or any((was.get("sweep") or {}).get(k) != now["sweep"][k]
                                                       for k in same):
        raise SecateurError(f"cocurve_graph {path} was built with other CoCurve settings ({', '.join(keys)}); "
                            "rebuild it or match them")
    spans = meta.get("towers") or {}
    if any(p.name not in spans for p in ji.parts):
        raise SecateurError(f"cocurve_graph {path} holds no units of the {'/'.join(p.name for p in ji.parts)} tower")
    idx = torch.cat([torch.arange(*spans[p.name]) for p in ji.parts])
    lo = {p.name: int(g.layer_of[spans[p.name][0]]) for p in ji.parts}
    layer_of = torch.cat([g.layer_of[torch.arange(*spans[p.name])] - lo[p.name] + p.layer_offset for p in ji.parts])
    if idx.numel() != len(ji) or not torch.equal(g.costs[idx], ji.inv.costs) \
            or not torch.equal(layer_of, ji.inv.layer_of):
        raise SecateurError(f"cocurve_graph {path} does not match this model's units; rebuild it")
    sub = (lambda t: None if t is None else t[idx][:, idx]) if idx.numel() != len(g) else (lambda t: t)
    vec = (lambda t: None if t is None else t[idx]) if idx.numel() != len(g) else (lambda t: t)
    halves = None if g.halves is None else (sub(g.halves[0]), sub(g.halves[1]))
    out = CoPruningGraph(H=sub(g.H), costs=ji.inv.costs.clone(), layer_of=ji.inv.layer_of.clone(),
                         is_attn=vec(g.is_attn), n_layers=ji.inv.n_layers, ablated=vec(g.ablated),
                         kl_single=vec(g.kl_single), meta={**meta, "reused_from": str(path),
                                                           "towers": {p.name: [p.offset, p.offset + len(p.inv)]
                                                                      for p in ji.parts}}, halves=halves)
    out.meta["lambda_min"] = out.check_psd()
    if idx.numel() != len(g):  # the diagnostic of the block used, not of the whole graph
        from secateur.methods.cocurve import graph_split_half

        out.meta["split_half"] = graph_split_half(out)
    return out


def select_joint(graph, ji: JointInventory, rho: float, teacher: CaptionKL | None, cfg=None,
                 diagonal: bool = False):
    """Text CoCurve's selection (:func:`secateur.methods.cocurve.select`: the lambda family and the held-out choice)
    over the joint graph, with the per-tower guard and both towers masked while a candidate is measured."""
    from secateur.methods.cocurve import CoCurveConfig, select

    cfg = cfg or CoCurveConfig()
    return select(graph, ji.inv, rho, None, teacher, cfg, diagonal,
                  guard=ji.guard(rho, cfg.protect_first, cfg.protect_last, cfg.cap_factor), masker=ji.masked)


# --- the baselines over the joint inventory -------------------------------------------------------------------------

@torch.no_grad()
def joint_scores(vlm: nn.Module, ji: JointInventory, data: CaptionData, method: str, seed: int = 0,
                 chunk_size: int = 8) -> torch.Tensor:
    """Each tower's unit scores (module docstring) concatenated in joint order, float64, higher = keep."""
    from secateur.calib.collect import SCORE_STATS, collect_stats
    from secateur.models.towers import merged_embeddings
    from secateur.scoring.structured import unit_scores

    score = BASELINES[method]
    out = []
    for k, p in enumerate(ji.parts):
        stats = None
        if score in ("wanda_sp", "flap"):
            x = data.pixels if p.name == "vision" else merged_embeddings(vlm, data.ids, data.pixels)
            stats = collect_stats(p.model, p.adapter, x, SCORE_STATS, chunk_size=chunk_size).groups
        out.append(unit_scores(p.inv, p.adapter, score, stats, seed=seed + k))
    return torch.cat(out)


def select_baseline(vlm: nn.Module, ji: JointInventory, data: CaptionData, method: str, rho: float,
                    seed: int = 0, chunk_size: int = 8, guard: Guard | None = None) -> tuple[torch.Tensor, dict]:
    """``(removed, info)``: ``score / c_u`` ascending (stable) over the joint inventory until ``rho`` of its removable
    parameters are removed, under the per-tower guard (default :meth:`JointInventory.guard`;
    :func:`~secateur.budgets.allocate.allocate_global`)."""
    scores = joint_scores(vlm, ji, data, method, seed, chunk_size)
    alloc = allocate_global(ji.inv, scores, rho, guard or ji.guard(rho), cost_normalized=True)
    return alloc.removed, {**alloc.info, "method": method, "scores": "raw per parameter across towers"}


# --- slicing and the run -------------------------------------------------------------------------------------------

def slice_joint(vlm: nn.Module, ji: JointInventory, removed: torch.Tensor) -> dict[str, str]:
    """Slice each tower's removed units out of the VLM (in place) and write its widths into the VLM's config;
    returns each tower's config route (``stock`` | ``hetero``)."""
    from secateur.structured.selection import Selection
    from secateur.structured.slicing import apply_selection
    from secateur.vlm_config import write_back

    routes = {}
    for p in ji.parts:
        r = p.take(removed)
        if bool(r.any()):
            apply_selection(p.model, p.adapter, Selection.from_removed(p.inv, r))
        routes[p.name] = write_back(vlm, p.name, p.model, per_layer=True)
    return routes


def check_feasible(ji: JointInventory, rho: float, guard: Guard) -> None:
    """Refuse a budget the guard cannot reach before the sweep (the greedy on a zero graph: only the costs, the
    protected layers and the caps decide feasibility)."""
    from secateur.budgets.greedy import conditional_greedy
    from secateur.scoring.cocurve_graph import CoPruningGraph

    zero = CoPruningGraph.from_inventory(ji.inv, torch.zeros(len(ji), len(ji), dtype=torch.float64))
    conditional_greedy(zero, rho, 0.0, guard)


def matched_ratio(budget: dict, tower: str = "language") -> float:
    """The ratio of ``tower``'s removable parameters that equals the parameters a joint run removed
    (``budget``: ``report["vlm"]["budget"]``): a ``--towers joint:<tower>`` run at this ratio removes the same count
    within one unit's cost (the budget's contract: ``[rho C, rho C + c_max)``)."""
    removed, removable = int(budget["removed_params"]), int(budget["by_tower"][tower]["removable"])
    if removed >= removable:
        raise SecateurError(f"the joint run removed {removed:,} parameters, the whole {tower} tower holds "
                            f"{removable:,}: no {tower}-only ratio matches it; compare at a lower --sparsity")
    return removed / removable


def parse_joint(spec: str) -> tuple[str, ...] | None:
    """``joint`` -> both towers; ``joint:language`` / ``joint:vision`` -> that tower alone; else None."""
    s = str(spec).strip()
    if s == "joint":
        return TOWERS
    if s.startswith("joint:") and s[6:] in TOWERS:
        return (s[6:],)
    return None


def check_joint(opts) -> None:
    """Refusals a joint run knows before anything is loaded (one line each)."""
    from secateur.data.captions import is_caption_source

    if opts.method not in METHODS:
        raise SecateurError(f"--towers joint runs {', '.join(METHODS)}; got --method {opts.method}")
    if not is_caption_source(opts.calib):
        raise SecateurError(f"--towers joint calibrates both towers on image-caption pairs; pass --calib "
                            f"fashion-mnist-captions (got {opts.calib!r})")
    o = opts.method_options
    if getattr(o, "compensation", None) not in (None, "none"):
        raise SecateurError("--towers joint has no compensation yet; drop --compensation")
    if getattr(o, "positions", None) not in (None, "all"):
        raise SecateurError("--towers joint scores every caption token; drop --positions")
    if opts.eval_ppl is not None:
        raise SecateurError("--eval-ppl measures a text model; score the saved VLM with secateur eval captions")


def prune_joint(opts, vlm: nn.Module, proc, towers: tuple[str, ...]) -> tuple[dict, dict, dict[str, bytes]]:
    """The joint run on a loaded VLM (``secateur.vlm_run.prune_tower`` calls it): pairs, selection, slicing.
    Returns ``(report, routes, files)`` (CoCurve: ``cocurve_graph.npz``, the joint graph with its costs and layers;
    ``H_sha256`` in the report); the VLM is sliced in place."""
    from secateur.data.captions import caption_pairs, caption_target

    t0 = time.perf_counter()
    rho = float(opts.sparsity)
    ids, pixels, manifest = caption_pairs(vlm, proc, opts.nsamples, opts.seed, opts.data_dir)
    data = CaptionData(ids, pixels, caption_target(proc.tokenizer, vlm.config, ids, pixels))
    n_before = sum(p.numel() for p in vlm.parameters())
    details: dict = {}
    files: dict[str, bytes] = {}
    if opts.method in COCURVE:
        from secateur.methods.cocurve import cocurve_config
        from secateur.scoring.cocurve_graph import array_sha256

        cfg, _ = cocurve_config(opts)
        if len(data) <= cfg.heldout:
            raise SecateurError(f"{opts.method} holds out the last {cfg.heldout} caption pairs for the lambda choice: "
                                f"pass --nsamples > {cfg.heldout} (the paper: 128 + 48)")
        ji = joint_inventory(vlm, towers, COCURVE_KINDS, cfg.n_ffn_groups)
        check_feasible(ji, rho, ji.guard(rho, cfg.protect_first, cfg.protect_last, cfg.cap_factor))
        graph_data, held = data.split(len(data) - cfg.heldout)
        pairs_sha = _pairs_sha256(graph_data)
        reuse = opts.method_options.cocurve_graph
        if reuse is not None:
            graph = reused_graph(reuse, ji, pairs_sha, cfg)
        else:
            graph = joint_graph(vlm, ji, graph_data, cfg)
            graph.meta["calibration"]["sha256"] = pairs_sha
        res = select_joint(graph, ji, rho, CaptionKL(vlm, held), cfg, diagonal=opts.method == "cocurve-diag")
        removed = res.removed
        details = {"lambda": res.lam, "candidates": res.candidates, "chosen": res.chosen,
                   "split_half": res.info["split_half"], "graph": {k: v for k, v in graph.meta.items()
                                                                   if k != "config"},
                   "config": cfg.to_dict(), "cross_tower_edges": cross_tower_edges(graph, ji)}
        files["cocurve_graph.npz"] = graph.to_bytes()
        details["H_sha256"] = array_sha256(graph.H)
    else:
        ji = joint_inventory(vlm, towers, BASELINE_KINDS)
        removed, info = select_baseline(vlm, ji, data, opts.method, rho, int(opts.seed or 0),
                                        opts.run.chunk_size)
        details = {"selection": {k: v for k, v in info.items() if k not in ("per_layer",)}}
    budget = ji.budget(removed, rho)
    routes = slice_joint(vlm, ji, removed)
    n_after = sum(p.numel() for p in vlm.parameters())
    wall = time.perf_counter() - t0
    rep = {"method": opts.method, "kind": "structured-joint", "target_sparsity": rho,
           "realized_sparsity": {"targeted": budget["realized"], "of_all_parameters": 1 - n_after / n_before,
                                 "pruned_weights": n_before - n_after, "targeted_weights": budget["removable"]},
           "vlm": {"model": opts.model if isinstance(opts.model, str) else None, "towers": opts.towers,
                   "joint_towers": list(towers), "model_type": vlm.config.model_type, "budget": budget,
                   "routes": routes, "params_before": n_before, "params_after": n_after,
                   "unused_vision_layers": unused_vision_layers(vlm)},
           "details": details, "calibration": dict(manifest), "timings": {"phases": {"prune": wall}},
           "removed_mask": [int(i) for i in torch.nonzero(removed).flatten()]}
    return rep, routes, files


def unused_vision_layers(vlm: nn.Module) -> list[int]:
    """The vision blocks whose output the VLM never reads: LLaVA takes the hidden state of ``vision_feature_layer``
    (default ``-2``: the last block is unused, issue 47's pitfall), so every block after it is free to remove (its
    units have zero rows in CoCurve's ``H``); a list of layers (several feature layers) reads up to the deepest."""
    layer = getattr(vlm.config, "vision_feature_layer", -1)
    n = int(vlm.config.vision_config.num_hidden_layers)
    deepest = max((x % (n + 1) for x in layer), default=n) if isinstance(layer, list | tuple) else int(layer) % (n + 1)
    return list(range(deepest, n))  # hidden_states[k] is the output of block k - 1


def cross_tower_edges(graph, ji: JointInventory) -> dict | None:
    """How much of ``H`` lies between the towers: the Frobenius norm of the vision-language block and of the
    within-tower off-diagonal blocks (measured units only)."""
    if len(ji.parts) < 2:
        return None
    v, lang = ji.part("vision"), ji.part("language")
    H = graph.H
    vs, ls = slice(v.offset, v.offset + len(v.inv)), slice(lang.offset, lang.offset + len(lang.inv))

    def off(block: torch.Tensor) -> float:
        return float((block - torch.diag(block.diagonal())).norm())

    return {"vision_language_fro": float(H[vs, ls].norm()), "vision_offdiag_fro": off(H[vs, vs]),
            "language_offdiag_fro": off(H[ls, ls]), "diag_fro": float(H.diagonal().norm())}


def budget_line(budget: dict) -> str:
    """One line: the joint budget and where it went."""
    parts = ", ".join(f"{t} {d['fraction']:.1%} ({d['removed_params']:,} of {d['removable']:,})"
                      for t, d in budget["by_tower"].items())
    return (f"secateur: budget {budget['realized']:.1%} of {budget['removable']:,} removable parameters (target "
            f"{budget['target']:.1%}): {parts}")


def save(out: str, overwrite: bool, vlm: nn.Module, proc, rep: dict, routes: dict[str, str],
         files: dict[str, bytes] | None = None) -> None:
    """The sliced VLM, its processor, the report and ``files``, atomically (one ``from_pretrained`` reloads it)."""
    from secateur.safe_write import EXPORT_MARKER, REPORT_NAME, atomic_dir

    route = "hetero" if "hetero" in routes.values() else "stock"
    with atomic_dir(out, overwrite) as tmp:
        vlm.save_pretrained(tmp)
        proc.save_pretrained(tmp)
        for name, b in (files or {}).items():
            (Path(tmp) / name).write_bytes(b)
        (Path(tmp) / REPORT_NAME).write_text(json.dumps(rep, indent=1, default=str))
        (Path(tmp) / EXPORT_MARKER).write_text(json.dumps({"route": route, "architectures": vlm.config.architectures,
                                                           "towers": list(routes), "routes": routes}))
