"""CORP on vision encoders (issue 43): query/key head dimensions sliced into narrow heads (``--units qk``), joint
with the MLP channels (``--units channel,qk``, CORP's default on a vision model), saved as per-layer folders that
reload in one call.

Tolerances: the narrowed model computes the same float32 sums as the zeroed dense one, minus the zero terms, in
another order (sdpa's kernels block the head dimension differently): the logits agree to a few float32 ulps of
their O(1) values, so 1e-5 absolute leaves a margin of ~100 ulps and still fails on any wrong row or scale.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from secateur import api
from secateur.models import hetero
from secateur.models.families import get_adapter
from secateur.models.loading import load_model
from secateur.testing import VISION_FAMILIES, save_tiny

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("img") / "calib.npz"
    rng = np.random.default_rng(0)
    np.savez(path, images=rng.integers(0, 256, (12, 16, 16, 3), dtype=np.uint8), labels=np.arange(12) % 10)
    return str(path)


def _pixels(folder) -> torch.Tensor:
    return torch.randn(5, 3, 16, 16, generator=torch.Generator().manual_seed(1))


def _out(model, x):
    with torch.no_grad():
        o = model(pixel_values=x)
    return o.logits if hasattr(o, "logits") else o.last_hidden_state


@pytest.mark.parametrize("family", VISION_FAMILIES)
def test_sliced_qk_equals_the_zeroed_dense_model(tmp_path, images, family):
    """CORP spec K11: q/k out = H d_s, v/o unchanged, and the narrow model's output is the masked dense one's."""
    folder = save_tiny(family, tmp_path / "m")
    zeroed = api.prune(model=folder, method="corp-qk", sparsity=0.5, calib=images, nsamples=12, quiet=True).model
    sliced = api.prune(model=folder, method="corp", units="qk", sparsity=0.5, calib=images, nsamples=12,
                       quiet=True)
    x = _pixels(folder)
    torch.testing.assert_close(_out(sliced.model, x), _out(zeroed, x), atol=1e-5, rtol=0)
    ad = get_adapter(sliced.model)
    g = ad.geometry
    for layer in ad.layers:
        attn = hetero.attention_module(family, layer)
        assert isinstance(attn, hetero.NarrowQKAttention) and attn.qk_dim == g.head_dim // 2
        lay = ad.layout
        assert getattr(attn, lay.q).weight.shape[0] == getattr(attn, lay.k).weight.shape[0] == g.n_heads * 8
        assert getattr(attn, lay.v).weight.shape[0] == getattr(attn, lay.out).weight.shape[1] == g.n_heads * 16
    qk = sliced.report["details"]["qk"]
    assert qk["d_s"] == [8] and all(r["logit_rel_after"] <= r["logit_rel_before"] + 1e-12 for r in qk["layers"])


@pytest.mark.parametrize("family", ["vit", "siglip_vision_model"])
def test_joint_corp_saves_a_per_layer_folder_that_reloads(tmp_path, images, family):
    """Joint CORP (the vision default): fewer parameters, ``qk_dim`` per layer in the config, and the folder reloads
    with secateur's loader and with plain transformers to the in-memory output."""
    from transformers import AutoModel, AutoModelForImageClassification

    folder = save_tiny(family, tmp_path / "m")
    res = api.prune(model=folder, method="corp", sparsity=0.5, calib=images, nsamples=12, out=str(tmp_path / "o"),
                    quiet=True)
    d = res.report["details"]
    assert d["units"] == ["channel", "qk"] and d["params_after"] < d["params_before"]
    cfg = json.loads((tmp_path / "o" / "config.json").read_text())
    assert cfg["model_type"] == f"secateur_{family}"
    assert [s["qk_dim"] for s in cfg["secateur_layers"]] == [8, 8]
    assert [s["intermediate"] for s in cfg["secateur_layers"]] == [32, 32]
    x = _pixels(folder)
    want = _out(res.model, x)
    again, _ = load_model(str(tmp_path / "o"))
    torch.testing.assert_close(_out(again, x), want, atol=1e-6, rtol=0)
    auto = AutoModel if family == "siglip_vision_model" else AutoModelForImageClassification
    plain = auto.from_pretrained(str(tmp_path / "o")).eval()
    torch.testing.assert_close(_out(plain, x), want, atol=1e-6, rtol=0)


def test_qk_units_refused_on_a_rope_model(tmp_path):
    """``--units qk`` on a RoPE language model: one line before any calibration (rotary embeddings do not commute
    with dim pruning, corp.md [A8])."""
    from contract import check

    folder = save_tiny("llama", tmp_path / "m")
    code, _, err = check("corp-qk-rope", ["prune", "--model", folder, "--method", "corp", "--units", "channel,qk",
                                          "--calib", "self", "--nsamples", "2", "--seqlen", "16", "--quiet",
                                          "--out", tmp_path / "o"], [tmp_path])
    assert code == 2 and "rotary" in err


def test_qk_units_belong_to_corp(tmp_path, images):
    from contract import check

    folder = save_tiny("vit", tmp_path / "m")
    code, _, err = check("qk-units", ["prune", "--model", folder, "--method", "wanda-sp", "--units", "qk",
                                      "--calib", images, "--nsamples", "4", "--quiet", "--out", tmp_path / "o"],
                         [tmp_path])
    assert code == 2 and "--units qk" in err and "--method corp" in err


def test_report_renders_a_vision_run_with_its_accuracy(tmp_path, images):
    """``secateur report`` on a pruned vision folder with its ``eval accuracy`` JSON beside the report: an accuracy
    table with the numbers the JSON holds, and the model card names the Auto class that reloads it."""
    from secateur.cli import main

    folder = save_tiny("vit", tmp_path / "m")
    out = tmp_path / "o"
    api.prune(model=folder, method="corp", sparsity=0.5, calib=images, nsamples=12, out=str(out), quiet=True)
    assert main(["eval", "accuracy", "--model", str(out), "--dataset", images, "--json", str(out / "acc.json"),
                 "--quiet"]) == 0
    acc = json.loads((out / "acc.json").read_text())
    assert main(["report", str(out), "--out", str(tmp_path / "rep")]) == 0
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "## Image classification accuracy" in md and f"| {acc['top1']:.4f} |" in md
    assert "AutoModelForImageClassification.from_pretrained" in (out / "README.md").read_text()


def test_without_compensation_the_kept_qk_rows_are_the_dense_rows(tmp_path, images):
    """``--compensation none`` (CORP's "w/o compensation" arm, spec K8): every narrowed q/k row is the dense row of
    a kept dim of its own head, unmixed; with compensation the rows are mixed (M != 0) and the calibration logit
    error is no larger."""
    from secateur.testing import tiny_vision_model

    folder = save_tiny("vit", tmp_path / "m")
    dense = tiny_vision_model("vit")
    plain = api.prune(model=folder, method="corp", units="qk", compensation="none", sparsity=0.5, calib=images,
                      nsamples=12, quiet=True)
    comp = api.prune(model=folder, method="corp", units="qk", sparsity=0.5, calib=images, nsamples=12, quiet=True)
    lay, hd = get_adapter(dense).layout, 16
    for i, layer in enumerate(get_adapter(plain.model).layers):
        for name in (lay.q, lay.k):
            w = getattr(layer.attention, name).weight
            w0 = getattr(dense.vit.layers[i].attention, name).weight
            for h in range(2):
                block = w0[h * hd:(h + 1) * hd]
                assert all(any(torch.equal(r, b) for b in block) for r in w[h * 8:(h + 1) * 8])
    mixed = get_adapter(comp.model).layers[0].attention.q_proj.weight
    assert not all(any(torch.equal(r, b) for b in dense.vit.layers[0].attention.q_proj.weight) for r in mixed)
    for a, b in zip(plain.report["details"]["qk"]["layers"], comp.report["details"]["qk"]["layers"]):
        assert b["logit_rel_after"] <= a["logit_rel_before"] + 1e-12


@pytest.mark.parametrize("compensation", ["ls", "bias", "rcpu", "coec", "corp"])
@pytest.mark.parametrize("family", ["vit", "dinov2", "siglip"])
def test_each_compensator_lowers_the_vision_blocks_error_or_is_guarded(tmp_path, images, family, compensation):
    """Every compensator on vision blocks (Wanda-sp's MLP channels and heads at 50%): each compensated projection's
    relative calibration reconstruction error is no larger than the sliced one's, either by the solve or because
    the no-worse guard kept the plain slice (recorded)."""
    folder = save_tiny(family, tmp_path / "m")
    res = api.prune(model=folder, method="wanda-sp", sparsity=0.5, calib=images, nsamples=12,
                    compensation=compensation, quiet=True)
    records = res.report["details"]["per_layer"]
    assert records, "no projection was compensated"
    for r in records:
        assert r["recon_after"] <= r["recon_before"] * (1 + 1e-6) + 1e-12, r
    assert any(r["recon_after"] < r["recon_before"] for r in records)


def test_a_vision_recipe_replays_to_the_same_bits(tmp_path, images):
    """The recipe a vision run writes (its images by source, count and seed, checked by the pixels' sha256) replays
    to bit-identical weights."""
    from secateur.cli import main

    folder = save_tiny("dinov2", tmp_path / "m")
    a, b = tmp_path / "a", tmp_path / "b"
    api.prune(model=folder, method="corp", sparsity=0.5, calib=images, nsamples=12, out=str(a), quiet=True)
    assert main(["prune", "--recipe", str(a / "secateur-recipe.yaml"), "--out", str(b), "--quiet"]) == 0
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert json.loads((b / "secateur-report.json").read_text())["calibration"]["sha256"] == \
        json.loads((a / "secateur-report.json").read_text())["calibration"]["sha256"]
