"""CORP Q/K: prune query/key head dimensions of a non-RoPE model and fold the logit-space compensation
into the q/k projections (CORP, seed 002, Sec. 3.3-3.4; spec ``corp.md`` Sec. 2, 4, 5).

Per block, in the calibration engine's ``attn_in`` group (the q/k input ``X``):

1. statistics: the per-sequence second moments ``A_b = Q_b^T Q_b`` and ``C_b = K_b^T K_b`` of every head,
   from the block's current q/k projections (biases included) -- :class:`secateur.calib.qk.QKOutputGrams`;
2. selection: per KV head, keep ``d_s = d_h - floor(rho d_h)`` dims (at least ``min_qk_dim``) by CORP's
   score ``sum_b diag(A_b) * diag(C_b)`` over the head's query heads (:func:`secateur.scoring.corp.corp_qk_scores`);
3. compensation: the ridge solve ``M`` of Eq. (4.2) per query head (``q_s^T M k_s`` fits the dense logit
   ``q^T k`` over the calibration tokens), folded into W_Q/b_Q (one-sided, GQA) or split between W_Q and
   W_K (balanced, MHA) -- :func:`secateur.compensate.corp_qk_layer`;
4. materialization by zeroing: the compensated rows are written into the kept positions of each head and
   the other q/k rows (and bias entries) are set to zero. A head's logit is then exactly ``q_s^T M k_s``
   with the module's original ``1/sqrt(d_h)`` scale, and the model keeps its stock class (Hugging Face
   attention needs one head width for q, k and v, so there is no physical slice). The masks mark the
   zeroed rows.

RoPE models are refused (rotary embeddings do not commute with dim pruning or mixing, corp.md [A8]);
so are q/k-norm models (the logit is not bilinear in the projections). v and o are untouched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from secateur.calib import dist, engine
from secateur.calib.qk import QKOutputGrams
from secateur.calib.stats import Accumulator
from secateur.compensate.corp import corp_qk_layer
from secateur.errors import SecateurError, check_fraction
from secateur.methods.knobs import MethodOptions
from secateur.methods.result import MethodResult
from secateur.models.adapters import Adapter
from secateur.models.blocks import RESIDENT, Blocks
from secateur.models.linear import LinearRef
from secateur.scoring.corp import corp_qk_kept


@dataclass
class CorpQKConfig:
    """rho: fraction of each head's q/k dims removed; lam: ``'auto'`` (corp.md Sec. 5 rule), ``'fixed'``
    (``lam0``) or a number; mode / fold / min_qk_dim: :func:`corp_qk_layer`'s."""

    sparsity: float = 0.25
    lam: float | Literal["auto", "fixed"] = "auto"
    lam0: float = 1e-3
    mode: Literal["exact", "pooled"] = "exact"
    fold: Literal["auto", "balanced", "one_sided"] = "auto"
    min_qk_dim: int = 8
    compensate: bool = True  # False: the kept dims sliced as they are (CORP's "w/o compensation" arm, Fig. 2)

    def validate(self) -> None:
        check_fraction(self.sparsity, unit="query/key dims")  # [0, 1): every head keeps at least one dim


def check_supported(adapter: Adapter) -> None:
    g = adapter.geometry
    if g.rope:
        raise SecateurError("CORP Q/K compensation is defined only for non-RoPE models (OPT, GPT-2); this model "
                            "uses rotary embeddings (corp.md [A8]); use --method corp for its MLP channels")
    if g.qk_norm:
        raise SecateurError("CORP Q/K needs logits bilinear in the q/k projections; this model normalizes q/k")


class CorpQKHandler(engine.Handler):
    """``slice_heads``: materialize by slicing (q/k keep ``d_s`` rows per head in a
    :class:`~secateur.models.hetero.NarrowQKAttention`; vision encoders) instead of zeroing (masks)."""

    resumable = True

    def __init__(self, cfg: CorpQKConfig, slice_heads: bool = False) -> None:
        self.cfg = cfg
        self.slice_heads = slice_heads
        self.resumable = not slice_heads  # a narrowed block's weights do not load into the dense model
        self.masks: dict[str, torch.Tensor] = {}
        self.layers: list[dict] = []
        self.owners = dist.Owners("corp_qk")  # the per-head ridge solves over several processes: round-robin owners

    def accumulators(self, ctx, group, names) -> dict[str, Accumulator]:
        if group != "attn_in":
            return {}
        g = ctx.adapter.geometry
        refs = ctx.adapter.role_refs(ctx.layer)
        return {"corp_qk": QKOutputGrams(refs["q"], refs["k"], g.n_heads, g.n_kv_heads, g.head_dim)}

    def on_group(self, ctx, group, names, accs) -> None:
        if group != "attn_in":
            return
        acc: QKOutputGrams = accs["corp_qk"]
        g = ctx.adapter.geometry
        q, k = acc.q, acc.k
        # solve on the CPU, where the statistics are (the block may be visiting a GPU)
        wq, wk = q.weight.detach().double().cpu(), k.weight.detach().double().cpu()
        bq = None if q.bias is None else q.bias.detach().double().cpu()
        bk = None if k.bias is None else k.bias.detach().double().cpu()
        kept = corp_qk_kept(acc.qa, acc.ka, g.n_heads, g.n_kv_heads, self.cfg.sparsity, self.cfg.min_qk_dim)
        res = corp_qk_layer(wq, bq, wk, bk, acc.qa, acc.ka, kept, n_heads=g.n_heads, n_kv_heads=g.n_kv_heads,
                            lam=self.cfg.lam, lam0=self.cfg.lam0, mode=self.cfg.mode, fold=self.cfg.fold,
                            map_heads=self.owners.map)
        d_h, ds = g.head_dim, res.kept.shape[1]
        gs = g.n_heads // g.n_kv_heads
        if not self.cfg.compensate:
            res = _uncompensated(res, wq, bq, wk, bk, d_h, gs)
        if self.slice_heads:
            self._narrow(ctx, res, ds)
            self._record(ctx, res, d_h, ds)
            return
        new = {"q": (torch.zeros_like(wq), None if bq is None else torch.zeros_like(bq), g.n_heads),
               "k": (torch.zeros_like(wk), None if bk is None else torch.zeros_like(bk), g.n_kv_heads)}
        outs = {"q": (res.w_q, res.b_q), "k": (res.w_k, res.b_k)}
        for role, (w_new, b_new, n) in new.items():
            w_c, b_c = outs[role]
            pruned = torch.ones(w_new.shape[0], dtype=torch.bool)
            for h in range(n):
                kept = res.kept[h // gs if role == "q" else h]
                rows = h * d_h + kept  # row j of the reduced head goes to kept dim j: q and k stay aligned
                w_new[rows] = w_c[h * ds:(h + 1) * ds]
                pruned[rows] = False
                if b_new is not None:
                    b_new[rows] = b_c[h * ds:(h + 1) * ds] if b_c is not None else 0.0
            ref = q if role == "q" else k
            ref.set_weight(w_new)
            if b_new is not None:
                with torch.no_grad():
                    ref.bias.copy_(b_new.to(ref.bias.dtype))
            self._store(ctx, ref, pruned[:, None].expand(-1, w_new.shape[1]).clone())
        self._record(ctx, res, d_h, ds)

    def _record(self, ctx, res, d_h: int, ds: int) -> None:
        d = res.diagnostics
        self.layers.append({"layer": ctx.index, "d_h": d_h, "d_s": ds, "fold": d["fold"],
                            "logit_rel_before": d["logit_rel_before"], "logit_rel_after": d["logit_rel_after"],
                            "sv_clamped": d["sv_clamped"]})

    def _narrow(self, ctx, res, ds: int) -> None:
        """The compensated ``[H d_s, d]`` q/k rows (head ``h``'s block: its kept dims in kept order, so q and k stay
        aligned) into a layer whose attention keeps ``d_s`` dims per head (K11: q/k out ``H d_s``, v/o unchanged)."""
        from secateur.models import hetero

        g, fam = ctx.adapter.geometry, ctx.adapter.family
        if ds == g.head_dim:
            return  # nothing removed (d_h - floor(rho d_h) = d_h, or min_qk_dim): the stock attention stays
        if g.n_kv_heads != g.n_heads:
            raise SecateurError("CORP Q/K slicing needs one key head per query head (MHA)")
        attn = hetero.narrow_qk(fam, ctx.layer, ds, g.head_dim)
        for name, w, b in ((ctx.adapter.layout.q, res.w_q, res.b_q), (ctx.adapter.layout.k, res.w_k, res.b_k)):
            mod = getattr(attn, name)
            with torch.no_grad():
                mod.weight.copy_(w.to(mod.weight.dtype))
                if mod.bias is not None:
                    mod.bias.copy_(b.to(mod.bias.dtype) if b is not None else torch.zeros_like(mod.bias))

    def block_state(self, ctx) -> dict:
        from secateur.methods.unstructured import block_masks

        return {"masks": block_masks(self.masks, ctx), "layers": [r for r in self.layers if r["layer"] == ctx.index]}

    def load_block_state(self, index, state) -> None:
        self.masks.update(state["masks"])
        self.layers += state["layers"]

    def _store(self, ctx, ref: LinearRef, mask: torch.Tensor) -> None:
        """``mask`` ([out, in] of ``ref``) under its module's full name; fused q/k/v slices share one mask."""
        name = next(n for n, r in ctx.refs.items() if r.module is ref.module)
        key = f"{ctx.adapter.base_prefix}.{ctx.index}.{name}"
        if ref.rows is None:
            self.masks[key] = mask
            return
        full = self.masks.get(key)
        if full is None:
            full = torch.zeros(ctx.refs[name].weight.shape, dtype=torch.bool)
        full[ref.rows] = mask
        self.masks[key] = full


def prune_corp_qk(model: nn.Module, adapter: Adapter, calib_ids: torch.Tensor, cfg: CorpQKConfig,
                  mode: str = "sequential", chunk_size: int = 8, device=None, progress: bool = True,
                  blocks: Blocks = RESIDENT, slice_heads: bool = False) -> dict:
    """Prune q/k dims and fold CORP's compensation in place; returns ``{"masks", "timings", "details"}``
    (``slice_heads``: the narrowed q/k sliced out, no masks; see :class:`CorpQKHandler`)."""
    cfg.validate()
    check_supported(adapter)
    if calib_ids is None:
        raise SecateurError("CORP Q/K needs calibration data")
    h = CorpQKHandler(cfg, slice_heads)
    rep = engine.run(model, adapter, calib_ids, h, mode=mode, chunk_size=chunk_size, device=device,
                     progress=progress, blocks=blocks)
    n = len(h.layers)
    details = {"method": "corp-qk", "sparsity": cfg.sparsity, "lam": cfg.lam, "mode": cfg.mode, "layers": h.layers,
               "d_s": sorted({r["d_s"] for r in h.layers}),
               "logit_rel_before_mean": sum(r["logit_rel_before"] for r in h.layers) / max(n, 1),
               "logit_rel_after_mean": sum(r["logit_rel_after"] for r in h.layers) / max(n, 1)}
    return {"masks": h.masks, "timings": rep.timings, "details": details}


def _uncompensated(res, wq, bq, wk, bk, d_h: int, gs: int):
    """``res`` with its q/k rows replaced by the dense rows of the kept dims (M = 0: the logit is ``q_S^T k_S``,
    CORP's pruning without compensation, spec K8); the selection and the diagnostics stay."""
    import dataclasses

    def rows(w, n, group):
        if w is None:
            return None
        return torch.cat([w[h * d_h + res.kept[h // group]] for h in range(n)])

    n_heads, n_kv = wq.shape[0] // d_h, wk.shape[0] // d_h
    return dataclasses.replace(res, w_q=rows(wq, n_heads, gs), b_q=rows(bq, n_heads, gs), w_k=rows(wk, n_kv, 1),
                               b_k=rows(bk, n_kv, 1))


# --- the registered method (--method corp-qk) ----------------------------------------------------------------

@dataclass
class CorpQKOptions(MethodOptions):
    """CORP Q/K takes no knob beyond ``--sparsity`` (its ridge and fold follow corp.md Sec. 5)."""


def corp_qk_config(opts) -> CorpQKConfig:
    """The validated :class:`CorpQKConfig` from ``PruneOptions``."""
    cfg = CorpQKConfig(sparsity=opts.sparsity)
    cfg.validate()
    return cfg


def run(model: nn.Module, adapter: Adapter, calib_ids: torch.Tensor, opts, blocks: Blocks = RESIDENT) -> MethodResult:
    """Registry runner: prune q/k dims in place, return the masks of the zeroed rows (``blocks``: in memory only,
    ``--stream`` is refused for this method before anything is loaded)."""
    blocks.resident_only("--method corp-qk")
    res = prune_corp_qk(model, adapter, calib_ids, corp_qk_config(opts), mode=opts.run.mode,
                        chunk_size=opts.run.chunk_size, device=opts.device, progress=not opts.run.quiet,
                        blocks=blocks)
    return MethodResult(masks=res["masks"], timings=res["timings"], details=res["details"])
