"""Train the small Fashion-MNIST vision transformers that the vision benches and real-weights tests prune.

No pretrained vision weights can be downloaded here, so secateur trains its own: a seeded, deterministic,
resumable run over the shared Fashion-MNIST copy (``../shared/data/fashion-mnist`` or ``$SECATEUR_DATA``) that
writes a Hugging Face folder (``config.json``, ``model.safetensors``, ``preprocessor_config.json``) with
``train.json`` (dense top-1 on the 10,000 test images, steps, seconds, threads, machine load) into
``$SECATEUR_CACHE/vision/<name>`` (default ``~/.cache/secateur/vision/<name>``). Weights are never committed.

Architectures (``--arch``), all 28 x 28 grayscale, patch 4 (49 patches):
  vit     ViTForImageClassification, CLS token          (the main model: hidden 144, 5 blocks, 4 heads, MLP 576)
  dinov2  Dinov2ForImageClassification, layer scale      (CLS + mean patch token into the classifier)
  siglip  SiglipForImageClassification, no CLS token     (mean of the patch tokens)
  deit    DeiTForImageClassificationWithTeacher          (CLS + distillation token; both heads trained on labels)

Training: AdamW (lr 1e-3, weight decay 0.05), linear warm-up then cosine, batch 128, random 2-pixel shifts and
horizontal flips; data order and augmentation drawn from ``--seed`` and the step, so a run resumed from its
checkpoint (written atomically every ``--ckpt-every`` steps next to the output) continues to the same bits.

    python bench/tools/train_vision.py --arch vit --epochs 6          # about an hour on one thread here
    python bench/tools/train_vision.py --arch vit --tiny --out DIR    # seconds: the tests' smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from secateur.data.idx import read_idx  # noqa: E402

# Fashion-MNIST's pixel mean and standard deviation over the training set (on [0, 1]).
MEAN, STD = 0.2860, 0.3530
CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot")


def data_dir() -> Path:
    base = Path(os.environ.get("SECATEUR_DATA", ROOT.parent / "shared" / "data"))
    return base / "fashion-mnist"


def load_split(split: str) -> tuple[np.ndarray, np.ndarray]:
    pre = "train" if split == "train" else "t10k"
    d = data_dir()
    return read_idx(d / f"{pre}-images-idx3-ubyte.gz"), read_idx(d / f"{pre}-labels-idx1-ubyte.gz")


def pixels(images: np.ndarray) -> torch.Tensor:
    """``uint8 [N, 28, 28]`` -> the processor's ``[N, 1, 28, 28]`` float32 (rescale, normalize)."""
    x = torch.from_numpy(np.ascontiguousarray(images)).float().div_(255.0)
    return ((x - MEAN) / STD).unsqueeze(1)


def build(arch: str, tiny: bool):
    import transformers as T

    labels = {"id2label": dict(enumerate(CLASSES)), "label2id": {c: i for i, c in enumerate(CLASSES)}}
    hidden, layers, heads, inter = (32, 2, 2, 64) if tiny else (144, 5, 4, 576)
    common = dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, intermediate_size=inter,
                  image_size=28, patch_size=4, num_channels=1)
    if arch == "vit":
        return T.ViTForImageClassification(T.ViTConfig(**common, qkv_bias=True, **labels))
    if arch == "deit":
        return T.DeiTForImageClassificationWithTeacher(T.DeiTConfig(**common, qkv_bias=True, **labels))
    if arch == "dinov2":
        cfg = T.Dinov2Config(**{k: v for k, v in common.items() if k != "intermediate_size"}, mlp_ratio=inter // hidden,
                             layerscale_value=1.0, **labels)
        return T.Dinov2ForImageClassification(cfg)
    if arch == "siglip":
        vis = dict(common, vision_use_head=False)
        return T.SiglipForImageClassification(T.SiglipConfig(vision_config=vis, **labels))
    raise SystemExit(f"unknown --arch {arch!r}")


def processor_config(arch: str) -> dict:
    """The ``preprocessor_config.json`` whose output :func:`pixels` reproduces (checked at start)."""
    cls = {"vit": "ViTImageProcessor", "deit": "DeiTImageProcessor", "dinov2": "BitImageProcessor",
           "siglip": "SiglipImageProcessor"}[arch]
    return {"image_processor_type": cls, "do_resize": False, "size": {"height": 28, "width": 28},
            "do_center_crop": False, "crop_size": {"height": 28, "width": 28}, "do_rescale": True,
            "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [MEAN], "image_std": [STD],
            "do_convert_rgb": False}


def augment(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Random shifts of up to 2 pixels (zero padding in the normalized background) and horizontal flips."""
    n = x.shape[0]
    pad = F.pad(x, (2, 2, 2, 2), value=(0 - MEAN) / STD)
    dx = torch.randint(0, 5, (n,), generator=gen)
    dy = torch.randint(0, 5, (n,), generator=gen)
    flip = torch.rand(n, generator=gen) < 0.5
    out = torch.stack([pad[i, :, dy[i]:dy[i] + 28, dx[i]:dx[i] + 28] for i in range(n)])
    out[flip] = out[flip].flip(-1)
    return out


def logits_of(model, x: torch.Tensor) -> torch.Tensor:
    out = model(pixel_values=x)
    return out.logits


def loss_of(model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = model(pixel_values=x)
    if hasattr(out, "cls_logits"):  # DeiT with teacher: both heads learn the labels (no teacher here)
        return 0.5 * (F.cross_entropy(out.cls_logits, y) + F.cross_entropy(out.distillation_logits, y))
    return F.cross_entropy(out.logits, y)


@torch.no_grad()
def top1(model, images: np.ndarray, labels: np.ndarray, batch: int = 500) -> float:
    model.eval()
    hit = 0
    for s in range(0, len(images), batch):
        hit += int((logits_of(model, pixels(images[s:s + batch])).argmax(-1).numpy() == labels[s:s + batch]).sum())
    model.train()
    return hit / len(images)


def save_atomic(obj, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", choices=("vit", "deit", "dinov2", "siglip"), default="vit")
    ap.add_argument("--epochs", type=float, default=6.0)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--ckpt-every", type=int, default=100)
    ap.add_argument("--tiny", action="store_true", help="a 2-block width-32 model on 2,048 images (tests)")
    ap.add_argument("--stop-after", type=int, default=None, help=argparse.SUPPRESS)  # tests: an interruption
    ap.add_argument("--out", help="output folder (default $SECATEUR_CACHE/vision/fmnist-<arch>)")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    cache = Path(os.environ.get("SECATEUR_CACHE", Path.home() / ".cache" / "secateur"))
    out = Path(a.out) if a.out else cache / "vision" / f"fmnist-{a.arch}"
    if (out / "train.json").exists():
        print(f"{out}: already trained ({json.loads((out / 'train.json').read_text())['test_top1']:.4f} top-1)")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    ckpt = out / "train-ckpt.pt"

    xtr, ytr = load_split("train")
    xte, yte = load_split("test")
    if a.tiny:
        xtr, ytr, xte, yte = xtr[:2048], ytr[:2048], xte[:512], yte[:512]
    torch.manual_seed(a.seed)
    model = build(a.arch, a.tiny)
    model.config._attn_implementation = "eager"  # one attention path for training and every later check
    _check_processor(a.arch, xte[:4])
    steps_per_epoch = len(xtr) // a.batch
    total = max(1, int(a.epochs * steps_per_epoch))
    warm = max(1, total // 20)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + np.cos(np.pi * (s - warm) / max(1, total - warm))))
    step, seconds, log = 0, 0.0, []
    if a.stop_after is not None:
        a.stop_after += _resumed_step(ckpt)
    if ckpt.exists():
        st = torch.load(ckpt, weights_only=False)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        sched.load_state_dict(st["sched"])
        step, seconds, log = st["step"], st["seconds"], st["log"]
        print(f"resumed at step {step}/{total}", flush=True)
    model.train()
    t0 = time.perf_counter()
    while step < total:
        epoch, pos = divmod(step, steps_per_epoch)
        order = np.random.default_rng([a.seed, epoch]).permutation(len(xtr))
        idx = order[pos * a.batch:(pos + 1) * a.batch]
        gen = torch.Generator().manual_seed(a.seed * 1_000_003 + step)
        x, y = augment(pixels(xtr[idx]), gen), torch.from_numpy(ytr[idx].astype(np.int64))
        loss = loss_of(model, x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        step += 1
        if step % 20 == 0 or step == total:
            el = seconds + time.perf_counter() - t0
            print(f"step {step}/{total} loss {loss.item():.4f} {el:.0f}s load {os.getloadavg()[0]:.1f}", flush=True)
            log.append({"step": step, "loss": round(loss.item(), 5)})
        if step % a.ckpt_every == 0 and step < total:
            save_atomic({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                         "step": step, "seconds": seconds + time.perf_counter() - t0, "log": log}, ckpt)
        if a.stop_after is not None and step >= a.stop_after:
            return 3  # stopped as if killed: the checkpoint holds the last multiple of --ckpt-every
    seconds += time.perf_counter() - t0
    acc = top1(model, xte, yte)
    model.config._attn_implementation = "sdpa"
    model.save_pretrained(out)
    (out / "preprocessor_config.json").write_text(json.dumps(processor_config(a.arch), indent=2) + "\n")
    info = {"arch": a.arch, "tiny": a.tiny, "test_top1": acc, "test_images": len(xte), "train_images": len(xtr),
            "epochs": a.epochs, "steps": total, "batch": a.batch, "lr": a.lr, "seed": a.seed, "threads": a.threads,
            "train_seconds": round(seconds, 1), "params": sum(p.numel() for p in model.parameters()),
            "load_avg_1_5_15": [round(v, 2) for v in os.getloadavg()], "loss_log": log,
            "written_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    backbone = _save_backbone(model, a.arch, out)
    if backbone:
        info["backbone"] = backbone
    (out / "train.json").write_text(json.dumps(info, indent=1) + "\n")  # last: its presence means "trained"
    ckpt.unlink(missing_ok=True)
    print(f"{out}: test top-1 {acc:.4f} after {total} steps, {seconds:.0f} s")
    return 0


def _resumed_step(ckpt: Path) -> int:
    return torch.load(ckpt, weights_only=False)["step"] if ckpt.exists() else 0


def _save_backbone(model, arch: str, out: Path) -> str | None:
    """The headless backbone of a DINOv2- or SigLIP-shaped classifier as its own folder ``<out>-backbone`` (with the
    processor config): what CORP's Table 8 prunes and scores by feature cosine and linear probe."""
    if arch not in ("dinov2", "siglip"):
        return None
    backbone = model.dinov2 if arch == "dinov2" else model.vision_model
    folder = out.parent / f"{out.name}-backbone"
    backbone.config._attn_implementation = "sdpa"
    backbone.save_pretrained(folder)
    (folder / "preprocessor_config.json").write_text(json.dumps(processor_config(arch), indent=2) + "\n")
    return str(folder)


def _check_processor(arch: str, images: np.ndarray) -> None:
    """The Hugging Face image processor of :func:`processor_config` gives :func:`pixels` (to float32 rounding)."""
    import tempfile

    from transformers import AutoImageProcessor

    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "preprocessor_config.json").write_text(json.dumps(processor_config(arch)))
        proc = AutoImageProcessor.from_pretrained(d)
    got = proc(images=[im[:, :, None] for im in images], return_tensors="pt")["pixel_values"]
    want = pixels(images)
    if got.shape != want.shape or not torch.allclose(got.float(), want, atol=1e-5):
        raise SystemExit(f"the image processor's pixels {tuple(got.shape)} differ from the training pixels "
                         f"{tuple(want.shape)} (max {float((got.float() - want).abs().max()):.3g})")


if __name__ == "__main__":
    raise SystemExit(main())
