"""The cheaper CoCurve sweep gives the old sweep's H bit for bit (issue 18 §1).

The oracle is the frozen copy of the sweep as of 7c3384c (``tests/cocurve_sweep_ref.py``); every family of
``secateur.testing.TINY_CONFIGS`` and several settings (unit kinds, positions, support, batching, blocks,
centering, a subset of units) are compared with ``torch.equal`` on ``H`` and on the single-unit KLs.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from cocurve_sweep_ref import reference_sweep

from secateur.methods.cocurve import cocurve_inventory
from secateur.models.adapters import get_adapter
from secateur.scoring.cocurve_sweep import SweepConfig, ablation_sweep
from secateur.structured.units import inventory
from secateur.testing import FAMILIES, random_ids, tiny_model

SETTINGS = {
    # the CLI's digest geometry: KV groups + FFN groups, a few positions, a support smaller than the vocabulary
    "kv-ffn": dict(kinds=None, cfg=SweepConfig(positions_per_seq=6, top_r=24, unit_batch=4), n=2, t=24,
                   units="all"),
    # KV groups + single channels, every position, full-vocabulary support, unbatched units, blocks of two
    # sequences (one with a single sequence), raw features, only the units of layers 1..2
    "kv-channel": dict(kinds=("kv_group", "channel"), cfg=SweepConfig(positions_per_seq=64, top_r=1000, unit_batch=5,
                                                                    seqs_per_block=2, renormalize=False,
                                                                    center="none"), n=3, t=16, units="middle"),
    # one sampled position, one unit per forward: the last block's rows are a single row (GEMV-sized products)
    "one-row": dict(kinds=None, cfg=SweepConfig(positions_per_seq=1, top_r=8, unit_batch=1), n=2, t=20,
                    units="all"),
}


def _inv(a, kinds):
    return cocurve_inventory(a, n_ffn_groups=4) if kinds is None else inventory(a, kinds)


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("family", FAMILIES)
def test_sweep_H_bit_identical_to_reference(family, setting, one_thread):
    s = SETTINGS[setting]
    model = tiny_model(family, layers=4)
    a = get_adapter(model)
    inv = _inv(a, s["kinds"])
    units = None if s["units"] == "all" else (inv.layer_of >= 1) & (inv.layer_of <= 2)
    ids = random_ids(s["n"], s["t"], seed=3)
    H_ref, kl_ref = reference_sweep(model, a, inv, ids, s["cfg"], units)
    sw = ablation_sweep(model, a, inv, ids, s["cfg"], units)
    assert H_ref.abs().sum() > 0
    assert torch.equal(sw.H, H_ref)
    assert torch.equal(sw.kl_single, kl_ref)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_position_default_is_the_reference_at_all_positions(family, one_thread):
    """The default (issue 45: every position of each window, ``positions_per_seq=None``) is the reference run with as
    many positions as tokens; the other settings above pin their positions explicitly."""
    assert SweepConfig().positions_per_seq is None
    model = tiny_model(family, layers=4)
    a = get_adapter(model)
    inv = _inv(a, None)
    ids = random_ids(3, 12, seed=6)
    cfg = SweepConfig(top_r=24, unit_batch=4)
    H_ref, kl_ref = reference_sweep(model, a, inv, ids, replace(cfg, positions_per_seq=12))
    sw = ablation_sweep(model, a, inv, ids, cfg)
    assert sw.n_positions == 3 * 12
    assert torch.equal(sw.H, H_ref) and torch.equal(sw.kl_single, kl_ref)


@pytest.mark.parametrize("family", FAMILIES)
def test_sweep_H_bit_identical_to_reference_two_threads(family):
    """Two threads pick other kernels (H then depends on ``unit_batch``): the identity must hold there too."""
    s = SETTINGS["kv-ffn"]
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model = tiny_model(family, layers=4)
        a = get_adapter(model)
        inv = _inv(a, s["kinds"])
        ids = random_ids(s["n"], s["t"], seed=5)
        H_ref, kl_ref = reference_sweep(model, a, inv, ids, s["cfg"])
        sw = ablation_sweep(model, a, inv, ids, s["cfg"])
    finally:
        torch.set_num_threads(n)
    assert torch.equal(sw.H, H_ref) and torch.equal(sw.kl_single, kl_ref)
