"""The vision models trained here and a first pruning check on them: ``results/vision/vision-models.md`` (+ ``.jsonl``).

No pretrained vision weights can be downloaded on these machines, so ``bench/tools/train_vision.py`` trains small
Fashion-MNIST classifiers (cached outside the repository). This bench records, for each trained model, its shape,
training cost and dense top-1 (the training script's own count and ``secateur eval accuracy`` through the saved
folder, which must agree), then prunes the main ViT at 50% with CORP (joint, MLP-only, Q/K-only; with and without
compensation) and Wanda-sp + LS, scoring every output on the 10,000 test images.

    python bench/quality/vision_models.py                 # every trained model found in the cache + the ViT rows
    python bench/quality/vision_models.py --render        # the page from the recorded rows only

Protocol: calibration = ``--nsamples`` (default 1000) train images drawn with seed 0; evaluation = all 10,000 test
images; threads and machine load recorded with each row. Rows are keyed: a row already recorded is not rerun.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "src"))

from bench.common import append_row, fmt, read_rows, results_dir, stamped  # noqa: E402

OUT = results_dir("vision") / "vision-models.jsonl"
PAGE = results_dir("vision") / "vision-models.md"
ARCHS = ("vit", "deit", "dinov2", "siglip")
#: the pruning rows of the main ViT: key -> (method, prune keywords)
ROWS = {
    "corp-joint-50": ("corp", {"units": "channel,qk"}),
    "corp-joint-50-nocomp": ("corp", {"units": "channel,qk", "compensation": "none"}),
    "corp-mlp-50": ("corp", {"units": "channel"}),
    "corp-mlp-50-nocomp": ("corp", {"units": "channel", "compensation": "none"}),
    "corp-qk-50": ("corp", {"units": "qk"}),
    "corp-qk-50-nocomp": ("corp", {"units": "qk", "compensation": "none"}),
    "wanda-sp-ls-50": ("wanda-sp", {"units": "channel", "compensation": "ls"}),
}


def cache() -> Path:
    return Path(os.environ.get("SECATEUR_CACHE", Path.home() / ".cache" / "secateur")) / "vision"


def load_avg() -> list[float]:
    return [round(v, 2) for v in os.getloadavg()]


def params_of(folder: Path) -> int:
    from secateur.eval.efficiency import count_params
    from secateur.models.loading import load_model

    return count_params(load_model(str(folder))[0])


def dense_row(arch: str) -> dict | None:
    import torch

    from secateur.eval.accuracy import eval_accuracy

    folder = cache() / f"fmnist-{arch}"
    if not (folder / "train.json").exists():
        return None
    info = json.loads((folder / "train.json").read_text())
    cfg = json.loads((folder / "config.json").read_text())
    t = time.perf_counter()
    acc = eval_accuracy(str(folder), "fashion-mnist", "test")
    return stamped({"key": f"dense-{arch}", "kind": "dense", "arch": arch, "model": f"fmnist-{arch}",
                    "class": (cfg.get("architectures") or ["?"])[0], "params": params_of(folder),
                    "shape": {k: cfg.get(k, (cfg.get("vision_config") or {}).get(k))
                              for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                                        "mlp_ratio", "patch_size", "image_size")},
                    "train": {k: info.get(k) for k in ("epochs", "steps", "batch", "lr", "seed", "threads",
                                                       "train_seconds", "test_top1", "load_avg_1_5_15",
                                                       "written_utc")},
                    "top1": acc["top1"], "top5": acc["top5"], "n_images": acc["n_images"],
                    "images_sha256": acc["images_sha256"], "eval_s": round(time.perf_counter() - t, 1),
                    "threads": torch.get_num_threads(), "load_avg_1_5_15": load_avg()})


def prune_row(key: str, nsamples: int) -> dict:
    import torch

    from secateur import api
    from secateur.eval.accuracy import eval_accuracy

    method, kw = ROWS[key]
    dense = cache() / "fmnist-vit"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out"
        t = time.perf_counter()
        res = api.prune(model=str(dense), method=method, sparsity=0.5, calib="fashion-mnist", nsamples=nsamples,
                        out=str(out), quiet=True, **kw)
        prune_s = time.perf_counter() - t
        acc = eval_accuracy(str(out), "fashion-mnist", "test")
        d = res.report["details"]
        return stamped({"key": key, "kind": "prune", "arch": "vit", "method": method, "options": kw,
                        "sparsity": 0.5, "nsamples": nsamples, "params": params_of(out),
                        "params_before": d.get("params_before"), "realized": res.report["realized_sparsity"],
                        "export_route": res.report.get("export_route"), "top1": acc["top1"], "top5": acc["top5"],
                        "n_images": acc["n_images"], "images_sha256": acc["images_sha256"],
                        "prune_s": round(prune_s, 2), "threads": torch.get_num_threads(),
                        "command": f"secateur prune --model {dense.name} --method {method} --sparsity 0.5 "
                                   f"--calib fashion-mnist --nsamples {nsamples} "
                                   + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in kw.items()),
                        "load_avg_1_5_15": load_avg()})


def vlm_row() -> dict | None:
    """The assembled VLM (``bench/tools/train_vlm.py``): its training record and ``secateur eval captions`` through
    the saved folder (both on the first test images of the same count and seed-0 draw rule)."""
    folder = cache() / "fmnist-llava"
    if not (folder / "train.json").exists():
        return None
    from secateur.eval.captions import eval_captions

    info = json.loads((folder / "train.json").read_text())
    t = time.perf_counter()
    ev = eval_captions(str(folder), max_images=info["dense"]["images"])
    cfg = json.loads((folder / "config.json").read_text())
    from transformers import AutoModelForImageTextToText

    params = sum(p.numel() for p in AutoModelForImageTextToText.from_pretrained(folder).parameters())
    return stamped({"key": "dense-vlm", "kind": "vlm", "model": "fmnist-llava", "params": params,
                    "vision": cfg["vision_config"].get("model_type"), "text": cfg["text_config"].get("model_type"),
                    "image_tokens": cfg.get("image_seq_length"), "train": {k: v for k, v in info.items()
                                                                          if k != "loss_log"},
                    "eval": {k: v for k, v in ev.items() if k != "images_manifest"},
                    "eval_s": round(time.perf_counter() - t, 1), "load_avg_1_5_15": load_avg()})


def _vlm_section(rows: list[dict]) -> list[str]:
    v = next((r for r in rows if r["kind"] == "vlm"), None)
    if v is None:
        return ["## The assembled vision-language model", "", "Not trained yet: `python bench/tools/train_vlm.py` "
                "(about an hour on one free thread; resumable), then this page's command.", ""]
    t, e, d = v["train"], v["eval"], v["train"]["dense"]
    return ["## The assembled vision-language model (issue 47)", "",
            "A stock `LlavaForConditionalGeneration` built here (`bench/tools/train_vlm.py`): the SigLIP-shaped "
            f"backbone above as its vision tower ({v['image_tokens']} image tokens: every patch, no pooling in a stock "
            "LLaVA), SmolLM2-135M as its language model, and a two-layer GELU projector, the only part trained "
            f"({t['trained_params']:,} of {v['params']:,} parameters; {t['steps']} steps x {t['batch']} captions = "
            f"{t['train_images_seen']:,} training images seen, {t['train_seconds'] / 60:.0f} min on {t['threads']} "
            f"thread at load {t['load_avg_1_5_15'][0]}). Captions from four training templates; evaluation on "
            f"test images (disjoint from training) with two held-out templates.", "",
            "| scored by | images | caption accuracy | multiple choice (10-way) | caption perplexity |",
            "|---|---:|---:|---:|---:|",
            f"| training script (the first test images) | {d['images']} | {d['caption_accuracy']:.4f} | "
            f"{d['multiple_choice_accuracy']:.4f} | "
            f"{d['caption_ppl']:.3f} |",
            f"| `secateur eval captions` (saved folder; test images drawn with seed 0) | {e['images']} | "
            f"{e['caption_accuracy']:.4f} | "
            f"{e['multiple_choice_accuracy']:.4f} | {e['caption_ppl']:.3f} |", "",
            "Caption accuracy: the greedy caption (8 tokens) names the class; multiple choice: the class whose "
            "caption is most likely; perplexity: caption tokens only, held-out templates. "
            f"Evaluation took {v['eval_s']:.0f} s at load {v['load_avg_1_5_15'][0]}.", ""]


def render(rows: list[dict]) -> str:
    vlm = _vlm_section(rows)
    rows = [r for r in rows if r["kind"] != "vlm"]
    dense = [r for r in rows if r["kind"] == "dense"]
    prunes = [r for r in rows if r["kind"] == "prune"]
    out = ["# Vision models trained here (Fashion-MNIST) and a first pruning check", "",
           "No pretrained vision weights can be downloaded on these machines (no package on the index ships them), so "
           "secateur trains its own small classifiers on the real Fashion-MNIST images (`../shared/data/"
           "fashion-mnist`) with `bench/tools/train_vision.py` (seeded, deterministic, resumable; weights cached "
           "outside the repository, never committed). 28 x 28 grayscale, patch 4 (49 patches), AdamW lr 1e-3, "
           "batch 128, 2-pixel shifts and flips, one thread. Page: `python bench/quality/vision_models.py` "
           "(rows in `vision-models.jsonl`, each with its commit, threads and machine load).", "",
           "## The models", "",
           "| model | class | params | hidden x blocks, heads, MLP | epochs (steps) | training time | load | "
           "top-1 (training script) | top-1 (`secateur eval accuracy`) | top-5 |",
           "|---|---|---:|---|---|---:|---|---:|---:|---:|"]
    for r in dense:
        s, t = r["shape"], r["train"]
        mlp = s.get("intermediate_size") or (s.get("mlp_ratio") or 0) * (s.get("hidden_size") or 0)
        out.append(f"| {r['model']} | `{r['class']}` | {r['params']:,} | {s['hidden_size']} x "
                   f"{s['num_hidden_layers']}, {s['num_attention_heads']}, {mlp} | {t['epochs']} ({t['steps']}) | "
                   f"{t['train_seconds'] / 60:.0f} min | {t['load_avg_1_5_15'][0]} | {t['test_top1']:.4f} | "
                   f"{r['top1']:.4f} | {r['top5']:.4f} |")
    out += ["", "Sized to this machine (the main ViT in about an hour on one thread, the others in a few epochs): "
            "small ViTs reach about 90% on this set with longer training, so these are not converged models; every "
            "comparison below is between prunes of the same dense model.", "",
            "Both top-1 columns score all 10,000 test images; the training script runs eager attention, secateur "
            "the saved folder with SDPA through the model's own image processor: they agree to the last image or "
            "differ by a near-tie. The DINOv2- and SigLIP-shaped classifiers also save their headless backbones "
            "(`fmnist-dinov2-backbone`, `fmnist-siglip-backbone`), which CORP's Table 8 prunes and scores by "
            "features.", ""]
    if prunes:
        d = next((r for r in dense if r["arch"] == "vit"), None)
        out += ["## A first pruning check on the ViT (50%, no training after pruning)", "",
                f"Calibration: {prunes[0]['nsamples']} train images (seed 0); top-1 on the 10,000 test images"
                + (f"; dense {d['top1']:.4f}, {d['params']:,} parameters." if d else "."), "",
                "| row | method | units | compensation | params | removed (all params) | top-1 | top-5 | prune (s) | "
                "load | commit |", "|---|---|---|---|---:|---:|---:|---:|---:|---|---|"]
        for r in prunes:
            o = r["options"]
            out.append(f"| {r['key']} | {r['method']} | {o.get('units', '-')} | "
                       f"{o.get('compensation', 'native (corp: ridge)')} | {r['params']:,} | "
                       f"{fmt(100 * r['realized']['of_all_parameters'], 1)}% | {r['top1']:.4f} | {r['top5']:.4f} | "
                       f"{r['prune_s']} | {r['load_avg_1_5_15'][0]} | `{r['commit']}` |")
        out += ["", "The full CORP tables (sparsity sweeps, calibration size, competitors, speed) are issue 44's "
                "`corp-vit.md`; this table only shows that the vision path prunes a real trained model end to end.",
                ""]
    return "\n".join(out + vlm) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--render", action="store_true")
    ap.add_argument("--nsamples", type=int, default=1000)
    a = ap.parse_args(argv)
    if not a.render:
        done = {r["key"] for r in read_rows(OUT)}
        for arch in ARCHS:
            if f"dense-{arch}" not in done and (row := dense_row(arch)) is not None:
                append_row(OUT, row, unique_key=True)
                print(f"dense {arch}: top-1 {row['top1']:.4f}", flush=True)
        if "dense-vlm" not in done and (row := vlm_row()) is not None:
            append_row(OUT, row, unique_key=True)
            print(f"vlm: {row['eval']}", flush=True)
        if (cache() / "fmnist-vit" / "train.json").exists():
            for key in ROWS:
                if key not in done:
                    row = prune_row(key, a.nsamples)
                    append_row(OUT, row, unique_key=True)
                    print(f"{key}: top-1 {row['top1']:.4f} ({row['params']:,} params)", flush=True)
    PAGE.write_text(render(read_rows(OUT)))
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
