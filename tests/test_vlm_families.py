"""Issue 47 §1, the VLM families beyond LLaVA: Idefics3 and SmolVLM (``Idefics3ForConditionalGeneration`` /
``SmolVLMForConditionalGeneration``: vision blocks ``model.vision_model.encoder.layers.N``, the connector
``model.connector``, language blocks ``model.text_model.layers.N``).

Invariants on the tiny random VLMs of :mod:`secateur.testing` (``save_tiny("idefics3" | "smolvlm", path)``):

* the folder holds the VLM and its processor (image processor, tokenizer with the image tokens, chat template); one
  forward on image + text through the processor; the caption paths write exactly the ids the processor writes for
  one image;
* each tower is the VLM's own modules (the language stand-in gives the VLM's logits on text bit for bit); the joint
  inventory is both towers' blocks and nothing else: no unit holds a connector, embedding or LM head parameter;
* a pruned VLM (``--towers language`` / ``vision`` / ``joint:language``, and a joint mask sliced over both towers)
  reloads with one ``from_pretrained`` and gives the in-memory logits on the same image and text;
* a vision tower with per-layer widths or fewer heads (Idefics3 builds it from its own class, which secateur makes
  honour ``secateur_layers``) reloads inside the VLM folder; a processor without the image token or the image
  processor: one line, exit 2, nothing written.
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

from secateur import api
from secateur.errors import SecateurError
from secateur.models.towers import image_seq_length, image_token_id, tower_model, vlm_inputs
from secateur.testing import save_tiny, save_tiny_vlm, tiny_vlm, tiny_vlm_processor

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = ("idefics3", "smolvlm")


def _fmnist_or_skip():
    from secateur.data.sources import default_data_dir

    d = default_data_dir()
    if d is None or not (d / "fashion-mnist").exists():
        pytest.skip("Fashion-MNIST not in ../shared/data")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlmf")
    return {f: save_tiny(f, root / f) for f in FAMILIES}


def _inputs(folder, n: int = 2):
    from PIL import Image
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(folder)
    rng = np.random.default_rng(0)
    imgs = [Image.fromarray(rng.integers(0, 255, (28, 28, 3), dtype=np.uint8)) for _ in range(n)]
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Caption: a shoe"}]}]
    text = proc.apply_chat_template(msgs)
    return proc, proc(images=imgs, text=[text] * n, return_tensors="pt")


@pytest.mark.parametrize("family", FAMILIES)
def test_folder_holds_the_processor_and_runs_image_and_text(folders, family):
    from transformers import AutoModelForImageTextToText

    from secateur.data.captions import caption_ids, check_processor

    folder = folders[family]
    vlm = AutoModelForImageTextToText.from_pretrained(folder).eval()
    assert vlm.config.model_type == family and type(vlm).__name__.endswith("ForConditionalGeneration")
    proc, x = _inputs(folder)
    check_processor(proc, vlm.config)
    assert proc.chat_template and proc.image_processor is not None
    ids = x["input_ids"]
    img = image_token_id(vlm.config)
    assert int((ids[0] == img).sum()) == image_seq_length(vlm.config) == 4  # 4 x 4 patches, pixel shuffle by 2
    assert x["pixel_values"].shape == (2, 1, 3, 28, 28)
    with torch.no_grad():
        z = vlm(**x).logits
    assert z.shape == (*ids.shape, 128) and bool(torch.isfinite(z).all())
    # the caption paths write the processor's own ids for one image and "Caption: a shoe"
    mine, _ = caption_ids(proc.tokenizer, vlm.config, ["a shoe"])
    assert mine[0, :-1].tolist() == ids[0].tolist()  # caption_ids ends the caption with EOS
    # secateur's [N, C, H, W] pixels become the VLM's [N, 1, C, H, W]: the same logits
    with torch.no_grad():
        z2 = vlm(**vlm_inputs(vlm, ids, x["pixel_values"][:, 0])).logits
    assert torch.equal(z, z2)


@pytest.mark.parametrize("family", FAMILIES)
def test_towers_share_the_vlm_modules_and_the_joint_inventory_is_their_blocks(family):
    from secateur.vlm_joint import joint_inventory, slice_joint

    vlm = tiny_vlm(family, layers=3)
    assert tower_model(vlm, "vision") is vlm.model.vision_model
    lm = tower_model(vlm, "language")
    assert lm.model is vlm.model.text_model and lm.lm_head is vlm.lm_head
    ids = torch.randint(3, 90, (2, 10))
    with torch.no_grad():
        assert torch.equal(lm(input_ids=ids).logits, vlm(input_ids=ids).logits)
    ji = joint_inventory(vlm)
    assert [p.name for p in ji.parts] == ["vision", "language"]
    v_layers, l_layers = vlm.model.vision_model.encoder.layers, vlm.model.text_model.layers
    assert all(a is b for a, b in zip(ji.part("vision").adapter.layers, v_layers, strict=True))
    assert all(a is b for a, b in zip(ji.part("language").adapter.layers, l_layers, strict=True))
    skip = ("norm", "out_proj.bias", "fc2.bias")  # norms and the residual-writing biases stay
    want = sum(p.numel() for layers in (v_layers, l_layers) for name, p in layers.named_parameters()
               if not any(s in name for s in skip))
    assert ji.inv.total_cost == want  # the blocks' projections and nothing else
    # removing every removable unit leaves the connector, embeddings, stem, norms and LM head bit-identical
    sliced = copy.deepcopy(vlm)
    sji = joint_inventory(sliced)
    assert slice_joint(sliced, sji, torch.ones(len(sji), dtype=torch.bool)) == {"vision": "hetero",
                                                                                "language": "hetero"}
    before, after = vlm.state_dict(), sliced.state_dict()
    outside = [k for k in before if ".layers." not in k]
    assert any(k.startswith("model.connector.") for k in outside) and "lm_head.weight" in outside
    assert all(torch.equal(before[k], after[k]) for k in outside)


def _uniform_vision_mask(ji) -> torch.Tensor:
    """Remove the same MLP channels in every vision layer (a uniform width the stock config expresses) and every
    fifth language unit (per-layer widths: the language tower's ``secateur_llama`` config)."""
    removed = torch.zeros(len(ji), dtype=torch.bool)
    v = ji.part("vision")
    for pool in v.inv.pools:
        if pool.kind in ("channel", "ffn_group"):
            removed[v.offset + pool.offset: v.offset + pool.offset + pool.n // 2] = True
    lang = ji.part("language")
    removed[lang.offset + 1: lang.offset + len(lang.inv): 5] = True  # 18 units a layer: a different set in each
    return removed


def _per_layer_vision_mask(ji) -> torch.Tensor:
    """Vision: one head and half the MLP channels of layer 1 only (per-layer widths and head counts); language as
    :func:`_uniform_vision_mask`."""
    removed = _uniform_vision_mask(ji)
    v = ji.part("vision")
    removed[v.offset:v.offset + len(v.inv)] = False
    for pool in v.inv.pools:
        if pool.layer == 1:
            removed[v.offset + pool.offset: v.offset + pool.offset + max(1, pool.n // 2)] = True
    return removed


@pytest.mark.parametrize("family,mask", [("idefics3", "uniform"), ("smolvlm", "uniform"),
                                         ("idefics3", "per-layer"), ("smolvlm", "per-layer")])
def test_joint_slice_over_both_towers_reloads_in_one_call(family, mask, tmp_path):
    """float32: the masked and the sliced VLM drop the same terms; only the summation order of the shortened dot
    products differs (logits of magnitude ~1: atol 1e-5 x the largest is loose by orders of magnitude). The
    reload itself is bit-exact."""
    from transformers import AutoModelForImageTextToText

    from secateur.vlm_joint import joint_inventory, slice_joint

    vlm = tiny_vlm(family, layers=3)
    ji = joint_inventory(vlm)
    removed = _uniform_vision_mask(ji) if mask == "uniform" else _per_layer_vision_mask(ji)
    g = torch.Generator().manual_seed(1)
    ids = torch.cat([torch.tensor([[98, 101] + [99] * 4 + [98]] * 2), torch.randint(3, 90, (2, 8), generator=g)], 1)
    px = torch.randn(2, 3, 28, 28, generator=g)
    with torch.no_grad(), ji.masked(removed):
        z_mask = vlm(**vlm_inputs(vlm, ids, px)).logits
    sliced = copy.deepcopy(vlm)
    routes = slice_joint(sliced, joint_inventory(sliced), removed)
    if mask == "uniform":
        assert routes == {"vision": "stock", "language": "hetero"}
        assert sliced.config.vision_config.intermediate_size == 32
    else:  # the vision config carries secateur_layers, which the VLM's own vision class honours on reload
        assert routes == {"vision": "hetero", "language": "hetero"}
        specs = sliced.config.vision_config.secateur_layers
        assert [s["n_heads"] for s in specs] == [2, 1, 2] and [s["intermediate"] for s in specs] == [64, 32, 64]
    sliced.save_pretrained(tmp_path / "s")
    back = AutoModelForImageTextToText.from_pretrained(tmp_path / "s").eval()
    with torch.no_grad():
        z_back, z_mem = back(**vlm_inputs(back, ids, px)).logits, sliced(**vlm_inputs(sliced, ids, px)).logits
    assert sum(p.numel() for p in back.parameters()) == sum(p.numel() for p in sliced.parameters())
    assert torch.equal(z_back, z_mem)
    torch.testing.assert_close(z_back, z_mask, rtol=0, atol=1e-5 * float(z_mask.abs().max()))


@pytest.mark.parametrize("family", FAMILIES)
def test_language_tower_pruned_and_reloaded(folders, family, tmp_path):
    from transformers import AutoModelForImageTextToText

    folder = folders[family]
    dense = AutoModelForImageTextToText.from_pretrained(folder).eval()
    out = tmp_path / "out"
    res = api.prune(model=str(folder), towers="language", method="wanda-sp", sparsity=0.3, calib="wikitext2",
                    nsamples=4, seqlen=32, out=str(out), quiet=True)
    pruned = res.model
    before, after = dense.state_dict(), pruned.state_dict()
    for k, v in before.items():  # everything outside the language blocks is bit-identical
        if not k.startswith("model.text_model.layers."):
            assert torch.equal(v, after[k]), k
    assert pruned.config.text_config.intermediate_size < dense.config.text_config.intermediate_size
    _, x = _inputs(folder)
    back = AutoModelForImageTextToText.from_pretrained(out).eval()
    with torch.no_grad():
        assert torch.equal(back(**x).logits, pruned(**x).logits)


def test_vision_tower_channels_pruned_and_reloaded_heads_refused(folders, tmp_path):
    """Uniform MLP channels of the vision tower reload in the stock config; fewer heads need the per-layer config
    (the stock class derives the head width from the head count), which a one-tower run refuses as for LLaVA (one
    line, nothing written; ``--towers joint`` writes it)."""
    from transformers import AutoModelForImageTextToText

    _fmnist_or_skip()
    folder = folders["idefics3"]
    out = tmp_path / "v"
    res = api.prune(model=str(folder), towers="vision", method="wanda-sp", units="channel", sparsity=0.25,
                    calib="fashion-mnist", nsamples=4, out=str(out), quiet=True)
    assert res.model.config.vision_config.intermediate_size == 48
    _, x = _inputs(folder)
    back = AutoModelForImageTextToText.from_pretrained(out).eval()
    with torch.no_grad():
        assert torch.equal(back(**x).logits, res.model(**x).logits)
    with pytest.raises(SecateurError, match="per-layer widths"):
        api.prune(model=str(folder), towers="vision", method="wanda-sp", sparsity=0.5, calib="fashion-mnist",
                  nsamples=4, out=str(tmp_path / "no"), quiet=True)
    assert not (tmp_path / "no").exists()


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    return save_tiny_vlm("smolvlm", tmp_path_factory.mktemp("vlmf") / "deep", layers=14)


def test_cli_joint_language_runs_on_caption_pairs_and_reloads(deep, tmp_path, capsys):
    """``--towers joint:language`` on image-caption pairs through the SmolVLM processor: the per-layer language
    config reloads with one call; ``eval captions`` scores the output."""
    from transformers import AutoModelForImageTextToText

    from secateur.cli import main

    _fmnist_or_skip()
    out = tmp_path / "j"
    assert main(["prune", "--model", deep, "--towers", "joint:language", "--method", "magnitude-sp", "--sparsity",
                 "0.1", "--calib", "fashion-mnist-captions", "--nsamples", "4", "--quiet", "--out", str(out)]) == 0
    rep = json.loads((out / "secateur-report.json").read_text())
    b = rep["vlm"]["budget"]
    assert set(b["by_tower"]) == {"language"} and 0.1 * b["removable"] <= b["removed_params"]
    back = AutoModelForImageTextToText.from_pretrained(out)
    assert sum(p.numel() for p in back.parameters()) == rep["vlm"]["params_after"] < rep["vlm"]["params_before"]
    assert main(["eval", "captions", "--model", str(out), "--max-images", "4", "--json", str(tmp_path / "c.json")]) == 0
    r = json.loads((tmp_path / "c.json").read_text())
    assert r["images"] == 4 and 1 < r["caption_ppl"] < float("inf")


def test_cli_joint_vision_per_layer_widths_reload(deep, tmp_path):
    """CoCurve's guard keeps the first and last two vision layers whole, so the vision tower's widths differ by
    layer: the VLM's vision config carries ``secateur_layers``, which SmolVLM's own vision class honours in a process
    that imported secateur: one ``from_pretrained`` gives the in-memory model."""
    from transformers import AutoModelForImageTextToText

    from secateur.cli import main

    _fmnist_or_skip()
    out = tmp_path / "jv"
    assert main(["prune", "--model", deep, "--towers", "joint:vision", "--method", "magnitude-sp", "--sparsity",
                 "0.1", "--calib", "fashion-mnist-captions", "--nsamples", "4", "--quiet", "--out", str(out)]) == 0
    rep = json.loads((out / "secateur-report.json").read_text())
    assert rep["vlm"]["routes"] == {"vision": "hetero"}
    cfg = json.loads((out / "config.json").read_text())
    widths = {s["intermediate"] for s in cfg["vision_config"]["secateur_layers"]}
    assert len(widths) > 1
    back = AutoModelForImageTextToText.from_pretrained(out).eval()
    assert sum(p.numel() for p in back.parameters()) == rep["vlm"]["params_after"] < rep["vlm"]["params_before"]
    _, x = _inputs(deep)
    dense = AutoModelForImageTextToText.from_pretrained(deep).eval()
    with torch.no_grad():
        assert not torch.equal(back(**x).logits, dense(**x).logits)


def _no_image_token(folder, tmp_path):
    """A copy of ``folder`` whose config names an image token id its processor does not write."""
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["image_token_id"] = 5
    (bad / "config.json").write_text(json.dumps(cfg))
    return bad


@pytest.mark.parametrize("case", ["no-image-token-prune", "no-image-token-eval", "no-image-processor-eval"])
def test_bad_inputs_one_line_exit_2_nothing_written(deep, folders, tmp_path, capsys, case):
    from secateur.cli import main

    out = tmp_path / "out"
    if case == "no-image-token-prune":
        bad = _no_image_token(folders["idefics3"], tmp_path)
        argv = ["prune", "--model", str(bad), "--towers", "joint", "--method", "magnitude-sp", "--sparsity", "0.1",
                "--calib", "fashion-mnist-captions", "--nsamples", "4", "--quiet", "--out", str(out)]
        match = "has no image token for id 5"
    elif case == "no-image-token-eval":
        bad = _no_image_token(folders["idefics3"], tmp_path)
        out = tmp_path / "c.json"
        argv = ["eval", "captions", "--model", str(bad), "--max-images", "4", "--json", str(out)]
        match = "has no image token for id 5"
    else:  # the processor's image half deleted: the file it needs is named
        import shutil

        bad = tmp_path / "bad"
        shutil.copytree(folders["smolvlm"], bad)
        (bad / "processor_config.json").unlink()
        out = tmp_path / "c.json"
        argv = ["eval", "captions", "--model", str(bad), "--max-images", "4", "--json", str(out)]
        match = "preprocessor_config.json"
    capsys.readouterr()
    assert main(argv) == 2
    err = [ln for ln in capsys.readouterr().err.strip().splitlines()
           if not ln.startswith(("secateur: note:", "[transformers]"))]
    assert len(err) == 1 and match in err[0], err
    assert not out.exists()


def test_tiny_processors_name_their_image_tokens():
    """The tokens the caption paths write are the processor's: ``<image>`` and, for Idefics3, the tokens around an
    untiled image."""
    from secateur.data.captions import IDEFICS3_IMAGE_TOKENS

    for family in FAMILIES:
        tok = tiny_vlm_processor(family).tokenizer
        ids = [tok.convert_tokens_to_ids(t) for t in ("<image>", *IDEFICS3_IMAGE_TOKENS)]
        assert len(set(ids)) == 3 and tok.unk_token_id not in ids


# --- Qwen2.5-VL: the language tower (Qwen2 blocks under M-RoPE) and the vision tower's MLP channels ---------------


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return save_tiny("qwen2_5_vl", tmp_path_factory.mktemp("vlmf") / "qwen")


def _qwen_inputs(folder, vlm):
    from secateur.data.captions import caption_ids
    from secateur.data.images import _run_processor
    from secateur.models.towers import load_processor

    proc = load_processor(folder, vlm.config)
    rng = np.random.default_rng(0)
    px = _run_processor(proc.image_processor, [rng.integers(0, 255, (28, 28, 3), dtype=np.uint8) for _ in range(2)],
                        "random", 3)
    ids, _ = caption_ids(proc.tokenizer, vlm.config, ["a shoe", "a bag"], px)
    return proc, ids, px


def test_qwen_folder_runs_image_and_text_and_counts_image_tokens(qwen):
    """The image processor's patch rows regrouped ``[N, h, w, D]``; image tokens ``t h w / merge^2`` (4 for a 28 x 28
    image in 7 x 7 patches merged 2 x 2); one forward on image + caption."""
    from transformers import AutoModelForImageTextToText

    from secateur.data.captions import check_processor

    vlm = AutoModelForImageTextToText.from_pretrained(qwen).eval()
    proc, ids, px = _qwen_inputs(qwen, vlm)
    check_processor(proc, vlm.config)
    assert proc.chat_template and px.shape == (2, 4, 4, 3 * 2 * 7 * 7)
    raw = proc.image_processor(images=[np.zeros((28, 28, 3), np.uint8)], return_tensors="pt")
    n = int(raw["image_grid_thw"].prod()) // 4
    assert n == image_seq_length(vlm.config, px) == 4
    assert ids[0, :n + 2].tolist() == [vlm.config.vision_start_token_id] + [image_token_id(vlm.config)] * n + \
        [vlm.config.vision_end_token_id]
    with torch.no_grad():
        z = vlm(**vlm_inputs(vlm, ids, px)).logits
    assert z.shape == (*ids.shape, 128) and bool(torch.isfinite(z).all())


def test_qwen_language_tower_pruned_and_reloaded(qwen, tmp_path):
    """The language stand-in (Qwen2's causal LM around the VLM's ``Qwen2_5_VLTextModel``) gives the VLM's logits on
    text bit for bit; a uniform wanda-sp prune writes the sizes into the VLM's own text config and reloads with the
    in-memory logits."""
    from transformers import AutoModelForImageTextToText

    vlm = tiny_vlm("qwen2_5_vl")
    lm = tower_model(vlm, "language")
    assert lm.model is vlm.model.language_model and lm.lm_head is vlm.lm_head
    ids = torch.randint(3, 90, (2, 10))
    with torch.no_grad():
        assert torch.equal(lm(input_ids=ids).logits, vlm(input_ids=ids).logits)
    out = tmp_path / "out"
    res = api.prune(model=str(qwen), towers="language", method="wanda-sp", sparsity=0.3, calib="wikitext2",
                    nsamples=4, seqlen=32, out=str(out), quiet=True)
    tc = res.model.config.text_config
    assert tc.model_type == "qwen2_5_vl_text" and tc.intermediate_size < 64
    back = AutoModelForImageTextToText.from_pretrained(out).eval()
    _, ids, px = _qwen_inputs(out, back)
    with torch.no_grad():
        assert torch.equal(back(**vlm_inputs(back, ids, px)).logits, res.model(**vlm_inputs(res.model, ids, px)).logits)


@pytest.fixture(scope="module")
def qwen_deep(tmp_path_factory):
    return save_tiny_vlm("qwen2_5_vl", tmp_path_factory.mktemp("vlmf") / "qwen_deep", layers=14)


@pytest.mark.parametrize("towers,match", [("vision", "pass --units channel"), ("joint", "not in a joint inventory"),
                                          ("joint:language", "cannot reload")])
def test_qwen_refusals_one_line_exit_2_nothing_written(qwen_deep, tmp_path, capsys, towers, match):
    from secateur.cli import main

    if towers == "joint:language":  # CoCurve's guard gives per-layer widths: Qwen2.5-VL builds its own text model
        _fmnist_or_skip()
    out = tmp_path / "out"
    capsys.readouterr()
    assert main(["prune", "--model", qwen_deep, "--towers", towers, "--method", "magnitude-sp", "--sparsity", "0.1",
                 "--calib", "fashion-mnist-captions", "--nsamples", "4", "--quiet", "--out", str(out)]) == 2
    err = [ln for ln in capsys.readouterr().err.strip().splitlines()
           if not ln.startswith(("secateur: note:", "[transformers]"))]
    assert len(err) == 1 and match in err[0], err
    assert not out.exists()


def test_qwen_merged_embeddings_carry_the_m_rope_positions(qwen):
    """The captured embeddings (with the VLM's M-RoPE position ids as trailing channels), fed to the language
    stand-in, give the VLM's logits on image + caption bit for bit: the language tower calibrates on what the VLM
    computes, image-token positions included."""
    from transformers import AutoModelForImageTextToText

    from secateur.models.towers import merged_embeddings

    vlm = AutoModelForImageTextToText.from_pretrained(qwen).eval()
    _, ids, px = _qwen_inputs(qwen, vlm)
    emb = merged_embeddings(vlm, ids, px)  # one chunk: the vision tower's sums in the order of the VLM's own call
    assert emb.shape == (*ids.shape, 32 + 3)
    lm = tower_model(vlm, "language")
    with torch.no_grad():
        want = vlm(**vlm_inputs(vlm, ids, px)).logits
        torch.testing.assert_close(lm(input_ids=emb).logits, want, rtol=0, atol=0)
        plain = lm(input_ids=emb[..., :32]).logits  # 1-D positions: the image tokens would be placed otherwise
    assert not torch.equal(plain, want)


def test_qwen_caption_pairs_calibrate_and_eval_captions_scores(qwen, tmp_path):
    from secateur.cli import main

    _fmnist_or_skip()
    out = tmp_path / "l"
    res = api.prune(model=str(qwen), towers="language", method="wanda-sp", sparsity=0.3,
                    calib="fashion-mnist-captions", nsamples=4, out=str(out), quiet=True)
    assert res.report["calibration"]["source"] == "fashion-mnist-captions"
    assert main(["eval", "captions", "--model", str(out), "--max-images", "4", "--json", str(tmp_path / "c.json")]) == 0
    r = json.loads((tmp_path / "c.json").read_text())
    assert r["images"] == 4 and 1 < r["caption_ppl"] < float("inf")


def test_qwen_vision_mlp_channels_scored_sliced_and_reloaded(qwen, tmp_path):
    """Qwen2.5-VL's vision MLP channels (``secateur.models.qwen_vision``): Wanda-sp ``||W_down[:, j]|| ||X_j||`` with
    ``X`` the gated activations recomputed here from each MLP's input; each block keeps its ``ceil(0.75 x 64) = 48``
    best; the sliced VLM equals the dense one with the removed channels' ``down_proj`` columns zeroed (float32
    summation order only), reloads in one call with the in-memory logits; heads, merger and the language tower are
    untouched."""
    from transformers import AutoModelForImageTextToText

    from secateur.models import qwen_vision as qv

    dense = AutoModelForImageTextToText.from_pretrained(qwen).eval()
    _, ids, px = _qwen_inputs(qwen, dense)
    # brute force: the MLP inputs of every block on these images, the gated activations, the scores
    xs = {i: [] for i in range(len(dense.model.visual.blocks))}
    hooks = [b.mlp.register_forward_pre_hook(lambda _m, a, i=i: xs[i].append(a[0].detach()))
             for i, b in enumerate(dense.model.visual.blocks)]
    with torch.no_grad():
        kw = vlm_inputs(dense, ids, px)
        dense.model.visual(kw["pixel_values"], grid_thw=kw["image_grid_thw"])
    for h in hooks:
        h.remove()
    stats = qv.down_input_energy(dense, px)
    want_keep = []
    for i, b in enumerate(dense.model.visual.blocks):
        x = torch.cat(xs[i]).double()
        m = b.mlp
        act = m.act_fn(x @ m.gate_proj.weight.double().T + m.gate_proj.bias.double()) * \
            (x @ m.up_proj.weight.double().T + m.up_proj.bias.double())
        score = m.down_proj.weight.double().norm(dim=0) * act.pow(2).sum(0).sqrt()
        got = qv.channel_scores(dense, "wanda-sp", stats)[i]
        torch.testing.assert_close(got, score, rtol=1e-5, atol=0)
        want_keep.append(torch.sort(torch.argsort(score, descending=True, stable=True)[:48]).values)
    pruned = copy.deepcopy(dense)
    info = qv.prune_vision_mlp(pruned, "wanda-sp", 0.25, px)
    assert all(torch.equal(torch.tensor(a), b) for a, b in zip(info["kept"], want_keep, strict=True))
    assert pruned.config.vision_config.intermediate_size == 48 == info["intermediate_after"]
    before, after = dense.state_dict(), pruned.state_dict()
    assert all(torch.equal(v, after[k]) for k, v in before.items() if ".mlp." not in k or "visual" not in k)
    zeroed = copy.deepcopy(dense)
    with torch.no_grad():
        for b, keep in zip(zeroed.model.visual.blocks, info["kept"], strict=True):
            drop = torch.ones(b.mlp.down_proj.in_features, dtype=torch.bool)
            drop[keep] = False
            b.mlp.down_proj.weight[:, drop] = 0
        z_zero = zeroed(**vlm_inputs(zeroed, ids, px)).logits
        z_mem = pruned(**vlm_inputs(pruned, ids, px)).logits
    torch.testing.assert_close(z_mem, z_zero, rtol=0, atol=1e-5 * float(z_zero.abs().max()))
    pruned.save_pretrained(tmp_path / "s")
    back = AutoModelForImageTextToText.from_pretrained(tmp_path / "s").eval()
    with torch.no_grad():
        assert torch.equal(back(**vlm_inputs(back, ids, px)).logits, z_mem)


@pytest.mark.parametrize("extra,match", [(["--method", "wanda"], "prunes MLP channels with"),
                                         (["--method", "wanda-sp"], "pass --units channel")])
def test_qwen_vision_refusals_one_line_exit_2_nothing_written(qwen, tmp_path, capsys, extra, match):
    from secateur.cli import main

    out = tmp_path / "out"
    capsys.readouterr()
    assert main(["prune", "--model", str(qwen), "--towers", "vision", "--sparsity", "0.2", "--calib", "fashion-mnist",
                 "--nsamples", "2", "--quiet", "--out", str(out), *extra]) == 2
    err = [ln for ln in capsys.readouterr().err.strip().splitlines()
           if not ln.startswith(("secateur: note:", "[transformers]"))]
    assert len(err) == 1 and match in err[0], err
    assert not out.exists()


def test_qwen_vision_cli_prunes_channels_and_reloads(qwen, tmp_path):
    from transformers import AutoModelForImageTextToText

    from secateur.cli import main

    _fmnist_or_skip()
    out = tmp_path / "v"
    assert main(["prune", "--model", str(qwen), "--towers", "vision", "--method", "wanda-sp", "--units", "channel",
                 "--sparsity", "0.25", "--calib", "fashion-mnist", "--nsamples", "4", "--quiet", "--out",
                 str(out)]) == 0
    rep = json.loads((out / "secateur-report.json").read_text())
    assert rep["details"]["vision_mlp"]["intermediate_after"] == 48 and rep["calibration"]["n"] == 4
    back = AutoModelForImageTextToText.from_pretrained(out)
    assert back.config.vision_config.intermediate_size == 48


def test_idefics3_one_cocurve_graph_spans_both_towers():
    """CoCurve's joint graph through the whole Idefics3 (image + caption in, caption tokens scored): its
    vision-language block is nonzero, and the baselines' one budget is met within one unit over both towers."""
    from secateur.data.captions import NAMES, TEMPLATES, caption_ids, caption_target
    from secateur.methods.cocurve import CoCurveConfig
    from secateur.scoring.cocurve_sweep import SweepConfig
    from secateur.vlm_joint import BASELINE_KINDS, CaptionData, joint_graph, joint_inventory, select_baseline

    vlm = tiny_vlm("idefics3", layers=4)
    tok = tiny_vlm_processor("idefics3").tokenizer
    caps = [TEMPLATES[i % len(TEMPLATES)].format(NAMES[3 * i % 10]) for i in range(4)]
    ids, target = caption_ids(tok, vlm.config, caps)
    assert torch.equal(target, caption_target(tok, vlm.config, ids))
    data = CaptionData(ids, torch.randn(4, 3, 28, 28, generator=torch.Generator().manual_seed(0)), target)
    cfg = CoCurveConfig(heldout=2, protect_first=1, protect_last=1, cap_factor=3.0, n_ffn_groups=2,
                        sweep=SweepConfig(top_r=32))
    ji = joint_inventory(vlm, n_ffn_groups=cfg.n_ffn_groups)
    g = joint_graph(vlm, ji, data, cfg)
    v = ji.part("vision")
    va = torch.nonzero(g.ablated[:len(v.inv)]).flatten()
    la = torch.nonzero(g.ablated[len(v.inv):]).flatten() + len(v.inv)
    assert va.numel() and la.numel()
    assert float(g.H[va][:, la].abs().max()) > 1e-6 * float(g.H.diagonal().max())
    bji = joint_inventory(vlm, kinds=BASELINE_KINDS)
    removed, _ = select_baseline(vlm, bji, data, "wanda-sp", 0.3, guard=bji.guard(0.3, 1, 1, 3.0))
    b = bji.budget(removed, 0.3)
    assert 0.3 * b["removable"] <= b["removed_params"] < 0.3 * b["removable"] + b["max_unit_cost"]
