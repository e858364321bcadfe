"""Prune one tower of a vision-language model (LLaVA) and score its captions against the dense model's.

    python examples/prune_vlm.py                           # the Fashion-MNIST LLaVA (bench/tools/train_vlm.py)
    python examples/prune_vlm.py --towers vision --method wanda-sp --calib fashion-mnist
    python examples/prune_vlm.py --towers language=0.2,vision=0.3 --calib fashion-mnist-captions

``--towers`` names the towers to prune (each at ``--sparsity`` or its own ratio); the vision tower calibrates on
images, the language tower on text or image-caption pairs; the projector and heads are never pruned. Caption
accuracy, caption perplexity and multiple-choice accuracy are scored on Fashion-MNIST test images. CLI:
``secateur prune --model VLM --towers language --out DIR`` and ``secateur eval captions --model DIR``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from secateur import api
from secateur.errors import SecateurError
from secateur.eval.captions import eval_captions


def default_model() -> str:
    """The LLaVA assembled by ``python bench/tools/train_vlm.py`` (its cache folder)."""
    cache = Path(os.environ.get("SECATEUR_CACHE") or Path.home() / ".cache" / "secateur")
    return str(cache / "vision" / "fmnist-llava")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a LLaVA folder with its processor (default: the Fashion-MNIST "
                    "LLaVA of bench/tools/train_vlm.py in $SECATEUR_CACHE/vision/fmnist-llava)")
    ap.add_argument("--towers", default="language", help="vision | language | vision=R,language=R")
    ap.add_argument("--method", default="wanda")
    ap.add_argument("--sparsity", type=float, default=0.2)
    ap.add_argument("--calib", default="wikitext2", help="text for the language tower, images for the vision tower")
    ap.add_argument("--nsamples", type=int, default=32)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--max-images", type=int, default=200, help="Fashion-MNIST test images scored")
    ap.add_argument("--out", default="out/examples/vlm")
    a = ap.parse_args(argv)
    model = a.model or default_model()
    if not Path(model).is_dir() and a.model is None:
        raise SecateurError(f"no Fashion-MNIST LLaVA in {model}: build it with python bench/tools/train_vlm.py, "
                            "or pass --model FOLDER")

    result = api.prune(model=model, towers=a.towers, method=a.method, sparsity=a.sparsity, calib=a.calib,
                       nsamples=a.nsamples, seqlen=a.seqlen, out=a.out, overwrite=True, quiet=True)
    scores = {name: eval_captions(m, max_images=a.max_images) for name, m in (("dense", model), ("pruned", a.out))}
    for name, s in scores.items():
        print(f"{name:>6}: caption accuracy {s['caption_accuracy']:.3f}, caption perplexity {s['caption_ppl']:.2f}, "
              f"multiple choice {s['multiple_choice_accuracy']:.3f}")
    print(f"pruned towers {result.report['vlm']['towers']}; saved to {a.out}")
    return {"scores": scores, "out": a.out, "report": result.report}


if __name__ == "__main__":
    main()
