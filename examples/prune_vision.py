"""Prune a vision transformer with CORP (no training) and measure its top-1 accuracy against the dense model's.

    python examples/prune_vision.py                        # the Fashion-MNIST ViT (bench/tools/train_vision.py)
    python examples/prune_vision.py --model VIT_FOLDER --calib /data/train-images --dataset /data/test-images

CORP removes MLP channels and query/key head dimensions and folds a ridge compensation into the next layer.
Images: ``fashion-mnist`` (from ``--data-dir`` / ``$SECATEUR_DATA``), an image folder (one sub-folder per class) or
an .npy/.npz/idx file, read through the model's own image processor. CLI: ``secateur prune --model VIT --method
corp --calib fashion-mnist --out DIR`` and ``secateur eval accuracy --model DIR --dataset fashion-mnist``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from secateur import api
from secateur.errors import SecateurError
from secateur.eval.accuracy import eval_accuracy


def default_model() -> str:
    """The ViT trained on Fashion-MNIST by ``python bench/tools/train_vision.py --arch vit`` (its cache folder)."""
    cache = Path(os.environ.get("SECATEUR_CACHE") or Path.home() / ".cache" / "secateur")
    return str(cache / "vision" / "fmnist-vit")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="an image classifier folder (default: the Fashion-MNIST ViT "
                    "of bench/tools/train_vision.py in $SECATEUR_CACHE/vision/fmnist-vit)")
    ap.add_argument("--method", default="corp", help="corp, vbp, wanda-sp, flap, ... (default: %(default)s)")
    ap.add_argument("--sparsity", type=float, default=0.5)
    ap.add_argument("--calib", default="fashion-mnist", help="calibration images (train split)")
    ap.add_argument("--nsamples", type=int, default=1000, help="calibration images (default: %(default)s)")
    ap.add_argument("--dataset", default="fashion-mnist", help="test images (default: %(default)s)")
    ap.add_argument("--max-images", type=int, default=2000, help="test images scored (default: %(default)s)")
    ap.add_argument("--out", default="out/examples/vision")
    a = ap.parse_args(argv)
    model = a.model or default_model()
    if not Path(model).is_dir() and a.model is None:
        raise SecateurError(f"no Fashion-MNIST ViT in {model}: train it with python bench/tools/train_vision.py "
                            "--arch vit (about an hour, resumable), or pass --model FOLDER")

    result = api.prune(model=model, method=a.method, sparsity=a.sparsity, calib=a.calib, nsamples=a.nsamples,
                       out=a.out, overwrite=True, quiet=True)
    top1 = {name: eval_accuracy(m, a.dataset, max_images=a.max_images)["top1"]
            for name, m in (("dense", model), ("pruned", a.out))}
    print(f"{a.method} {a.sparsity:.0%}: top-1 on {a.dataset} ({a.max_images} images): dense {top1['dense']:.4f}, "
          f"pruned {top1['pruned']:.4f}; saved to {a.out}")
    return {"top1": top1, "out": a.out, "report": result.report}


if __name__ == "__main__":
    main()
