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
from secateur.models.towers import check_tower, merged_embeddings, tower_model, write_back


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

    from transformers import AutoModelForImageTextToText, AutoProcessor

    from secateur.safe_write import EXPORT_MARKER, REPORT_NAME, atomic_dir, check_output_dir

    if not isinstance(opts.model, str):
        raise SecateurError("--towers takes a VLM folder (an in-memory VLM: prune secateur.models.towers."
                            "tower_model(vlm, tower) instead)")
    if split.split or opts.stream or opts.resume:
        raise SecateurError("--towers runs in one process, resident: drop --procs/--stream/--resume")
    cfg = SimpleNamespace(**_config(opts.model))
    tower = check_tower(cfg, opts.towers)
    if is_caption_source(opts.calib) and tower != "language":
        raise SecateurError(f"--calib {opts.calib} is image-caption pairs for the language tower; the vision tower "
                            "calibrates on images: pass --calib fashion-mnist (or an image folder)")
    if opts.out:
        check_output_dir(opts.out, opts.overwrite)
    try:
        vlm = AutoModelForImageTextToText.from_pretrained(opts.model, dtype=getattr(__import__("torch"), opts.dtype))
        proc = AutoProcessor.from_pretrained(opts.model)
    except (OSError, ValueError, KeyError) as e:
        raise SecateurError(f"{opts.model}: the VLM or its processor does not load ({str(e).splitlines()[0]}); "
                            "check the folder's weights and processor files") from None
    vlm.eval()
    part = tower_model(vlm, tower)
    reader = proc.image_processor if tower == "vision" else proc.tokenizer
    calibration = None
    if tower == "language" and is_caption_source(opts.calib):  # image + caption sequences, merged by the VLM
        ids, pixels, manifest = caption_pairs(vlm, proc, opts.nsamples, opts.seed, opts.data_dir)
        calibration = (merged_embeddings(vlm, ids, pixels), manifest)
    sub = dataclasses.replace(opts, model=part, tokenizer=reader, out=None, towers=None, overwrite=False)
    if calibration is not None:  # the pairs' own length, not --seqlen
        sub = dataclasses.replace(sub, calib="self", seqlen=int(calibration[0].shape[1]))
    res = run_pipeline(sub, ALONE, calibration)
    write_back(vlm, tower, part)  # refuses per-layer widths before anything is written
    res.report["vlm"] = {"model": opts.model, "tower": tower, "model_type": cfg.model_type}
    res.report["options"] = opts.to_dict()
    if opts.out:
        with atomic_dir(opts.out, opts.overwrite) as tmp:
            vlm.save_pretrained(tmp)
            proc.save_pretrained(tmp)
            (Path(tmp) / REPORT_NAME).write_text(json.dumps(res.report, indent=1, default=str))
            (Path(tmp) / EXPORT_MARKER).write_text(json.dumps({"route": "stock", "architectures":
                                                               vlm.config.architectures, "tower": tower}))
    return type(res)(res.report, vlm, proc)
