"""Tiny random vision-language models for tests (issue 47): ``save_tiny("llava", path)`` writes one as a Hugging Face
folder with its processor (image processor, tokenizer with an ``<image>`` token, chat template)."""

from __future__ import annotations

import torch

VLM_FAMILIES = ("llava",)

IMAGE_SIZE, PATCH = 28, 7  # a 4 x 4 patch grid: 16 patches + CLS = 17 image tokens with the "full" feature strategy
IMAGE_TOKEN = "<image>"
CHAT_TEMPLATE = ("{% for m in messages %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>"
                 "{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endfor %}")


def tiny_vlm_processor():
    """A LLaVA processor: CLIP image processor at 28 x 28, the character tokenizer of :func:`secateur.testing.
    tiny_tokenizer` plus ``<image>`` (id 98), the full feature strategy (the CLS token is an image token too)."""
    from transformers import CLIPImageProcessor, LlavaProcessor

    from secateur.testing import tiny_tokenizer

    tok = tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    ip = CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
                            image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    return LlavaProcessor(image_processor=ip, tokenizer=tok, patch_size=PATCH, vision_feature_select_strategy="full",
                          chat_template=CHAT_TEMPLATE, image_token=IMAGE_TOKEN, num_additional_image_tokens=1)


def tiny_vlm(family: str = "llava", seed: int = 0) -> torch.nn.Module:
    """A float32 random LLaVA (CLIP vision tower 2 x 32, Llama 2 x 32 with 2 KV heads) in eval mode, its image token
    the processor's; the last vision block feeds the projector (``vision_feature_layer=-1``) and every patch and the
    CLS token are image features (``full``), so no unit of the vision tower is unused."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    if family not in VLM_FAMILIES:
        raise ValueError(f"no tiny VLM of family {family!r}")
    image_id = tiny_vlm_processor().tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    vc = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                          image_size=IMAGE_SIZE, patch_size=PATCH, projection_dim=32)
    tc = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=256)
    cfg = LlavaConfig(vision_config=vc, text_config=tc, image_token_index=image_id, vision_feature_layer=-1,
                      vision_feature_select_strategy="full", image_seq_length=(IMAGE_SIZE // PATCH) ** 2 + 1)
    torch.manual_seed(seed)
    return LlavaForConditionalGeneration(cfg).eval()


def save_tiny_vlm(family: str, path, seed: int = 0) -> str:
    tiny_vlm(family, seed).save_pretrained(path)
    tiny_vlm_processor().save_pretrained(path)
    return str(path)
