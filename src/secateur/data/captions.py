"""Image-caption calibration pairs for a vision-language model's language tower (issue 47 §3, first slice).

``fashion-mnist-captions``: Fashion-MNIST training images (a seeded draw without replacement, through the VLM's
image processor and channel count: :func:`secateur.data.images.processed_images`), each captioned from its label
by one of four templates chosen with the same seed ("a photo of a sneaker."). Each pair becomes one sequence in the
VLM's own layout: the processor's image tokens, ``"Caption:"``, the caption, EOS, right-padded with EOS to the
longest pair (the statistics of the few padding positions are the VLM's own on EOS tokens; no method here reads a
mask). The language tower is calibrated on the merged embeddings of these sequences
(:func:`secateur.models.towers.merged_embeddings`), so its statistics see the image tokens as the VLM feeds them.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from secateur.errors import SecateurError

SOURCES = ("fashion-mnist-captions",)
NAMES = ("t-shirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag", "ankle boot")
TEMPLATES = ("a photo of a {}.", "a picture of a {}.", "an image of a {}.", "a {} on a plain background.")
HELD_OUT_TEMPLATES = ("a close-up photo of a {}.", "this is a {}.")  # evaluation only: never calibrated or trained on
PROMPT = "Caption:"


#: the tokens Idefics3 / SmolVLM processors put around one image that is not split into tiles
IDEFICS3_IMAGE_TOKENS = ("<fake_token_around_image>", "<global-img>")


def image_head(tok, vlm_config, pixels: torch.Tensor | None = None) -> list[int]:
    """The ids one image becomes in the VLM's input, as its processor writes them: LLaVA ``<image> x
    image_seq_length``; Idefics3 / SmolVLM (one global image, no tiles) ``<fake_token_around_image> <global-img>
    <image> x (grid / scale_factor^2) <fake_token_around_image>``; Qwen2.5-VL ``<|vision_start|> <|image_pad|> x
    (t h w / merge^2) <|vision_end|>`` (the count from the processed ``pixels``, which Qwen2.5-VL needs)."""
    from secateur.models.towers import image_seq_length, image_token_id, vlm_type

    image = [image_token_id(vlm_config)] * image_seq_length(vlm_config, pixels)
    if getattr(vlm_config, "model_type", None) == "llava":
        return image
    if vlm_type(vlm_config).patches:
        return [int(vlm_config.vision_start_token_id), *image, int(vlm_config.vision_end_token_id)]
    fake, glob = (_token_id(tok, t) for t in IDEFICS3_IMAGE_TOKENS)
    return [fake, glob, *image, fake]


def _token_id(tok, token: str) -> int:
    i = tok.convert_tokens_to_ids(token)
    if i is None or i == tok.unk_token_id:
        raise SecateurError(f"the VLM's tokenizer has no {token} token, which its processor puts around an image; "
                            "save the model's processor (tokenizer and image processor) in its folder")
    return int(i)


def check_processor(processor, vlm_config) -> None:
    """One line on a processor the caption paths cannot use: no image processor or tokenizer, no EOS, or no image
    token (the processor's ``image_token`` must be the token of the VLM config's image token id)."""
    from secateur.models.towers import image_token_id, vlm_type

    missing = [a for a in ("image_processor", "tokenizer") if getattr(processor, a, None) is None]
    if missing:
        raise SecateurError(f"the VLM's processor ({type(processor).__name__}) has no {' or '.join(missing)}; "
                            "image-caption pairs need both: save the model's processor in its folder")
    tok, want = processor.tokenizer, image_token_id(vlm_config)
    token = getattr(processor, "image_token", None)
    got = None if token is None else tok.convert_tokens_to_ids(token)
    if got is None or got == tok.unk_token_id or int(got) != want:
        raise SecateurError(f"the VLM's processor ({type(processor).__name__}) has no image token for id {want} "
                            f"(config {vlm_type(vlm_config).image_token}; its image_token is {token!r}, id {got}): "
                            "save the model's own processor, whose tokenizer holds the image token, in its folder")
    if tok.eos_token_id is None:
        raise SecateurError("the VLM's tokenizer has no EOS token to end and pad the captions; set eos_token in "
                            "its tokenizer_config.json")


def caption_ids(tok, vlm_config, captions: list[str], pixels: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, target)``: the VLM's image tokens (:func:`image_head`) + ``PROMPT`` + each caption + EOS,
    right-padded with EOS; ``target`` is True on the caption's tokens and its EOS (what caption losses and
    perplexities score)."""
    if tok.eos_token_id is None:
        raise SecateurError("the VLM's tokenizer has no EOS token to end and pad the captions; set eos_token in "
                            "its tokenizer_config.json")
    head = image_head(tok, vlm_config, pixels) + tok(PROMPT, add_special_tokens=False)["input_ids"]
    rows = [head + tok(" " + c, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for c in captions]
    T = max(map(len, rows))
    ids = torch.full((len(rows), T), tok.eos_token_id, dtype=torch.long)
    target = torch.zeros((len(rows), T), dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r)
        target[i, len(head):len(r)] = True
    return ids, target


def caption_target(tok, vlm_config, ids: torch.Tensor, pixels: torch.Tensor | None = None) -> torch.Tensor:
    """The ``target`` of :func:`caption_ids` recovered from its ``ids``: True from the first caption token through
    the first EOS after the image tokens and ``PROMPT`` (the captions themselves hold no EOS; the right padding after
    that EOS is not a target)."""
    head = len(image_head(tok, vlm_config, pixels)) + len(tok(PROMPT, add_special_tokens=False)["input_ids"])
    t = torch.arange(ids.shape[1])[None, :]
    is_eos = (ids == tok.eos_token_id) & (t >= head)
    first = torch.where(is_eos, t, ids.shape[1]).min(dim=1, keepdim=True).values
    return (t >= head) & (t <= first)


def named_class(text: str) -> str | None:
    """The class a caption names (the longest class name it contains: 't-shirt' before 'shirt'), or None."""
    t = text.lower()
    found = [n for n in NAMES if n in t]
    return max(found, key=len) if found else None


class CaptionManifest(dict):
    """The pairs' manifest: a plain dict (the report's ``calibration``) with the ``sha256`` and ``to_dict`` that
    the pipeline reads of every calibration manifest."""

    @property
    def sha256(self) -> str:
        return self["sha256"]

    def to_dict(self) -> dict:
        return dict(self)


def vision_channels(vision_config) -> int:
    """The image channels of a vision config (``num_channels``; Qwen2.5-VL's ``in_channels``)."""
    return int(getattr(vision_config, "num_channels", None) or getattr(vision_config, "in_channels", 3))


def is_caption_source(name: str) -> bool:
    return name in SOURCES


def caption_pairs(vlm, processor, n: int, seed: int, data_dir=None, split: str = "train"
                  ) -> tuple[torch.Tensor, torch.Tensor, CaptionManifest]:
    """``(input_ids [n, T], pixel_values [n, C, H, W], manifest)`` of ``n`` Fashion-MNIST caption pairs (``split``:
    ``train`` for calibration; ``test`` for a held-out measure such as the benches' caption-token teacher KL)."""
    from secateur.data.images import processed_images

    check_processor(processor, vlm.config)
    vc = vlm.config.vision_config
    imgs = processed_images("fashion-mnist", processor.image_processor, vision_channels(vc), int(vc.patch_size), n=n,
                            seed=seed, split=split, data_dir=data_dir, need_labels=True)
    rng = np.random.default_rng([seed, 47])
    caps = [TEMPLATES[int(t)].format(NAMES[int(c)])
            for t, c in zip(rng.integers(0, len(TEMPLATES), len(imgs.labels)), imgs.labels, strict=True)]
    ids, _ = caption_ids(processor.tokenizer, vlm.config, caps, imgs.pixel_values)
    manifest = CaptionManifest({"source": "fashion-mnist-captions", "n": len(caps), "seqlen": int(ids.shape[1]),
                                "seed": seed,
                "images": imgs.manifest, "templates": list(TEMPLATES), "prompt": PROMPT,
                "sha256": hashlib.sha256(ids.numpy().tobytes() + imgs.pixel_values.numpy().tobytes()).hexdigest(),
                "rule": "Fashion-MNIST train images drawn with the seed; one template per image drawn with the seed"})
    return ids, imgs.pixel_values, manifest
