"""Issue 47, first slice: a LLaVA pruned one tower at a time through the ordinary pipeline (``--towers``).

Exact invariants on the tiny random LLaVA of :mod:`secateur.testing`: the language tower's stand-in model
shares the VLM's modules and gives the VLM's logits bit for bit on text; pruning a tower touches only that tower's
blocks (the projector, embeddings, LM head and the other tower are bit-identical); the saved folder reloads with
plain ``from_pretrained`` and gives the in-memory logits on the same image and text; the refusals end in one line,
exit 2, nothing written."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from secateur import api
from secateur.errors import SecateurError
from secateur.models.towers import tower_model
from secateur.testing import save_tiny, tiny_vlm

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny("llava", tmp_path_factory.mktemp("vlm") / "llava")


def _inputs(folder):
    from PIL import Image
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(folder)
    rng = np.random.default_rng(0)
    imgs = [Image.fromarray(rng.integers(0, 255, (28, 28, 3), dtype=np.uint8)) for _ in range(2)]
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "a photo of a shoe"}]}]
    text = proc.apply_chat_template(msgs)
    return proc(images=imgs, text=[text, text], return_tensors="pt")


def _state(model, skip: str) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items() if skip not in k}


def test_language_tower_shares_the_vlm_modules():
    vlm = tiny_vlm()
    lm = tower_model(vlm, "language")
    assert lm.model is vlm.model.language_model and lm.lm_head is vlm.lm_head
    ids = torch.randint(0, 98, (2, 12))
    with torch.no_grad():
        assert torch.equal(lm(input_ids=ids).logits, vlm(input_ids=ids).logits)
    assert tower_model(vlm, "vision") is vlm.model.vision_tower


@pytest.mark.parametrize("tower,method,calib", [("language", "wanda-sp", "wikitext2"),
                                                ("language", "wanda", "wikitext2"),
                                                ("vision", "magnitude", "fashion-mnist")])
def test_one_tower_pruned_the_rest_untouched_and_reloads(folder, tmp_path, tower, method, calib):
    from transformers import AutoModelForImageTextToText

    if calib == "fashion-mnist":
        from secateur.data.sources import default_data_dir

        d = default_data_dir()
        if d is None or not (d / "fashion-mnist").exists():
            pytest.skip("Fashion-MNIST not in ../shared/data")
    dense = AutoModelForImageTextToText.from_pretrained(folder).eval()
    other = "model.vision_tower" if tower == "language" else "model.language_model"
    out = tmp_path / "out"
    res = api.prune(model=str(folder), towers=tower, method=method, sparsity=0.3, calib=calib, nsamples=4,
                    seqlen=32, out=str(out), quiet=True)
    assert res.report["vlm"]["towers"] == {tower: 0.3}
    pruned = res.model
    mine = "model.language_model" if tower == "language" else "model.vision_tower"
    before, after = dense.state_dict(), pruned.state_dict()
    for k, v in before.items():  # everything outside the pruned tower's blocks is bit-identical
        if not k.startswith(mine) or "layers" not in k:
            assert torch.equal(v, after[k]), k
    changed = [k for k in before if k.startswith(mine) and "layers" in k
               and (before[k].shape != after[k].shape or not torch.equal(before[k], after[k]))]
    assert changed, "the tower was not pruned"
    assert all(not k.startswith(other) for k in changed)
    x = _inputs(folder)
    back = AutoModelForImageTextToText.from_pretrained(out).eval()
    with torch.no_grad():
        torch.testing.assert_close(back(**x).logits, pruned(**x).logits, rtol=0, atol=0)


def test_refusals_in_one_line(folder, tmp_path):
    out = tmp_path / "no"
    with pytest.raises(SecateurError, match="names no towers to prune; pass --towers"):
        api.prune(model=str(folder), method="wanda", sparsity=0.3, calib="wikitext2", nsamples=2, seqlen=16,
                  out=str(out))
    with pytest.raises(SecateurError, match="per-layer widths"):  # FLAP's per-layer allocation: no stock config
        api.prune(model=str(folder), towers="language", method="flap", sparsity=0.3, calib="wikitext2", nsamples=4,
                  seqlen=32, out=str(out), quiet=True)
    assert not out.exists()


def _fmnist_or_skip():
    from secateur.data.sources import default_data_dir

    d = default_data_dir()
    if d is None or not (d / "fashion-mnist").exists():
        pytest.skip("Fashion-MNIST not in ../shared/data")


def test_merged_embeddings_are_what_the_language_model_receives():
    """The captured embeddings, fed to the language tower's stand-in, give the VLM's logits on image + text."""
    from secateur.models.towers import merged_embeddings

    vlm = tiny_vlm()
    n_img, img = vlm.config.image_seq_length, vlm.config.image_token_index
    ids = torch.cat([torch.full((2, n_img), img), torch.randint(3, 90, (2, 6))], 1)
    px = torch.randn(2, 3, 28, 28)
    emb = merged_embeddings(vlm, ids, px, chunk=1)
    lm = tower_model(vlm, "language")
    with torch.no_grad():
        torch.testing.assert_close(lm(input_ids=emb).logits, vlm(input_ids=ids, pixel_values=px).logits,
                                   rtol=0, atol=0)


def test_language_tower_calibrated_on_caption_pairs(folder, tmp_path):
    """``--calib fashion-mnist-captions``: the statistics come from image + caption sequences (the manifest says so),
    and another draw of pairs gives another mask; the vision tower refuses caption pairs in one line."""
    _fmnist_or_skip()
    res = api.prune(model=str(folder), towers="language", method="wanda", sparsity=0.5,
                    calib="fashion-mnist-captions", nsamples=6, seed=0, quiet=True)
    assert res.report["calibration"]["source"] == "fashion-mnist-captions"
    text = api.prune(model=str(folder), towers="language", method="wanda", sparsity=0.5, calib="wikitext2",
                     nsamples=6, seqlen=24, quiet=True)
    w = "model.language_model.layers.0.mlp.down_proj.weight"
    assert not torch.equal(res.model.state_dict()[w] == 0, text.model.state_dict()[w] == 0)
    with pytest.raises(SecateurError, match="image-caption pairs for the language tower"):
        api.prune(model=str(folder), towers="vision", method="wanda", sparsity=0.5, calib="fashion-mnist-captions",
                  nsamples=4, out=str(tmp_path / "no"))
    assert not (tmp_path / "no").exists()


def test_eval_captions_cli_and_refusals(folder, tmp_path):
    """``secateur eval captions`` on the tiny VLM: the scores are fractions, the perplexity finite; a classifier
    folder and a missing folder are one line, exit 2, no JSON written."""
    import json as _json

    from secateur.cli import main

    _fmnist_or_skip()
    out = tmp_path / "c.json"
    assert main(["eval", "captions", "--model", str(folder), "--max-images", "8", "--json", str(out)]) == 0
    r = _json.loads(out.read_text())
    assert r["images"] == 8 and 0 <= r["caption_accuracy"] <= 1 and 0 <= r["multiple_choice_accuracy"] <= 1
    assert 1 < r["caption_ppl"] < float("inf")
    vit = save_tiny("vit", tmp_path / "vit")
    for bad in (vit, str(tmp_path / "nowhere")):
        assert main(["eval", "captions", "--model", bad, "--json", str(tmp_path / "x.json")]) == 2
    assert not (tmp_path / "x.json").exists()


def test_both_towers_equal_one_tower_then_the_other(folder, tmp_path):
    """``--towers vision=0.5,language=0.3`` is the vision run, saved, then the language run on that folder (its
    caption pairs through the pruned vision tower): the same weights bit for bit."""
    _fmnist_or_skip()
    kw = dict(method="wanda", calib="fashion-mnist-captions", nsamples=4, quiet=True)
    both = api.prune(model=str(folder), towers="language=0.3,vision=0.5", sparsity=0.9, **kw)
    assert both.report["vlm"]["towers"] == {"vision": 0.5, "language": 0.3}  # the data's order, not the given one
    api.prune(model=str(folder), towers="vision", sparsity=0.5, out=str(tmp_path / "v"),
              **(kw | {"calib": "fashion-mnist"}))
    second = api.prune(model=str(tmp_path / "v"), towers="language", sparsity=0.3, **kw)
    a, b = both.model.state_dict(), second.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="visonlaguae=0.123,", max_size=30), st.floats(0, 0.99))
def test_towers_spec_parses_or_says_how(spec, sparsity):
    """Any --towers text: a list of distinct towers in the data's order with ratios in [0, 1), or one line naming
    the form."""
    from secateur.models.towers import TOWERS, parse_towers

    try:
        plan = parse_towers(spec, sparsity)
    except SecateurError as e:
        assert "\n" not in str(e)
        return
    names = [t for t, _ in plan]
    assert names == [t for t in TOWERS if t in names] and len(set(names)) == len(names) >= 1
    assert all(0 <= r < 1 for _, r in plan)


def test_both_towers_need_caption_pairs(folder, tmp_path):
    with pytest.raises(SecateurError, match="fashion-mnist-captions"):
        api.prune(model=str(folder), towers="vision,language", method="wanda", calib="wikitext2",
                  out=str(tmp_path / "no"))
    assert not (tmp_path / "no").exists()
