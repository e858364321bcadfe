"""``PruneOptions`` holds what every run has; ``pattern``, ``budget``, ``rounding``, ``targets`` are knobs of the
methods that use them, and ``mode``, ``chunk_size``, ``quiet`` one :class:`RunSettings` (issue 27 §2).

What a run records did not change: its options dict (reports, checkpoint fingerprints), its recipe and its command
line are key for key those written before the split (tests/golden/prune-options.json, made by the code before it),
and a recipe written before reads back to the same options.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from secateur.cli import main
from secateur.errors import SecateurError
from secateur.options import FLAT_KNOBS, RECIPE_NEUTRAL, PruneOptions, RunSettings, options_from_recipe

GOLDEN = json.loads((Path(__file__).parent / "golden" / "prune-options.json").read_text())


@pytest.mark.parametrize("case", sorted(GOLDEN))
def test_the_flat_record_is_the_one_before_the_split(case):
    g = GOLDEN[case]
    opts = PruneOptions.from_kwargs(**g["kwargs"])
    assert [list(kv) for kv in opts.to_dict().items()] == g["to_dict"]  # keys, order and values
    assert [list(kv) for kv in opts.recipe().items()] == g["recipe"]
    assert opts.command_line() == g["command_line"]


@pytest.mark.parametrize("case", sorted(GOLDEN))
def test_a_recipe_written_before_the_split_reads_back(case):
    g = GOLDEN[case]
    opts = options_from_recipe(dict(g["recipe"]))
    assert [list(kv) for kv in opts.recipe().items()] == g["recipe"]
    replayed = {k: v for k, v in g["kwargs"].items() if k not in RECIPE_NEUTRAL}  # a recipe holds none of these
    assert opts.command_line() == PruneOptions.from_kwargs(**replayed).command_line()


@pytest.mark.parametrize("method,knob,value", [("cocurve", "rounding", "floor"), ("wanda-sp", "budget", "row"),
                                               ("corp-qk", "rounding", "ceil")])
def test_an_old_recipe_value_its_method_ignored_is_dropped(method, knob, value):
    """Before the split these were common fields every method took, and ignored where it had no use for them."""
    recipe = dict(GOLDEN["wanda"]["recipe"]) | {"method": method, knob: value}
    opts = options_from_recipe(recipe)
    assert opts.method == method and opts.to_dict()[knob] == FLAT_KNOBS[knob]
    with pytest.raises(SecateurError, match=f"--{knob} only applies to"):  # given now, it is refused
        PruneOptions.from_kwargs(method=method, **{knob: value})


REFUSED = [
    (["--method", "wanda-sp", "--pattern", "2:4"],
     "--pattern only applies to --method magnitude / wanda / sparsegpt, and 'wanda-sp' is a structured method; "
     "drop --pattern"),
    (["--method", "wanda", "--structured", "--budget", "row"],
     "--budget only applies to --method magnitude / wanda / sparsegpt / qk-wanda, and 'wanda-sp' is a structured"),
    (["--method", "cocurve", "--rounding", "floor"],
     "--rounding only applies to --method magnitude / wanda / sparsegpt / qk-wanda and the structured pipeline"),
    (["--method", "corp-qk", "--targets", "q"], "--targets only applies to --method magnitude / wanda / sparsegpt"),
    (["--method", "qk-wanda", "--targets", "q,k"], "choose the projections with --scope qk"),
    (["--method", "rcpu", "--targets", "q"], "choose what is removed with --units"),
]


@pytest.mark.parametrize("argv,msg", REFUSED)
def test_a_knob_of_another_method_is_one_line_and_exit_2(tmp_path, capsys, argv, msg):
    out = tmp_path / "out"
    assert main(["prune", "--model", str(tmp_path / "absent"), "--out", str(out), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("secateur: error: ") and msg in err[0], err
    assert not out.exists()


@pytest.mark.parametrize("kw,msg", [
    (dict(method="wanda-sp", pattern="2:4"), REFUSED[0][1]),
    (dict(method="wanda", structured=True, budget="row"), REFUSED[1][1]),
    (dict(method="cocurve", rounding="floor"), REFUSED[2][1]),
    (dict(method="corp-qk", targets="q"), REFUSED[3][1]),
])
def test_the_api_refuses_it_alike(tmp_path, kw, msg):
    with pytest.raises(SecateurError) as e:
        PruneOptions.from_kwargs(model=str(tmp_path / "absent"), **kw)
    assert msg in str(e.value) and "\n" not in str(e.value)


def test_run_settings_are_one_object_with_the_flat_keywords():
    opts = PruneOptions.from_kwargs(method="wanda", chunk_size=4, mode="dense-block", quiet=True)
    assert opts.run == RunSettings(mode="dense-block", chunk_size=4, quiet=True)
    assert {k: opts.to_dict()[k] for k in ("mode", "chunk_size", "quiet")} == \
        {"mode": "dense-block", "chunk_size": 4, "quiet": True}
    with pytest.raises(SecateurError, match=r"--chunk-size must be >= 1"):
        PruneOptions.from_kwargs(chunk_size=0).validate()
    with pytest.raises(SecateurError, match="chunk_size"):
        PruneOptions.from_kwargs(chunk_size="8")


def test_each_method_has_the_knobs_it_reads():
    from secateur.methods.registry import METHODS

    has = {name: sorted(k for k in FLAT_KNOBS if k in m.options.knob_names()) for name, m in METHODS.items()}
    for name in ("magnitude", "wanda", "sparsegpt"):
        assert has[name] == ["budget", "pattern", "rounding", "targets"]
    assert has["qk-wanda"] == ["budget", "rounding"]
    for name in ("wanda-sp", "flap", "rcpu", "magnitude-sp", "random", "shortgpt", "corp"):
        assert has[name] == ["rounding"]
    for name in ("cocurve", "cocurve-diag", "corp-qk"):
        assert has[name] == []
