"""The all-position CoCurve sweep stays within its memory plan, and its memory does not grow with the windows
(issue 45 §1: every position by default, ``H`` accumulated block by block, the plan named term by term).

Each measurement runs in a child process on a tiny model: a warm-up sweep (kernels, thread pools), then the peak
resident set of the measured sweep above the resident set before it (``VmHWM`` reset through
``/proc/self/clear_refs``). glibc is told to map every block above 64 KiB on its own
(``MALLOC_MMAP_THRESHOLD_``), so the resident set follows the live tensors, which is what the plan counts (see
:func:`secateur.scoring.cocurve_sweep.memory_plan` on the heap's slack below glibc's default threshold).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from secateur.methods.cocurve import cocurve_inventory
from secateur.models.adapters import get_adapter
from secateur.scoring.cocurve_sweep import SweepConfig, memory_plan
from secateur.testing import tiny_model

VOCAB, LAYERS, SEQLEN = 4096, 4, 128
CFG = dict(positions_per_seq=None, top_r=256, unit_batch=8)  # every position, the paper's support

_CHILD = """
import json, sys
import torch
torch.set_num_threads(1)
from secateur.methods.cocurve import cocurve_inventory
from secateur.models.adapters import get_adapter
from secateur.scoring.cocurve_sweep import SweepConfig, ablation_sweep
from secateur.testing import random_ids, tiny_model

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

model = tiny_model("llama", layers={layers}, vocab={vocab})
a = get_adapter(model)
inv = cocurve_inventory(a, n_ffn_groups=16)
cfg = SweepConfig(**{cfg})
ablation_sweep(model, a, inv, random_ids(1, 16, {vocab}, seed=0), cfg)  # warm-up
open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS
base = status("VmRSS:")
sw = ablation_sweep(model, a, inv, random_ids({n}, {seqlen}, {vocab}, seed=1), cfg)
print(json.dumps({{"used": status("VmHWM:") - base, "positions": sw.n_positions}}))
"""


def _clear_refs_works() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _measure(n_windows: int) -> dict:
    code = _CHILD.format(layers=LAYERS, vocab=VOCAB, cfg=CFG, n=n_windows, seqlen=SEQLEN)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux") or not _clear_refs_works(),
                    reason="needs Linux /proc/self/clear_refs to reset the peak resident set")
def test_all_position_sweep_stays_within_its_memory_plan():
    model = tiny_model("llama", layers=LAYERS, vocab=VOCAB)
    a = get_adapter(model)
    inv = cocurve_inventory(a, n_ffn_groups=16)
    plan = memory_plan(model, a, len(inv), len(inv), SEQLEN, SweepConfig(**CFG))
    terms = {k: b for k, (b, _) in plan.terms.items()}
    # the per-unit features are named in the plan: B P r 8 bytes per unit, every position of the window
    assert terms["features"] == SEQLEN * 256 * 8 * len(inv)
    assert "per unit" in plan.terms["features"][1] and "P 128" in plan.terms["features"][1]
    one, three = _measure(1), _measure(3)
    assert one["positions"] == SEQLEN and three["positions"] == 3 * SEQLEN
    # within the plan, and the plan is not a loose bound: the live tensors it names are really there
    assert 0.8 * plan.total <= one["used"] <= plan.total, (one, terms)
    # one block alive at a time: three windows take the memory of one (H is folded block by block)
    assert three["used"] <= plan.total and abs(three["used"] - one["used"]) <= 0.05 * plan.total, (one, three)
