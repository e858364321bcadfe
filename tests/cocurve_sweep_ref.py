"""Frozen reference of CoCurve's ablation sweep as of commit 7c3384c (the test oracle of issue 18 §1).

A single-process copy of ``secateur.scoring.cocurve_sweep.ablation_sweep`` before the cheaper sweep: the same
floating-point operations in the same order, so ``reference_sweep(...)`` returns the ``H`` / single-unit KLs the
library computed then. It uses only the adapter's staged API and the engine's block walker (shared
infrastructure, pinned separately by the H digests of ``bench/checks/digests.py`` in
``results/reliability/digests.txt``); the feature math and the loop are copied here so that a change of the
library's sweep cannot change its oracle.
Do not "improve" this file: ``tests/test_cocurve_sweep_exact.py`` asserts the library's H equals it bit for bit,
and ``bench/speed/cocurve_sweep_cost.py`` times it as the "before" path.
"""

from __future__ import annotations

import time

import torch

from secateur.calib import engine
from secateur.scoring.cocurve_sweep import SweepConfig
from secateur.structured.units import ATTN_KINDS, MLP_KINDS


def sample_positions(seqlen: int, per_seq: int) -> torch.Tensor:
    if per_seq >= seqlen:
        return torch.arange(seqlen)
    s = seqlen // per_seq
    return torch.arange(1, per_seq + 1) * s - 1


def teacher_support(logits: torch.Tensor, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    logp = torch.log_softmax(logits.float(), dim=-1)
    r = min(r, logp.shape[-1])
    idx = torch.sort(logp, dim=-1, descending=True, stable=True).indices[..., :r]
    return idx, logp.gather(-1, idx).to(torch.float64).exp()


def fisher_features(dz, p, renormalize=True, center="fisher"):
    dz = dz.to(torch.float64)
    p = p.to(torch.float64)
    if renormalize:
        p = p / p.sum(-1, keepdim=True)
    if center == "fisher":
        dz = dz - (p * dz).sum(-1, keepdim=True)
    return p.sqrt() * dz


def unit_specs(inv, units=None) -> list[tuple[int, int, bool, torch.Tensor]]:
    """(inventory index, layer, is attention, owned columns of o_proj / down_proj)."""
    out = []
    m = inv.head_dim
    for p in inv.pools:
        for u in range(p.n):
            i = p.offset + u
            if units is not None and not bool(units[i]):
                continue
            mem = p.unit_members(u)
            if p.kind in ATTN_KINDS:
                out.append((i, p.layer, True, (mem[:, None] * m + torch.arange(m)).reshape(-1)))
            elif p.kind in MLP_KINDS:
                out.append((i, p.layer, False, mem.clone()))
    return out


class _Walker:
    def __init__(self, model, a, kw, pos):
        self.a, self.kw, self.pos, self.head = a, kw, pos, model.get_output_embeddings()

    def dense_inputs(self, ids):
        walk = engine.Walk(self.a, ids, ids.shape[0], store=None, kwargs=self.kw)
        hs = list(walk.hs)
        for visit in walk.blocks():
            hs.append(visit.output(0))
        return hs

    def logits(self, h):
        return self.head(self.a.final_hidden(h[:, self.pos])).float()

    def layer_parts(self, li, h_in):
        a, layer = self.a, self.a.layers[li]
        refs = a.role_refs(layer)
        att = a.attn_core(layer, a.attn_norm(layer, h_in), a.layer_kwargs(li, self.kw))
        o_out = a.out_module(layer, "attn_out")(att)
        h_mid = a.attn_residual(layer, h_in, o_out)
        mlp_act = a.mlp_core(layer, a.mlp_norm(layer, h_mid))
        return {"att": att, "h_in": h_in, "o_out": o_out, "h_mid": h_mid, "mlp_act": mlp_act,
                "mlp_out": a.out_module(layer, "mlp_out")(mlp_act),
                "w_o": refs["o"].weight, "w_down": refs["down"].weight, "layer": layer}

    def mlp(self, layer, h):
        a = self.a
        return a.out_module(layer, "mlp_out")(a.mlp_core(layer, a.mlp_norm(layer, h)))

    def ablated_output(self, parts, h_next, attn, cols):
        a, layer = self.a, parts["layer"]
        if attn:
            y = parts["att"][..., cols] @ parts["w_o"][:, cols].T
            if a.plain_residual:
                return h_next - y + (self.mlp(layer, parts["h_mid"] - y) - parts["mlp_out"])
            h_mid = a.attn_residual(layer, parts["h_in"], parts["o_out"] - y)
            return a.mlp_residual(layer, h_mid, self.mlp(layer, h_mid))
        y = parts["mlp_act"][..., cols] @ parts["w_down"][:, cols].T
        if a.plain_residual:
            return h_next - y
        return a.mlp_residual(layer, parts["h_mid"], parts["mlp_out"] - y)


class _Teacher:
    def __init__(self, z0, top_r):
        self.shape = z0.shape
        self.logp0 = torch.log_softmax(z0.double(), dim=-1)
        self.idx, self.p_sup = teacher_support(z0, top_r)
        self.z0_sup = z0.gather(-1, self.idx)

    def response(self, z, cfg):
        dz = self.z0_sup - z.gather(-1, self.idx)
        f = fisher_features(dz, self.p_sup, cfg.renormalize, cfg.center)
        logq = torch.log_softmax(z.double(), dim=-1)
        return f, (self.logp0.exp() * (self.logp0 - logq)).sum()


def _block(walker, specs, by_layer, col_of, M, x, cfg, clock):
    t0 = time.perf_counter()
    hs = walker.dense_inputs(x)
    teacher = _Teacher(walker.logits(hs[-1]), cfg.top_r)
    t1 = time.perf_counter()
    phi = torch.zeros(teacher.idx.numel(), len(specs), dtype=torch.float64)
    kl = torch.zeros(M, dtype=torch.float64)
    for li in sorted(by_layer):
        parts = walker.layer_parts(li, hs[li])
        todo = by_layer[li]
        for c in range(0, len(todo), cfg.unit_batch):
            group = todo[c:c + cfg.unit_batch]
            h = torch.cat([walker.ablated_output(parts, hs[li + 1], sp[2], sp[3]) for sp in group])
            h = engine.run_blocks(walker.a, h, walker.kw, li + 1)
            z = walker.logits(h).view(len(group), *teacher.shape)
            for k, sp in enumerate(group):
                f, kl[sp[0]] = teacher.response(z[k], cfg)
                phi[:, col_of[sp[0]]] = f.reshape(-1)
    clock["dense"] += t1 - t0
    clock["abl"] += time.perf_counter() - t1
    clock["n_abl"] += len(specs)
    g = phi.T @ phi
    full = torch.zeros(M, M, dtype=torch.float64)
    sel = torch.tensor([sp[0] for sp in specs])
    full[sel[:, None], sel[None, :]] = g
    return full, kl, teacher.p_sup.sum(-1).to(torch.float64).sum().reshape(1)


def reference_sweep(model, adapter, inv, ids: torch.Tensor, cfg: SweepConfig, units: torch.Tensor | None = None,
                    clock: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(H, kl_single)`` of the old sweep (one process), ``H`` symmetrized and divided by ``P`` as it was.

    ``clock`` (optional) receives the seconds of the dense passes (``dense``), of the ablations (``abl``: the
    layer intermediates, re-runs, logits and features, as the library's ``ablations_s`` counts them) and the
    number of ablations (``n_abl``)."""
    clock = clock if clock is not None else {}
    for k in ("dense", "abl", "n_abl"):
        clock.setdefault(k, 0)
    specs = unit_specs(inv, units)
    M = len(inv)
    by_layer: dict[int, list] = {}
    for s in specs:
        by_layer.setdefault(s[1], []).append(s)
    col_of = {s[0]: j for j, s in enumerate(specs)}
    N, T = ids.shape
    pos = sample_positions(T, cfg.positions_per_seq).to(adapter.device)
    _, kw = adapter.capture_inputs(ids[:1])
    walker = _Walker(model, adapter, kw, pos)
    H, kl_sum = torch.zeros(M, M, dtype=torch.float64), torch.zeros(M, dtype=torch.float64)
    with torch.no_grad():
        for s in range(0, N, cfg.seqs_per_block):
            g, kl, _ = _block(walker, specs, by_layer, col_of, M, ids[s:s + cfg.seqs_per_block].to(adapter.device),
                              cfg, clock)
            H += g.clone()
            kl_sum += kl.clone()
    n_pos = N * pos.numel()
    H = H / n_pos
    return 0.5 * (H + H.T), kl_sum / n_pos
