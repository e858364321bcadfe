"""``--width-multiple N`` (issue 17 §1): every layer's kept MLP width a multiple of N (or the full width) under the
uniform, global and FLAP AL-AM allocators, the kept channels still the highest-scored of their layer, the realized
fraction the sliced model's; N = 1 is today's selection; streamed equals in-memory; bad values are refused."""

from __future__ import annotations

import pytest
import torch

from secateur import api
from secateur.budgets.allocate import allocate_uniform, shortfall_note, width_round
from secateur.budgets.select import select_units, selection_scores
from secateur.calib.collect import SCORE_STATS, collect_stats
from secateur.cli import main
from secateur.errors import SecateurError
from secateur.models.adapters import get_adapter
from secateur.structured.units import inventory, layer_shape
from secateur.testing import random_ids, save_tiny, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")
LAYERS = 4
F = 64  # the tiny models' MLP width
CASES = [("uniform", "flap"), ("flap", "flap"), ("global", "wanda_sp"), ("uniform", "magnitude")]


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    model = tiny_model("llama", layers=LAYERS)
    adapter = get_adapter(model)
    stats = collect_stats(model, adapter, random_ids(4, 32), SCORE_STATS, 2)
    return model, adapter, stats.groups


def _widths(inv, removed) -> list[int]:
    return [p.n - int(removed[p.offset:p.offset + p.n].sum()) for p in inv.pools if p.kind == "channel"]


def _select(tiny, allocation, method, rho, n):
    _, adapter, stats = tiny
    inv = inventory(adapter, ("kv_group", "channel"))
    scores = selection_scores(inv, adapter, method, stats, allocation=allocation)
    sel = select_units(adapter, method, rho, stats, allocation=allocation, width_multiple=n, scores=scores, inv=inv)
    removed = torch.zeros(len(inv), dtype=torch.bool)
    for p in inv.pools:
        keep = sel.layers.get(p.layer)
        if p.kind == "channel" and keep is not None and keep.channels is not None:
            removed[p.offset:p.offset + p.n] = ~torch.isin(torch.arange(p.n), torch.tensor(keep.channels))
    return inv, scores, sel, removed


@pytest.mark.parametrize("allocation,method", CASES)
@pytest.mark.parametrize("n", [8, 16, 24])
@pytest.mark.parametrize("rho", [0.1, 0.3, 0.55])
def test_kept_widths_are_multiples_and_the_highest_scored(tiny, allocation, method, n, rho):
    inv, scores, sel, removed = _select(tiny, allocation, method, rho, n)
    widths = _widths(inv, removed)
    assert all(w % n == 0 or w == F for w in widths), widths
    for p in inv.pools:  # inside a layer: every kept channel scores at least as high as every removed one
        if p.kind == "channel":
            s, r = scores[p.offset:p.offset + p.n], removed[p.offset:p.offset + p.n]
            if r.any() and (~r).any():
                assert float(s[~r].min()) >= float(s[r].max())
    info = sel.info
    assert info["width_multiple"] == n and 0 <= info["unrounded_realized"] <= 1
    assert info["removed_params"] == int(inv.costs[removed].sum()) + sum(  # attention is not rounded
        d["removed_params"] for k, d in info["by_kind"].items() if k != "channel")
    if allocation == "uniform":  # rounded up: never more removed than the ratio asks, on any layer
        _, _, plain, plain_removed = _select(tiny, allocation, method, rho, 1)
        assert widths == [width_round(w, F, n) for w in _widths(inv, plain_removed)]
        assert info["realized"] <= plain.info["realized"]
    else:  # a neighbouring multiple of the ranking's width, the total within half a layer's N channels
        _, _, plain, plain_removed = _select(tiny, allocation, method, rho, 1)
        for w, w0 in zip(widths, _widths(inv, plain_removed), strict=True):
            assert w == w0 or w0 % n and w in (w0 // n * n, min(F, w0 // n * n + n))
        assert info["unrounded_realized"] == plain.info["realized"]
        assert abs(info["realized"] - plain.info["realized"]) <= n * int(inv.costs.max()) / 2 / inv.total_cost


@pytest.mark.parametrize("allocation,method", CASES)
def test_width_multiple_1_is_todays_selection(tiny, allocation, method):
    _, adapter, stats = tiny
    for rho in (0.2, 0.5):
        a = select_units(adapter, method, rho, stats, allocation=allocation)
        b = select_units(adapter, method, rho, stats, allocation=allocation, width_multiple=1)
        assert a.to_dict() == b.to_dict() and "width_multiple" not in b.info


def test_full_width_when_n_is_no_multiple():
    """n = 64, N = 48: the kept width is 48 or all 64 (uniform at 10%: ceil(57.6) = 58 -> 64, nothing removed)."""
    model = tiny_model("llama", layers=2)
    inv = inventory(get_adapter(model), ("channel",))
    scores = torch.arange(len(inv), dtype=torch.float64)
    at10 = allocate_uniform(inv, scores, 0.1, width_multiple=48)
    assert _widths(inv, at10.removed) == [64, 64] and at10.info["realized"] == 0
    note = shortfall_note(at10.info, 0.1)
    assert "--width-multiple 48" in note and "smaller --width-multiple" in note
    at30 = allocate_uniform(inv, scores, 0.3, width_multiple=48)
    assert _widths(inv, at30.removed) == [48, 48]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("width")
    text = root / "calib.txt"
    text.write_text("The quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs. " * 30)
    return {"model": save_tiny("llama", root / "llama"), "text": str(text)}


@pytest.mark.parametrize("allocation", ["uniform", "flap-global"])
def test_realized_fraction_is_the_sliced_models(folder, tmp_path, allocation):
    rep = api.prune(model=folder["model"], method="flap", calib=folder["text"], sparsity=0.4, nsamples=4, seqlen=32,
                    quiet=True, allocation=allocation, compensation="none", width_multiple=16,
                    out=str(tmp_path / "o"))
    d, model = rep["details"], rep.model
    adapter = get_adapter(model)
    widths = [layer_shape(adapter, i).intermediate for i in range(adapter.n_layers)]
    assert all(w % 16 == 0 for w in widths) and d["width_multiple"] == 16
    total = rep["realized_sparsity"]["targeted_weights"]
    assert d["params_before"] - d["params_after"] == round(d["realized"] * total)
    assert d["params_after"] == sum(p.numel() for p in model.parameters())


def test_streamed_equals_in_memory(folder, tmp_path):
    import json

    from safetensors.torch import load_file

    kw = dict(model=folder["model"], method="flap", calib=folder["text"], sparsity=0.4, nsamples=4, seqlen=32,
              quiet=True, allocation="flap-global", width_multiple=16)
    api.prune(out=str(tmp_path / "mem"), **kw)
    rep = api.prune(out=str(tmp_path / "str"), stream=True, **kw)
    a, b = (load_file(tmp_path / d / "model.safetensors") for d in ("mem", "str"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    sa, sb = (json.loads((tmp_path / d / "secateur_selection.json").read_text()) for d in ("mem", "str"))
    assert sa == sb and rep["details"]["width_multiple"] == 16


@pytest.mark.parametrize("value,units,message", [
    (0, None, r"--width-multiple must be an integer >= 1, not 0"),
    (-8, None, r"--width-multiple must be an integer >= 1, not -8"),
    (2.5, None, r"--width-multiple: 2\.5 is not a valid value"),
    (True, None, r"--width-multiple: True is not a valid value"),
    (8, "kv_group", r"--width-multiple 8 rounds the kept MLP width of channel units, and attention widths"),
])
def test_refusals(folder, tmp_path, value, units, message):
    kw = {"units": units} if units else {}
    with pytest.raises(SecateurError, match=message):
        api.prune(model=folder["model"], method="wanda-sp", calib=folder["text"], sparsity=0.3, nsamples=2, seqlen=16,
                  quiet=True, width_multiple=value, out=str(tmp_path / "o"), **kw)
    assert not (tmp_path / "o").exists()


def test_refusals_below_the_methods(tiny):
    _, adapter, stats = tiny
    with pytest.raises(SecateurError, match="ffn_group units have uneven channel counts"):
        select_units(adapter, "wanda_sp", 0.3, stats, kinds=("kv_group", "ffn_group"), width_multiple=8)
    from secateur.methods.structured import StructuredConfig

    with pytest.raises(SecateurError, match="whole blocks have no width"):
        StructuredConfig(score="shortgpt", compensation="none", width_multiple=8).validate()


def test_cli_flag(folder, tmp_path, capsys):
    rc = main(["prune", "--model", folder["model"], "--method", "wanda-sp", "--structured", "--calib", folder["text"],
               "--nsamples", "2", "--seqlen", "16", "--sparsity", "0.3", "--width-multiple", "0", "--quiet",
               "--out", str(tmp_path / "o")])
    assert rc == 2 and "--width-multiple must be an integer >= 1, not 0" in capsys.readouterr().err


def test_gguf_names_the_matrices_k_quants_cannot_hold(tmp_path):
    """q8_0's fallbacks (rows not a multiple of 32) are named by ``export gguf``; so, in a note, are the matrices
    whose rows llama-quantize's k-quants (multiples of 256) cannot hold; a model whose rows all fit has no note."""
    from secateur.export import gguf as gx
    from secateur.export.sliced import save_pruned
    from secateur.structured.selection import LayerKeep, Selection
    from secateur.structured.slicing import apply_selection
    from secateur.testing import tiny_bpe_tokenizer

    def entry(name, *shape):
        return gx.Entry(name, shape, None)

    fits = [entry("token_embd.weight", 1000, 512), entry("blk.0.ffn_down.weight", 512, 768),
            entry("blk.0.attn_norm.weight", 512)]
    assert gx.kquant_note(fits) is None
    note = gx.kquant_note(fits + [entry("blk.1.ffn_down.weight", 512, 700)])
    assert "for 1 of 3 matrices (rows of 700: blk.1.ffn_down.weight)" in note and "--width-multiple 256" in note
    model = tiny_model("llama", layers=2)
    apply_selection(model, get_adapter(model), Selection(8, 2, {0: LayerKeep(channels=list(range(40)))}))
    save_pruned(model, tmp_path / "run", tiny_bpe_tokenizer(model.config.vocab_size))
    r = gx.export_gguf(tmp_path / "run", tmp_path / "m.gguf", "q8_0")
    assert ("blk.0.ffn_down.weight", "f16", "its rows hold 40 values, not a multiple of 32") in r["fallbacks"]
    assert any("rows of 40: blk.0.ffn_down.weight;" in n and "k-quants" in n for n in r["notes"])
