"""Sequential engine: staged block forward equals the reference forward; statistics; bad activations."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from secateur.calib import engine, stats
from secateur.calib.stats import Gram, MeanVar, SumSq
from secateur.errors import SecateurError
from secateur.models.adapters import get_adapter
from secateur.testing import FAMILIES, random_ids, tiny_model


def _last_block_output(model, adapter, ids):
    cap = {}

    def hook(_m, _a, out):
        cap["h"] = out[0] if isinstance(out, tuple) else out

    h = adapter.layers[-1].register_forward_hook(hook)
    with torch.no_grad():
        model(ids)
    h.remove()
    return cap["h"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", engine.MODES)
def test_staged_propagation_matches_reference_forward(family, mode):
    model = tiny_model(family)
    adapter = get_adapter(model)
    ids = random_ids(5, 16)
    ref = _last_block_output(model, adapter, ids)
    rep = engine.run(model, adapter, ids, engine.Handler(), mode=mode, chunk_size=2, progress=False,
                     keep_outputs=True)
    torch.testing.assert_close(torch.cat(rep.outputs), ref, rtol=1e-5, atol=1e-6)


class _Zero(engine.Handler):
    """Zero the MLP output projection: the pruned-propagation output must then skip the MLP."""

    def on_group(self, ctx, group, names, accs):
        if group == "mlp_out":
            for n in names:
                ctx.refs[n].weight.data.zero_()
                if ctx.refs[n].bias is not None:
                    ctx.refs[n].bias.data.zero_()


@pytest.mark.parametrize("family", ["llama", "opt", "gpt2"])
def test_sequential_mode_propagates_pruned_outputs(family):
    model = tiny_model(family)
    adapter = get_adapter(model)
    ids = random_ids(3, 16)
    rep = engine.run(model, adapter, ids, _Zero(), mode="sequential", chunk_size=2, progress=False,
                     keep_outputs=True)
    ref = _last_block_output(model, adapter, ids)  # the model is pruned in place now
    torch.testing.assert_close(torch.cat(rep.outputs), ref, rtol=1e-5, atol=1e-6)
    dense = tiny_model(family)
    assert not torch.allclose(ref, _last_block_output(dense, get_adapter(dense), ids))


class _Collect(engine.Handler):
    def __init__(self):
        self.got = {}

    def accumulators(self, ctx, group, names):
        d = ctx.refs[names[0]].in_features
        return {"sumsq": SumSq(d), "meanvar": MeanVar(d), "gram": Gram(d)}

    def on_group(self, ctx, group, names, accs):
        self.got[(ctx.index, group)] = accs


def test_statistics_match_hooked_inputs():
    model = tiny_model("llama")
    adapter = get_adapter(model)
    ids = random_ids(4, 12)
    inputs = {}
    layer = adapter.layers[1]
    hk = layer.mlp.down_proj.register_forward_pre_hook(lambda m, a: inputs.setdefault("x", a[0]))
    with torch.no_grad():
        model(ids)
    hk.remove()
    x = inputs["x"].reshape(-1, inputs["x"].shape[-1]).double()
    h = _Collect()
    engine.run(model, adapter, ids, h, mode="dense", chunk_size=3, progress=False)
    accs = h.got[(1, "mlp_out")]
    torch.testing.assert_close(accs["sumsq"].sumsq, (x * x).sum(0), rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(accs["meanvar"].mean, x.mean(0), rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(accs["meanvar"].var, x.var(0, unbiased=False), rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(accs["gram"].G, x.T @ x, rtol=1e-5, atol=1e-6)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 300), d=st.integers(stats.GRAM_MIN_WIDTH - 3, stats.GRAM_MIN_WIDTH + 150),
       seed=st.integers(0, 1000))
def test_the_triangle_gram_is_the_full_product(n, d, seed):
    """``stats.gram`` computes the block upper triangle and mirrors it: exactly symmetric, and each entry the same
    dot product as the full GEMM's. On the BLAS we ship that is the full product bit for bit; a BLAS that sums a
    sub-block in another order stays within float32 rounding of an n-term sum of products (n eps |x|^2: 1e-4 here
    relative to the largest entry, the diagonal)."""
    x = torch.randn(n, d, generator=torch.Generator().manual_seed(seed))
    got, full = stats.gram(x), x.T @ x
    assert torch.equal(got, got.T)
    if not torch.equal(got, full):
        assert float((got - full).abs().max()) <= 1e-4 * float(full.diagonal().max())


def test_chunking_does_not_change_statistics():
    x = torch.randn(6, 10, 5)
    a, b = MeanVar(5), MeanVar(5)
    a.update(x)
    for c in x.split(4):
        b.update(c)
    torch.testing.assert_close(a.var, b.var)
    torch.testing.assert_close(a.mean, b.mean)


def test_nan_activations_raise_clear_error():
    model = tiny_model("llama")
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[0, 0] = float("nan")
    with pytest.raises(SecateurError, match="non-finite"):
        engine.run(model, get_adapter(model), random_ids(2, 8), _Collect(), progress=False)


def test_unknown_family_names_supported_ones():
    model = tiny_model("llama")
    model.config.model_type = "mamba"
    with pytest.raises(SecateurError, match="supported: gemma3_text, gpt2, llama, mistral, opt, phi3, qwen2, qwen3"):
        get_adapter(model)


@pytest.mark.parametrize("family", ["llama", "opt", "gpt2"])
def test_walk_visits_every_block_and_hands_on_the_dense_outputs(family):
    """The one block walker: chunked inputs, every block once in order, outputs computed once and fed to the
    next block; the last block's outputs equal the reference forward's."""
    model = tiny_model(family)
    adapter = get_adapter(model)
    ids = random_ids(5, 8)
    walk = engine.Walk(adapter, ids, 2)
    assert [h.shape[0] for h in walk.hs] == [2, 2, 1] and all(h.device.type == "cpu" for h in walk.hs)
    seen, prev = [], None
    for visit in walk.blocks():
        seen.append(visit.index)
        if prev is not None:
            assert all(a is b for a, b in zip(visit.inputs, prev))  # the previous block's outputs, not copies
        y0 = visit.output(0)
        assert torch.equal(visit.output(0), y0)  # computed once
        expect = adapter.block_forward(visit.layer, visit.input(1), visit.kwargs)
        assert torch.equal(visit.output(1), expect)
        prev = visit.outputs
        assert len(prev) == 3 and prev[2].shape[0] == 1
    assert seen == list(range(adapter.n_layers))
    ref = _last_block_output(model, adapter, ids)
    torch.testing.assert_close(torch.cat(walk.hs), ref, rtol=1e-5, atol=1e-5)
    sub = list(engine.Walk(adapter, ids, 5).blocks(layers=[1], progress=False))
    assert [v.index for v in sub] == [1]


def test_gemma3_blocks_get_their_layer_types_mask_and_rope():
    """Gemma-3 mixes sliding (window 8 in the tiny config, RoPE 1e4) and global (RoPE 1e6) layers: each block
    gets its own type's kwargs, so calibration longer than the window matches the model's own forward."""
    model = tiny_model("gemma3_text", layers=4)
    adapter = get_adapter(model)
    ids = random_ids(3, 24)  # 24 > sliding_window 8
    adapter.check_calibration_length(24)  # per-type masks: no refusal
    _, kw = adapter.capture_inputs(ids[:1])
    k0, k1 = adapter.layer_kwargs(0, kw), adapter.layer_kwargs(1, kw)
    assert not torch.equal(k0["position_embeddings"][0], k1["position_embeddings"][0])
    assert adapter.layer_kwargs(2, kw)["position_embeddings"] is k0["position_embeddings"]
    rep = engine.run(model, adapter, ids, engine.Handler(), chunk_size=2, progress=False, keep_outputs=True)
    torch.testing.assert_close(torch.cat(rep.outputs), _last_block_output(model, adapter, ids), rtol=1e-5, atol=1e-6)
