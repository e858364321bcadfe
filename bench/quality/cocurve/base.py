"""CoCurve bench, the run's setup: presets, the run's device/model/inputs/paths (``_configure``), model and data."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from bench.common import (
    RESULTS,
    WORK,
    calib_tokens,
)

PRESETS = {
    # the paper's protocol (default in code): 128 x 2048 graph, P_tok 128, r 256, 16 held-out, full corpora;
    # + an independent 16 x 2048 test split for the KL column (the held-out split chooses lambda)
    "full": {"n_graph": 128, "n_heldout": 16, "seqlen": 2048, "positions": 128, "top_r": 256, "ppl_windows": None,
             "unit_batch": 8, "n_test": 16},
    # what 2 heavily shared CPU cores allow: 4 x 256 graph, 32 positions/seq (P = 128), r 256, 4 x 256
    # held-out, perplexity on the first sliding window (2048 tokens, 2047 scored) of each corpus
    "quick": {"n_graph": 4, "n_heldout": 4, "seqlen": 256, "positions": 32, "top_r": 256, "ppl_windows": 1,
              "unit_batch": 8},
    # issue 18 §2: 16 x 512 graph / 16 x 512 held-out (lambda) / 16 x 512 test (KL column), positions scaled
    # with the length at the paper's stride (128 per 2048 -> 32 per 512), top-r 256 kept (a support size);
    # perplexity on the first 32 windows, every window for dense + CoCurve 30% (the paper's 2048/512 protocol)
    # issue 26 re-sized its evaluation: nonoverlap-2048 on the first 16 windows of each corpus; every WikiText-2
    # window for the 30% CoCurve row only (dense is measured there already: 21.61); zero-shot for four 30% rows
    "medium": {"n_graph": 16, "n_heldout": 16, "seqlen": 512, "positions": 32, "top_r": 256, "ppl_windows": 16,
               "ppl_seqlen": 2048, "ppl_stride": None, "unit_batch": 8, "n_test": 16, "rhos": [0.2, 0.3],
               "methods": ["cocurve", "cocurve-diag", "wanda_sp", "flap", "random"],
               "coec_methods": ["cocurve+coec", "wanda_sp+coec"], "full_ppl": ["cocurve@0.3"],
               "full_ppl_corpora": ["wikitext2"],
               "zs": ["cocurve@0.3", "cocurve-diag@0.3", "wanda_sp@0.3", "cocurve+coec@0.3"], "efficiency": False},
    # issue 45 §2: medium's windows (the same three disjoint splits), the graph from every position (+ the split-half
    # Grams of medium's 32-position subsample from the same features, side by side), the breakpoint lambda family
    # (at most 12 masks measured on the held-out split) and the paired one-SE choice, the fixed-split arm; 20-40%
    "medium-all": {"n_graph": 16, "n_heldout": 16, "seqlen": 512, "positions": None, "subsample_check": 32,
                   "top_r": 256, "ppl_windows": 16, "ppl_seqlen": 2048, "ppl_stride": None, "unit_batch": 8,
                   "n_test": 16, "rhos": [0.3, 0.2, 0.4],
                   "methods": ["cocurve", "cocurve-diag", "cocurve-fixed", "wanda_sp", "flap"], "coec_methods": [],
                   "family": "breakpoints", "choice": "paired", "max_candidates": 12, "efficiency": False},
    "smoke": {"n_graph": 2, "n_heldout": 2, "seqlen": 64, "positions": 8, "top_r": 64, "ppl_windows": 1,
              "unit_batch": 8},
    # the CPU exercise of bench/quality/device_cocurve_full.sh (TINY=1): a random 16-layer Llama, random token ids
    "tiny": {"n_graph": 2, "n_heldout": 2, "seqlen": 64, "positions": 8, "subsample_check": 4, "top_r": 16,
             "ppl_windows": None, "unit_batch": 8, "n_test": 2, "ppl_seqlen": 128, "ppl_stride": 32,
             "family": "breakpoints", "choice": "paired", "efficiency": False},
}


RHOS = (0.2, 0.3, 0.4, 0.5)


METHODS = ("cocurve", "cocurve-diag", "cocurve-fixed", "wanda_sp", "flap", "magnitude", "random")

# the preset keys that fix the graph (its checkpoint's fingerprint): the others only shape the rows
GRAPH_KEYS = ("n_graph", "n_heldout", "n_test", "seqlen", "positions", "subsample_check", "top_r", "unit_batch")


CORPORA = ("wikitext2", "c4", "ptb")


def _configure() -> None:
    """Module paths and the run's device/model/inputs from the environment (spawned ranks inherit it)."""
    global DEVICE, MODEL, INPUTS, RESULTS_DIR, OUT_JSON, OUT_MD, OUT_PNG, DIR
    env = os.environ
    DEVICE = env.get("COCURVE_DEVICE", "cpu")
    MODEL = env.get("COCURVE_MODEL", "smollm2-135m")
    INPUTS = env.get("COCURVE_INPUTS") or None
    RESULTS_DIR = Path(env.get("COCURVE_RESULTS") or RESULTS / "text")
    OUT_JSON = RESULTS_DIR / "cocurve-smollm2.jsonl"
    OUT_MD = RESULTS_DIR / "cocurve-smollm2.md"
    OUT_PNG = RESULTS_DIR / "cocurve-smollm2-alloc.png"
    DIR = Path(env.get("COCURVE_WORK") or WORK / "cocurve-smollm2")


_configure()


def md_path(preset: str) -> Path:
    """The quick preset's page is ``cocurve-smollm2.md`` (as committed); every other preset has its own."""
    return OUT_MD if preset == "quick" else OUT_MD.with_name(f"cocurve-smollm2-{preset}.md")


def png_path(preset: str) -> Path:
    return OUT_PNG if preset == "quick" else OUT_PNG.with_name(f"cocurve-smollm2-{preset}-alloc.png")


def out_dir(preset: str, method: str, rho: float) -> Path:
    """A CoCurve row's export folder (the quick preset keeps its committed names)."""
    tag = "" if preset == "quick" else f"{preset}-"
    return DIR / f"out-{tag}{method}-{int(round(rho * 100))}"


def preset_rhos(p: dict) -> list[float]:
    return list(p.get("rhos", RHOS))


def preset_methods(p: dict) -> list[str]:
    return list(p.get("methods", METHODS))


def load(device: str | None = None):
    """``(model, tokenizer)`` of the run's model on the run's device. ``COCURVE_TF32=1``: float32 matrix products
    in TF32 on an accelerator (faster, less exact; the graph's metadata records the precision)."""
    from secateur.models.loading import load_model

    if os.environ.get("COCURVE_TF32") == "1":
        torch.set_float32_matmul_precision("high")
    return load_model(MODEL, device=device or DEVICE)


def graph_path(preset: str) -> Path:
    return DIR / f"graph-{preset}.npz"


# Presets with a test split draw their three splits from disjoint C4 documents (index i of the calibration pool
# [0, 1500): held-out if i % 8 == 6, test if i % 8 == 7, graph otherwise; seeds 0 / 1 / 2). One draw from the
# whole pool cannot keep them apart at 2048 tokens: only 42 of the 1500 documents are longer than 2048 tokens
# (392 longer than 512), and 160 windows drawn from them by the long-document rule repeat (3 identical pairs).
DOC_SPLIT = {"graph": (0, 1, 2, 3, 4, 5), "heldout": (6,), "test": (7,)}


def _doc_split(tok, p: dict) -> dict:
    from secateur.data.sources import calib_documents
    from secateur.data.windows import Manifest, sample_windows, token_sha256

    path = WORK / f"calib-c4-docsplit-{p['n_graph']}-{p['n_heldout']}-{p['n_test']}x{p['seqlen']}.pt"
    if path.exists():
        return torch.load(path)
    docs = calib_documents("c4")
    out, mans = {}, {}
    for seed, (name, rems) in enumerate(DOC_SPLIT.items()):
        pool = [d for i, d in enumerate(docs) if i % 8 in rems]
        n = p["n_graph"] if name == "graph" else p[f"n_{name}"]
        ids, rule = sample_windows(pool, tok, n, p["seqlen"], seed, f"c4 {name} documents")
        out[name] = ids
        mans[name] = Manifest(f"c4 documents [0, 1500) with index % 8 in {list(rems)}", n, p["seqlen"], seed,
                              token_sha256(ids), str(getattr(tok, "name_or_path", "")), rule).to_dict()
    out["manifest"] = {"rule": "disjoint documents per split", **mans}
    WORK.mkdir(parents=True, exist_ok=True)
    torch.save(out, path)
    return out


def splits(tok, p: dict) -> dict:
    """The preset's token splits: ``graph`` (H, baseline statistics), ``heldout`` (C': lambda choice),
    ``test`` (the KL column, None without ``n_test``) and the calibration ``manifest``. Without a test split
    (quick, smoke): one seeded draw of ``n_graph + n_heldout`` windows split in that order, as committed. With
    one: three draws from disjoint documents (``DOC_SPLIT``). Every split is checked to share no 32-token run
    with the others; from the ``--inputs`` file instead when one is given (``--stage pack`` wrote it)."""
    n_test = p.get("n_test", 0)
    if INPUTS:
        blob = torch.load(INPUTS)
        want = {"graph": p["n_graph"], "heldout": p["n_heldout"], "test": n_test}
        got = {k: 0 if blob[k] is None else int(blob[k].shape[0]) for k in want}
        if got != want or int(blob["graph"].shape[1]) != p["seqlen"]:
            raise SystemExit(f"{INPUTS} holds {got} x {blob['graph'].shape[1]} windows, the preset wants {want} x "
                             f"{p['seqlen']}")
        return {k: blob[k] if blob[k] is None else blob[k].long() for k in ("graph", "heldout", "test")} | {
            "manifest": blob["manifest"]}
    if not n_test:
        ids, man = calib_tokens(tok, "c4", p["n_graph"] + p["n_heldout"], p["seqlen"])
        out = {"graph": ids[:p["n_graph"]], "heldout": ids[p["n_graph"]:], "test": None, "manifest": man}
        if any(torch.equal(x, y) for x in out["graph"] for y in out["heldout"]):
            raise SystemExit("held-out windows overlap the graph windows")
        return out
    out = _doc_split(tok, p)
    g, h, t = out["graph"], out["heldout"], out["test"]
    if not (_disjoint(g, h) and _disjoint(torch.cat([g, h]), t) and _disjoint(t, torch.cat([g, h]))):
        raise SystemExit("the graph, held-out and test windows share a 32-token run")
    return out


def data(tok, p: dict):
    s = splits(tok, p)
    return s["graph"], s["heldout"], s["manifest"]


def corpora_ids(tok) -> dict[str, torch.Tensor]:
    """The perplexity corpora as token ids (from the ``--inputs`` file when one is given)."""
    if INPUTS:
        return {k: v.long() for k, v in torch.load(INPUTS)["corpora"].items()}
    from secateur.data.sources import eval_text
    from secateur.data.windows import eval_ids

    return {c: eval_ids(eval_text(c), tok) for c in CORPORA}


def config(p: dict):
    from secateur.methods.cocurve import CoCurveConfig
    from secateur.scoring.cocurve_sweep import SweepConfig

    # the recorded rows' protocol (before issue 45): the 22-value lambda grid and the plain held-out argmin; a preset
    # may name the new ones ("family": "breakpoints", "choice": "paired")
    return CoCurveConfig(sweep=SweepConfig(positions_per_seq=p["positions"], top_r=p["top_r"],
                                           unit_batch=p["unit_batch"], progress=True,
                                           subsample_check=p.get("subsample_check")),
                         family=p.get("family", "grid"), choice=p.get("choice", "min"),
                         max_candidates=p.get("max_candidates", 32))


COEC_OPTS = {"max_rounds": 50}  # the paper's cap (tol 1e-4); the solver is ~4x cheaper per round since session 2


# COEC's Grams come from their own calibration set, not the 4 x 256 graph windows: 1024 tokens cannot pin down a
# 1536-wide down_proj Gram, and COEC fitted there raised held-out KL. C4 like the graph (documents [0, 1500)),
# seed 1 so the windows differ; checked against the held-out split below.
COMP_CALIB = {"source": "c4", "nsamples": 16, "seqlen": 2048, "seed": 1}


COEC_METHODS = ("cocurve+coec", "wanda_sp+coec", "coec")


def _disjoint(windows: torch.Tensor, heldout: torch.Tensor, k: int = 32) -> bool:
    """No k-token run of a held-out window occurs in the compensation windows."""
    runs = {tuple(w[i:i + k].tolist()) for w in windows for i in range(0, w.numel() - k + 1)}
    return not any(tuple(h[i:i + k].tolist()) in runs for h in heldout for i in range(0, h.numel() - k + 1, k))
