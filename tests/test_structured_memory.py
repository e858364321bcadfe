"""Issue 16: the statistics of a compensated structured run do not grow with depth. The Grams are taken one block
at a time in a second dense pass (:class:`secateur.methods.compensation_pass.BlockCompensation`) and the weights are
bit for bit those of compensating from every layer's Grams kept at once (the code path before, still used when
statistics that hold every Gram are passed in)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from secateur.calib import engine
from secateur.calib.collect import collect_stats
from secateur.calib.stats import Gram
from secateur.compensate import COECOptions
from secateur.methods.materialize import MEMORY_FORMULA, materialize_selection
from secateur.methods.structured import StructuredConfig, prune_structured, stat_kinds
from secateur.models.adapters import get_adapter
from secateur.testing import random_ids, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

# wanda-sp + COEC, RCPU with its native compensation, FLAP + LS
CASES = {"wanda-sp+coec": ("wanda_sp", "coec"), "rcpu": ("rcpu", "rcpu"), "flap+ls": ("flap", "ls")}


def _cfg(score: str, comp: str, **kw) -> StructuredConfig:
    return StructuredConfig(**{"score": score, "sparsity": 0.3, "compensation": comp,
                               "coec": COECOptions(max_rounds=2), **kw})


def _state(m) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("case", list(CASES))
def test_per_block_grams_give_bit_identical_weights(family, case):
    cfg = _cfg(*CASES[case])
    ids = random_ids(4, 16)
    ref = tiny_model(family, layers=3)
    stats = collect_stats(ref, get_adapter(ref), ids, stat_kinds(cfg))  # every layer's Grams at once
    res_ref = prune_structured(ref, get_adapter(ref), ids, cfg, stats=stats)
    m = tiny_model(family, layers=3)
    res = prune_structured(m, get_adapter(m), ids, cfg)  # selection statistics, then one block's Grams at a time
    want, got = _state(ref), _state(m)
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want), case
    assert res.details["per_layer"] and [(r["layer"], r["group"]) for r in res.details["per_layer"]] == \
        [(r["layer"], r["group"]) for r in res_ref.details["per_layer"]]
    assert res.details["statistics_memory"]["mode"] == "one block at a time"
    assert res_ref.details["statistics_memory"]["mode"] == "every layer (statistics passed in)"


def test_statistics_memory_is_one_blocks_grams():
    ids = random_ids(2, 16)
    m = tiny_model("llama", layers=4)
    a = get_adapter(m)
    d_o, d_down = a.role_refs(a.layers[0])["o"].weight.shape[1], a.role_refs(a.layers[0])["down"].weight.shape[1]
    res = prune_structured(m, a, ids, _cfg("wanda_sp", "coec", sparsity=0.5))
    mem = res.details["statistics_memory"]
    per_block = 8 * (d_o**2 + d_down**2)
    assert mem["grams_bytes"] == mem["grams_bytes_measured_peak"] == per_block
    assert mem["grams_bytes_all_layers"] == 4 * per_block  # what the run used to hold
    assert mem["tempered_bytes"] == 8 * max(d_o, d_down) ** 2
    assert mem["selection_bytes"] == 4 * 24 * (d_o + d_down)
    assert mem["formula"] == MEMORY_FORMULA


def test_at_most_one_blocks_grams_are_alive(monkeypatch):
    """Every Gram's state and every tempered copy is tracked by a weak reference: while a projection is solved
    only the current block's (at most two) Grams are alive, and none survives its block."""
    import secateur.compensate as comp
    import secateur.linalg as linalg

    grams: list[tuple[int, weakref.ref]] = []  # (block being visited, the Gram's d x d state)
    tempered: list[weakref.ref] = []
    block = [0]
    real_init, real_comp, real_power = Gram.__init__, comp.compensate, linalg.psd_power

    def init(self, *a, **kw):
        real_init(self, *a, **kw)
        grams.append((block[0], weakref.ref(self.G)))

    def alive() -> list[int]:
        gc.collect()
        return [b for b, r in grams if r() is not None]

    solves: list[list[int]] = []

    def compensate(*a, **kw):
        solves.append(alive())
        return real_comp(*a, **kw)

    def power(*a, **kw):
        out = real_power(*a, **kw)
        tempered.append(weakref.ref(out))
        return out

    def after_block(i: int) -> None:
        assert alive() == [] and all(r() is None for r in tempered), f"block {i} left statistics alive"
        block[0] += 1

    monkeypatch.setattr(Gram, "__init__", init)
    monkeypatch.setattr(comp, "compensate", compensate)
    monkeypatch.setattr(linalg, "psd_power", power)
    monkeypatch.setattr(engine, "_after_block", after_block)
    m = tiny_model("qwen2", layers=4)
    res = prune_structured(m, get_adapter(m), random_ids(2, 16), _cfg("wanda_sp", "coec", sparsity=0.5))
    assert len(grams) == 8 and len(solves) == 8 and len(tempered) == 8  # 4 blocks x (o_proj, down_proj)
    assert all(len(s) <= 2 and len(set(s)) <= 1 for s in solves)  # one block's Grams at most
    assert [s[0] for s in solves] == [4, 4, 5, 5, 6, 6, 7, 7]  # blocks 0-3 of the second pass (after 4 of the first)
    assert len(res.details["per_layer"]) == 8


def test_materialize_selection_from_ids_equals_from_every_gram():
    """CoCurve's compensation (materialize_selection over its graph windows) through the per-block pass."""
    from secateur.budgets.select import select_units

    ids = random_ids(3, 16)
    cfg = _cfg("rcpu", "coec")
    out = []
    for reuse in (True, False):
        m = tiny_model("mistral", layers=3)
        a = get_adapter(m)
        stats = collect_stats(m, a, ids, stat_kinds(cfg), chunk_size=2)
        sel = select_units(a, "rcpu", 0.3, stats.groups)
        if not reuse:
            stats = None
        recs, timings, mem = materialize_selection(m, a, sel, cfg, stats, ids, chunk_size=2)
        assert recs and mem["mode"] == ("every layer (statistics passed in)" if reuse else "one block at a time")
        out.append(_state(m))
    assert all(torch.equal(out[0][k], out[1][k]) for k in out[0])
