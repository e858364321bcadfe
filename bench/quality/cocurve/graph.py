"""CoCurve bench, the graph stages: token pack, the sweep building H (over gloo ranks, checkpointed), the probe."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from bench.quality.cocurve import base as run
from bench.quality.cocurve.base import CORPORA, GRAPH_KEYS, PRESETS, config, corpora_ids, data, graph_path, load, splits


def stage_pack(preset: str, path: Path) -> None:
    """Every token a preset's rows need in one file (``--inputs`` elsewhere: a machine without the corpora)."""
    from secateur.data.windows import token_sha256

    p = PRESETS[preset]
    _, tok = load("cpu")
    s = splits(tok, p)
    corpora = corpora_ids(tok)
    blob = {"preset": preset, "preset_params": p, **s,
            "corpora": {k: v.to(torch.int32) for k, v in corpora.items()},
            "corpora_sha256": {k: token_sha256(v) for k, v in corpora.items()}}
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(blob, path)
    print(json.dumps({"inputs": str(path), "bytes": path.stat().st_size, "graph": list(s["graph"].shape),
                      "corpora_tokens": {k: v.numel() for k, v in corpora.items()}}), flush=True)


def _graph_checkpoint(rank: int, world: int, preset: str, g_ids: torch.Tensor, resume_it: bool):
    """The sweep's per-block checkpoint beside the graph file (``.graph-<preset>.npz.secateur-ckpt``): opened (or
    refused on a fingerprint mismatch) by rank 0, then joined by the other ranks. Its fingerprint is what fixes
    the blocks' contents: model, the preset's graph keys, sweep config, graph tokens, library versions (not the
    world size: H does not depend on it)."""
    import torch.distributed as tdist

    from secateur.calib import resume
    from secateur.data.windows import token_sha256
    from secateur.runinfo import versions

    p = PRESETS[preset]
    fp = json.loads(json.dumps({"model": run.MODEL, "device": run.DEVICE,
                                "preset": {k: p[k] for k in GRAPH_KEYS if k in p},
                                "sweep": config(PRESETS[preset]).to_dict(), "graph_sha256": token_sha256(g_ids),
                                "versions": versions()}, default=str))
    ck = resume.Checkpoint.open(graph_path(preset), fp, resume_it) if rank == 0 else None
    if world > 1:
        tdist.barrier()
    return ck or resume.Checkpoint(resume.checkpoint_dir(graph_path(preset)))


def _graph_worker(rank: int, world: int, preset: str, n_seqs: int | None = None, resume_it: bool = False) -> None:
    from secateur.calib import resume
    from secateur.methods.cocurve import build_graph, cocurve_inventory
    from secateur.models.adapters import get_adapter

    p = PRESETS[preset]
    model, tok = load()
    adapter = get_adapter(model)
    g_ids, _, man = data(tok, p)
    cfg = config(p)
    ck = _graph_checkpoint(rank, world, preset, g_ids, resume_it) if n_seqs is None else None
    t = time.perf_counter()
    with resume.active(ck):
        graph = build_graph(model, adapter, g_ids[:n_seqs], cfg, cocurve_inventory(adapter))
    if n_seqs is not None:  # --stage probe: the first n_seqs sequences, timed and extrapolated, nothing saved
        _probe_report(preset, graph.meta, time.perf_counter() - t, n_seqs, p["n_graph"])
        return
    if rank == 0:
        graph.meta["wall_s"] = time.perf_counter() - t
        graph.meta["calibration_manifest"] = man
        graph.meta["preset"] = preset
        graph.meta["device"] = run.DEVICE
        graph.meta["float32_matmul_precision"] = torch.get_float32_matmul_precision()
        info = graph.save(graph_path(preset))
        ck.remove()  # the graph holds everything the blocks did
        print(json.dumps({k: graph.meta[k] for k in ("timings", "wall_s", "n_ablated", "lambda_min")}
                         | info, default=str), flush=True)


def _probe_report(preset: str, meta: dict, wall: float, n_seqs: int, n_graph: int) -> None:
    """The sweep's time on ``n_seqs`` sequences scaled to the preset's ``n_graph`` (one block per sequence)."""
    t = meta["timings"]
    per_seq = (t["ablations_s"] + t["dense_s"] + t["gram_s"]) / n_seqs
    out = {"preset": preset, "device": run.DEVICE, "float32_matmul_precision": torch.get_float32_matmul_precision(),
           "probe_sequences": n_seqs, "probe_wall_s": round(wall, 2),
           "ablations_per_sequence": t["n_ablations"] // n_seqs, "per_ablation_s": t["per_ablation_s"],
           "ablation_over_dense": t["ablation_over_dense"],
           "projected_sweep_s": round(per_seq * n_graph, 1)}
    (run.RESULTS_DIR / f"cocurve-probe-{preset}.json").write_text(json.dumps(out, indent=1))
    print("probe", json.dumps(out), flush=True)


def stage_graph(preset: str, ranks: int, resume_it: bool = False) -> None:
    """H over ``ranks`` processes, checkpointed per block of sequences; ``resume_it``: continue a killed run
    (bit-identical H: ``tests/test_cocurve_resume.py``)."""
    if ranks > 1:
        if run.DEVICE != "cpu":
            raise SystemExit("--ranks > 1 is the CPU's gloo split; on an accelerator use --ranks 1")
        from secateur.calib.dist import spawn_gloo

        spawn_gloo(_graph_worker, ranks, (preset, None, resume_it), threads=1)
    else:
        torch.set_num_threads(1)
        _graph_worker(0, 1, preset, None, resume_it)


def stage_tiny_setup(work: Path) -> tuple[Path, Path]:
    """The CPU exercise of ``bench/quality/device_cocurve_full.sh`` (TINY=1): a seeded random 16-layer Llama (4 heads,
    2 KV heads, 16 x (2 + 16) units; 16 layers so that 12 unprotected ones under the 1.5 rho cap reach 30%)
    and a token file of random ids in the ``tiny`` preset's shapes."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from secateur.data.windows import token_sha256
    from secateur.testing import tiny_tokenizer

    p = PRESETS["tiny"]
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=16,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    model_dir = work / "tiny-model"
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    g = torch.Generator().manual_seed(1)
    n = p["n_graph"] + p["n_heldout"] + p["n_test"]
    ids = torch.randint(3, 128, (n, p["seqlen"]), generator=g)
    a, b = p["n_graph"], p["n_graph"] + p["n_heldout"]
    corpora = {c: torch.randint(3, 128, (600,), generator=g) for c in CORPORA}
    blob = {"preset": "tiny", "preset_params": p, "graph": ids[:a], "heldout": ids[a:b], "test": ids[b:],
            "manifest": {"source": "random ids (seed 1)", "n": n, "seqlen": p["seqlen"], "sha256": token_sha256(ids)},
            "corpora": {k: v.to(torch.int32) for k, v in corpora.items()},
            "corpora_sha256": {k: token_sha256(v) for k, v in corpora.items()}}
    inputs = work / "inputs-tiny.pt"
    torch.save(blob, inputs)
    print(json.dumps({"model": str(model_dir), "inputs": str(inputs)}), flush=True)
    return model_dir, inputs
