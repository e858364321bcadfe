"""CoCurve end to end: graph -> lambda path -> held-out choice -> slicing -> export -> reload; registry."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from secateur import api
from secateur.errors import SecateurError
from secateur.methods.cocurve import CoCurveConfig, build_graph, cocurve_inventory, prune, select
from secateur.methods.registry import METHODS
from secateur.models.adapters import get_adapter
from secateur.models.loading import load_model
from secateur.scoring.cocurve_graph import CoPruningGraph, array_sha256
from secateur.scoring.cocurve_sweep import SweepConfig
from secateur.testing import random_ids, tiny_model, tiny_tokenizer

# 16 layers (12 eligible) and 16 FFN groups: 0.3 is feasible under the cap 0.45 with tiny units
CFG = CoCurveConfig(sweep=SweepConfig(positions_per_seq=8, top_r=32, unit_batch=16), n_ffn_groups=16,
                    lambdas=(0.0, 0.25, 0.5, 1.0))

pytestmark = pytest.mark.usefixtures("one_thread")


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_prune_slices_exports_and_reloads(tmp_path):
    model = tiny_model("llama", layers=16)
    a = get_adapter(model)
    ids, held = random_ids(3, 32, seed=1), random_ids(2, 32, seed=2)
    probe = random_ids(1, 20, seed=3)
    rep = prune(model, a, ids, held, 0.3, CFG, out_dir=tmp_path / "o", tokenizer=tiny_tokenizer())
    res, graph = rep["_result"], rep["_graph"]
    assert abs(rep["realized"] - 0.3) < graph.costs.max() / graph.costs.sum()
    kls = [c["heldout_kl"] for c in rep["candidates"]]
    assert rep["candidates"][0]["lambda"] == 0.0
    # the paired one-SE rule (issue 45): the lowest mean KL among lambda = 0 and the candidates below it by more
    # than the SE of their per-sequence differences, recomputed here from the saved per-sequence KLs
    per = [c["heldout_per_sequence"] for c in rep["candidates"]]
    n = len(per[0])
    assert n == 2 and all(len(x) == n for x in per)
    beats = []
    for x in per:
        d = [a - b for a, b in zip(x, per[0])]
        m = sum(d) / n
        beats.append(m + (sum((v - m) ** 2 for v in d) / (n - 1) / n) ** 0.5 < 0)
    eligible = [0] + [k for k, b in enumerate(beats) if b and k]
    assert rep["chosen"] == min(eligible, key=lambda k: (kls[k], k))
    assert rep["selection_info"]["choice"]["best"] == kls.index(min(kls))
    assert [c["beats_diagonal"] for c in rep["candidates"]] == [b and k > 0 for k, b in enumerate(beats)]
    assert rep["lambda"] == rep["candidates"][rep["chosen"]]["lambda"]
    # artifacts: files on disk match the reported hashes; H reloads bit for bit
    out = tmp_path / "o"
    for name in ("cocurve_graph.npz", "cocurve_mask.npz", "secateur_selection.json"):
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == rep["hashes"][name]
    back = CoPruningGraph.load(out / "cocurve_graph.npz")
    assert torch.equal(back.H, graph.H) and array_sha256(back.H) == rep["hashes"]["H_sha256"]
    z = np.load(out / "cocurve_mask.npz")
    assert np.array_equal(z["removed"], res.removed.numpy()) and float(z["lambda"]) == rep["lambda"]
    # the sliced model reloads with one from_pretrained and computes the same function
    loaded, _ = load_model(str(out))
    assert torch.allclose(logits(loaded, probe), logits(model, probe), atol=1e-5)
    assert sum(p.numel() for p in loaded.parameters()) < sum(p.numel() for p in tiny_model("llama", layers=16)
                                                             .parameters())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_model_selects_like_the_cpu_one():
    """The sweep runs where the model is; its sums come back to the CPU (an H200 run once failed adding a GPU block
    to a CPU total). GPU kernels sum in other orders, so H agrees to float32 rounding, and the selection with it."""
    ids, held = random_ids(3, 32, seed=1), random_ids(2, 32, seed=2)
    out = {}
    for device in ("cpu", "cuda"):
        model = tiny_model("llama", layers=16).to(device)
        rep = prune(model, get_adapter(model), ids.to(device), held.to(device), 0.3, CFG)
        out[device] = rep["_result"].removed.cpu(), rep["_graph"].H.cpu()
    torch.testing.assert_close(out["cuda"][1], out["cpu"][1], rtol=1e-3, atol=1e-6)
    assert torch.equal(out["cuda"][0], out["cpu"][0])


def test_graph_reuse_across_budgets_and_diagonal_control():
    model = tiny_model("qwen2", layers=16)
    a = get_adapter(model)
    inv = cocurve_inventory(a, 16)
    g = build_graph(model, a, random_ids(2, 32), CFG, inv)
    diag = select(g, inv, 0.3, cfg=CFG, diagonal=True)  # no held-out needed: a single mask
    assert diag.lam == 0.0 and len(diag.candidates) == 1
    from secateur.budgets.allocate import Guard, allocate_global

    ref = allocate_global(inv, 0.5 * g.diag, 0.3, guard=Guard.cocurve(0.3)).removed
    assert torch.equal(diag.removed, ref)
    prev = 0.0
    for rho in (0.2, 0.3, 0.4):
        r = select(g, inv, rho, cfg=CFG, diagonal=True)
        assert r.info["realized"] >= rho > prev
        prev = r.info["realized"]


def test_registry_method_runs_through_api(tmp_path):
    assert METHODS["cocurve"].kind == "structured" and METHODS["cocurve-diag"].kind == "structured"
    path = tmp_path / "m"
    tiny_model("llama", layers=16, vocab=128).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    calib = tmp_path / "calib.txt"
    calib.write_text("The quick brown fox jumps over the lazy dog, again and again. " * 60)
    rep = api.prune(model=str(path), method="cocurve", sparsity=0.3, calib=str(calib), nsamples=5, seqlen=32,
                    out=str(tmp_path / "o"), quiet=True,
                    heldout=2, positions=8, top_r=16, n_ffn_groups=16)
    d = rep["details"]
    assert d["graph"]["calibration"]["n"] == 3 and d["realized"] >= 0.3
    for name in ("cocurve_graph.npz", "cocurve_mask.npz", "secateur_selection.json"):
        data = (tmp_path / "o" / name).read_bytes()
        assert hashlib.sha256(data).hexdigest() == d["hashes"][name]
    loaded, tok = load_model(str(tmp_path / "o"))
    # the report's realized sparsity is the selection's, and the parameters the export really lost (was 0: masks={})
    rs, dense = rep["realized_sparsity"], tiny_model("llama", layers=16, vocab=128)
    n_dense, n_kept = (sum(p.numel() for p in m.parameters()) for m in (dense, loaded))
    assert rs["targeted"] == d["realized"] and rs["pruned_weights"] == n_dense - n_kept > 0
    assert rs["of_all_parameters"] == (n_dense - n_kept) / n_dense
    ids = random_ids(1, 16, seed=9)
    assert torch.allclose(logits(loaded, ids), logits(rep.model, ids), atol=1e-5)
    with pytest.raises(SecateurError, match=r"^cocurve-diag holds out the last 2 calibration sequences for the lambda "
                                           r"choice: pass --nsamples > 2 \(the paper: 130\)$"):
        api.prune(model=str(path), method="cocurve-diag", sparsity=0.3, calib=str(calib), nsamples=2, seqlen=32,
                  quiet=True, heldout=2)


def test_any_compensator_follows_cocurve_selection(tmp_path):
    """--method cocurve --compensation X: the same selection as without, compensated on the dense Grams of the
    graph windows (never worse than the slice on them), sliced, exported, reloaded with equal logits."""
    path = tmp_path / "m"
    tiny_model("llama", layers=16, vocab=128).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    calib = tmp_path / "calib.txt"
    calib.write_text("The quick brown fox jumps over the lazy dog, again and again. " * 60)
    kw = dict(model=str(path), method="cocurve", sparsity=0.3, calib=str(calib), nsamples=5, seqlen=32, quiet=True)
    knobs = {"heldout": 2, "positions": 8, "top_r": 16}
    plain = api.prune(**kw, **knobs)
    for comp in ("ls", "coec"):
        rep = api.prune(**kw, out=str(tmp_path / comp), **knobs, compensation=comp, coec_rounds=2)
        d = rep["details"]
        assert d["hashes"]["mask_sha256"] == plain["details"]["hashes"]["mask_sha256"]
        assert d["compensation"] == comp and d["per_layer"]
        assert all(r["recon_after"] <= r["recon_before"] + 1e-12 for r in d["per_layer"])
        ids = random_ids(1, 16, seed=9)
        assert not torch.allclose(logits(rep.model, ids), logits(plain.model, ids), atol=1e-4)
        loaded, _ = load_model(str(tmp_path / comp))
        assert torch.allclose(logits(loaded, ids), logits(rep.model, ids), atol=1e-5)


def test_cocurve_and_structured_knobs_are_checked_before_loading(tmp_path):
    absent = str(tmp_path / "absent")  # no model there: each refusal must come before the model is read
    units = ("^--units only applies to the structured pipeline \\(--structured with wanda-sp, flap, rcpu, "
             "magnitude-sp, random, shortgpt, corp, vbp\\), and 'cocurve' is a structured method that selects its own "
             "units; drop --units, or choose a method it applies to$")
    with pytest.raises(SecateurError, match=units):
        api.prune(model=absent, method="cocurve", sparsity=0.3, units="channel")
    heldout = ("^--heldout only applies to --method cocurve / cocurve-diag, and 'wanda' is an unstructured method; "
               "drop --heldout, or choose a method it applies to$")
    with pytest.raises(SecateurError, match=heldout):
        api.prune(model=absent, method="wanda", sparsity=0.3, heldout=4)
    with pytest.raises(SecateurError, match="^--heldout only applies to .*'wanda-sp' is a structured method; drop"):
        api.prune(model=absent, method="wanda-sp", sparsity=0.3, heldout=4)
    comp = "^unknown compensation 'nope'; choose from none, bias, ls, rcpu, coec, corp, grail$"
    with pytest.raises(SecateurError, match=comp):
        api.prune(model=absent, method="cocurve", sparsity=0.3, compensation="nope")
