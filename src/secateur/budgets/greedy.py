"""Cost-normalized conditional greedy under the shared removable-parameter budget, and the lambda path.

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

Lambda path (cocurve.md §6 [A4]): the greedy for every lambda of the grid ``{0, 0.02, 0.05, 0.10, ...,
1.0}``, identical masks merged (each distinct mask keeps the lambdas that produced it, so its smallest
lambda and the breakpoints between grid values are known); ``bisect_depth > 0`` bisects between
neighbouring lambdas whose masks differ to find more breakpoints (the spec's exact mode uses depth 6).
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

    @property
    def realized(self) -> float:
        return self.removed_cost / self.total_cost if self.total_cost else 0.0


def conditional_greedy(graph: CoPruningGraph, rho: float, lam: float, guard: Guard | None = None) -> GreedyResult:
    """Run the conditional greedy on ``graph`` for budget ``rho`` and edge weight ``lam`` (see module)."""
    # closed: rho = 1 (every removable unit) is a well-defined budget here; runs are held to [0, 1) upstream
    check_fraction(rho, closed=True, unit="parameters")
    H = graph.H.to(torch.float64).numpy()
    M = H.shape[0]
    costs = graph.costs.to(torch.long).numpy()
    if bool((costs <= 0).any()):
        raise SecateurError("every unit needs a positive cost")
    cf = costs.astype(np.float64)
    total = int(costs.sum())
    target = rho * total
    layer_of = graph.layer_of.to(torch.long).numpy()
    n_layers = graph.n_layers
    layer_cost = np.bincount(layer_of, weights=costs, minlength=n_layers).astype(np.int64)
    prot = guard.protected(n_layers) if guard else set()
    allowed = ~np.isin(layer_of, np.array(sorted(prot), dtype=np.int64))
    cap = guard.cap if guard and guard.cap is not None else None
    # the shared solver's cap test: rem + c > cap C_l + eps C_l -> skip (allocate.allocate_global)
    limit = cap * layer_cost + _EPS * layer_cost if cap is not None else np.full(n_layers, np.inf)
    half_diag = 0.5 * H.diagonal()
    g = np.zeros(M)
    removed = np.zeros(M, dtype=bool)
    rem_layer = np.zeros(n_layers, dtype=np.int64)
    order: list[int] = []
    deltas: list[float] = []
    done = 0
    while done < target - _EPS * total:
        elig = allowed & ~removed & ((rem_layer[layer_of] + costs) <= limit[layer_of])
        if not elig.any():
            raise SecateurError(
                f"budget {rho:.4f} is infeasible under the guards: at most {done / total:.4f} of the removable "
                "parameters can be removed (protected layers / per-layer cap)")
        delta = half_diag + lam * g
        key = np.where(elig, delta / cf, np.inf)
        u = int(np.argmin(key))  # first minimum: smallest unit index on ties
        order.append(u)
        deltas.append(float(delta[u]))
        removed[u] = True
        g += H[:, u]
        rem_layer[layer_of[u]] += costs[u]
        done += int(costs[u])
    removed, g = torch.from_numpy(removed), torch.from_numpy(g)
    return GreedyResult(removed, order, deltas, g, float(lam), target, done, total)


@dataclass
class Candidate:
    removed: torch.Tensor  # [M] bool
    lambdas: list[float] = field(default_factory=list)  # every evaluated lambda that produced this mask
    realized: float = 0.0

    @property
    def lam(self) -> float:
        """The smallest lambda producing this mask (the held-out tie-break prefers it)."""
        return min(self.lambdas)


def lambda_path(graph: CoPruningGraph, rho: float, guard: Guard | None = None,
                lambdas: tuple[float, ...] | list[float] = DEFAULT_LAMBDAS, bisect_depth: int = 0
                ) -> list[Candidate]:
    """Distinct greedy masks over the lambda grid (ordered by their smallest lambda); see module docstring.

    The ``lambda = 0`` (diagonal) mask is always a candidate (invariant V8)."""
    grid = sorted(set(float(x) for x in lambdas) | {0.0})
    if grid[0] < 0 or grid[-1] > 1:
        raise SecateurError("lambdas must lie in [0, 1]")
    results: dict[float, GreedyResult] = {lam: conditional_greedy(graph, rho, lam, guard) for lam in grid}

    def bisect(a: float, b: float, depth: int) -> None:
        if depth <= 0 or torch.equal(results[a].removed, results[b].removed):
            return
        mid = 0.5 * (a + b)
        results[mid] = conditional_greedy(graph, rho, mid, guard)
        bisect(a, mid, depth - 1)
        bisect(mid, b, depth - 1)

    for a, b in zip(grid[:-1], grid[1:]):
        bisect(a, b, bisect_depth)
    out: list[Candidate] = []
    index: dict[bytes, Candidate] = {}
    for lam in sorted(results):
        r = results[lam]
        key = r.removed.numpy().tobytes()
        if key not in index:
            index[key] = Candidate(r.removed, [], r.realized)
            out.append(index[key])
        index[key].lambdas.append(lam)
    return out
