"""Issue 47: one budget and one CoCurve graph over both towers of a VLM (``secateur prune --towers joint``).

Invariants on the tiny random LLaVA of :mod:`secateur.testing` (4 layers per tower for the function-level tests,
with the guard relaxed to one protected layer at each end of each tower and a per-layer cap of ``3 rho`` so that a
budget is feasible; 14 layers for the CLI, whose guard is CoCurve's two-and-two with cap ``1.5 rho``):

* the joint inventory is the two towers' blocks and nothing else (its cost is counted independently from the
  parameters; slicing leaves the projector, embeddings, stem and heads bit-identical);
* one budget: ``rho C <= removed < rho C + c_max`` over the joint inventory, for CoCurve and every baseline;
* CoCurve's ``H`` has a nonzero vision-language block, and its entries are the Fisher inner products of the two
  towers' ablations measured through the whole VLM on caption tokens (brute force); CoCurve-diag's mask is the
  lambda = 0 mask of the same graph;
* a joint-sliced VLM reloads with one ``from_pretrained`` and gives the masked VLM's logits;
* results do not depend on the thread count; the per-tower options split the budget as asked; a joint run's
  removed parameters convert into a language-only ratio that removes the same count within one unit;
* bad inputs: one line, exit 2, nothing written.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from secateur.data.captions import NAMES, TEMPLATES, caption_ids, caption_target
from secateur.methods.cocurve import CoCurveConfig
from secateur.scoring.cocurve_sweep import SweepConfig, fisher_features, teacher_support
from secateur.testing import save_tiny_vlm, tiny_vlm, tiny_vlm_processor
from secateur.vlm_joint import (
    BASELINE_KINDS,
    CaptionData,
    CaptionKL,
    caption_logits,
    joint_graph,
    joint_inventory,
    matched_ratio,
    select_baseline,
    select_joint,
    slice_joint,
)

pytestmark = pytest.mark.usefixtures("one_thread")

RHO = 0.3
CFG = CoCurveConfig(heldout=4, protect_first=1, protect_last=1, cap_factor=3.0, sweep=SweepConfig(top_r=32))


def _data(vlm, n: int = 10, seed: int = 0) -> CaptionData:
    proc = tiny_vlm_processor()
    caps = [TEMPLATES[i % len(TEMPLATES)].format(NAMES[(3 * i + seed) % 10]) for i in range(n)]
    ids, target = caption_ids(proc.tokenizer, vlm.config, caps)
    assert torch.equal(target, caption_target(proc.tokenizer, vlm.config, ids))
    g = torch.Generator().manual_seed(seed)
    return CaptionData(ids, torch.randn(n, 3, 28, 28, generator=g), target)


def _run(threads: int | None = None, pairs: int = 10, cfg: CoCurveConfig = CFG):
    n = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        vlm = tiny_vlm(layers=4)
        data = _data(vlm, pairs)
        ji = joint_inventory(vlm, n_ffn_groups=cfg.n_ffn_groups)
        graph_data, held = data.split(len(data) - cfg.heldout)
        graph = joint_graph(vlm, ji, graph_data, cfg)
        sel = select_joint(graph, ji, RHO, CaptionKL(vlm, held), cfg)
    finally:
        torch.set_num_threads(n)
    return vlm, data, ji, graph_data, graph, sel


@pytest.fixture(scope="module")
def run():
    return _run()


def _guard(ji):
    return ji.guard(RHO, CFG.protect_first, CFG.protect_last, CFG.cap_factor)


def test_joint_inventory_is_both_towers_blocks_and_nothing_else(run):
    vlm, data, ji, *_ = run
    assert [p.name for p in ji.parts] == ["vision", "language"]
    v_layers = vlm.model.vision_tower.encoder.layers
    l_layers = vlm.model.language_model.layers
    assert all(a is b for a, b in zip(ji.part("vision").adapter.layers, v_layers, strict=True))
    assert all(a is b for a, b in zip(ji.part("language").adapter.layers, l_layers, strict=True))
    assert ji.inv.layer_of.tolist() == sorted(ji.inv.layer_of.tolist())  # vision layers 0..3, language 4..7
    assert set(ji.inv.layer_of.tolist()) == set(range(8))
    # the removable parameters counted from the blocks' parameters: every projection weight and input bias, not the
    # norms and not the output projections' biases (they stay), nothing outside the blocks
    skip = ("norm", "out_proj.bias", "o_proj.bias", "fc2.bias", "down_proj.bias")
    want = sum(p.numel() for layers in (v_layers, l_layers) for name, p in layers.named_parameters()
               if not any(s in name for s in skip))
    assert ji.inv.total_cost == want
    # slicing any mask leaves everything outside the two towers' blocks bit-identical
    sliced = copy.deepcopy(vlm)
    sji = joint_inventory(sliced)
    removed = torch.zeros(len(sji), dtype=torch.bool)
    removed[1::3] = True
    slice_joint(sliced, sji, removed)
    before, after = vlm.state_dict(), sliced.state_dict()
    assert before.keys() == after.keys()
    outside = [k for k in before if ".layers." not in k]
    assert any("multi_modal_projector" in k for k in outside) and any("embed_tokens" in k for k in outside)
    assert all(torch.equal(before[k], after[k]) for k in outside)
    assert any(before[k].shape != after[k].shape for k in before if "language_model.layers" in k)
    assert any(before[k].shape != after[k].shape for k in before if "vision_tower" in k and ".layers." in k)


def test_one_budget_met_within_one_unit(run):
    vlm, data, ji, _, graph, sel = run
    masks = {"cocurve": (ji, sel.removed)}
    bji = joint_inventory(vlm, kinds=BASELINE_KINDS)
    for m in ("wanda-sp", "flap", "magnitude-sp", "random"):
        masks[m] = (bji, select_baseline(vlm, bji, data, m, RHO, guard=_guard(bji))[0])
    for m, (inv, removed) in masks.items():
        b = inv.budget(removed, RHO)
        assert RHO * b["removable"] <= b["removed_params"] < RHO * b["removable"] + b["max_unit_cost"], m
        assert sum(t["removed_params"] for t in b["by_tower"].values()) == b["removed_params"]
        assert sum(t["removable"] for t in b["by_tower"].values()) == b["removable"]
        for t, d in b["by_tower"].items():  # the per-layer records add up to the tower's
            assert sum(r["removed_params"] for r in b["per_layer"] if r["tower"] == t) == d["removed_params"]
        prot = set(inv.protected(CFG.protect_first, CFG.protect_last))
        assert not any(int(li) in prot for li in inv.inv.layer_of[removed].tolist()), m
    assert bji.inv.total_cost == ji.inv.total_cost  # FFN groups or channels: the same removable parameters


def test_one_graph_spans_both_towers(run):
    """The vision-language block of H is nonzero, and H's entries are the Fisher inner products of single-unit
    ablations through the whole VLM on caption tokens (cocurve.md §3), computed here the slow way."""
    vlm, data, ji, graph_data, graph, sel = run
    v, lang = ji.part("vision"), ji.part("language")
    a = graph.ablated
    va = torch.nonzero(a[:len(v.inv)]).flatten()
    la = torch.nonzero(a[len(v.inv):]).flatten() + lang.offset
    assert va.numel() and la.numel()
    cross = graph.H[va][:, la]
    scale = float(graph.H.diagonal().max())
    assert float(cross.abs().max()) > 1e-6 * scale
    u, w = int(va[torch.argmax(graph.H.diagonal()[va])]), int(la[torch.argmax(graph.H.diagonal()[la])])
    num = {(u, u): 0.0, (u, w): 0.0, (w, w): 0.0}
    n_pos = 0
    for i in range(len(graph_data)):
        z0 = caption_logits(vlm, graph_data, i, i + 1)
        idx, p = teacher_support(z0, CFG.sweep.top_r)
        phi = {}
        for k in (u, w):
            removed = torch.zeros(len(ji), dtype=torch.bool)
            removed[k] = True
            with ji.masked(removed):
                zk = caption_logits(vlm, graph_data, i, i + 1)
            phi[k] = fisher_features(z0.gather(-1, idx) - zk.gather(-1, idx), p)
        for x, y in num:
            num[(x, y)] += float((phi[x] * phi[y]).sum())
        n_pos += z0.shape[0]
    for (x, y), val in num.items():
        assert float(graph.H[x, y]) == pytest.approx(val / n_pos, rel=1e-6, abs=1e-12 * scale)
    # CoCurve-diag: the lambda = 0 mask of the same graph (the first of CoCurve's family)
    from secateur.methods.cocurve import candidate_family

    diag = select_joint(graph, ji, RHO, None, CFG, diagonal=True)
    cands, _ = candidate_family(graph, RHO, CFG, False, _guard(ji))
    assert diag.lam == 0.0 and cands[0].lam == 0.0 and torch.equal(cands[0].removed, diag.removed)
    if sel.chosen == 0:
        assert torch.equal(sel.removed, diag.removed)


def test_sliced_vlm_reloads_with_the_masked_logits(run, tmp_path):
    """float32: the masked and the sliced VLM drop exactly the same terms (a removed unit's output column is zero in
    one, absent in the other); only the summation order of the shortened dot products differs, each product of at
    most 64 terms through 8 layers: a few units in the last place of logits of magnitude ~1, so atol 1e-5 x the
    largest logit is loose by two orders of magnitude. The reload itself is bit-exact."""
    from transformers import AutoModelForImageTextToText

    vlm, data, ji, _, graph, sel = run
    ids, px = data.ids[:3], data.pixels[:3]
    with torch.no_grad(), ji.masked(sel.removed):
        z_mask = vlm(input_ids=ids, pixel_values=px).logits
    sliced = copy.deepcopy(vlm)
    routes = slice_joint(sliced, joint_inventory(sliced), sel.removed)
    assert routes == {"vision": "hetero", "language": "hetero"}  # CoCurve's per-layer widths
    assert sum(p.numel() for p in sliced.parameters()) < sum(p.numel() for p in vlm.parameters())
    sliced.save_pretrained(tmp_path / "s")
    back = AutoModelForImageTextToText.from_pretrained(tmp_path / "s").eval()
    with torch.no_grad():
        z_back, z_mem = back(input_ids=ids, pixel_values=px).logits, sliced(input_ids=ids, pixel_values=px).logits
    assert torch.equal(z_back, z_mem)
    torch.testing.assert_close(z_back, z_mask, rtol=0, atol=1e-5 * float(z_mask.abs().max()))


def test_results_do_not_depend_on_threads():
    """1 and 2 threads: the same mask. ``H`` agrees to ~1e-15 relative, not bit for bit: a float32 GEMM's rows can
    round differently with the number of threads (MKL; :mod:`secateur.scoring.cocurve_sweep`), so the chosen
    lambda (a breakpoint of H's entries) may move in its last bits while the mask it gives does not. Small run (4
    pairs, 2 FFN groups per layer): two threads on this shared machine cost ten times one."""
    cfg = replace(CFG, heldout=2, n_ffn_groups=2)
    _, _, _, _, g1, s1 = _run(threads=1, pairs=4, cfg=cfg)
    _, _, _, _, g2, s2 = _run(threads=2, pairs=4, cfg=cfg)
    assert torch.equal(s1.removed, s2.removed) and s1.chosen == s2.chosen
    assert s1.lam == pytest.approx(s2.lam, rel=1e-9, abs=1e-12)
    torch.testing.assert_close(g1.H, g2.H, rtol=1e-9, atol=1e-12 * float(g1.H.diagonal().max()))


# --- through the CLI (Fashion-MNIST caption pairs) --------------------------------------------------------------


def _fmnist_or_skip():
    from secateur.data.sources import default_data_dir

    d = default_data_dir()
    if d is None or not (d / "fashion-mnist").exists():
        pytest.skip("Fashion-MNIST not in ../shared/data")


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    return save_tiny_vlm("llava", tmp_path_factory.mktemp("vlm") / "deep", layers=14)


def _report(out):
    import json

    return json.loads((out / "secateur-report.json").read_text())


def test_cli_joint_runs_report_and_matched_language_ratio(deep, tmp_path, capsys):
    import numpy as np
    from transformers import AutoModelForImageTextToText

    from secateur import api
    from secateur.cli import main

    _fmnist_or_skip()
    # CoCurve through the API on the 4-layer VLM (the guard relaxed as above: API-only knobs)
    small = save_tiny_vlm("llava", tmp_path / "small", layers=4)
    out = tmp_path / "j"
    api.prune(model=small, towers="joint", method="cocurve", sparsity=RHO, calib="fashion-mnist-captions",
              nsamples=6, heldout=2, top_r=16, cocurve_protect=1, cocurve_cap=3.0, out=str(out), quiet=True)
    rep = _report(out)
    b = rep["vlm"]["budget"]
    assert set(b["by_tower"]) == {"vision", "language"} and RHO * b["removable"] <= b["removed_params"]
    g = np.load(out / "cocurve_graph.npz")
    assert g["H"].shape == (b["by_tower"]["vision"]["units"] + b["by_tower"]["language"]["units"],) * 2
    back = AutoModelForImageTextToText.from_pretrained(out)
    assert sum(p.numel() for p in back.parameters()) == rep["vlm"]["params_after"] < rep["vlm"]["params_before"]
    # the CLI with CoCurve's own guard (14 layers per tower) prints where the budget went; then the
    # joint-vs-language-only comparison at matched parameters (magnitude-sp: no sweep, cheap)
    common = ["--model", deep, "--calib", "fashion-mnist-captions", "--quiet"]
    assert main(["prune", *common, "--towers", "joint", "--method", "magnitude-sp", "--sparsity", "0.15",
                 "--nsamples", "4", "--out", str(tmp_path / "m")]) == 0
    printed = capsys.readouterr().out
    assert "budget" in printed and "vision" in printed and "language" in printed
    jb = _report(tmp_path / "m")["vlm"]["budget"]
    r = matched_ratio(jb)
    assert main(["prune", *common, "--towers", "joint:language", "--method", "magnitude-sp", "--sparsity", str(r),
                 "--nsamples", "4", "--out", str(tmp_path / "l")]) == 0
    lb = _report(tmp_path / "l")["vlm"]["budget"]
    assert set(lb["by_tower"]) == {"language"}
    assert jb["removed_params"] <= lb["removed_params"] < jb["removed_params"] + lb["max_unit_cost"]


def test_per_tower_options_split_the_budget_as_asked(tmp_path):
    from secateur import api

    _fmnist_or_skip()
    folder = save_tiny_vlm("llava", tmp_path / "v")
    res = api.prune(model=folder, towers="vision=0.25,language=0.5", method="magnitude",
                    calib="fashion-mnist-captions", nsamples=4, quiet=True)
    assert res.report["vlm"]["towers"] == {"vision": 0.25, "language": 0.5}
    vis = res.report["vlm"]["vision_report"]["realized_sparsity"]["targeted"]
    lang = res.report["realized_sparsity"]["targeted"]
    assert vis == pytest.approx(0.25, abs=0.02) and lang == pytest.approx(0.5, abs=0.02)


@pytest.mark.parametrize("extra,match", [
    (["--towers", "joint", "--method", "sparsegpt"], "--towers joint runs"),
    (["--towers", "joint", "--method", "wanda-sp", "--calib", "wikitext2"], "image-caption pairs"),
    (["--towers", "joint:bogus", "--method", "wanda-sp"], "--towers takes"),
    (["--towers", "joint", "--method", "cocurve", "--nsamples", "4"], "--nsamples > 16"),
    (["--towers", "joint", "--method", "cocurve", "--compensation", "ls"], "no compensation"),
    (["--towers", "joint", "--method", "wanda-sp", "--eval-ppl", "wikitext2"], "eval captions"),
    (["--towers", "joint", "--method", "magnitude-sp", "--sparsity", "0.3"], "infeasible"),  # 2 layers: all protected
])
def test_bad_inputs_one_line_exit_2_nothing_written(tmp_path, capsys, extra, match):
    from secateur.cli import main

    if "wikitext2" not in extra:
        _fmnist_or_skip()
    folder = save_tiny_vlm("llava", tmp_path / "v")
    capsys.readouterr()  # the save's progress bars
    out = tmp_path / "out"
    argv = ["prune", "--model", folder, "--calib", "fashion-mnist-captions", "--nsamples", "4", "--quiet",
            "--out", str(out)]
    assert main(argv + extra) == 2
    err = [ln for ln in capsys.readouterr().err.strip().splitlines()
           if not ln.startswith(("secateur: note:", "[transformers]"))]  # notes and library warnings aside
    assert len(err) == 1 and match in err[0], err
    assert not out.exists()


def test_blocks_of_several_pairs_give_the_same_graph(run):
    """Pairs score different numbers of caption positions; a block of 3 pairs (one forward per unit for the three)
    sums the same per-pair Grams, so H and the split halves agree with one pair per block up to summation order."""
    vlm, _, ji, graph_data, graph, _ = run
    g3 = joint_graph(vlm, ji, graph_data, replace(CFG, sweep=replace(CFG.sweep, seqs_per_block=3)))
    sizes = [int(graph_data.rows(i).numel()) for i in range(len(graph_data))]
    assert len(set(sizes)) > 1  # the captions have different lengths
    scale = float(graph.H.diagonal().max())
    torch.testing.assert_close(g3.H, graph.H, rtol=1e-6, atol=1e-9 * scale)
    for a, b in zip(g3.halves, graph.halves, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9 * scale)
    assert g3.meta["n_positions"] == graph.meta["n_positions"] == sum(sizes)


def test_a_saved_joint_graph_serves_every_budget_and_the_language_block(run, tmp_path):
    """H does not depend on the budget: a saved joint graph is reused (checked against the pairs and units), and its
    language block is the graph a language-only sweep builds (the same ablations, teacher and positions)."""
    from secateur.errors import SecateurError
    from secateur.vlm_joint import _pairs_sha256, reused_graph

    vlm, _, ji, graph_data, graph, _ = run
    graph.meta["calibration"]["sha256"] = sha = _pairs_sha256(graph_data)
    graph.save(tmp_path / "g.npz")
    again = reused_graph(str(tmp_path / "g.npz"), ji, sha, CFG)
    assert torch.equal(again.H, graph.H) and torch.equal(again.ablated, graph.ablated)
    lji = joint_inventory(vlm, ("language",))
    block = reused_graph(str(tmp_path / "g.npz"), lji, sha, CFG)
    fresh = joint_graph(vlm, lji, graph_data, CFG)
    scale = float(fresh.H.diagonal().max())
    torch.testing.assert_close(block.H, fresh.H, rtol=1e-9, atol=1e-12 * scale)
    assert torch.equal(block.costs, fresh.costs) and torch.equal(block.layer_of, fresh.layer_of)
    with pytest.raises(SecateurError, match="other caption pairs"):
        reused_graph(str(tmp_path / "g.npz"), ji, "0" * 64, CFG)
    with pytest.raises(SecateurError, match="other CoCurve settings"):
        reused_graph(str(tmp_path / "g.npz"), ji, sha, replace(CFG, n_ffn_groups=8))


def test_unused_vision_blocks_are_named():
    """LLaVA's default ``vision_feature_layer=-2`` never reads the last vision block (issue 47's pitfall); the tiny
    VLM reads the last block (-1): nothing unused."""
    from secateur.vlm_joint import unused_vision_layers

    vlm = tiny_vlm(layers=4)
    assert unused_vision_layers(vlm) == []
    vlm.config.vision_feature_layer = -2
    assert unused_vision_layers(vlm) == [3]
    vlm.config.vision_feature_layer = [1, -3]
    assert unused_vision_layers(vlm) == [2, 3]
