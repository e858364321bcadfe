"""``secateur prune --towers vision|language`` on a vision-language model (issue 47, first slice): one tower pruned by
the ordinary pipeline as a model of its own family (:mod:`secateur.models.towers`), the VLM saved whole.

Order: the VLM's files checked and the tower named before anything is loaded; the VLM and its processor loaded; the
tower handed to the one pipeline in memory (its calibration: images through the VLM's image processor for the
vision tower, text through its tokenizer for the language tower); the tower's new sizes written into the VLM's
config (refused, before anything is written, where only per-layer widths would express them); the VLM, its processor
and the report saved atomically. One process, resident, no checkpoint: ``--procs``, ``--stream`` and ``--resume``
are refused in one line for now."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

from secateur.data.captions import caption_pairs, is_caption_source
from secateur.errors import SecateurError
from secateur.models.blocks import ALONE, Shard
from secateur.models.towers import check_tower, check_vision_mlp, load_processor, merged_embeddings, tower_model
from secateur.vlm_config import write_back


def _config(model: str) -> dict:
    cfg = Path(model) / "config.json"
    if not cfg.is_file():
        raise SecateurError(f"--towers needs a local model folder with config.json; {model!r} has none")
    try:
        return json.loads(cfg.read_text())
    except (OSError, ValueError) as e:
        raise SecateurError(f"{cfg}: not readable JSON ({e}); restore the model's config.json") from None


def prune_tower(opts, split: Shard, run_pipeline: Callable):
    """Prune ``opts.towers`` of the VLM folder ``opts.model``; returns the pipeline's ``PruneResult`` whose model is
    the whole VLM (pruned in place) and whose tokenizer is its processor."""
    from types import SimpleNamespace

    from transformers import AutoModelForImageTextToText

    from secateur.safe_write import EXPORT_MARKER, REPORT_NAME, atomic_dir, check_output_dir

    if not isinstance(opts.model, str):
        raise SecateurError("--towers takes a VLM folder (an in-memory VLM: prune secateur.models.towers."
                            "tower_model(vlm, tower) instead)")
    if split.split or opts.stream or opts.resume:
        raise SecateurError("--towers runs in one process, resident: drop --procs/--stream/--resume")
    cfg = SimpleNamespace(**_config(opts.model))
    plan = check_tower(cfg, opts.towers, opts.sparsity)
    if plan[0][0].startswith("joint"):
        return _prune_joint(opts, plan[0][0])
    towers = [t for t, _ in plan]
    check_vision_mlp(cfg, towers, opts.method, getattr(opts.method_options, "units", None))
    captions = is_caption_source(opts.calib)
    if captions and towers == ["vision"]:
        raise SecateurError(f"--calib {opts.calib} is image-caption pairs for the language tower; the vision tower "
                            "calibrates on images: pass --calib fashion-mnist (or an image folder)")
    if len(towers) == 2 and not captions:
        raise SecateurError("pruning both towers calibrates both from one set; pass --calib fashion-mnist-captions "
                            "(its images for the vision tower, its image-caption pairs for the language tower)")
    if opts.out:
        check_output_dir(opts.out, opts.overwrite)
    try:
        vlm = AutoModelForImageTextToText.from_pretrained(opts.model, dtype=getattr(__import__("torch"), opts.dtype))
        proc = load_processor(opts.model, vlm.config)
    except (OSError, ValueError, KeyError, ImportError) as e:
        raise SecateurError(f"{opts.model}: the VLM or its processor does not load ({str(e).splitlines()[0]}); "
                            "check the folder's weights and processor files") from None
    vlm.eval()
    reports = {}
    for tower, ratio in plan:  # vision first: the language tower's pairs then pass through the pruned vision tower
        res = _one_tower(opts, run_pipeline, vlm, proc, tower, ratio, captions)
        reports[tower] = res.report
    report = res.report
    report["vlm"] = {"model": opts.model, "towers": {t: r for t, r in plan}, "model_type": cfg.model_type}
    if len(plan) == 2:
        report["vlm"]["vision_report"] = reports["vision"]
    report["options"] = opts.to_dict()
    if opts.out:
        with atomic_dir(opts.out, opts.overwrite) as tmp:
            vlm.save_pretrained(tmp)
            proc.save_pretrained(tmp)
            (Path(tmp) / REPORT_NAME).write_text(json.dumps(report, indent=1, default=str))
            (Path(tmp) / EXPORT_MARKER).write_text(json.dumps({"route": "stock", "architectures":
                                                               vlm.config.architectures, "towers": towers}))
    return type(res)(report, vlm, proc)


def _load(opts):
    import torch
    from transformers import AutoModelForImageTextToText

    try:
        vlm = AutoModelForImageTextToText.from_pretrained(opts.model, dtype=getattr(torch, opts.dtype))
        proc = load_processor(opts.model, vlm.config)
    except (OSError, ValueError, KeyError, ImportError) as e:
        raise SecateurError(f"{opts.model}: the VLM or its processor does not load ({str(e).splitlines()[0]}); "
                            "check the folder's weights and processor files") from None
    return vlm.eval(), proc


def _prune_joint(opts, spec: str):
    """``--towers joint`` / ``joint:<tower>``: one budget over the towers' joint inventory (:mod:`secateur.vlm_joint`):
    checked before loading, pruned, saved atomically with its processor and report."""
    from secateur.methods.result import PruneResult
    from secateur.safe_write import check_output_dir
    from secateur.vlm_joint import check_joint, parse_joint, prune_joint, save

    check_joint(opts)
    if opts.out:
        check_output_dir(opts.out, opts.overwrite)
    vlm, proc = _load(opts)
    rep, routes, files = prune_joint(opts, vlm, proc, parse_joint(spec))
    rep["options"] = opts.to_dict()
    if opts.out:
        save(opts.out, opts.overwrite, vlm, proc, rep, routes, files)
    return PruneResult(rep, vlm, proc)


def _qwen_vision(opts, vlm, proc, ratio: float, captions: bool):
    """Qwen2.5-VL's vision tower: its MLP channels scored over the VLM's own forward and sliced uniformly
    (:mod:`secateur.models.qwen_vision`; the staged engine does not run its patch-row blocks)."""
    import time

    from secateur.data.captions import vision_channels
    from secateur.data.images import processed_images
    from secateur.methods.result import PruneResult
    from secateur.models.qwen_vision import prune_vision_mlp

    t0 = time.perf_counter()
    n_before = sum(p.numel() for p in vlm.parameters())
    vc = vlm.config.vision_config
    pixels, manifest = None, None
    if opts.method == "wanda-sp":
        imgs = processed_images("fashion-mnist" if captions else opts.calib, proc.image_processor,
                                vision_channels(vc), int(vc.patch_size), n=opts.nsamples, seed=opts.seed or 0,
                                split="train", data_dir=opts.data_dir)
        pixels, manifest = imgs.pixel_values, imgs.manifest
    info = prune_vision_mlp(vlm, opts.method, ratio, pixels, int(opts.seed or 0), opts.run.chunk_size)
    n_after = sum(p.numel() for p in vlm.parameters())
    rep = {"method": opts.method, "kind": "structured-vision-mlp", "target_sparsity": ratio,
           "realized_sparsity": {"targeted": info["realized"], "of_all_parameters": 1 - n_after / n_before,
                                 "pruned_weights": n_before - n_after, "targeted_weights": info["removable"]},
           "details": {"vision_mlp": {k: v for k, v in info.items() if k != "kept"}}, "calibration": manifest,
           "timings": {"phases": {"prune": time.perf_counter() - t0}}, "kept_channels": info["kept"]}
    return PruneResult(rep, vlm, proc)


def _one_tower(opts, run_pipeline: Callable, vlm, proc, tower: str, ratio: float, captions: bool):
    """One tower through the pipeline in memory at ``ratio``; its sizes written back into the VLM's config."""
    from secateur.models.towers import vlm_type

    if tower == "vision" and vlm_type(vlm.config).patches:
        return _qwen_vision(opts, vlm, proc, ratio, captions)
    part = tower_model(vlm, tower)
    reader = proc.image_processor if tower == "vision" else proc.tokenizer
    sub = dataclasses.replace(opts, model=part, tokenizer=reader, out=None, towers=None, overwrite=False,
                              sparsity=ratio)
    calibration = None
    if tower == "vision" and captions:  # the pairs' images
        sub = dataclasses.replace(sub, calib="fashion-mnist")
    if tower == "language" and captions:  # image + caption sequences, merged by the VLM (its vision tower as is now)
        ids, pixels, manifest = caption_pairs(vlm, proc, opts.nsamples, opts.seed, opts.data_dir)
        calibration = (merged_embeddings(vlm, ids, pixels), manifest)
        sub = dataclasses.replace(sub, calib="self", seqlen=int(ids.shape[1]))  # the pairs' own length
    res = run_pipeline(sub, ALONE, calibration)
    write_back(vlm, tower, part)  # refuses per-layer widths before anything is written
    return res
