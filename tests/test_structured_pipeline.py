"""End-to-end structured pipeline (secateur.methods.structured): dense stats -> selection -> compensation ->
slicing -> export; CLI ``prune --structured --compensation ...``; ``eval efficiency``; bad input."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from secateur import api
from secateur.calib.collect import collect_stats
from secateur.cli import main
from secateur.compensate import COECOptions, InputStats, relative_recon_error
from secateur.errors import SecateurError
from secateur.methods.materialize import COMPENSATIONS
from secateur.methods.structured import (
    NATIVE,
    StructuredConfig,
    StructuredOptions,
    prune_structured,
    stat_kinds,
    structured_config,
)
from secateur.models.adapters import get_adapter
from secateur.structured.selection import LayerKeep
from secateur.testing import (
    FAMILIES,  # every family, Qwen3 (q/k norms) included
    random_ids,
    save_tiny,
    tiny_model,
)

COMPS = tuple(COMPENSATIONS)
FAST_COEC = ["--coec-rounds", "2"]


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.fixture(scope="module")
def calib_txt(tmp_path_factory):
    p = tmp_path_factory.mktemp("calib") / "calib.txt"
    p.write_text("The quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs. " * 30)
    return str(p)


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {f: save_tiny(f, root / f) for f in FAMILIES}


def _opts(model_dir, out, method, comp, calib, **extra):
    ex = {"structured": True, "compensation": comp, **extra}
    if comp == "coec":
        ex.setdefault("coec_rounds", 2)
    return api.PruneOptions.from_kwargs(model=model_dir, method=method, sparsity=0.5, calib=calib, nsamples=2,
                                        seqlen=24, out=None if out is None else str(out), quiet=True, **ex)


# --- export: one from_pretrained, identical logits -----------------------------------------------------------

# every compensator on llama; on the other families the stock route (none), an added or updated bias (corp)
# and, for GPT-2's Conv1D storage, COEC
EXPORT_CASES = [("llama", c) for c in COMPS] + [(f, c) for f in FAMILIES[1:] for c in ("none", "corp")] + [
    ("gpt2", "coec")]


@pytest.mark.parametrize("family,comp", EXPORT_CASES)
def test_prune_export_reload_identical_logits(family, comp, tiny_dirs, calib_txt, tmp_path):
    out = tmp_path / "out"
    rep = api.prune(options=_opts(tiny_dirs[family], out, "rcpu", comp, calib_txt))
    model = rep.model
    ids = random_ids(2, 12)
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()  # one call, no trust_remote_code needed
    assert torch.equal(logits(loaded, ids), logits(model, ids))
    assert not (out / "secateur-masks.npz").exists()  # structured: the units are gone, no masks
    saved = json.loads((out / "secateur-report.json").read_text())
    d = saved["details"]
    assert d["compensation"] == comp and d["params_after"] < d["params_before"]
    assert saved["realized_sparsity"]["targeted"] == pytest.approx(0.5)
    sel = json.loads((out / "secateur_selection.json").read_text())
    assert all(len(v["channels"]) == 32 for v in sel["layers"].values())  # ceil(0.5 * 64)
    if comp != "none":
        assert d["per_layer"] and all(r["recon_after"] <= r["recon_before"] + 1e-9 for r in d["per_layer"])


def test_cli_prune_structured_each_compensation(tiny_dirs, calib_txt, tmp_path, capsys):
    ids = random_ids(1, 10)
    for comp in COMPS:
        out = tmp_path / comp
        rc = main(["prune", "--model", tiny_dirs["llama"], "--structured", "--method", "wanda", "--sparsity", "0.5",
                   "--compensation", comp, "--calib", calib_txt, "--nsamples", "2", "--seqlen", "24", "--quiet",
                   "--out", str(out), *(FAST_COEC if comp == "coec" else [])])
        assert rc == 0, capsys.readouterr().err
        rep = json.loads((out / "secateur-report.json").read_text())
        assert rep["method"] == "wanda-sp" and rep["kind"] == "structured"
        # the same options through the API rebuild the same model: the folder holds exactly that model
        ref = api.prune(options=_opts(tiny_dirs["llama"], None, "wanda-sp", comp, calib_txt)).model
        loaded = AutoModelForCausalLM.from_pretrained(out).eval()
        assert torch.equal(logits(loaded, ids), logits(ref, ids))
    assert "realized sparsity 0.5000" in capsys.readouterr().out


# --- compensation never raises the layer's calibration error -------------------------------------------------

def _kept_cols(sel, i, group, width):
    k = sel.kept_columns(i, group)
    return torch.arange(width) if k is None else k


@pytest.mark.parametrize("family", FAMILIES)
def test_compensation_never_raises_calibration_error(family):
    dense = tiny_model(family, layers=2)
    ids = random_ids(3, 24)
    stats = collect_stats(dense, get_adapter(dense), ids, stat_kinds(StructuredConfig(compensation="ls")))
    dense_refs = [get_adapter(dense).role_refs(lay) for lay in get_adapter(dense).layers]
    for comp in COMPS:
        m = tiny_model(family, layers=2)
        a = get_adapter(m)
        res = prune_structured(m, a, ids, StructuredConfig(score="rcpu", sparsity=0.5, compensation=comp,
                                                           coec=COECOptions(max_rounds=5)), stats=stats)
        gains = 0.0
        for i, lay in enumerate(get_adapter(m).layers):
            refs = get_adapter(m).role_refs(lay)
            for group, role in (("attn_out", "o"), ("mlp_out", "down")):
                w0 = dense_refs[i][role].weight.detach()
                b0 = dense_refs[i][role].bias
                kept = _kept_cols(res.selection, i, group, w0.shape[1])
                st = InputStats.from_gram(stats.groups[i][group]["gram"])
                w, b = refs[role].weight.detach(), refs[role].bias  # what the sliced model computes
                db = None
                if b is not None:
                    db = b.detach().double() - (torch.zeros_like(b, dtype=torch.float64) if b0 is None
                                                else b0.detach().double())
                after = relative_recon_error(w0, st, kept, w, db)
                before = relative_recon_error(w0, st, kept, w0[:, kept])
                assert after <= before * (1 + 1e-5) + 1e-7, (comp, i, group, before, after)
                gains += before - after
        if comp == "none":
            assert gains == pytest.approx(0.0, abs=1e-6)
        else:
            assert gains > 1e-3, comp  # a real improvement, not just the slice-only fallback everywhere


def test_guard_replaces_a_worse_compensation_by_the_slice():
    m = tiny_model("llama", layers=2)
    ids = random_ids(2, 16)
    a = get_adapter(m)
    stats = collect_stats(m, a, ids, stat_kinds(StructuredConfig(compensation="ls")))
    # a huge ridge lambda shrinks the refit towards 0: worse than the slice, so the guard must fire
    cfg = StructuredConfig(score="wanda_sp", sparsity=0.5, compensation="ls", ls_lambda_rel=1e6)
    res = prune_structured(m, a, ids, cfg, stats=stats)
    recs = res.details["per_layer"]
    assert recs and all(r.get("guard") == "slice" and r["recon_rejected"] > r["recon_before"] for r in recs)
    m2 = tiny_model("llama", layers=2)
    res2 = prune_structured(m2, get_adapter(m2), ids, StructuredConfig(score="wanda_sp", sparsity=0.5), stats=stats)
    assert torch.equal(logits(m, ids), logits(m2, ids))  # = slice-only
    assert res2.details["per_layer"] == []
    m3 = tiny_model("llama", layers=2)
    cfg3 = StructuredConfig(score="wanda_sp", sparsity=0.5, compensation="ls", ls_lambda_rel=1e6, no_worse=False)
    res3 = prune_structured(m3, get_adapter(m3), ids, cfg3, stats=stats)
    assert all(r["recon_after"] > r["recon_before"] for r in res3.details["per_layer"])


# --- composition: any compensator after any selection --------------------------------------------------------

SELECTION_CASES = [("wanda_sp", {}), ("flap", {}), ("flap", {"allocation": "flap-global"}), ("rcpu", {}),
                   ("magnitude", {}), ("random", {}), ("corp", {"units": ("channel",)}),
                   ("rcpu", {"units": ("channel",)}), ("rcpu", {"units": ("kv_group",)})]


@pytest.mark.parametrize("score,kw", SELECTION_CASES)
def test_any_compensator_after_any_selection(score, kw):
    base = tiny_model("qwen2", layers=2)
    ids = random_ids(2, 16)
    stats = collect_stats(base, get_adapter(base), ids, stat_kinds(StructuredConfig(compensation="ls")))
    kept = None
    outs = {}
    for comp in COMPS:
        m = tiny_model("qwen2", layers=2)
        cfg = StructuredConfig(score=score, sparsity=0.5, compensation=comp, coec=COECOptions(max_rounds=2), **kw)
        res = prune_structured(m, get_adapter(m), ids, cfg, stats=stats)
        keep = {i: LayerKeep(**k.to_dict()) for i, k in res.selection.layers.items()}
        kept = kept or keep
        assert keep == kept  # the selection does not depend on the compensator
        y = logits(m, ids)
        assert torch.isfinite(y).all()
        outs[comp] = y
        n_comp = {r["group"] for r in res.details["per_layer"]}
        if comp != "none":
            want = {g for g, k in (("attn_out", "heads"), ("mlp_out", "channels"))
                    if any(getattr(v, k) is not None for v in keep.values())}
            assert n_comp == want
    assert not torch.equal(outs["none"], outs["coec"])


def test_cached_stats_equal_fresh_stats_and_are_reused_across_sparsities():
    ids = random_ids(2, 16)
    base = tiny_model("llama", layers=2)
    stats = collect_stats(base, get_adapter(base), ids, stat_kinds(StructuredConfig(compensation="coec")))
    for rho in (0.25, 0.5):
        m1, m2 = tiny_model("llama", layers=2), tiny_model("llama", layers=2)
        cfg = StructuredConfig(score="rcpu", sparsity=rho, compensation="rcpu")
        prune_structured(m1, get_adapter(m1), ids, cfg, stats=stats)
        prune_structured(m2, get_adapter(m2), ids, cfg)  # collects its own dense statistics
        assert torch.equal(logits(m1, ids), logits(m2, ids))


def test_shortgpt_removes_blocks_and_reloads(tmp_path):
    m = tiny_model("llama", layers=4)
    ids = random_ids(2, 16)
    res = prune_structured(m, get_adapter(m), ids, StructuredConfig(score="shortgpt", sparsity=0.5))
    assert len(res.selection.removed_blocks) == 2 and m.config.num_hidden_layers == 2
    from secateur.export.sliced import save_structured

    save_structured(m, None, tmp_path / "o", {"x": 1})
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "o").eval()
    assert torch.equal(logits(loaded, ids), logits(m, ids))


def test_coec_reports_gcv_lambda_rounds_and_time():
    m = tiny_model("llama", layers=2)
    ids = random_ids(2, 16)
    cfg = StructuredConfig(score="rcpu", sparsity=0.5, compensation="coec", coec=COECOptions(max_rounds=4))
    res = prune_structured(m, get_adapter(m), ids, cfg)
    recs = res.details["per_layer"]
    assert {r["group"] for r in recs} == {"attn_out", "mlp_out"}
    assert all("gcv_lambda" in r and 1 <= r["rounds"] <= 4 and r["seconds"] >= 0 for r in recs)
    assert res.details["coec_options"]["max_rounds"] == 4 and res.details["coec_options"]["alpha"] == 0.9
    s = res.details["compensation_summary"]
    assert s["mlp_out"]["recon_after_mean"] < s["mlp_out"]["recon_before_mean"]
    assert res.details["compensation_seconds"] == pytest.approx(sum(r["seconds"] for r in recs))


# --- eval efficiency -----------------------------------------------------------------------------------------

def test_eval_efficiency_cli(tiny_dirs, calib_txt, tmp_path, capsys):
    out = tmp_path / "p"
    api.prune(options=_opts(tiny_dirs["llama"], out, "wanda-sp", "none", calib_txt))
    capsys.readouterr()
    js = tmp_path / "eff.json"
    rc = main(["eval", "efficiency", "--model", str(out), "--dense", tiny_dirs["llama"], "--prompt-len", "16",
               "--new-tokens", "4", "--warmup", "0", "--repeats", "1", "--json", str(js)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "| dense (" in text and "| pruned (" in text and "prefill tok/s" in text
    dense_line = next(ln for ln in text.splitlines() if ln.startswith("| dense ("))
    assert dense_line.count("| 1.000 |") >= 3  # params, FLOPs and memory ratios of dense vs itself
    rows = json.loads(js.read_text())
    assert rows[1]["params"] < rows[0]["params"]
    from shape_flops import shape_flops

    from secateur.models.loading import load_model

    for row, spec in zip(rows, (tiny_dirs["llama"], str(out))):  # FLOPs from the saved models' module shapes
        assert row["flops_per_token"] == shape_flops(load_model(spec)[0])


# --- bad input: exit 2, one line, nothing written ---------------------------------------------------------------

@pytest.mark.parametrize("extra,msg", [
    (["--method", "wanda", "--compensation", "coec"], "only applies to the structured pipeline"),
    (["--method", "sparsegpt", "--units", "channel"], "only applies to the structured pipeline"),
    (["--method", "wanda", "--coec-alpha", "0.5"], "only applies to the structured pipeline"),
    (["--structured", "--method", "sparsegpt"], "has no structured form"),
    (["--structured", "--method", "shortgpt", "--compensation", "coec"], "no kept columns"),
    (["--structured", "--method", "wanda", "--allocation", "flap-global"], "use it with --method flap"),
    (["--structured", "--method", "rcpu", "--units", "kv_group,bogus"], "--units"),
    (["--structured", "--method", "rcpu", "--units", "kv_group,head"], "names two attention units"),
    (["--structured", "--method", "corp", "--units", "kv_group,channel"], "corp ranks MLP channels (--units channel)"),
    (["--structured", "--method", "rcpu", "--pattern", "2:4"], "--pattern only applies to --method magnitude"),
    (["--structured", "--method", "rcpu", "--compensation", "coec", "--coec-alpha", "1.5"], "alpha"),
    (["--structured", "--method", "rcpu", "--units", "head"], "single query heads"),  # GQA model: after loading
])
def test_bad_structured_input_exits_2_and_writes_nothing(tiny_dirs, calib_txt, tmp_path, capsys, extra, msg):
    out = tmp_path / "out"
    rc = main(["prune", "--model", tiny_dirs["llama"], "--calib", calib_txt, "--nsamples", "2", "--seqlen", "16",
               "--quiet", "--out", str(out), *extra])
    assert rc == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("secateur:")]
    assert len(err) == 1 and msg in err[0], err
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_save_structured_accepts_a_model_already_carrying_its_export_config(tmp_path):
    """Runners that swap in the export config themselves (CoCurve) go through the same saver."""
    from secateur.export.sliced import export_config, save_structured
    from secateur.structured.selection import Selection
    from secateur.structured.slicing import apply_selection

    m = tiny_model("llama", layers=2)
    a = get_adapter(m)
    sel = Selection(8, 2, {0: LayerKeep(heads=[0, 1], kv_heads=[0], channels=list(range(40))),
                           1: LayerKeep(channels=list(range(0, 64, 3)))})
    apply_selection(m, a, sel)
    cfg, route = export_config(m)
    assert route == "hetero"
    m.config = cfg
    save_structured(m, None, tmp_path / "o", {"r": 1}, {"secateur_hetero.py": b"stale copy"})
    ids = random_ids(1, 9)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "o").eval()
    assert torch.equal(logits(loaded, ids), logits(m, ids))
    assert (tmp_path / "o" / "secateur_hetero.py").read_bytes() != b"stale copy"


def test_cached_tempering_equals_plain_coec():
    """The runner tempers C once per projection and runs COEC with alpha = 1 on C^alpha: same weights."""
    from secateur.budgets.select import select_units
    from secateur.compensate import compensate
    from secateur.methods.materialize import compensate_selection

    m = tiny_model("llama", layers=1)
    a = get_adapter(m)
    ids = random_ids(2, 16)
    stats = collect_stats(m, a, ids, stat_kinds(StructuredConfig(compensation="coec")))
    sel = select_units(a, "rcpu", 0.5, stats.groups)
    opts = COECOptions(max_rounds=3)
    cfg = StructuredConfig(score="rcpu", sparsity=0.5, compensation="coec", coec=opts, coec_align=False)
    reps, recs, _ = compensate_selection(m, a, sel, stats, cfg)
    for group, role in (("attn_out", "o"), ("mlp_out", "down")):
        w0 = a.role_refs(a.layers[0])[role].weight.detach()
        st = InputStats.from_gram(stats.groups[0][group]["gram"])
        ref = compensate("coec", w0, st, sel.kept_columns(0, group), options=opts)
        assert torch.allclose(reps[(0, group)].weight, ref.weight, rtol=1e-5, atol=1e-6)
        rec = next(r for r in recs if r["group"] == group)
        assert rec["recon_before"] == pytest.approx(ref.diagnostics["recon_before"])
        assert rec["recon_after"] == pytest.approx(ref.diagnostics["recon_after"], rel=1e-4)
    assert "tempered" not in vars(stats)  # C^alpha is taken per projection, never cached on the statistics


@pytest.mark.parametrize("method,native", sorted(NATIVE.items()))
def test_no_compensation_flag_means_the_methods_own(method, native):
    """``--method flap`` without ``--compensation`` is FLAP with its bias (likewise RCPU, CORP); an explicit
    choice, ``none`` included, wins."""
    opts = api.PruneOptions.from_kwargs(model="x", method=method, sparsity=0.3, structured=True)
    assert structured_config(method, opts).compensation == native
    opts.method_options = StructuredOptions(compensation="none")
    assert structured_config(method, opts).compensation == "none"


def test_reused_statistics_must_hold_what_the_config_reads():
    m = tiny_model("llama")
    a = get_adapter(m)
    ids = random_ids(2, 12)
    stats = collect_stats(m, a, ids)  # scores only: no Gram
    with pytest.raises(SecateurError, match="lack gram"):
        prune_structured(m, a, ids, StructuredConfig(score="rcpu", sparsity=0.5, compensation="ls"), stats=stats)
    prune_structured(m, a, ids, StructuredConfig(score="rcpu", sparsity=0.5), stats=stats)  # enough for a slice


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("comp", ["none", "coec", "corp"])
def test_cuda_model_prunes_like_the_cpu_one(comp):
    """Statistics and compensators stay on the CPU; a model on the GPU gets the same widths and weights.

    The Grams come from the GPU's forward, equal to the CPU's up to float32 rounding (~1e-6 relative). The one-shot
    solves (none, corp) keep that elementwise. COEC's rounds amplify it by far more (32 tokens for 64-wide inputs:
    rank-deficient Grams held up by the damping): on the CPU, weights perturbed by 1e-6 relative move its output by
    ~8e-3 in relative Frobenius norm, and an H200 run differed from the CPU by 2.3e-3. So for COEC the bound is
    measured here: the GPU's largest difference over the tensors within 4x the perturbation's largest on the CPU."""
    ids = random_ids(2, 16)
    out = {}
    for device in ("cpu", "cuda", "perturbed"):
        m = tiny_model("llama")
        if device == "perturbed":
            g = torch.Generator().manual_seed(1)
            with torch.no_grad():
                for p in m.parameters():
                    p.mul_(1 + 1e-6 * torch.randn(p.shape, generator=g))
        dev = "cpu" if device == "perturbed" else device
        m = m.to(dev)
        cfg = StructuredConfig(score="rcpu", sparsity=0.5, compensation=comp, coec=COECOptions(max_rounds=2))
        prune_structured(m, get_adapter(m), ids.to(dev), cfg, device=dev)
        out[device] = {k: v.detach().cpu() for k, v in m.state_dict().items()}
    def worst(of: str) -> float:
        return max(float((out[of][k] - v).norm() / v.norm().clamp_min(1e-30)) for k, v in out["cpu"].items())

    for k, v in out["cpu"].items():
        assert out["cuda"][k].shape == v.shape, k
        if comp != "coec":
            torch.testing.assert_close(out["cuda"][k], v, atol=1e-4, rtol=1e-4)
    if comp == "coec":
        assert worst("cuda") <= 4 * worst("perturbed"), (worst("cuda"), worst("perturbed"))


def test_data_free_scores_reuse_gram_only_statistics():
    """magnitude / random read no score statistics: Grams alone (what CoCurve's runner collects) suffice."""
    m = tiny_model("llama")
    a = get_adapter(m)
    ids = random_ids(2, 12)
    stats = collect_stats(m, a, ids, ("gram",))
    for score in ("magnitude", "random"):
        mm = tiny_model("llama")
        prune_structured(mm, get_adapter(mm), None, StructuredConfig(score=score, sparsity=0.5, compensation="ls"),
                         stats=stats)
    assert stat_kinds(StructuredConfig(score="shortgpt", sparsity=0.25)) == ()
