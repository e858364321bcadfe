"""CORP's speed targets on vision (issue 44 section 3): ``results/speed/corp-vit-speed.md`` (+ ``.jsonl``).

1. Prune time against one dense calibration forward: CORP joint 50% on the trained Fashion-MNIST ViT at 1000
   calibration images (the prune phase of the run, model load and image processing excluded) beside one dense
   forward of the same images in the same chunks, alternated ``--repeats`` times in this process.
2. Throughput of the saved joint-50% model against dense at batch 16 (and p50 latency at batch 1), and where the
   crossover width is: random DeiT-shaped encoders (6 blocks, 4 x MLP, 32 x 32 RGB input in patches of 4: 65
   tokens) of hidden 144 / 192 / 384 / 768, pruned joint 50% on 32 random images (speed does not depend on the
   weights' values), each dense/pruned pair timed in alternation (``measure_vision_models``).

    python bench/speed/corp_vit_speed.py [--threads 1] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "src"))

from bench.common import append_row, read_rows, results_dir, stamped  # noqa: E402

OUT = results_dir("speed") / "corp-vit-speed.jsonl"
PAGE = results_dir("speed") / "corp-vit-speed.md"
WIDTHS = ((144, 4), (192, 3), (384, 6), (768, 12))  # (hidden, heads): ViT here, DeiT-Tiny, -Small, -Base widths


def _load() -> list[float]:
    return [round(v, 2) for v in os.getloadavg()]


def prune_vs_forward(repeats: int, nsamples: int) -> dict:
    """The prune phase of CORP joint 50% and one dense forward of the same calibration images, alternated."""
    import torch

    from secateur import api
    from secateur.data.images import calibration_images
    from secateur.models.loading import load_model

    dense = Path(os.environ.get("SECATEUR_CACHE", Path.home() / ".cache" / "secateur")) / "vision" / "fmnist-vit"
    model, proc = load_model(str(dense))
    px, _ = calibration_images("fashion-mnist", proc, model.config, nsamples, 0, None)
    fwd, prune = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        with torch.no_grad():
            for s in range(0, px.shape[0], 8):  # the engine's chunk size
                model(pixel_values=px[s:s + 8])
        fwd.append(time.perf_counter() - t)
        res = api.prune(model=str(dense), method="corp", sparsity=0.5, calib="fashion-mnist", nsamples=nsamples,
                        quiet=True)
        prune.append(res.report["timings"]["phases"]["prune"])
        timings = res.report["timings"]["engine"]
    return stamped({"key": f"prune-vs-forward-n{nsamples}-t{torch.get_num_threads()}", "kind": "prune",
                    "nsamples": nsamples, "dense_forward_s": fwd, "prune_phase_s": prune,
                    "ratio_median": sorted(p / f for p, f in zip(prune, fwd))[len(fwd) // 2],
                    "engine_timings": timings, "threads": torch.get_num_threads(), "load_avg_1_5_15": _load()})


def width_row(hidden: int, heads: int, threads: int) -> dict:
    import numpy as np
    import torch
    import transformers as T

    from secateur import api
    from secateur.eval.efficiency import measure_vision_models
    from secateur.models.loading import load_model
    from secateur.testing import TINY_PROCESSOR

    with tempfile.TemporaryDirectory() as tmp:
        folder, out, npz = Path(tmp) / "dense", Path(tmp) / "joint50", Path(tmp) / "c.npz"
        cfg = T.DeiTConfig(hidden_size=hidden, num_hidden_layers=6, num_attention_heads=heads,
                           intermediate_size=4 * hidden, image_size=32, patch_size=4, num_channels=3, num_labels=10)
        torch.manual_seed(0)
        T.DeiTForImageClassificationWithTeacher(cfg).save_pretrained(folder)
        import json

        (folder / "preprocessor_config.json").write_text(json.dumps(TINY_PROCESSOR | {
            "size": {"height": 32, "width": 32}}))
        np.savez(npz, images=np.random.default_rng(0).integers(0, 256, (32, 32, 32, 3), dtype=np.uint8))
        api.prune(model=str(folder), method="corp", sparsity=0.5, calib=str(npz), nsamples=32, out=str(out),
                  quiet=True)
        models = [load_model(str(folder))[0], load_model(str(out))[0]]
        got = measure_vision_models(models, 32, 3, batch_latency=1, batch_throughput=16, warmup=3, repeats=20,
                                    threads=threads)
    return stamped({"key": f"width-{hidden}-t{threads}", "kind": "width", "hidden": hidden, "heads": heads,
                    "blocks": 6, "tokens": 65, "dense": got[0], "joint50": got[1],
                    "speedup_b16": got[1]["throughput_images_per_s"] / got[0]["throughput_images_per_s"],
                    "speedup_b1": got[0]["latency_ms_p50"] / got[1]["latency_ms_p50"], "threads": threads,
                    "load_avg_1_5_15": _load()})


def render(rows: list[dict]) -> str:
    out = ["# CORP on vision: prune time and inference speed (issue 44's speed targets)", "",
           "Command: `python bench/speed/corp_vit_speed.py` (rows in `corp-vit-speed.jsonl` with commit, threads and "
           "load). CPU timings on this 2-core machine: indicative under load, alternated within each row.", ""]
    pr = [r for r in rows if r["kind"] == "prune"]
    if pr:
        out += ["## Prune time against one dense calibration forward (target: at most 1.3x)", "",
                "| calibration images | dense forward (s) | prune phase (s) | ratio (median) | threads | load | "
                "commit |", "|---:|---|---|---:|---:|---|---|"]
        for r in pr:
            out.append(f"| {r['nsamples']} | {', '.join(f'{v:.2f}' for v in r['dense_forward_s'])} | "
                       f"{', '.join(f'{v:.2f}' for v in r['prune_phase_s'])} | {r['ratio_median']:.2f}x | "
                       f"{r['threads']} | {r['load_avg_1_5_15'][0]} | `{r['commit']}` |")
        out += ["", "The joint prune walks the calibration images three times: the dense statistics pass (MLP "
                "channel scores), the compensation's Gram pass (the kept channels' Grams, after selection), and the "
                "sequential Q/K pass on the MLP-pruned blocks (per-image q/k Grams and the ridge solves). Three "
                "forwards are its floor, so the 1.3x target is not met by this composition; folding the Q/K "
                "statistics into the first pass (dense, not sequential) would bring it to two.", ""]
    wr = [r for r in rows if r["kind"] == "width"]
    if wr:
        out += ["## Saved joint-50% models against dense, by width (target: batch-16 throughput at least 1.4x)", "",
                "| hidden | heads | dense img/s (b=16) | joint-50% img/s | speed-up b=16 | dense ms (b=1) | "
                "joint-50% ms | speed-up b=1 | threads | load |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for r in sorted(wr, key=lambda r: (r["threads"], r["hidden"])):
            d, j = r["dense"], r["joint50"]
            out.append(f"| {r['hidden']} | {r['heads']} | {d['throughput_images_per_s']:.0f} | "
                       f"{j['throughput_images_per_s']:.0f} | {r['speedup_b16']:.2f}x | {d['latency_ms_p50']:.2f} | "
                       f"{j['latency_ms_p50']:.2f} | {r['speedup_b1']:.2f}x | {r['threads']} | "
                       f"{r['load_avg_1_5_15'][0]} |")
        out.append("")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--nsamples", type=int, default=1000)
    ap.add_argument("--render", action="store_true")
    a = ap.parse_args(argv)
    if not a.render:
        import torch

        torch.set_num_threads(a.threads)
        done = {r["key"] for r in read_rows(OUT)}
        if f"prune-vs-forward-n{a.nsamples}-t{a.threads}" not in done:
            append_row(OUT, prune_vs_forward(a.repeats, a.nsamples), unique_key=True)
        for hidden, heads in WIDTHS:
            if f"width-{hidden}-t{a.threads}" not in done:
                append_row(OUT, width_row(hidden, heads, a.threads), unique_key=True)
    PAGE.write_text(render(read_rows(OUT)))
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
