"""Cost-normalized conditional greedy under the shared removable-parameter budget, and its lambda family.

Greedy (cocurve.md §5, the paper's Algorithm 3; exact form reconstructed [R]):

    Delta_lambda(u | S) = 1/2 H_uu + lambda g_u(S),   g_u(S) = sum_{v in S} H_uv
    repeat until sum_{v in S} c_v >= rho C:
        E  = { u not in S : layer(u) not protected, removed_cost[layer(u)] + c_u <= kappa C_layer(u) }
        u* = argmin_{u in E} Delta_lambda(u | S) / c_u        (ties: smallest unit index)
        S += {u*};  g += H[:, u*];  removed_cost[layer(u*)] += c_u*

Maintaining ``g`` makes each step O(M) (the paper: "maintaining g_u^(S) makes each step O(M)"). The
stopping rule, the cap test and the tolerance are those of
:func:`secateur.budgets.allocate.allocate_global` (removed cost in ``[rho C, rho C + c_max)``), so with
``lambda = 0`` the greedy is exactly the shared solver run on ``1/2 H_uu`` (invariant V2). An infeasible
budget raises :class:`SecateurError`; guards are never relaxed.

Fixed split (the paper's "edges, fixed split" arm, its Table 29: "holding the diagonal selector's attention/FFN
allocation fixed, edge-conditioned reordering"): ``quota = (n_attn, n_ffn)``, the numbers of attention and FFN
units the diagonal (lambda = 0) greedy removes; a unit is eligible only while its kind is below its quota, and only
if both quotas can still be met after it under the per-layer caps (otherwise edges that fill the layers with FFN
groups first can strand an attention unit with no layer left to take it; the look-ahead is exact:
:meth:`_Problem.quota_feasible`, a max-plus DP over the layers of the most FFN units that fit beside ``n``
attention units, checked in key order until the first unit that passes). The greedy stops when both quotas are met
instead of at ``rho C``: the same counts, so with the per-kind uniform unit costs of every supported family the
same removed cost as the diagonal. With ``lambda = 0`` the quota greedy is the diagonal greedy itself (each
diagonal pick leaves the diagonal's own remaining picks feasible, so it passes the look-ahead, and no quota binds
before it is met).

Lambda family (the paper's Proposition 7: "varying lambda produces a finite family of distinct removal sets").
Given the removal set ``S_k`` after ``k`` steps, the eligible set does not depend on lambda and every key is
affine in it, ``key_v(lambda) = a_v + lambda b_v`` with ``a_v = 1/2 H_vv / c_v`` and ``b_v = g_v(S_k) / c_v``. The
choice ``u`` of step ``k`` stays the choice exactly while ``a_u + lambda b_u <= a_v + lambda b_v`` for every other
eligible ``v``, i.e. for

    lambda (b_u - b_v) <= a_v - a_u        (a half-line for b_u != b_v, no constraint for b_u == b_v)

so the lambdas that reproduce a whole greedy trajectory form one interval ``[L, R]``, the intersection of these
half-lines over the steps (computed beside the greedy at O(M) per step). :func:`breakpoint_path` walks
``[0, 1]`` piece by piece: run the greedy at ``lambda`` (the first at 0), take its interval's right end ``R`` (a
breakpoint: some step's argmin changes there), continue at ``R + min_step``. Every piece is one trajectory, so
the distinct masks of the pieces are every distinct greedy mask for ``lambda`` in ``[0, 1]`` (up to pieces
narrower than ``min_step = 1e-9``, below what float64 keys resolve, and masks that exist only at a breakpoint's
exact tie). Each mask keeps its pieces (intervals) and their total length ``measure``; the held-out split then
measures them (:mod:`secateur.budgets.heldout`). When the family is larger than ``max_candidates``, the lambda = 0
mask and the masks of widest measure are kept (the most stable pieces of the path; ties: smaller lambda).

Grid family (cocurve.md §6 [A4], the earlier default, ``family='grid'``): the greedy for every lambda of the grid
``{0, 0.02, 0.05, 0.10, ..., 1.0}``, identical masks merged; ``bisect_depth > 0`` bisects between neighbouring
lambdas whose masks differ.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from secateur.budgets.allocate import Guard
from secateur.errors import SecateurError, check_fraction
from secateur.scoring.cocurve_graph import CoPruningGraph

_EPS = 1e-9  # the shared solver's relative tolerance (allocate.allocate_global)

DEFAULT_LAMBDAS: tuple[float, ...] = (0.0, 0.02) + tuple(round(0.05 * k, 2) for k in range(1, 21))
FAMILIES = ("breakpoints", "grid")
MIN_STEP = 1e-9  # the breakpoint walk's step past a breakpoint (narrower pieces are not resolved)


@dataclass
class GreedyResult:
    removed: torch.Tensor  # [M] bool
    order: list[int]  # units in the order they were removed
    deltas: list[float]  # Delta_lambda(u* | S) at each step (sum = R_lambda(S), telescoping)
    g: torch.Tensor  # final incremental edge sums g_u(S) = sum_{v in S} H_uv, [M] float64
    lam: float
    target: float
    removed_cost: int
    total_cost: int
    interval: tuple[float, float] | None = None  # the lambdas that give this same trajectory (breakpoint walk)

    @property
    def realized(self) -> float:
        return self.removed_cost / self.total_cost if self.total_cost else 0.0


@dataclass
class _Problem:
    """What the greedy reads of a graph, budget and guard (computed once for every lambda of a family)."""

    H: np.ndarray
    costs: np.ndarray
    cf: np.ndarray
    total: int
    target: float
    rho: float
    layer_of: np.ndarray
    n_layers: int
    allowed: np.ndarray
    limit: np.ndarray
    is_attn: np.ndarray
    half_diag: np.ndarray
    layer_units: list[tuple[int, np.ndarray, np.ndarray]] = field(default_factory=list)  # (layer, attn, FFN)
    uniform: dict | None = None  # per eligible layer: one attention and one FFN unit cost (the fast quota check)
    feasible: dict = field(default_factory=dict)  # quota checks by state (the walk's runs share their prefixes)

    @classmethod
    def build(cls, graph: CoPruningGraph, rho: float, guard: Guard | None) -> _Problem:
        # closed: rho = 1 (every removable unit) is a well-defined budget here; runs are held to [0, 1) upstream
        check_fraction(rho, closed=True, unit="parameters")
        H = graph.H.to(torch.float64).numpy()
        costs = graph.costs.to(torch.long).numpy()
        if bool((costs <= 0).any()):
            raise SecateurError("every unit needs a positive cost")
        total = int(costs.sum())
        layer_of = graph.layer_of.to(torch.long).numpy()
        n_layers = graph.n_layers
        layer_cost = np.bincount(layer_of, weights=costs, minlength=n_layers).astype(np.int64)
        prot = guard.protected(n_layers) if guard else set()
        allowed = ~np.isin(layer_of, np.array(sorted(prot), dtype=np.int64))
        cap = guard.cap if guard and guard.cap is not None else None
        # the shared solver's cap test: rem + c > cap C_l + eps C_l -> skip (allocate.allocate_global)
        limit = cap * layer_cost + _EPS * layer_cost if cap is not None else np.full(n_layers, np.inf)
        is_attn = graph.is_attn.to(torch.bool).numpy()
        layer_units = [(li, np.flatnonzero((layer_of == li) & allowed & is_attn),
                        np.flatnonzero((layer_of == li) & allowed & ~is_attn)) for li in range(n_layers)]
        layer_units = [x for x in layer_units if x[1].size or x[2].size]
        uniform = None
        if all(np.unique(costs[ua]).size <= 1 and np.unique(costs[uf]).size <= 1 for _, ua, uf in layer_units):
            uniform = {"layers": np.array([li for li, _, _ in layer_units], dtype=np.int64),
                       "ca": np.array([costs[ua[0]] if ua.size else 1 for _, ua, _ in layer_units], dtype=np.float64),
                       "cf": np.array([costs[uf[0]] if uf.size else 1 for _, _, uf in layer_units], dtype=np.float64),
                       "na": np.array([ua.size for _, ua, _ in layer_units]),
                       "nf": np.array([uf.size for _, _, uf in layer_units])}
        return cls(H, costs, costs.astype(np.float64), total, rho * total, rho, layer_of, n_layers, allowed, limit,
                   is_attn, 0.5 * H.diagonal(), layer_units, uniform)

    def _fits(self, removed: np.ndarray, rem_layer: np.ndarray, need_attn: int) -> np.ndarray:
        """``y[l, x]``: the most FFN units layer ``l`` still takes beside ``x`` more attention units (``-inf``
        where ``x`` attention units do not fit), for ``x = 0..need_attn`` (capped by the layer's units)."""
        if self.uniform is not None:
            u = self.uniform
            li = u["layers"]
            avail_a = u["na"] - np.bincount(self.layer_of[removed & self.is_attn], minlength=self.n_layers)[li]
            avail_f = u["nf"] - np.bincount(self.layer_of[removed & ~self.is_attn], minlength=self.n_layers)[li]
            X = np.arange(min(need_attn, int(avail_a.max(initial=0))) + 1)
            left = (self.limit[li] - rem_layer[li])[:, None] - X[None, :] * u["ca"][:, None]  # capacity after x
            cf = u["cf"][:, None]
            y = np.floor(left / cf)
            y -= y * cf > left  # exact integer fit: (y) cf <= left < (y + 1) cf despite the division's rounding
            y += (y + 1) * cf <= left
            y = np.minimum(y, avail_f[:, None])
            return np.where((X[None, :] <= avail_a[:, None]) & (left >= 0), y, -np.inf)
        rows = []
        for li, ua, uf in self.layer_units:  # any costs: the cheapest units of each kind fit best
            cap = self.limit[li] - rem_layer[li]
            ca = np.concatenate(([0], np.cumsum(np.sort(self.costs[ua[~removed[ua]]]))))[:need_attn + 1]
            cf = np.concatenate(([0], np.cumsum(np.sort(self.costs[uf[~removed[uf]]]))))
            y = np.full(need_attn + 1, -np.inf)
            ok = ca <= cap
            y[:ca.size][ok] = np.searchsorted(cf, cap - ca[ok], side="right") - 1
            rows.append(y)
        return np.array(rows).reshape(len(rows), need_attn + 1)

    def quota_feasible(self, removed: np.ndarray, rem_layer: np.ndarray, need_attn: int, need_ffn: int) -> bool:
        """Whether ``need_attn`` more attention and ``need_ffn`` more FFN units can still be removed under the
        per-layer caps (exact: a max-plus DP over the layers of the most FFN units beside ``n`` attention units)."""
        if need_attn <= 0 and need_ffn <= 0:
            return True
        y = self._fits(removed, rem_layer, need_attn)
        K = y.shape[1]
        if need_attn == 0:
            return bool(y[:, 0].sum() >= need_ffn)
        n = np.arange(need_attn + 1)
        idx = n[None, :] - np.arange(K)[:, None] + K - 1  # pad[idx[x, n]] = best[n - x]
        best = np.full(need_attn + 1, -np.inf)
        best[0] = 0.0
        for row in y:
            pad = np.concatenate((np.full(K - 1, -np.inf), best))
            best = (pad[idx] + row[:, None]).max(0)
        return bool(best[need_attn] >= need_ffn)


def _run(p: _Problem, lam: float, quota: tuple[int, int] | None = None, interval: bool = False) -> GreedyResult:
    """The greedy of the module docstring on a prepared problem; ``interval``: also the lambdas reproducing it."""
    M = p.H.shape[0]
    g = np.zeros(M)
    removed = np.zeros(M, dtype=bool)
    rem_layer = np.zeros(p.n_layers, dtype=np.int64)
    order: list[int] = []
    deltas: list[float] = []
    done = 0
    n_kind = [0, 0]  # removed FFN, attention units (indexed by is_attn)
    lo, hi = -np.inf, np.inf
    a = p.half_diag / p.cf if interval else None

    def more() -> bool:
        if quota is None:
            return done < p.target - _EPS * p.total
        return n_kind[1] < quota[0] or n_kind[0] < quota[1]

    while more():
        elig = p.allowed & ~removed & ((rem_layer[p.layer_of] + p.costs) <= p.limit[p.layer_of])
        if quota is not None:
            elig &= np.where(p.is_attn, n_kind[1] < quota[0], n_kind[0] < quota[1])
            elig = _feasible_first(p, lam, g, elig, removed, rem_layer, quota, n_kind)
        if not elig.any():
            if quota is not None:
                raise SecateurError(
                    f"the fixed split ({quota[0]} attention + {quota[1]} FFN units, the diagonal's) cannot be reached "
                    f"under the guards with lambda {lam:g}: {n_kind[1]} + {n_kind[0]} removed when no unit of a kind "
                    "still short of its count remains eligible (per-layer cap)")
            raise SecateurError(
                f"budget {p.rho:.4f} is infeasible under the guards: at most {done / p.total:.4f} of the removable "
                "parameters can be removed (protected layers / per-layer cap)")
        delta = p.half_diag + lam * g
        key = np.where(elig, delta / p.cf, np.inf)
        u = int(np.argmin(key))  # first minimum: smallest unit index on ties
        if interval:
            lo, hi = _step_interval(a, g / p.cf, elig, u, lo, hi)
        order.append(u)
        deltas.append(float(delta[u]))
        removed[u] = True
        g += p.H[:, u]
        rem_layer[p.layer_of[u]] += p.costs[u]
        done += int(p.costs[u])
        n_kind[int(p.is_attn[u])] += 1
    return GreedyResult(torch.from_numpy(removed), order, deltas, torch.from_numpy(g), float(lam), p.target, done,
                        p.total, (float(lo), float(hi)) if interval else None)


def _feasible_first(p: _Problem, lam: float, g: np.ndarray, elig: np.ndarray, removed: np.ndarray,
                    rem_layer: np.ndarray, quota: tuple[int, int], n_kind: list[int]) -> np.ndarray:
    """The fixed split's eligible set with the units that would make the quotas unreachable dropped, in key order
    until the argmin is a unit after which both quotas can still be met (so the greedy never strands a kind)."""
    elig = elig.copy()
    key = np.where(elig, (p.half_diag + lam * g) / p.cf, np.inf)
    for u in np.argsort(key, kind="stable"):
        if not elig[u]:
            break
        li = p.layer_of[u]
        rem_layer[li] += p.costs[u]
        removed[u] = True
        state = (quota, np.packbits(removed).tobytes())  # the state fixes the counts and the layers' removed costs
        ok = p.feasible.get(state)
        if ok is None:
            a = int(p.is_attn[u])
            ok = p.feasible[state] = p.quota_feasible(removed, rem_layer, quota[0] - n_kind[1] - a,
                                                      quota[1] - n_kind[0] - (1 - a))
        removed[u] = False
        rem_layer[li] -= p.costs[u]
        if ok:
            break
        elig[u] = False
    return elig


def _step_interval(a: np.ndarray, b: np.ndarray, elig: np.ndarray, u: int, lo: float, hi: float
                   ) -> tuple[float, float]:
    """Intersect ``[lo, hi]`` with the lambdas for which ``u`` is this step's argmin: ``lambda (b_u - b_v) <=
    a_v - a_u`` for every other eligible ``v``."""
    others = elig.copy()
    others[u] = False
    du = a[others] - a[u]
    db = b[u] - b[others]
    up, down = db > 0, db < 0
    if up.any():
        hi = min(hi, float((du[up] / db[up]).min()))
    if down.any():
        lo = max(lo, float((du[down] / db[down]).max()))
    return lo, hi


def conditional_greedy(graph: CoPruningGraph, rho: float, lam: float, guard: Guard | None = None,
                       quota: tuple[int, int] | None = None) -> GreedyResult:
    """Run the conditional greedy on ``graph`` for budget ``rho`` and edge weight ``lam`` (see module);
    ``quota = (n_attn, n_ffn)``: the fixed-split arm (removes exactly these numbers of units of each kind)."""
    return _run(_Problem.build(graph, rho, guard), lam, quota)


def kind_counts(graph: CoPruningGraph, removed: torch.Tensor) -> tuple[int, int]:
    """``(attention units, FFN units)`` of a removal mask: the fixed split's quota from the diagonal's mask."""
    a = int((removed & graph.is_attn).sum())
    return a, int(removed.sum()) - a


@dataclass
class Candidate:
    removed: torch.Tensor  # [M] bool
    lambdas: list[float] = field(default_factory=list)  # every evaluated lambda that produced this mask
    realized: float = 0.0
    intervals: list[tuple[float, float]] = field(default_factory=list)  # breakpoint walk: its pieces of [0, 1]

    @property
    def lam(self) -> float:
        """The smallest lambda producing this mask (the held-out tie-break prefers it)."""
        return min(self.lambdas)

    @property
    def measure(self) -> float:
        """Total length of the lambda pieces producing this mask (breakpoint family)."""
        return float(sum(b - a for a, b in self.intervals))


def _merge(results: list[GreedyResult], pieces: list[tuple[float, float]] | None = None) -> list[Candidate]:
    """Distinct masks of ``results`` (ordered by their smallest lambda), each with the lambdas (and pieces)."""
    out: list[Candidate] = []
    index: dict[bytes, Candidate] = {}
    for i in sorted(range(len(results)), key=lambda j: results[j].lam):
        r = results[i]
        key = r.removed.numpy().tobytes()
        if key not in index:
            index[key] = Candidate(r.removed, [], r.realized)
            out.append(index[key])
        index[key].lambdas.append(r.lam)
        if pieces is not None:
            index[key].intervals.append(pieces[i])
    return out


def lambda_path(graph: CoPruningGraph, rho: float, guard: Guard | None = None,
                lambdas: tuple[float, ...] | list[float] = DEFAULT_LAMBDAS, bisect_depth: int = 0,
                quota: tuple[int, int] | None = None) -> list[Candidate]:
    """Distinct greedy masks over the lambda grid (ordered by their smallest lambda); see module docstring.

    The ``lambda = 0`` (diagonal) mask is always a candidate (invariant V8)."""
    grid = sorted(set(float(x) for x in lambdas) | {0.0})
    if grid[0] < 0 or grid[-1] > 1:
        raise SecateurError("lambdas must lie in [0, 1]")
    prob = _Problem.build(graph, rho, guard)
    results: dict[float, GreedyResult] = {lam: _run(prob, lam, quota) for lam in grid}

    def bisect(a: float, b: float, depth: int) -> None:
        if depth <= 0 or torch.equal(results[a].removed, results[b].removed):
            return
        mid = 0.5 * (a + b)
        results[mid] = _run(prob, mid, quota)
        bisect(a, mid, depth - 1)
        bisect(mid, b, depth - 1)

    for a, b in zip(grid[:-1], grid[1:]):
        bisect(a, b, bisect_depth)
    return _merge([results[lam] for lam in sorted(results)])


def breakpoint_path(graph: CoPruningGraph, rho: float, guard: Guard | None = None,
                    quota: tuple[int, int] | None = None, max_candidates: int | None = None,
                    min_step: float = MIN_STEP, max_pieces: int = 100_000) -> tuple[list[Candidate], dict]:
    """Every distinct greedy mask for lambda in ``[0, 1]`` by the breakpoint walk of the module docstring ->
    ``(candidates ordered by their smallest lambda, info)``; ``max_candidates`` keeps the lambda = 0 mask and the
    widest-measure others (``None`` or 0: all). ``info``: the breakpoints, the numbers of pieces and masks."""
    prob = _Problem.build(graph, rho, guard)
    results: list[GreedyResult] = []
    pieces: list[tuple[float, float]] = []
    lam, start = 0.0, 0.0
    while True:
        r = _run(prob, lam, quota, interval=True)
        right = min(max(r.interval[1], lam), 1.0)
        results.append(r)
        pieces.append((start, right))
        if right >= 1.0:
            break
        if len(results) >= max_pieces:
            raise SecateurError(f"the lambda path has more than {max_pieces} pieces; use the grid family")
        start = right
        lam = min(right + min_step, 1.0)
    fam = _merge(results, pieces)
    n_all = len(fam)
    if max_candidates and n_all > max_candidates:
        keep = sorted(range(1, n_all), key=lambda i: (-fam[i].measure, fam[i].lam))[:max_candidates - 1]
        fam = [fam[0]] + [fam[i] for i in sorted(keep)]
    info = {"family": "breakpoints", "pieces": len(pieces), "breakpoints": [b for _, b in pieces[:-1]],
            "distinct_masks": n_all, "evaluated": len(fam), "capped": len(fam) < n_all,
            "max_candidates": max_candidates or None, "min_step": min_step}
    return fam, info
