"""CoCurve sweep over torch.distributed (gloo, 2 spawned ranks) == single process, bit for bit (H, the
single-unit KLs and the split-half graphs)."""

from __future__ import annotations

import torch

from secateur.calib.dist import spawn_gloo
from secateur.methods.cocurve import cocurve_inventory
from secateur.models.adapters import get_adapter
from secateur.scoring.cocurve_sweep import SweepConfig, ablation_sweep
from secateur.testing import random_ids, tiny_model

CFG = SweepConfig(positions_per_seq=6, top_r=24, unit_batch=4, seqs_per_block=1)


def _run():
    model = tiny_model("llama", layers=4)
    a = get_adapter(model)
    inv = cocurve_inventory(a, n_ffn_groups=4)
    return ablation_sweep(model, a, inv, random_ids(5, 24, seed=4), CFG)


def _worker(rank: int, world: int, out: str) -> None:
    sw = _run()
    torch.save({"H": sw.H, "kl": sw.kl_single, "halves": sw.halves, "timings": sw.timings}, f"{out}/rank{rank}.pt")


def test_two_gloo_ranks_equal_one_process(tmp_path):
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # same kernels as the spawned ranks (1 thread each)
    try:
        ref = _run()
    finally:
        torch.set_num_threads(n)
    spawn_gloo(_worker, 2, (str(tmp_path),), threads=1)
    r0, r1 = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    assert r0["timings"]["world_size"] == 2 and r0["timings"]["n_blocks"] == 5
    assert r0["timings"]["n_ablations"] == 5 * 24  # every (unit, block) ablated exactly once over both ranks
    for r in (r0, r1):
        assert torch.equal(r["H"], ref.H)
        assert torch.equal(r["kl"], ref.kl_single)
        assert all(torch.equal(a, b) for a, b in zip(r["halves"], ref.halves))  # the split-half graphs too
    assert ref.H.abs().sum() > 0
