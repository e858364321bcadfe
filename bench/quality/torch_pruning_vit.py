"""Torch-Pruning on the ViT trained here, beside CORP (issue 44): the ``torch-pruning-*`` rows of corp-vit.jsonl.

Torch-Pruning (``torch-pruning`` 1.6.x, ``pip install -r bench/quality/requirements-torch-pruning.txt``; a bench
dependency only) prunes by its dependency graph and an importance score, with no compensation. Its upstream HF
ViT example (``examples/transformers/prune_hf_vit.py``) imports ``ViTSelfAttention``, which transformers 5.x no
longer has: its attention is one ``ViTAttention`` with ``q_proj/k_proj/v_proj/o_proj`` that reshapes q, k and v with
``view(..., -1, head_dim)``. What changed here, against the example:

* the ``num_heads`` map names the 5.x ``q_proj/k_proj/v_proj`` modules (not ``query/key/value``);
* after a head prune only ``attention.num_attention_heads`` is updated (``head_dim`` stays; the 5.x forward infers
  the head count from the width), where the example also rewrote ``all_head_size`` of the removed class;
* MLP-only rows ignore every layer whose outputs are the residual stream or attention (``o_proj``, ``fc2``, q/k/v,
  the patch embedding, the classifier), so only ``fc1``'s channels (and ``fc2``'s coupled inputs) are removed: the
  same units as CORP's MLP-only rows, at the same per-layer ratio.

Importance: Torch-Pruning's ``MagnitudeImportance(p=2)`` (the group's L2 norm; Taylor needs gradients, which the
training-free rows do not have). Calibration: none (magnitude). Evaluation: the 10,000 Fashion-MNIST test images
through the model's processor, as every CORP row.

    python bench/quality/torch_pruning_vit.py [--max-images N]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "src"))

from bench.common import append_row, read_rows, stamped  # noqa: E402
from bench.quality.corp_vit import OUT, PAGE, PRIORITY, cache  # noqa: E402


def prune_tp(model, part: str, ratio: float):
    """Torch-Pruning's MetaPruner on ``model`` in place: ``part`` ``mlp`` (fc1 channels) or ``heads`` (whole heads)."""
    import torch
    import torch_pruning as tp

    vit = model.vit
    attns = [layer.attention for layer in vit.layers]
    ignored = [model.classifier, vit.embeddings.patch_embeddings.projection]
    num_heads = {}
    for layer, a in zip(vit.layers, attns):
        ignored += [a.o_proj, layer.mlp.fc2]
        if part == "mlp":
            ignored += [a.q_proj, a.k_proj, a.v_proj]
        else:
            ignored.append(layer.mlp.fc1)
            num_heads |= {a.q_proj: a.num_attention_heads, a.k_proj: a.num_attention_heads,
                          a.v_proj: a.num_attention_heads}
    example = torch.randn(1, model.config.num_channels, model.config.image_size, model.config.image_size)
    pruner = tp.pruner.MetaPruner(model, example, importance=tp.importance.MagnitudeImportance(p=2),
                                  pruning_ratio=ratio, ignored_layers=ignored,
                                  num_heads=num_heads, prune_num_heads=part == "heads", prune_head_dims=False,
                                  head_pruning_ratio=ratio if part == "heads" else 0.0)
    pruner.step()
    if part == "heads":
        for a in attns:
            a.num_attention_heads = a.q_proj.out_features // a.head_dim
    return model


def row(part: str, ratio: float, max_images: int | None) -> dict:
    import torch

    from secateur.data.images import load_images
    from secateur.eval.accuracy import accuracy
    from secateur.eval.efficiency import count_params, vision_flops
    from secateur.models.loading import load_model

    folder = cache() / "fmnist-vit"
    model, _ = load_model(str(folder))
    t = time.perf_counter()
    prune_tp(model, part, ratio)
    prune_s = time.perf_counter() - t
    images = load_images("fashion-mnist", folder, n=max_images, split="test", need_labels=True)
    acc = accuracy(model, images)
    return stamped({"key": f"torch-pruning-{part}-{ratio:.1f}", "group": "f3" if part == "mlp" else "t4a",
                    "model": "fmnist-vit", "method": "torch-pruning", "sparsity": ratio,
                    "options": {"importance": "MagnitudeImportance(p=2)", "part": part},
                    "params": count_params(model),
                    "flops_per_image": vision_flops(model, model.config.image_size, model.config.num_channels)[
                        "flops_per_image"],
                    "top1": acc["top1"], "top5": acc["top5"], "n_images": acc["n_images"],
                    "images_sha256": images.manifest["pixels_sha256"], "prune_wall_s": round(prune_s, 2),
                    "torch_pruning": __import__("torch_pruning").__version__, "threads": torch.get_num_threads(),
                    "load_avg_1_5_15": [round(v, 2) for v in os.getloadavg()],
                    "command": "python bench/quality/torch_pruning_vit.py"})


def main(argv: list[str] | None = None) -> int:
    from bench.quality.corp_vit_page import render

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-images", type=int, default=None)
    ap.add_argument("--parts", default="mlp,heads")
    ap.add_argument("--sparsities", default=",".join(map(str, PRIORITY)), help="in this order")
    a = ap.parse_args(argv)
    done = {r["key"] for r in read_rows(OUT)}
    for s in (float(x) for x in a.sparsities.split(",")):
        for part in a.parts.split(","):
            if f"torch-pruning-{part}-{s:.1f}" not in done:
                rec = row(part, s, a.max_images)
                append_row(OUT, rec, unique_key=True)
                print(f"{rec['key']}: top-1 {rec['top1']:.4f} ({rec['params']:,} params)", flush=True)
    render(read_rows(OUT), PAGE)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
