"""``api.prune``: flat method knobs validated into the method's typed options (the same declaration as the CLI's
flags), and an already loaded model object (with its tokenizer) pruned like the same model passed by path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from secateur import api
from secateur.cli import build_parser
from secateur.errors import SecateurError
from secateur.methods.materialize import COMPENSATIONS
from secateur.methods.registry import METHODS, all_options
from secateur.methods.structured import STRUCTURED_ALLOCATIONS, StructuredOptions
from secateur.models.loading import load_model
from secateur.testing import save_tiny

COMMON = dict(calib="self", nsamples=2, seqlen=16, quiet=True)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return save_tiny("llama", tmp_path_factory.mktemp("m") / "llama")


def _weights(folder) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out |= load_file(f)
    return out


@pytest.mark.parametrize("method,knobs", [("wanda", {}), ("rcpu", {"compensation": "coec", "coec_rounds": 2}),
                                          ("qk-wanda", {"variant": "MR", "segment_len": 8})])
def test_a_loaded_model_prunes_like_the_same_model_by_path(tiny_path, tmp_path, method, knobs):
    by_path = api.prune(model=tiny_path, method=method, sparsity=0.3, out=str(tmp_path / "p"), **COMMON, **knobs)
    model, tok = load_model(tiny_path)
    in_mem = api.prune(model=model, tokenizer=tok, method=method, sparsity=0.3, out=str(tmp_path / "o"), **COMMON,
                       **knobs)
    assert in_mem.model is model  # pruned in place
    a, b = _weights(tmp_path / "p"), _weights(tmp_path / "o")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    masks = sorted(p.name for p in (tmp_path / "p").iterdir())
    assert masks == sorted(p.name for p in (tmp_path / "o").iterdir())
    npz = "secateur-masks.npz"
    if (tmp_path / "p" / npz).exists():
        assert (tmp_path / "p" / npz).read_bytes() == (tmp_path / "o" / npz).read_bytes()
    rep = json.loads((tmp_path / "o" / "secateur-report.json").read_text())
    name = Path(model.config._name_or_path).name  # published portably: a local path by its last component
    assert rep["model"] == rep["options"]["model"] == name and rep["model_source"] is None
    drop = ("model", "out")
    assert {k: v for k, v in rep["options"].items() if k not in drop} == \
        {k: v for k, v in by_path["options"].items() if k not in drop}


def test_a_loaded_model_needs_its_tokenizer(tiny_path, tmp_path):
    model, _ = load_model(tiny_path)
    with pytest.raises(SecateurError, match="tokenizer"):
        api.prune(model=model, method="wanda", out=str(tmp_path / "o"), **COMMON)
    assert not (tmp_path / "o").exists()


def test_flat_knobs_equal_typed_options(tiny_path):
    flat = api.prune(model=tiny_path, method="rcpu", sparsity=0.3, compensation="ls", ls_lambda="0.1", **COMMON)
    opts = api.PruneOptions(model=tiny_path, method="rcpu", sparsity=0.3, calib="self", nsamples=2, seqlen=16,
                            run=api.RunSettings(quiet=True),
                            method_options=StructuredOptions(compensation="ls", ls_lambda=0.1))
    typed = api.prune(options=opts)
    assert flat["options"] == typed["options"] and flat["options"]["ls_lambda"] == 0.1
    assert flat["options"]["coec_rounds"] is None  # unset knobs are recorded as None, as before
    for k, v in flat.model.state_dict().items():
        assert torch.equal(v, typed.model.state_dict()[k])


@pytest.mark.parametrize("kw,msg", [
    ({"method": "wanda", "coec_rounds": 2}, "--coec-rounds only applies to the structured pipeline"),
    ({"method": "rcpu", "n_ffn_groups": 4}, "--ffn-groups only applies to --method cocurve / cocurve-diag"),
    ({"method": "wanda", "variant": "MR"}, "--variant only applies to --method qk-wanda"),
    ({"method": "cocurve", "allocation": "uniform"}, "selects its own units"),
    ({"method": "wanda", "bogus": 1}, "unknown option bogus"),
    ({"method": "wanda-sp", "extra": {"compensation": "ls"}}, "extra= is gone"),
    ({"method": "rcpu", "compensation": "nope"}, "unknown compensation 'nope'; choose from none, bias"),
    ({"method": "rcpu", "coec_rounds": "two"}, "--coec-rounds: 'two' is not a valid value"),
    ({"method": "qk-wanda", "variant": "XYZ"}, "variant"),
    ({"method": "flap", "allocation": "flap-global", "units": "head,kv_group"}, "names two attention units"),
])
def test_bad_knobs_fail_before_loading(tmp_path, kw, msg):
    with pytest.raises(SecateurError, match=msg):
        api.prune(model=str(tmp_path / "absent"), sparsity=0.3, **kw)


def test_options_and_keywords_are_exclusive():
    with pytest.raises(SecateurError, match="either options= or keywords"):
        api.prune(options=api.PruneOptions(), method="wanda")


def test_options_of_another_method_are_refused():
    opts = api.PruneOptions(method="wanda", method_options=StructuredOptions(compensation="ls"))
    with pytest.raises(SecateurError, match="wanda takes UnstructuredOptions, not StructuredOptions"):
        opts.validate()


def test_cli_flags_come_from_the_options_declaration():
    """Every CLI knob is a field of a registered options class, its choices those of the tables."""
    p = build_parser()
    prune = next(a for a in p._subparsers._group_actions[0].choices.values() if a.prog.endswith("prune"))
    by_dest = {a.dest: a for a in prune._actions}
    assert tuple(by_dest["compensation"].choices) == tuple(COMPENSATIONS)
    assert tuple(by_dest["allocation"].choices) == tuple(STRUCTURED_ALLOCATIONS)
    assert by_dest["n_ffn_groups"].option_strings == ["--ffn-groups"]
    knobs = {f.name for o in all_options() for f in o.knob_fields() if f.metadata["flag"] is not None}
    assert knobs <= set(by_dest)
    assert {"no_worse", "unit_batch", "bisect_depth"}.isdisjoint(by_dest)  # API-only knobs
    for m in METHODS.values():
        assert m.config is not None and m.options is not None
