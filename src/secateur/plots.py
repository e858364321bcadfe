"""Plots for reports (matplotlib, Agg canvas; no global backend or pyplot state is touched).

* :func:`plot_qk_removal` -- per-block percentages of W_Q (solid) and W_K (dashed) weights removed,
  the layout of QK-Wanda's Fig. 3 / Figs. 4-6, with the requested sparsity as a dotted line.
* :func:`plot_block_errors` -- a per-block metric (e.g. relative QK error, Eq. 49) for several methods.
* :func:`plot_ppl_vs_sparsity` -- perplexity against target sparsity, one line per method (``secateur report``).
* :func:`plot_tower_budget` -- where one budget over a VLM's two towers went: per layer, % removed, a panel per tower.

Inputs are plain dicts so results read back from JSON plot the same way. matplotlib is an optional
dependency (extra ``plots``); importing this module without it raises ImportError.
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure


def _removal_series(alloc: Mapping) -> tuple[list[int], list[float], list[float]]:
    """``(blocks, % Q removed, % K removed)`` from an allocation (``{"per_block": [...]}``) or a list of
    per-block records with ``block``, ``rho_q``, ``rho_k``."""
    rows = alloc["per_block"] if isinstance(alloc, Mapping) else alloc
    rows = sorted(rows, key=lambda r: r["block"])
    return ([r["block"] for r in rows], [100 * r["rho_q"] for r in rows], [100 * r["rho_k"] for r in rows])


def _overall_removal(alloc: Mapping | Sequence[Mapping]) -> float | None:
    """``100 * qk_removed / qk_total`` when the allocation has both as finite numbers (a report read back may
    carry either as null), else None: no line."""
    if not isinstance(alloc, Mapping):
        return None
    removed, total = alloc.get("qk_removed"), alloc.get("qk_total")
    if not all(isinstance(x, int | float) and not isinstance(x, bool) for x in (removed, total)) or not total:
        return None
    share = 100 * removed / total
    return share if math.isfinite(share) else None


def _save(fig: Figure, path: str | Path | None) -> bytes:
    buf = io.BytesIO()
    FigureCanvasAgg(fig)
    fig.savefig(buf, format="png", dpi=130)
    data = buf.getvalue()
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_bytes(data)
    return data


def plot_qk_removal(series: Mapping[str, Mapping | Sequence[Mapping]], path: str | Path | None = None,
                    title: str = "", target: float | None = None) -> bytes:
    """Fig. 3: one colour per series (label -> allocation), solid = % of W_Q removed, dashed = % of W_K
    removed, x = transformer block; a dotted line per series at its overall Q+K removal (from
    ``qk_removed / qk_total`` when the allocation has them), or one grey line at ``target`` (a fraction).
    Returns the PNG bytes (also written to ``path``)."""
    fig = Figure(figsize=(7.5, 4.4))
    ax = fig.add_subplot(1, 1, 1)
    colors = ["C0", "C1", "C2", "C3", "C4", "C5", "C6", "C7"]
    for n, (label, alloc) in enumerate(series.items()):
        blocks, q, k = _removal_series(alloc)
        c = colors[n % len(colors)]
        ax.plot(blocks, q, color=c, ls="-", marker="o", ms=3, lw=1.4, label=f"{label}: W_Q")
        ax.plot(blocks, k, color=c, ls="--", marker="s", ms=3, lw=1.4, label=f"{label}: W_K")
        overall = _overall_removal(alloc) if target is None else None
        if overall is not None:
            ax.axhline(overall, color=c, ls=":", lw=1.0)
    if target is not None:
        ax.axhline(100 * target, color="0.4", ls=":", lw=1.0, label=f"{100 * target:.0f}% overall")
    ax.set_xlabel("transformer block")
    ax.set_ylabel("weights removed (%)")
    ax.set_title(title or "Q/K removal per block (dotted: overall Q+K removal)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.16), frameon=False)
    fig.tight_layout()
    return _save(fig, path)


def qk_removal_png(series: Mapping[str, Mapping], title: str = "") -> bytes:
    """PNG bytes of :func:`plot_qk_removal` (for ``MethodResult.extra_files``)."""
    return plot_qk_removal(series, None, title)


def plot_block_errors(series: Mapping[str, Sequence[float]], path: str | Path | None = None, title: str = "",
                      ylabel: str = "relative QK error (%)", log: bool = True) -> bytes:
    """One line per method of a per-block metric (index = block). Returns the PNG bytes."""
    fig = Figure(figsize=(7.0, 3.6))
    ax = fig.add_subplot(1, 1, 1)
    for label, values in series.items():
        ax.plot(range(len(values)), list(values), marker="o", ms=3, lw=1.4, label=label)
    if log and all(v > 0 for vals in series.values() for v in vals):
        ax.set_yscale("log")
    ax.set_xlabel("transformer block")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    return _save(fig, path)


def plot_ppl_vs_sparsity(series: dict[str, list[tuple[float, float]]], dense: float | None = None,
                         title: str = "") -> bytes:
    """Perplexity (log scale when it spans > 5x) against target sparsity (%), one line per method;
    ``dense`` draws the unpruned model as a dotted line. Returns the PNG bytes."""
    fig = Figure(figsize=(7.0, 3.8))
    ax = fig.add_subplot(1, 1, 1)
    ys = [y for pts in series.values() for _, y in pts] + ([dense] if dense else [])
    for label, pts in series.items():
        pts = sorted(pts)
        ax.plot([100 * x for x, _ in pts], [y for _, y in pts], marker="o", ms=4, lw=1.4, label=label)
    if dense:
        ax.axhline(dense, color="0.4", ls=":", lw=1.0, label=f"dense {dense:.3f}")
    if ys and min(ys) > 0 and max(ys) / min(ys) > 5:
        ax.set_yscale("log")
    ax.set_xlabel("target sparsity (%)")
    ax.set_ylabel("perplexity")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    return _save(fig, None)


def plot_tower_budget(series: Mapping[str, Sequence[Mapping]], path: str | Path | None = None, title: str = ""
                      ) -> bytes:
    """Where a ``--towers joint`` budget went (``secateur.vlm_joint``): one panel per tower (vision, language), x =
    the tower's layer, y = % of the layer's removable parameters removed, one line per series (label -> a run's
    ``budget["per_layer"]`` records with ``tower``, ``layer``, ``fraction``). Returns the PNG bytes."""
    towers = [t for t in ("vision", "language") if any(r["tower"] == t for rows in series.values() for r in rows)]
    fig = Figure(figsize=(9.0, 3.6))
    axes = [fig.add_subplot(1, len(towers), k + 1) for k in range(len(towers))]
    for ax, tower in zip(axes, towers, strict=True):
        for label, rows in series.items():
            pts = sorted((r["layer"], 100 * r["fraction"]) for r in rows if r["tower"] == tower)
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", ms=3, lw=1.4, label=label)
        ax.set_xlabel(f"{tower} layer")
        ax.grid(alpha=0.3)
    top = max((100 * r["fraction"] for rows in series.values() for r in rows), default=0.0)
    for ax in axes:  # one scale for both towers: a tower left whole shows as zeros, not as a zoomed flat line
        ax.set_ylim(0, max(1.0, 1.08 * top))
    axes[0].set_ylabel("% of the layer's removable params removed", fontsize=8)
    axes[0].legend(fontsize=7, loc="best")
    fig.suptitle(title, fontsize=10, y=0.99)
    fig.tight_layout()
    return _save(fig, path)
