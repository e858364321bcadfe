"""Vision evaluators: ``secateur eval features`` (pooled-feature cosine, block errors, ridge linear probe) and the
vision path of ``secateur eval efficiency`` (counted FLOPs/image, latency, throughput), with their refusals."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from secateur import api
from secateur.cli import main
from secateur.eval.efficiency import measure_vision_efficiency, vision_flops
from secateur.eval.features import block_errors, eval_features, linear_probe, pooled_features, pooling_rule
from secateur.models.loading import load_model
from secateur.testing import TINY_PROCESSOR, VISION_FAMILIES, random_pixels, save_tiny, tiny_vision_model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    """A tiny ViT classifier, its wanda-sp / CORP q/k / ShortGPT prunes, and a labelled split-less image set."""
    root = tmp_path_factory.mktemp("ve")
    rng = np.random.default_rng(0)
    calib = root / "calib.npz"
    np.savez(calib, images=rng.integers(0, 256, (8, 16, 16, 3), dtype=np.uint8), labels=rng.integers(0, 10, 8))
    data = root / "data.npz"
    np.savez(data, images=rng.integers(0, 256, (24, 16, 16, 3), dtype=np.uint8), labels=np.arange(24) % 3)
    out = {"dense": save_tiny("vit", root / "dense"), "calib": str(calib), "data": str(data)}
    for name, kw in (("wsp", {"method": "wanda-sp"}), ("corpqk", {"method": "corp", "units": "qk"}),
                     ("short", {"method": "shortgpt"})):
        api.prune(model=out["dense"], sparsity=0.5, calib=str(calib), nsamples=8, out=str(root / name), quiet=True,
                  **kw)
        out[name] = str(root / name)
    return out


# --- features ----------------------------------------------------------------------------------------------------

def test_features_of_a_model_against_itself(folders, tmp_path):
    js = tmp_path / "f.json"
    r = eval_features(folders["dense"], folders["dense"], folders["data"], max_images=10, probe_train=12,
                      json_path=str(js))
    assert r["cosine_mean"] == pytest.approx(1.0, abs=1e-6) and r["cosine_min"] == pytest.approx(1.0, abs=1e-6)
    assert r["block_rel_error"] == [0.0, 0.0] and r["block_error_scope"] == "per-block"
    assert r["probe_top1"] == r["probe_top1_reference"] and r["n_images"] == 10 and r["probe_train_images"] == 12
    assert json.loads(js.read_text())["cosine_mean"] == r["cosine_mean"]
    for key in ("protocol", "model", "reference", "dataset", "probe_top1", "probe_top1_reference"):
        assert key in r
    # a split-less source: the probe's training images and the scored ones are disjoint draws of the one set
    assert r["images"]["n"] + r["probe_images"]["n"] <= 24 and "permutation" in r["images"]["rule"]


def test_features_of_a_pruned_model(folders):
    r = eval_features(folders["wsp"], folders["dense"], folders["data"], max_images=10, probe_train=12)
    assert r["cosine_mean"] < 1 and r["cosine_min"] <= r["cosine_mean"]
    assert len(r["block_rel_error"]) == 2 and all(e > 0 for e in r["block_rel_error"])
    assert 0 <= r["probe_top1"] <= 1 and 0 <= r["probe_top1_reference"] <= 1
    short = eval_features(folders["short"], folders["dense"], folders["data"], max_images=10, probe_train=12)
    assert len(short["block_rel_error"]) == 1 and short["block_error_scope"].startswith("final hidden states")


def test_unlabelled_source_skips_the_probe(folders, tmp_path):
    npy = tmp_path / "x.npy"
    np.save(npy, np.random.default_rng(1).integers(0, 256, (6, 16, 16, 3), dtype=np.uint8))
    r = eval_features(folders["wsp"], folders["dense"], str(npy))
    assert r["probe_top1"] is None and "no labels" in r["probe_skipped"] and r["n_images"] == 6


@pytest.mark.parametrize("family", VISION_FAMILIES)
def test_pooled_features_are_what_the_head_reads(family):
    """A classifier's head applied to the pooled features gives its logits (DeiT with teacher: its CLS head's;
    DINOv2: the CLS half of its input);
    CLIP's tower: its pooler output; SigLIP's tower without a head: the token mean."""
    model = tiny_vision_model(family)
    px = random_pixels(3)
    feats = pooled_features(model, px, batch=2)
    with torch.no_grad():
        out = model(pixel_values=px)
        if family == "dinov2":
            want = model.dinov2(pixel_values=px).last_hidden_state[:, 0]
        elif hasattr(model, "classifier") or hasattr(model, "cls_classifier"):  # DeiT with teacher: its CLS head
            want = None
            head, logits = ((model.classifier, out.logits) if hasattr(model, "classifier")
                            else (model.cls_classifier, out.cls_logits))
            torch.testing.assert_close(head(feats), logits, rtol=1e-5, atol=1e-5)
        elif family == "clip_vision_model":
            want = out.pooler_output
        else:
            want = out.last_hidden_state.mean(1)
    if want is not None:
        torch.testing.assert_close(feats, want, rtol=1e-5, atol=1e-5)
    assert pooling_rule(model) in ("cls", "pooler", "mean", "mean-patches")
    assert block_errors(model, model, px) == [0.0, 0.0]


def _clusters(n_per: int, d: int, classes: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    centres = rng.normal(0, 10, (classes, d))
    x = np.concatenate([c + rng.normal(0, 0.5, (n_per, d)) for c in centres])
    return x, np.repeat(np.arange(classes), n_per)


def test_linear_probe_is_the_ridge_solve():
    x, y = _clusters(20, 6, 3, 0)
    xt, yt = _clusters(10, 6, 3, 0)
    p = linear_probe(x, y, xt, yt)
    mu = x.mean(0)
    xc = x - mu
    lam = 1e-3 * np.trace(xc.T @ xc) / x.shape[1]
    yy = np.eye(3)[y]
    w = np.linalg.solve(xc.T @ xc + lam * np.eye(6), xc.T @ yy)
    b = yy.mean(0) - mu @ w
    assert p["lambda"] == pytest.approx(lam, rel=1e-12)
    np.testing.assert_allclose(p["weight"].numpy(), w, rtol=0, atol=1e-9)
    np.testing.assert_allclose(p["bias"].numpy(), b, rtol=0, atol=1e-9)
    assert p["top1"] == np.mean(np.argmax(xt @ w + b, 1) == yt) == 1.0
    q = linear_probe(x, y, xt, yt, ridge=0.5)
    assert q["lambda"] == 0.5
    np.testing.assert_allclose(q["weight"].numpy(), np.linalg.solve(xc.T @ xc + 0.5 * np.eye(6), xc.T @ yy),
                               rtol=0, atol=1e-9)


# --- efficiency: FLOPs per image ----------------------------------------------------------------------------------

def _hand_flops(blocks: list[tuple[int, int, int]], d: int, tokens: int, patches: int, patch_macs: int,
                head_out: int) -> int:
    """``2 x MACs + attention`` of a ViT classifier with blocks of widths ``(w_qk, w_v, mlp)``: the patch conv
    (``patches x d x patch_macs``), per block q, k (``T d w_qk`` each), v (``T d w_v``), o (``T w_v d``), fc1 / fc2
    (``T d f`` each) and the products ``2 T^2 w_qk + 2 T^2 w_v`` (``4 H T^2 d_head`` dense), the classifier on the
    CLS token (``d x head_out``)."""
    macs = patches * d * patch_macs + d * head_out
    attn = 0
    for w_qk, w_v, f in blocks:
        macs += tokens * d * (2 * w_qk + w_v) + tokens * w_v * d + 2 * tokens * d * f
        attn += 2 * tokens**2 * (w_qk + w_v)
    return 2 * macs + attn


def _widths(model) -> list[tuple[int, int, int]]:
    return [(layer.attention.q_proj.out_features, layer.attention.v_proj.out_features, layer.mlp.fc1.out_features)
            for layer in model.vit.layers]


def test_flops_per_image_is_the_hand_count(folders):
    dense, _ = load_model(folders["dense"])
    c = dense.config
    grid = c.image_size // c.patch_size
    tokens, heads, d_head = grid * grid + 1, c.num_attention_heads, c.hidden_size // c.num_attention_heads
    shape = dict(d=c.hidden_size, tokens=tokens, patches=grid * grid, patch_macs=c.num_channels * c.patch_size**2,
                 head_out=c.num_labels)
    want = _hand_flops([(heads * d_head, heads * d_head, c.intermediate_size)] * c.num_hidden_layers, **shape)
    # the dense attention term is 4 H T^2 d_head per block
    assert vision_flops(dense, 16, 3)["attention_flops"] == c.num_hidden_layers * 4 * heads * tokens**2 * d_head
    assert vision_flops(dense, 16, 3)["flops_per_image"] == want
    wsp, _ = load_model(folders["wsp"])
    got = vision_flops(wsp, 16, 3)["flops_per_image"]
    assert got < want and got == _hand_flops(_widths(wsp), **shape)
    corp, _ = load_model(folders["corpqk"])
    assert [w[:2] for w in _widths(corp)] == [(16, 32)] * 2  # CORP keeps 8 of the 16 q/k dimensions of each head
    fl = vision_flops(corp, 16, 3)
    assert fl["flops_per_image"] == _hand_flops(_widths(corp), **shape) < want
    assert fl["attention_flops"] == 2 * 2 * tokens**2 * (16 + 32)  # the narrow width for the scores


def test_measure_vision_efficiency(folders):
    model, _ = load_model(folders["dense"])
    r = measure_vision_efficiency(model, 16, 3, batch_throughput=2, warmup=0, repeats=2, threads=1)
    assert r["params"] > 0 and r["flops_per_image"] == vision_flops(model, 16, 3)["flops_per_image"]
    assert r["latency_ms_p50"] > 0 and r["throughput_images_per_s"] > 0 and r["threads"] == 1


# --- CLI -----------------------------------------------------------------------------------------------------------

def test_cli_features_and_efficiency(folders, tmp_path, capsys):
    js = tmp_path / "f.json"
    assert main(["eval", "features", "--model", folders["wsp"], "--reference", folders["dense"], "--dataset",
                 folders["data"], "--max-images", "8", "--probe-train", "8", "--json", str(js), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("cosine ") and "probe top-1" in out and "(dense " in out and "(8 images)" in out
    assert json.loads(js.read_text())["n_images"] == 8
    ej = tmp_path / "e.json"
    assert main(["eval", "efficiency", "--model", folders["corpqk"], "--dense", folders["dense"], "--repeats", "1",
                 "--warmup", "0", "--throughput-batch", "2", "--json", str(ej)]) == 0
    out = capsys.readouterr().out
    assert "GFLOPs/image" in out and "images/s (b=2)" in out and "measured alternately" in out
    rows = json.loads(ej.read_text())
    assert [r["model"] for r in rows] == [folders["dense"], folders["corpqk"]]
    assert rows[1]["flops_per_image"] < rows[0]["flops_per_image"]


def _vit_folder(path: Path, **changes) -> str:
    import transformers

    cfg = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=16,
               patch_size=4, num_channels=3, qkv_bias=True, num_labels=10)
    cfg.update(changes)
    transformers.ViTForImageClassification(transformers.ViTConfig(**cfg)).save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps(TINY_PROCESSOR))
    return str(path)


@pytest.mark.parametrize("case", ["family", "hidden", "grid", "missing", "text", "text-reference", "processor",
                                  "efficiency-mixed"])
def test_refusals(folders, tmp_path, capsys, case):
    dense, js = folders["dense"], tmp_path / "r.json"
    model, ref, what = folders["wsp"], dense, None
    if case == "family":
        ref, what = save_tiny("deit", tmp_path / "deit"), "is a vit and --reference"
    elif case == "hidden":
        ref, what = _vit_folder(tmp_path / "wide", hidden_size=48), "hidden size 32"
    elif case == "grid":
        ref, what = _vit_folder(tmp_path / "coarse", patch_size=8), "patch grid 4x4"
    elif case == "processor":  # another normalization: other pixels, features of other inputs
        import shutil

        model = str(shutil.copytree(folders["wsp"], tmp_path / "wsp"))
        (tmp_path / "wsp" / "preprocessor_config.json").write_text(json.dumps(dict(TINY_PROCESSOR,
                                                                                    image_mean=[0.4] * 3)))
        what = "makes other pixels"
    elif case == "missing":
        model, what = str(tmp_path / "nowhere"), "is not a folder"
    elif case in ("text", "text-reference", "efficiency-mixed"):
        text = save_tiny("llama", tmp_path / "llama")
        model, ref = (text, dense) if case == "text" else (model, text)
        what = "text model" if case != "efficiency-mixed" else "is a vision model and --model"
    if case == "efficiency-mixed":
        argv = ["eval", "efficiency", "--model", text, "--dense", dense, "--repeats", "1", "--json", str(js)]
    else:
        argv = ["eval", "features", "--model", model, "--reference", ref, "--dataset", folders["data"], "--json",
                str(js)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("secateur: error: ") and what in err[0], err
    assert not js.exists()
