"""Vision encoders end to end: every family's adapter (layout, staged forward, block-0 input), the structured methods
through the CLI with outputs that reload (secateur and plain transformers, in this process and, per-layer, in a
process without secateur), unstructured masks and ``eval accuracy``, the one-line refusals, and CORP's channel
budget as a property."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from contract import check
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from secateur import api
from secateur.masks_file import load_masks
from secateur.models.families import ADAPTERS, get_adapter
from secateur.models.loading import load_model
from secateur.testing import VISION_FAMILIES, random_pixels, save_tiny, tiny_vision_model

pytestmark = pytest.mark.usefixtures("one_thread")

BACKBONES = ("siglip_vision_model", "clip_vision_model", "idefics3_vision", "smolvlm_vision")  # towers: no classifier
#: (family, headless) for every model class of a family: the task model and, where it differs, the backbone
MODELS = [(f, False) for f in VISION_FAMILIES] + [(f, True) for f in VISION_FAMILIES if ADAPTERS[f].more_classes]
N_IMAGES = 8
STRUCTURED = {"wanda-sp": ["--compensation", "ls"], "flap": [], "corp": [], "shortgpt": []}
#: tokens entering block 0 of a 16 x 16 image in 4 x 4 patches: 16 patches + CLS (+ DeiT's distillation token;
#: SigLIP has no CLS)
TOKENS = {"vit": 17, "deit": 18, "dinov2": 17, "siglip_vision_model": 16, "clip_vision_model": 17, "siglip": 16,
          "clip": 17, "idefics3_vision": 16, "smolvlm_vision": 16}


def _auto(family: str, headless: bool = False):
    return transformers.AutoModel if headless or family in BACKBONES else transformers.AutoModelForImageClassification


def _output(model, px: torch.Tensor) -> torch.Tensor:
    """Class logits (DeiT with teacher: the mean of its heads) or, for a backbone, the last hidden state."""
    with torch.no_grad():
        o = model(pixel_values=px)
    return o.logits if getattr(o, "logits", None) is not None else o.last_hidden_state


def _n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def _pixels(folder: Path, images: np.ndarray) -> torch.Tensor:
    """The images as the folder's own image processor (plain transformers) makes them."""
    proc = transformers.AutoImageProcessor.from_pretrained(folder)
    return proc(images=list(images), return_tensors="pt")["pixel_values"]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict:
    """A saved tiny model of every family (``models[family]``), headless ViT, and 8 random uint8 16x16x3 images
    with labels 0..7 (``npz``; the array: ``images``)."""
    root = tmp_path_factory.mktemp("vision")
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (N_IMAGES, 16, 16, 3), dtype=np.uint8)
    np.savez(root / "images.npz", images=images, labels=np.arange(N_IMAGES) % 10)
    models = {f: Path(save_tiny(f, root / f)) for f in VISION_FAMILIES}
    models["vit-headless"] = Path(save_tiny("vit", root / "vit-headless", headless=True))
    return {"root": root, "models": models, "npz": root / "images.npz", "images": images}


# --- 1. the adapter ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("family", "headless"), MODELS)
def test_layout_staged_forward_and_block0_input(family, headless):
    model = tiny_vision_model(family, headless=headless)
    a = get_adapter(model)
    assert type(a) is ADAPTERS[family] and a.modality == "vision"
    a.check_layout()
    px = random_pixels(3)
    h, kw = a.capture_inputs(px)
    assert tuple(h.shape) == (3, TOKENS[family], 32)
    with torch.no_grad():
        ref = model(pixel_values=px, output_hidden_states=True).hidden_states
        base_last = a.base(pixel_values=px).last_hidden_state
    assert len(ref) == a.n_layers + 1
    # Error argument: the staged forward runs the block's own modules (norms, SDPA, projections, layer scale) on the
    # same float32 inputs, so it can differ from the block's forward only by the order of a few roundings (a
    # residual add regrouped), each at most one ulp of the activations: atol = 8 eps * max|h| (about 1e-6 on these
    # O(1) values). A wrong stage (a norm skipped, a residual or layer scale missed) is off by O(1).
    eps = torch.finfo(torch.float32).eps
    torch.testing.assert_close(h, ref[0], atol=8 * eps * max(1.0, ref[0].abs().max().item()), rtol=0)
    with torch.no_grad():
        for i, layer in enumerate(a.layers):
            k = a.layer_kwargs(i, kw)
            x = a.attn_norm(layer, h)
            o_out = a.out_module(layer, "attn_out")(a.attn_core(layer, x, k))
            h2 = a.attn_residual(layer, h, o_out)
            m = a.mlp_core(layer, a.mlp_norm(layer, h2))
            staged = a.mlp_residual(layer, h2, a.out_module(layer, "mlp_out")(m))
            block = a.block_forward(layer, h, k)
            atol = 8 * eps * max(1.0, block.abs().max().item())
            torch.testing.assert_close(staged, block, atol=atol, rtol=0, msg=f"{family} block {i}")
            torch.testing.assert_close(block, ref[i + 1], atol=atol, rtol=0, msg=f"{family} block {i} vs model")
            h = block
        last = a.final_hidden(h)
    torch.testing.assert_close(last, base_last, atol=8 * eps * max(1.0, base_last.abs().max().item()), rtol=0)


# --- 2. structured methods through the CLI, reloaded ---------------------------------------------------------------

@pytest.mark.parametrize("method", list(STRUCTURED))
@pytest.mark.parametrize("family", VISION_FAMILIES)
def test_structured_prune_reloads_with_equal_output(inputs, tmp_path, family, method):
    folder, npz = inputs["models"][family], inputs["npz"]
    out = tmp_path / "cli"
    code, _, _ = check(f"vision-prune:{method}", ["prune", "--model", folder, "--method", method, "--sparsity", "0.5",
                                                  "--calib", npz, "--nsamples", str(N_IMAGES), "--out", out,
                                                  "--quiet", *STRUCTURED[method]],
                       [tmp_path, folder, npz], allowed_new=[out])
    assert code == 0
    extra = {"compensation": "ls"} if method == "wanda-sp" else {}
    res = api.prune(model=str(folder), method=method, sparsity=0.5, calib=str(npz), nsamples=N_IMAGES,
                    out=str(tmp_path / "api"), quiet=True, **extra)
    px = _pixels(out, inputs["images"])
    want = _output(res.model.eval(), px)
    dense = _n_params(_auto(family).from_pretrained(folder))

    reloaded, proc = load_model(str(out))
    assert proc is not None
    torch.testing.assert_close(proc(images=list(inputs["images"]), return_tensors="pt")["pixel_values"], px,
                               atol=0, rtol=0)
    got = _output(reloaded.eval(), px)
    assert got.shape == want.shape and torch.allclose(got, want, atol=1e-5), \
        f"load_model: max |diff| {(got - want).abs().max().item()}"
    plain = _auto(family).from_pretrained(out).eval()
    assert type(plain).__name__.endswith(type(reloaded).__name__.removeprefix("Secateur")), \
        f"plain transformers built {type(plain).__name__}, secateur {type(reloaded).__name__}"
    got = _output(plain, px)
    assert got.shape == want.shape and torch.allclose(got, want, atol=1e-5), \
        f"{type(plain).__name__}: max |diff| {(got - want).abs().max().item()}"
    assert _n_params(reloaded) == _n_params(plain) == _n_params(res.model) < dense


# --- 3. a per-layer export without secateur ------------------------------------------------------------------------

_WITHOUT_SECATEUR = """
import sys
sys.modules["secateur"] = None  # any import of secateur fails
import torch
import transformers
torch.set_num_threads(1)
out, ref = sys.argv[1], torch.load(sys.argv[2])
model = getattr(transformers, sys.argv[3]).from_pretrained(out, trust_remote_code=True).eval()
with torch.no_grad():
    o = model(pixel_values=ref["px"])
y = o.logits if getattr(o, "logits", None) is not None else o.last_hidden_state
torch.save(y, sys.argv[4])
assert not [m for m in sys.modules if m.split(".")[0] == "secateur" and sys.modules[m] is not None]
print("OK", type(model).__module__, type(model).__name__)
"""


@pytest.mark.parametrize("name", ["vit", "vit-headless"])
def test_per_layer_export_loads_without_secateur(inputs, tmp_path, name):
    folder, headless = inputs["models"][name], name.endswith("headless")
    out = tmp_path / "out"
    res = api.prune(model=str(folder), method="flap", allocation="flap-global", sparsity=0.5, calib=str(inputs["npz"]),
                    nsamples=N_IMAGES, out=str(out), quiet=True)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"].startswith("secateur_")
    widths = {(s["n_heads"], s["intermediate"]) for s in cfg["secateur_layers"]}
    assert len(widths) > 1, f"flap-global gave every layer the same widths: {cfg['secateur_layers']}"
    px = _pixels(out, inputs["images"])
    want = _output(res.model.eval(), px)
    torch.save({"px": px}, tmp_path / "ref.pt")
    auto = _auto("vit", headless).__name__
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env |= {"HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-c", _WITHOUT_SECATEUR, str(out), str(tmp_path / "ref.pt"), auto,
                          str(tmp_path / "got.pt")], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.startswith("OK transformers_modules."), run.stdout  # the class from the shipped file
    assert run.stdout.split()[-1] == "Secateur" + type(res.model).__name__.removeprefix("Secateur"), run.stdout
    got = torch.load(tmp_path / "got.pt")
    assert got.shape == want.shape and torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


# --- 4. unstructured masks and eval accuracy -----------------------------------------------------------------------

def test_unstructured_wanda_masks_and_accuracy(inputs, tmp_path):
    folder, npz = inputs["models"]["vit"], inputs["npz"]
    out = tmp_path / "out"
    check("vision-prune:wanda", ["prune", "--model", folder, "--method", "wanda", "--sparsity", "0.5", "--calib", npz,
                                 "--nsamples", str(N_IMAGES), "--out", out, "--quiet"],
          [tmp_path, folder, npz], allowed_new=[out])
    assert (out / "secateur-masks.npz").is_file()
    report = json.loads((out / "secateur-report.json").read_text())
    assert report["realized_sparsity"]["targeted"] == pytest.approx(0.5, abs=1e-12)
    masks = load_masks(out / "secateur-masks.npz")
    model = transformers.AutoModelForImageClassification.from_pretrained(out).eval()
    assert len(masks) == 6 * model.config.num_hidden_layers
    for name, mask in masks.items():
        w = model.get_submodule(name).weight
        assert mask.shape == w.shape and mask.float().mean().item() == 0.5, name
        assert torch.all(w[mask] == 0) and torch.all(w[~mask] != 0), name
    code, stdout, _ = check("vision-eval-accuracy", ["eval", "accuracy", "--model", out, "--dataset", npz, "--json",
                                                     tmp_path / "acc.json", "--quiet"],
                            [tmp_path, npz], allowed_new=[tmp_path / "acc.json"])
    assert code == 0 and "top-1" in stdout
    acc = json.loads((tmp_path / "acc.json").read_text())
    logits = _output(model, _pixels(out, inputs["images"]))
    labels = torch.arange(N_IMAGES) % 10
    rank = (logits > logits.gather(1, labels[:, None])).sum(1)  # ties have probability 0 on random logits
    assert acc["n_images"] == N_IMAGES
    assert acc["top1"] == pytest.approx((rank < 1).float().mean().item())
    assert acc["top5"] == pytest.approx((rank < 5).float().mean().item())


# --- 5. refusals ---------------------------------------------------------------------------------------------------

def _refusal_inputs(inputs, tmp: Path, case: str) -> tuple[Path, Path, list[str]]:
    """(model folder, --calib, extra arguments) of a refused prune."""
    model, calib = inputs["models"]["vit"], inputs["npz"]
    extra = {"calib-self": ["--calib", "self"], "calib-c4": ["--calib", "c4"], "qk-wanda": ["--method", "qk-wanda"],
             "cocurve": ["--method", "cocurve"], "eval-ppl": ["--eval-ppl", "wikitext2"]}.get(case, [])
    if case == "small-images":
        calib = tmp / "small.npz"
        np.savez(calib, images=np.random.default_rng(0).integers(0, 256, (N_IMAGES, 2, 2, 3), dtype=np.uint8))
    elif case == "empty-folder":
        calib = tmp / "empty"
        calib.mkdir()
    elif case == "truncated-png":
        calib = tmp / "pngs"
        calib.mkdir()
        for i, img in enumerate(inputs["images"][:3]):
            Image.fromarray(img).save(calib / f"{i}.png")
        data = (calib / "1.png").read_bytes()
        (calib / "1.png").write_bytes(data[: len(data) // 2])
    elif case == "no-processor":
        model = tmp / "noproc"
        shutil.copytree(inputs["models"]["vit"], model)
        (model / "preprocessor_config.json").unlink()
    return model, calib, extra


REFUSALS = {"calib-self": "--calib self is text", "calib-c4": "--calib c4 is text",
            "qk-wanda": "--method qk-wanda does not apply to a vision model",
            "cocurve": "--method cocurve does not apply to a vision model",
            "eval-ppl": "--eval-ppl measures next-token perplexity", "small-images": "smaller than the model's 4x4",
            "empty-folder": "holds no images", "truncated-png": "1.png cannot be decoded",
            "no-processor": "no image processor"}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refusal_is_one_line_and_writes_nothing(inputs, tmp_path, case):
    model, calib, extra = _refusal_inputs(inputs, tmp_path, case)
    out = tmp_path / "out"
    argv = ["prune", "--model", model, "--method", "wanda-sp", "--sparsity", "0.5", "--calib", calib, "--nsamples",
            "3", "--out", out, "--quiet"]
    for i in range(0, len(extra), 2):  # replace the default's value
        if extra[i] in argv:
            argv[argv.index(extra[i]) + 1] = extra[i + 1]
        else:
            argv += extra[i:i + 2]
    code, _, err = check(f"vision-refusal:{case}", argv, [tmp_path, inputs["models"]["vit"]])
    assert code == 2, f"{case} was accepted"
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("secateur: error:"), err
    assert REFUSALS[case] in lines[0], lines[0]
    assert not out.exists()


# --- 6. CORP's channel budget --------------------------------------------------------------------------------------

@settings(max_examples=8, deadline=None)
@given(sparsity=st.floats(0.1, 0.7), family=st.sampled_from(VISION_FAMILIES))
def test_corp_channels_keep_the_budget_and_reload(inputs, sparsity, family):
    folder = inputs["models"][family]
    inter = get_adapter(tiny_vision_model(family)).geometry.intermediate
    share = 1 / inter  # one channel of one layer's MLP weights (fc1 row and bias, fc2 column)
    with tempfile.TemporaryDirectory(dir=inputs["root"]) as tmp:
        res = api.prune(model=str(folder), method="corp", units="channel", sparsity=sparsity, calib=str(inputs["npz"]),
                        nsamples=N_IMAGES, out=str(Path(tmp) / "out"), quiet=True)
        rs = res["realized_sparsity"]
        assert abs(rs["targeted"] - sparsity) <= share + 1e-9, rs
        assert all(abs(v - sparsity) <= share + 1e-9 for v in rs["per_module"].values()), rs
        allowed = {inter - math.floor(sparsity * inter), inter - math.ceil(sparsity * inter)}
        reloaded, _ = load_model(str(Path(tmp) / "out"))
        a = get_adapter(reloaded)
        for layer in a.layers:
            assert a.role_refs(layer)["down"].module.in_features in allowed
            assert a.role_refs(layer)["up"].module.out_features in allowed
        px = random_pixels(4)
        want, got = _output(res.model.eval(), px), _output(reloaded.eval(), px)
        assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
