"""CoCurve's split-half diagnostic (issue 45 §1, §3): the graph from the even windows against the graph from the
odd ones. The statistic is 1 on a graph built twice from the same data and falls with injected noise; the sweep's
halves are the graphs of each half's windows bit for bit; a run says in one line when its edges are not to be
trusted, and records the statistics in its report."""

from __future__ import annotations

import pytest
import torch

from secateur import api
from secateur.methods.cocurve import CoCurveConfig, build_graph, cocurve_inventory, select, split_half_note
from secateur.models.adapters import get_adapter
from secateur.scoring.cocurve_graph import (
    EDGE_AGREEMENT_MIN,
    CoPruningGraph,
    mask_edge_agreement,
    spearman,
    split_half_agreement,
)
from secateur.scoring.cocurve_sweep import SweepConfig, ablation_sweep
from secateur.testing import random_ids, tiny_model, tiny_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

CFG = SweepConfig(top_r=32, unit_batch=8)  # every position (the default)


def _gram(n_rows: int, M: int, seed: int, rank: int = 12) -> torch.Tensor:
    """A PSD Gram with structure: units load on a few shared directions (signed, correlated edges)."""
    g = torch.Generator().manual_seed(seed)
    load = torch.randn(rank, M, generator=g, dtype=torch.float64) * torch.rand(M, generator=g, dtype=torch.float64)
    X = torch.randn(n_rows, rank, generator=g, dtype=torch.float64) @ load
    return X.T @ X / n_rows


def test_identical_halves_agree_exactly():
    """Windows [x0, x0, x1, x1]: the even and the odd windows are the same data, so the two halves are one graph."""
    model = tiny_model("llama", layers=4)
    a = get_adapter(model)
    inv = cocurve_inventory(a, n_ffn_groups=4)
    x = random_ids(2, 16, seed=3)
    ids = torch.stack([x[0], x[0], x[1], x[1]])
    g = build_graph(model, a, ids, CoCurveConfig(sweep=CFG, n_ffn_groups=4, ablate_protected=True), inv)
    h0, h1 = g.halves
    assert torch.equal(h0, h1) and h0.abs().sum() > 0
    sh = g.meta["split_half"]
    assert sh["available"] and sh["units"] == len(inv) and sh["positions"] == [32, 32]
    assert sh["diag_spearman"] == pytest.approx(1.0, abs=1e-12)
    assert sh["edge_pearson"] == pytest.approx(1.0, abs=1e-12) and sh["edges_trusted"]
    removed = torch.zeros(len(inv), dtype=torch.bool)
    removed[::3] = True
    at = mask_edge_agreement(h0, h1, g.H, removed)
    assert at["edge_sum_pearson"] == pytest.approx(1.0, abs=1e-12)
    assert at["edge_ratio"]["half0"] == at["edge_ratio"]["half1"]


def test_halves_are_the_graphs_of_the_even_and_odd_windows():
    """H^(0) of a sweep over 5 windows is, bit for bit, the H of a sweep over windows 0, 2, 4 (and H^(1) of 1, 3),
    with one window per block and with blocks of two (then a block's windows add one Gram each)."""
    model = tiny_model("qwen2", layers=4)
    a = get_adapter(model)
    inv = cocurve_inventory(a, n_ffn_groups=4)
    ids = random_ids(5, 16, seed=4)
    for spb in (1, 2):
        cfg = SweepConfig(top_r=32, unit_batch=8, seqs_per_block=spb)
        sw = ablation_sweep(model, a, inv, ids, cfg)
        assert sw.half_positions == (48, 32)
        even = ablation_sweep(model, a, inv, ids[0::2], SweepConfig(top_r=32, unit_batch=8))
        odd = ablation_sweep(model, a, inv, ids[1::2], SweepConfig(top_r=32, unit_batch=8))
        if spb == 1:
            assert torch.equal(sw.halves[0], even.H) and torch.equal(sw.halves[1], odd.H)
        else:  # a block's Gram is over all its rows at once, its halves one Gram per window: GEMM rounding
            torch.testing.assert_close(sw.halves[0], even.H, rtol=1e-10, atol=1e-14)
            torch.testing.assert_close(sw.halves[1], odd.H, rtol=1e-10, atol=1e-14)
    one = ablation_sweep(model, a, inv, ids[:1], CFG)
    assert one.halves is None  # a single window has no halves


def test_subsample_halves_are_the_halves_of_a_subsampled_sweep():
    """``subsample_check=4`` on an every-position sweep gives the halves of a 4-position sweep over the same windows
    (one block per window and blocks of two): the same features at those positions, so equal up to the rounding of
    the float32 LM head over 16 rows instead of 4 (relative ~1e-7 on the logits; float64 after that), the tolerance
    below. H itself is untouched by the diagnostic (bit for bit)."""
    model = tiny_model("llama", layers=4)
    a = get_adapter(model)
    inv = cocurve_inventory(a, n_ffn_groups=4)
    ids = random_ids(5, 16, seed=5)
    ref = ablation_sweep(model, a, inv, ids, SweepConfig(top_r=32, unit_batch=8, positions_per_seq=4))
    for spb in (1, 2):
        base = SweepConfig(top_r=32, unit_batch=8, seqs_per_block=spb)
        plain = ablation_sweep(model, a, inv, ids, base)
        sw = ablation_sweep(model, a, inv, ids, SweepConfig(**{**base.to_dict(), "subsample_check": 4}))
        assert torch.equal(sw.H, plain.H) and sw.sub_positions == 4 and plain.sub_halves is None
        for k in range(2):
            torch.testing.assert_close(sw.sub_halves[k], ref.halves[k], rtol=1e-5, atol=1e-9)
    g = build_graph(model, a, ids, CoCurveConfig(sweep=SweepConfig(top_r=32, subsample_check=4), n_ffn_groups=4,
                                                 ablate_protected=True), inv)
    sub = g.meta["split_half_subsample"]
    assert sub["positions_per_window"] == 4 and sub["units"] > 0 and -1 <= sub["edge_pearson"] <= 1


def test_agreement_falls_with_injected_noise():
    M = 60
    base = _gram(4000, M, seed=0)
    noise = _gram(4000, M, seed=1, rank=M)  # PSD, unrelated to the base's structure
    levels = [0.0, 0.05, 0.2, 1.0, 5.0]
    stats = [split_half_agreement(base, base + s * noise * base.diagonal().mean() / noise.diagonal().mean())
             for s in levels]
    edges = [st["edge_pearson"] for st in stats]
    assert edges[0] == pytest.approx(1.0, abs=1e-12) and stats[0]["diag_spearman"] == pytest.approx(1.0)
    assert all(a > b for a, b in zip(edges[:-1], edges[1:])), edges
    assert edges[-1] < EDGE_AGREEMENT_MIN <= edges[1]
    assert [st["edges_trusted"] for st in stats] == [e >= EDGE_AGREEMENT_MIN for e in edges]
    diag = [st["diag_spearman"] for st in stats]
    assert diag[-1] < diag[0]
    # at a removal set: the per-unit edge sums of the halves agree less and less
    removed = torch.zeros(M, dtype=torch.bool)
    removed[::2] = True
    at = [mask_edge_agreement(base, base + s * noise, base, removed)["edge_sum_pearson"] for s in (0.0, 0.5, 5.0)]
    assert at[0] == pytest.approx(1.0, abs=1e-12) and at[0] > at[1] > at[2]


def test_spearman_is_the_pearson_of_average_ranks():
    import numpy as np

    assert spearman(np.array([1.0, 2.0, 3.0, 4.0]), np.array([10.0, 20.0, 25.0, 100.0])) == pytest.approx(1.0)
    assert spearman(np.array([1.0, 2.0, 3.0]), np.array([3.0, 2.0, 1.0])) == pytest.approx(-1.0)
    # ties: ranks (1.5, 1.5, 3) against (1, 2, 3)
    assert spearman(np.array([5.0, 5.0, 7.0]), np.array([1.0, 2.0, 3.0])) == pytest.approx(np.sqrt(3) / 2)


def test_note_line_when_the_edges_disagree():
    info = {"lambda": 0.25, "split_half": {"available": True, "edge_pearson": 0.18, "edges_trusted": False,
                                           "threshold": EDGE_AGREEMENT_MIN,
                                           "at_chosen_mask": {"edge_sum_pearson": 0.31}}}
    note = split_half_note(info)
    assert note is not None and "\n" not in note
    assert "Pearson 0.18 < 0.5" in note and "not to be trusted" in note and "0.31" in note
    info["split_half"].update(edge_pearson=0.8, edges_trusted=True)
    assert split_half_note(info) is None
    assert split_half_note({"lambda": 0.0, "split_half": {"available": False}}) is None


def test_select_and_the_saved_graph_carry_the_diagnostic(tmp_path):
    model = tiny_model("gpt2", layers=16)
    a = get_adapter(model)
    inv = cocurve_inventory(a, 16)
    cfg = CoCurveConfig(sweep=SweepConfig(top_r=32, unit_batch=16), n_ffn_groups=16, max_candidates=4)
    g = build_graph(model, a, random_ids(2, 24, seed=1), cfg, inv)
    res = select(g, inv, 0.3, cfg=cfg, diagonal=True)
    sh = res.info["split_half"]
    assert sh["available"] and set(sh["at_chosen_mask"]) == {"units", "edge_sum_pearson", "edge_ratio"}
    assert sh["at_chosen_mask"]["units"] == int(res.removed.sum())
    g.save(tmp_path / "g.npz")
    back = CoPruningGraph.load(tmp_path / "g.npz")
    assert torch.equal(back.halves[0], g.halves[0]) and torch.equal(back.halves[1], g.halves[1])


def test_run_prints_one_note_and_reports_the_agreement(tmp_path, capsys):
    """--method cocurve on a tiny Llama whose two graph windows disagree on the edges (random weights, 32
    positions): one 'secateur: note:' line on stderr, the statistics and the note in the report's details, and every
    candidate's per-sequence held-out KLs with their paired statistics."""
    path = tmp_path / "m"
    tiny_model("llama", layers=16, vocab=128).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    calib = tmp_path / "calib.txt"
    calib.write_text("The quick brown fox jumps over the lazy dog, again and again. " * 60)
    rep = api.prune(model=str(path), method="cocurve", sparsity=0.3, calib=str(calib), nsamples=5, seqlen=16,
                    heldout=3, positions="all", top_r=16, n_ffn_groups=16, cocurve_max_candidates=3)
    d = rep.report["details"]
    assert d["graph"]["n_positions"] == 2 * 16 and d["config"]["sweep"]["positions_per_seq"] is None
    sh = d["split_half"]
    assert sh["available"] and not sh["edges_trusted"] and sh["edge_pearson"] < EDGE_AGREEMENT_MIN
    assert d["split_half_note"] == split_half_note(d["selection_info"])
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("secateur: note: CoCurve")]
    assert notes == [f"secateur: note: {d['split_half_note']}"]
    assert d["selection_info"]["lambda_family"]["family"] == "breakpoints"
    assert d["selection_info"]["choice"]["rule"] == "paired" and len(d["candidates"]) <= 3
    for c in d["candidates"]:
        assert len(c["heldout_per_sequence"]) == 3 and all(isinstance(v, float) for v in c["heldout_per_sequence"])
        assert {"paired_diff", "paired_se", "beats_diagonal"} <= set(c)
    assert "memory_plan" in d["graph"] and d["graph"]["memory_plan"]["features"]["bytes"] > 0
