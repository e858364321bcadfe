"""The vision demo (``make demo-vision``): find (or train) the Fashion-MNIST ViT, prune it 50% with CORP (joint:
MLP channels and query/key head dimensions, ridge compensation, no training) and print dense vs pruned top-1
and size.

    python bench/tools/vision_demo.py [--sparsity 0.5] [--nsamples 1000] [--out out/vit-corp50] [--tiny]

The model comes from ``bench/tools/train_vision.py --arch vit`` (cached under ``$SECATEUR_CACHE/vision/``;
trained here when absent: about an hour on one thread, resumable). Top-1 is on the 10,000 Fashion-MNIST test
images; calibration images come from the train split, drawn with the seed. ``--tiny``: a 2-block model trained in
seconds (the tests' smoke run; its accuracy means nothing).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def main(argv: list[str] | None = None) -> int:
    from bench.tools import train_vision
    from secateur import api
    from secateur.eval.accuracy import eval_accuracy
    from secateur.eval.efficiency import count_params
    from secateur.models.loading import load_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sparsity", type=float, default=0.5)
    ap.add_argument("--nsamples", type=int, default=1000)
    ap.add_argument("--out", default="out/vit-corp50")
    ap.add_argument("--max-images", type=int, default=None, help="test images scored (default: all 10,000)")
    ap.add_argument("--tiny", action="store_true")
    a = ap.parse_args(argv)
    cache = Path(os.environ.get("SECATEUR_CACHE", Path.home() / ".cache" / "secateur"))
    dense = cache / "vision" / ("fmnist-vit-tiny" if a.tiny else "fmnist-vit")
    if not (dense / "train.json").exists():
        print(f"no trained ViT in {dense}: training it (resumable; python bench/tools/train_vision.py --arch vit)")
        train_vision.main(["--arch", "vit", "--out", str(dense)] + (["--tiny", "--epochs", "1"] if a.tiny else []))
    res = api.prune(model=str(dense), method="corp", sparsity=a.sparsity, calib="fashion-mnist",
                    nsamples=a.nsamples, out=a.out, overwrite=True, quiet=True)
    rows = []
    for name, folder in (("dense", dense), (f"corp {a.sparsity:.0%} joint", Path(a.out))):
        acc = eval_accuracy(str(folder), "fashion-mnist", "test", max_images=a.max_images)
        model, _ = load_model(str(folder))
        rows.append((name, acc["top1"], count_params(model), folder_bytes(folder), acc["n_images"]))
    print(f"\nFashion-MNIST test top-1 ({rows[0][4]} images), CORP calibrated on {a.nsamples} train images, "
          f"no training after pruning:")
    print(f"{'model':<18} {'top-1':>7} {'params':>10} {'size':>9}")
    for name, top1, params, size, _ in rows:
        print(f"{name:<18} {top1:>7.4f} {params:>10,} {size / 2**20:>7.2f} MB")
    d = res.report["details"]
    print(f"removed: {d['realized_sparsity']['mlp_channels']:.0%} of the MLP channels, "
          f"{d['realized_sparsity']['qk_dims']:.0%} of every query/key head's dimensions; saved to {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
