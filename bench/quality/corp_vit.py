"""CORP's vision tables reproduced in shape on the ViT trained here: ``results/vision/corp-vit.md``
(+ ``.jsonl``, plots).

Every row prunes the Fashion-MNIST ViT (``bench/tools/train_vision.py --arch vit``) with the same calibration images
(``--nsamples`` train images drawn with seed 0) and scores the saved folder on the 10,000 test images. Groups
(``--groups``, default all; each row keyed, a recorded row is not rerun, so a stopped run resumes):

  t2   CORP Table 2: MLP-only, QK-only, joint at 50%, with and without compensation
  f2   CORP Fig. 2: the same three at 10-70%, with and without compensation
  t3   CORP Table 3: joint 50% with 64 / 256 / 1000 / 4000 calibration images
  f3   CORP Fig. 3 (MLP-only 10-70%): CORP, VBP, GRAIL (magnitude and Wanda selectors), Wanda-sp, FLAP, magnitude-sp
  f5   CORP Fig. 5: activation / magnitude / combined ranking, with and without compensation (MLP-only 50%)
  t5   CORP Table 5: params, FLOPs, p50 latency (batch 1) and throughput (batch 16) of joint 0-70%, dense first,
       every model timed in alternation in one process (``--threads``)
  fam  family rows: CORP joint 30% / 50% on the DeiT-, DINOv2- and SigLIP-shaped classifiers trained here; CLIP
       (no model trained) on tiny random models, by reconstruction error only
  t8   CORP Table 8's shape: the DINOv2- and SigLIP-shaped backbones at 30% / 50% joint: feature cosine to dense
       and linear-probe top-1 (the paper's dense tasks cannot run here)

    python bench/quality/corp_vit.py [--groups t2,f2] [--nsamples 1000] [--max-images N] [--render]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "src"))

from bench.common import append_row, read_rows, results_dir, stamped  # noqa: E402

OUT = results_dir("vision") / "corp-vit.jsonl"
PAGE = results_dir("vision") / "corp-vit.md"
SPARSITIES = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7)
#: the order rows run in: the headline sparsity first, then the ends and the middle, so a run stopped early still
#: draws every curve's shape
PRIORITY = (0.5, 0.3, 0.7, 0.1, 0.2, 0.4, 0.6)


def by_priority(items: list, sparsity=lambda r: r.sparsity) -> list:
    return sorted(items, key=lambda r: PRIORITY.index(round(sparsity(r), 1)) if round(sparsity(r), 1) in PRIORITY
                  else 0)
UNITS = {"mlp": "channel", "qk": "qk", "joint": "channel,qk"}


@dataclass(frozen=True)
class Row:
    key: str
    group: str
    method: str
    sparsity: float
    kw: dict = field(default_factory=dict, hash=False)
    nsamples: int | None = None  # None: --nsamples
    model: str = "fmnist-vit"


def rows(nsamples: int) -> list[Row]:
    """Every prune of the page, in order; keys are shared between groups (t2's rows are f2's 50% points)."""
    out: list[Row] = []
    for s in SPARSITIES:
        for part, units in UNITS.items():
            for comp in (True, False):
                kw = {"units": units} | ({} if comp else {"compensation": "none"})
                out.append(Row(f"corp-{part}-{'comp' if comp else 'nocomp'}-{s:.1f}", "f2", "corp", s, kw))
    for n in (64, 256, 1000, 4000):
        out.append(Row(f"corp-joint-comp-0.5-n{n}", "t3", "corp", 0.5, {"units": "channel,qk"}, n))
    competitors = {"vbp": ("vbp", {}), "grail-magnitude": ("magnitude-sp", {"compensation": "grail"}),
                   "grail-wanda": ("wanda-sp", {"compensation": "grail"}), "wanda-sp": ("wanda-sp", {}),
                   "flap": ("flap", {}), "magnitude-sp": ("magnitude-sp", {})}
    for s in SPARSITIES:
        for name, (method, kw) in competitors.items():
            out.append(Row(f"{name}-mlp-{s:.1f}", "f3", method, s, {"units": "channel"} | kw))
    for s in (0.3, 0.5):  # Table 4(a): GRAIL on attention, whole heads (GRAIL refits the module's second linear, o)
        for name, method in (("grail-magnitude", "magnitude-sp"), ("grail-wanda", "wanda-sp")):
            out.append(Row(f"{name}-heads-{s:.1f}", "t4a", method, s, {"units": "head", "compensation": "grail"}))
    for ranking in ("activation", "magnitude"):
        for comp in (True, False):
            kw = {"units": "channel", "corp_ranking": ranking} | ({} if comp else {"compensation": "none"})
            out.append(Row(f"corp-mlp-{ranking}-{'comp' if comp else 'nocomp'}-0.5", "f5", "corp", 0.5, kw))
    for model in ("fmnist-deit", "fmnist-dinov2", "fmnist-siglip"):  # family rows on the trained classifiers
        for s in (0.3, 0.5):
            out.append(Row(f"{model}-joint-{s:.1f}", "fam", "corp", s, {"units": "channel,qk"}, model=model))
    for model in ("fmnist-dinov2-backbone", "fmnist-siglip-backbone"):
        for s in (0.3, 0.5):
            out.append(Row(f"{model}-joint-{s:.1f}", "t8", "corp", s, {"units": "channel,qk"}, model=model))
    return out


def cache() -> Path:
    return Path(os.environ.get("SECATEUR_CACHE", Path.home() / ".cache" / "secateur")) / "vision"


def _load() -> list[float]:
    return [round(v, 2) for v in os.getloadavg()]


def _timings(report: dict) -> dict:
    """CORP Table 6's split from the report: calibration forwards, ranking, compensation, slicing (seconds)."""
    e = report["timings"]["engine"]
    return {"calibration_s": e.get("stats_s", 0) + e.get("gram_pass_s", 0) + e.get("qk_embed", 0)
            + e.get("qk_forward", 0),
            "ranking_s": e.get("select_s", 0), "compensation_s": e.get("compensation_s", 0) + e.get("qk_prune", 0),
            "slicing_s": e.get("slice_s", 0), "prune_phase_s": report["timings"]["phases"].get("prune")}


def prune_row(row: Row, nsamples: int, max_images: int | None) -> dict:
    import torch

    from secateur import api
    from secateur.eval.accuracy import eval_accuracy
    from secateur.eval.efficiency import count_params, vision_flops

    dense = cache() / row.model
    n = row.nsamples or nsamples
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out"
        t = time.perf_counter()
        res = api.prune(model=str(dense), method=row.method, sparsity=row.sparsity, calib="fashion-mnist",
                        nsamples=n, out=str(out), quiet=True, **row.kw)
        wall = time.perf_counter() - t
        model = res.model
        cfg = model.config.vision_config if hasattr(model.config, "vision_config") else model.config
        flops = vision_flops(model, cfg.image_size, cfg.num_channels)["flops_per_image"]
        rec = {"key": row.key, "group": row.group, "model": row.model, "method": row.method,
               "sparsity": row.sparsity, "options": row.kw, "nsamples": n, "params": count_params(model),
               "flops_per_image": flops, "realized": res.report["realized_sparsity"], "timings": _timings(res.report),
               "prune_wall_s": round(wall, 2), "threads": torch.get_num_threads(), "load_avg_1_5_15": _load(),
               "command": f"secateur prune --model {row.model} --method {row.method} --sparsity {row.sparsity} "
                          f"--calib fashion-mnist --nsamples {n} "
                          + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in row.kw.items())}
        if row.group == "t8":
            from secateur.eval.features import eval_features

            f = eval_features(str(out), str(dense), "fashion-mnist", max_images=max_images or 2000)
            rec |= {"cosine_mean": f["cosine_mean"], "cosine_min": f["cosine_min"], "probe_top1": f["probe_top1"],
                    "probe_top1_dense": f["probe_top1_reference"], "n_images": f["n_images"]}
        else:
            acc = eval_accuracy(str(out), "fashion-mnist", "test", max_images=max_images)
            rec |= {"top1": acc["top1"], "top5": acc["top5"], "n_images": acc["n_images"],
                    "images_sha256": acc["images_sha256"]}
        return stamped(rec)


def dense_row(max_images: int | None) -> dict:
    import torch

    from secateur.eval.accuracy import eval_accuracy
    from secateur.eval.efficiency import count_params, vision_flops
    from secateur.models.loading import load_model

    folder = cache() / "fmnist-vit"
    model, _ = load_model(str(folder))
    acc = eval_accuracy(str(folder), "fashion-mnist", "test", max_images=max_images)
    return stamped({"key": "dense", "group": "t2", "model": "fmnist-vit", "method": "dense", "sparsity": 0.0,
                    "params": count_params(model),
                    "flops_per_image": vision_flops(model, model.config.image_size, model.config.num_channels)[
                        "flops_per_image"],
                    "top1": acc["top1"], "top5": acc["top5"], "n_images": acc["n_images"],
                    "images_sha256": acc["images_sha256"], "threads": torch.get_num_threads(),
                    "load_avg_1_5_15": _load()})


TINY_FAMILIES = ("clip_vision_model", "clip", "deit")  # the vision families with no model trained here


def tiny_family_rows(done: set[str] = frozenset()) -> list[dict]:
    """Family rows of the vision families with no model trained here (``TINY_FAMILIES``): tiny random models, scored
    by reconstruction only (the block error of CORP joint 30% / 50% against the dense model on random images): named
    as such on the page. Rows whose key is in ``done`` are skipped."""
    import tempfile as tf

    import numpy as np

    from secateur import api
    from secateur.eval.features import block_errors
    from secateur.testing import random_pixels, save_tiny, tiny_vision_model

    out = []
    with tf.TemporaryDirectory() as tmp:
        npz = Path(tmp) / "calib.npz"
        np.savez(npz, images=np.random.default_rng(0).integers(0, 256, (64, 16, 16, 3), dtype=np.uint8))
        for fam in TINY_FAMILIES:
            folder = save_tiny(fam, Path(tmp) / fam)
            for s in (0.3, 0.5):
                for comp in (True, False):
                    if f"tiny-{fam}-joint-{s:.1f}-{'comp' if comp else 'nocomp'}" in done:
                        continue
                    kw = {} if comp else {"compensation": "none"}
                    res = api.prune(model=folder, method="corp", sparsity=s, calib=str(npz), nsamples=64, quiet=True,
                                    **kw)
                    err = block_errors(res.model, tiny_vision_model(fam), random_pixels(32, seed=1))
                    out.append(stamped({"key": f"tiny-{fam}-joint-{s:.1f}-{'comp' if comp else 'nocomp'}",
                                        "group": "fam-tiny", "model": f"tiny random {fam}", "sparsity": s,
                                        "compensation": comp, "block_rel_error": err, "load_avg_1_5_15": _load()}))
    return out


def speed_rows(nsamples: int, threads: int) -> dict:
    """Table 5: dense and joint CORP at 10-70% saved, reloaded and timed in alternation in this process."""
    import torch

    from secateur import api
    from secateur.eval.efficiency import measure_vision_models
    from secateur.models.loading import load_model

    dense = cache() / "fmnist-vit"
    with tempfile.TemporaryDirectory() as tmp:
        names, models = ["dense"], [load_model(str(dense))[0]]
        for s in SPARSITIES:
            out = Path(tmp) / f"j{s}"
            api.prune(model=str(dense), method="corp", sparsity=s, calib="fashion-mnist", nsamples=nsamples,
                      out=str(out), quiet=True)
            names.append(f"joint-{s:.1f}")
            models.append(load_model(str(out))[0])
        cfg = models[0].config
        got = measure_vision_models(models, cfg.image_size, cfg.num_channels, batch_latency=1, batch_throughput=16,
                                    warmup=3, repeats=20, threads=threads)
    return stamped({"key": f"t5-threads{threads}", "group": "t5", "rows": dict(zip(names, got)),
                    "threads": threads, "torch_threads_default": torch.get_num_threads(), "load_avg_1_5_15": _load()})


def main(argv: list[str] | None = None) -> int:
    from bench.quality.corp_vit_page import render

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", default="t2,f2,t3,f3,t4a,f5,t8,t5,fam")
    ap.add_argument("--nsamples", type=int, default=1000)
    ap.add_argument("--max-images", type=int, default=None, help="test images scored (default: all 10,000)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the Table 5 timing")
    ap.add_argument("--render", action="store_true", help="only write the page from the recorded rows")
    a = ap.parse_args(argv)
    groups = set(a.groups.split(","))
    if not a.render:
        done = {r["key"] for r in read_rows(OUT)}
        if "dense" not in done and groups & {"t2", "f2", "f3"}:
            append_row(OUT, dense_row(a.max_images), unique_key=True)
        for row in by_priority(rows(a.nsamples)):
            want = row.group in groups or (row.group == "f2" and row.sparsity == 0.5 and "t2" in groups)
            if want and row.key not in done and (cache() / row.model / "config.json").exists():
                rec = prune_row(row, a.nsamples, a.max_images)
                append_row(OUT, rec, unique_key=True)
                print(f"{row.key}: {rec.get('top1', rec.get('probe_top1')):.4f}", flush=True)
        if "fam" in groups:
            for rec in tiny_family_rows(done):
                append_row(OUT, rec, unique_key=True)
        if "t5" in groups and f"t5-threads{a.threads}" not in done:
            append_row(OUT, speed_rows(a.nsamples, a.threads), unique_key=True)
    render(read_rows(OUT), PAGE)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
