"""Tiny random models of every supported family, for tests and examples (no download needed)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    OPTConfig,
    Phi3Config,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)


def _common(vocab: int, layers: int) -> dict:
    return dict(vocab_size=vocab, num_hidden_layers=layers, hidden_size=32, intermediate_size=64,
                num_attention_heads=4, max_position_embeddings=256)


# The tiny-model fixture of every family (``model_type`` -> config builder ``(vocab, layers)``): a new family
# adds its entry here, next to its adapter module in ``secateur.models.families``.
TINY_CONFIGS: dict[str, Callable[[int, int], PretrainedConfig]] = {
    "llama": lambda vocab, layers: LlamaConfig(num_key_value_heads=2, **_common(vocab, layers)),
    "mistral": lambda vocab, layers: MistralConfig(num_key_value_heads=2, sliding_window=None,
                                                   **_common(vocab, layers)),
    "qwen2": lambda vocab, layers: Qwen2Config(num_key_value_heads=2, **_common(vocab, layers)),  # q/k/v biases
    "qwen3": lambda vocab, layers: Qwen3Config(num_key_value_heads=2, head_dim=8,  # q/k norms, explicit head_dim
                                               **_common(vocab, layers)),
    "opt": lambda vocab, layers: OPTConfig(vocab_size=vocab, num_hidden_layers=layers, hidden_size=32, ffn_dim=64,
                                           num_attention_heads=4, max_position_embeddings=256,
                                           word_embed_proj_dim=32),
    "gpt2": lambda vocab, layers: GPT2Config(vocab_size=vocab, n_layer=layers, n_embd=32, n_head=4, n_inner=64,
                                             n_positions=256, bos_token_id=0, eos_token_id=0),
    # MQA (one KV head), explicit head_dim, q/k norms, four norms per block; sliding (window 8, RoPE 1e4) and
    # global (RoPE 1e6) layers alternating, so any two layers hold both types
    "gemma3_text": lambda vocab, layers: Gemma3TextConfig(
        num_key_value_heads=1, head_dim=8, sliding_window=8, query_pre_attn_scalar=8,
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        pad_token_id=0, bos_token_id=1, eos_token_id=2, **_common(vocab, layers)),
    # fused qkv_proj ([q; k; v] rows, GQA 4 query / 2 KV heads) and gate_up_proj ([gate; up] rows)
    "phi3": lambda vocab, layers: Phi3Config(num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                             **_common(vocab, layers)),
}
FAMILIES = tuple(TINY_CONFIGS)  # the text families (token ids in, next-token logits out)


def _vision(layers: int, **extra) -> dict:
    """Tiny 16 x 16 RGB images in patches of 4 (16 patches), width 32, 2 heads of 16 dimensions (CORP keeps at
    least 8 query/key dimensions of a head: 16 leaves room to narrow them), MLP 64."""
    return dict(hidden_size=32, num_hidden_layers=layers, num_attention_heads=2, image_size=16, patch_size=4,
                num_channels=3, **extra)


_TINY_TEXT = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "vocab_size": 49408}  # CLIP's bos/eos ids are in range; the text model is never built


def _vision_configs() -> dict[str, Callable[[int], PretrainedConfig]]:
    import transformers as T

    return {
        "vit": lambda n: T.ViTConfig(**_vision(n, intermediate_size=64, qkv_bias=True, num_labels=10)),
        "deit": lambda n: T.DeiTConfig(**_vision(n, intermediate_size=64, qkv_bias=True, num_labels=10)),
        "dinov2": lambda n: T.Dinov2Config(**_vision(n, mlp_ratio=2, layerscale_value=0.5, num_labels=10)),
        "siglip_vision_model": lambda n: T.SiglipVisionConfig(**_vision(n, intermediate_size=64,
                                                                         vision_use_head=False)),
        "clip_vision_model": lambda n: T.CLIPVisionConfig(**_vision(n, intermediate_size=64, projection_dim=16)),
        # composite classifiers: the vision tower's sizes in vision_config (a tiny text config beside it, unused)
        "siglip": lambda n: T.SiglipConfig(vision_config=_vision(n, intermediate_size=64, vision_use_head=False),
                                           text_config=_TINY_TEXT, num_labels=10),
        "clip": lambda n: T.CLIPConfig(vision_config=_vision(n, intermediate_size=64), text_config=_TINY_TEXT,
                                       projection_dim=16, num_labels=10),
        # the vision towers of Idefics3 / SmolVLM (SigLIP blocks, no pooling head): headless backbones
        "idefics3_vision": lambda n: T.Idefics3VisionConfig(**_vision(n, intermediate_size=64)),
        "smolvlm_vision": lambda n: T.SmolVLMVisionConfig(**_vision(n, intermediate_size=64)),
    }


# The vision encoder families (``model_type`` -> config builder ``(layers)``; pixel values in, class logits or
# features out).
VISION_TINY_CONFIGS: dict[str, Callable[[int], PretrainedConfig]] = {}
VISION_FAMILIES = ("vit", "deit", "dinov2", "siglip_vision_model", "clip_vision_model", "siglip", "clip",
                   "idefics3_vision", "smolvlm_vision")


def tiny_vision_model(family: str, seed: int = 0, layers: int = 2, headless: bool = False) -> torch.nn.Module:
    """A float32 random vision encoder in eval mode (SDPA): the family's classifier, or its backbone
    (``headless``; SigLIP and CLIP vision towers are backbones); biases and norms made non-trivial."""
    from secateur.models.families import ADAPTERS

    if not VISION_TINY_CONFIGS:
        VISION_TINY_CONFIGS.update(_vision_configs())
    cfg = VISION_TINY_CONFIGS[family](layers)
    ad = ADAPTERS[family]
    cls = ad.more_classes[-1][0] if headless and ad.more_classes else ad.model_class
    torch.manual_seed(seed)
    cfg._attn_implementation = "sdpa"
    model = cls(cfg)
    return _nontrivial(model)


def random_pixels(n: int, size: int = 16, channels: int = 3, seed: int = 0) -> torch.Tensor:
    """``[n, channels, size, size]`` standard-normal pixel values (what a normalizing processor gives)."""
    return torch.randn(n, channels, size, size, generator=torch.Generator().manual_seed(seed))


TINY_PROCESSOR = {"image_processor_type": "ViTImageProcessor", "do_resize": True, "size": {"height": 16, "width": 16},
                  "resample": 2, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
                  "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}


def _nontrivial(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` in eval mode with its biases non-zero and its norm weights spread (the random init leaves them 0
    and 1, which would hide a bias or a norm handled wrongly)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
            elif "norm" in name and p.dim() == 1:
                p.uniform_(0.5, 1.5)
    return model.eval()


def tiny_config(family: str, vocab: int = 128, layers: int = 2):
    if family not in TINY_CONFIGS:
        raise ValueError(family)
    return TINY_CONFIGS[family](vocab, layers)


def tiny_model(family: str, seed: int = 0, **kw) -> torch.nn.Module:
    """A float32 random model in eval mode with SDPA attention; biases made non-zero where they exist."""
    torch.manual_seed(seed)
    cfg = tiny_config(family, **kw)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)
    return _nontrivial(model)


def servable_model(family: str, seed: int = 0, layers: int = 4) -> torch.nn.Module:
    """A tiny random model that vLLM's CPU attention serves (head size 32, its smallest; ``tiny_model``'s 8 is
    refused): hidden 128, 4 query heads over 2 KV heads, MLP 256, vocab 128 (:func:`tiny_bpe_tokenizer`), 256
    positions; float32, biases and norms non-trivial. Llama-shaped families only (``llama``, ``mistral``,
    ``qwen2``)."""
    torch.manual_seed(seed)
    cfg = tiny_config(family, vocab=128, layers=layers)
    cfg.hidden_size, cfg.intermediate_size, cfg.head_dim = 128, 256, 32
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)
    return _nontrivial(model)


def random_ids(n: int, t: int, vocab: int = 128, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, t), generator=g)


def tiny_tokenizer(bos: bool = False):
    """A character-level fast tokenizer (printable ASCII, ids < 100) that works offline; ``bos``: it prepends
    ``<s>`` (id 1) to every text it tokenizes with special tokens (Gemma's and Llama-2's convention)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for c in range(32, 127):
        vocab[chr(c)] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                           special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def tiny_bpe_tokenizer(vocab: int = 128):
    """A byte-level BPE fast tokenizer (GPT-2 style, offline) of ``vocab`` tokens: bytes 0..vocab-3, the merge
    "Ġ t" and ``<|endoftext|>`` (special, BOS = EOS). The tokenizer llama.cpp's gpt2 vocabulary can hold, for
    GGUF export tests (:func:`tiny_tokenizer` is word-level)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens, merges, _ = _byte_level_vocab(vocab)
    bpe = models.BPE({t: i for i, t in enumerate(tokens[:-1])}, [tuple(m.split(" ")) for m in merges])
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([tokens[-1]])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=tokens[-1], eos_token=tokens[-1])


def save_tiny(family: str, path, seed: int = 0, headless: bool = False) -> str:
    """Save a tiny model + tokenizer (text) or image processor config (vision) as a Hugging Face folder; returns
    the path."""
    import json
    from pathlib import Path

    if family in VLM_FAMILIES:  # a vision-language model with its processor
        return save_tiny_vlm(family, path, seed)
    if family in VISION_FAMILIES:
        tiny_vision_model(family, seed=seed, headless=headless).save_pretrained(path)
        (Path(path) / "preprocessor_config.json").write_text(json.dumps(TINY_PROCESSOR, indent=2))
        return str(path)
    model = tiny_model(family, seed=seed)
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return str(path)


def _llama_cpp_permute(w, n_head: int):
    """llama.cpp's q/k row permutation (convert_hf_to_gguf.py); transformers reverses it on load."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _byte_level_vocab(vocab: int) -> tuple[list[str], list[str], list[int]]:
    """A byte-level BPE vocabulary of ``vocab`` tokens: bytes 0.., one merge ("Ġt") and <|endoftext|> (control)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    spelling = bytes_to_unicode()
    tokens = [spelling[b] for b in range(vocab - 2)] + ["Ġt", "<|endoftext|>"]
    types = [1] * (vocab - 1) + [3]  # 1 NORMAL, 3 CONTROL
    return tokens, ["Ġ t"], types


def write_tiny_gguf(path, family: str = "llama", seed: int = 0, float_type: str = "f32",
                    arch: str | None = None, tied: bool = False) -> torch.nn.Module:
    """Write ``tiny_model(family)`` (llama, qwen2 or qwen3) as a llama.cpp-style GGUF; return the source model.

    Tensors are named and laid out the llama.cpp way (llama: q/k rows permuted; qwen2: q/k/v biases; qwen3:
    q/k norms), so loading the file exercises the same conversion as a real GGUF (transformers 5.x loads qwen3
    GGUFs with head_dim 128 only, so the tiny qwen3, head_dim 8, is refused: a test of that error).
    ``float_type``: f32 (exact) or f16 (matrices in float16, norms f32, as llama.cpp does). ``arch`` overrides
    ``general.architecture`` (to write an unsupported family). ``tied`` drops output.weight (the reader then
    ties lm_head to the embedding).
    """
    import gguf

    if family not in ("llama", "qwen2", "qwen3"):
        raise ValueError(f"write_tiny_gguf supports llama, qwen2 and qwen3, not {family!r}")
    model = tiny_model(family, seed=seed)
    if tied:
        with torch.no_grad():
            model.lm_head.weight = model.model.embed_tokens.weight
        model.config.tie_word_embeddings = True
    w = gguf.GGUFWriter(str(path), arch or family)
    _gguf_metadata(w, model.config, family)
    _gguf_tensors(w, model, family, float_type, tied)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model


def _gguf_metadata(w, cfg, family: str) -> None:
    """Hyperparameters and a byte-level BPE tokenizer, under llama.cpp's GGUF keys."""
    w.add_name(f"secateur tiny {family}")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_rope_dimension_count(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    tokens, merges, types = _byte_level_vocab(cfg.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(cfg.vocab_size - 1)
    w.add_bos_token_id(cfg.vocab_size - 1)


def _gguf_tensors(w, model: torch.nn.Module, family: str, float_type: str, tied: bool) -> None:
    """The model's tensors under llama.cpp's names and layouts (f16: matrices only), in llama.cpp's order."""
    import numpy as np

    def put(gname: str, t: torch.Tensor) -> None:
        a = t.detach().float().numpy()
        w.add_tensor(gname, a.astype(np.float16) if float_type == "f16" and a.ndim == 2 else a)

    cfg = model.config
    sd = model.state_dict()
    permute = _llama_cpp_permute if family == "llama" else (lambda t, n: t)  # llama.cpp permutes llama only
    put("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(cfg.num_hidden_layers):
        _gguf_block(put, sd, i, cfg, permute)
    put("output_norm.weight", sd["model.norm.weight"])
    if not tied:
        put("output.weight", sd["lm_head.weight"])


def _gguf_block(put, sd: dict, i: int, cfg, permute) -> None:
    """Block ``i``: norms, attention (q/k permuted for llama, optional q/k/v biases and q/k norms), MLP."""
    p = f"model.layers.{i}."
    put(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
    put(f"blk.{i}.attn_q.weight", permute(sd[p + "self_attn.q_proj.weight"], cfg.num_attention_heads))
    put(f"blk.{i}.attn_k.weight", permute(sd[p + "self_attn.k_proj.weight"], cfg.num_key_value_heads))
    put(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
    for role in ("q", "k", "v"):
        if p + f"self_attn.{role}_proj.bias" in sd:
            put(f"blk.{i}.attn_{role}.bias", sd[p + f"self_attn.{role}_proj.bias"])
    for role in ("q", "k"):
        if p + f"self_attn.{role}_norm.weight" in sd:
            put(f"blk.{i}.attn_{role}_norm.weight", sd[p + f"self_attn.{role}_norm.weight"])
    put(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
    put(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
    put(f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
    put(f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"])
    put(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"])


def folder_digest(path) -> str:
    """sha256 of an output folder's content: every safetensors tensor (name, dtype, shape, bytes, in name order) and
    every array of ``secateur-masks.npz``. Two runs with equal digests wrote the same model bit for bit (the tests'
    and the device check's "same answer on any number of processes")."""
    import hashlib
    from pathlib import Path

    import numpy as np
    from safetensors import safe_open

    path = Path(path)
    h = hashlib.sha256()
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "np") as st:
            for name in sorted(st.keys()):
                t = st.get_tensor(name)
                h.update(f"{name}|{t.dtype}|{t.shape}".encode() + np.ascontiguousarray(t).tobytes())
    masks = path / "secateur-masks.npz"
    if masks.exists():
        with np.load(masks) as z:
            for name in sorted(z.files):
                h.update(name.encode() + np.ascontiguousarray(z[name]).tobytes())
    return h.hexdigest()


# --- tiny vision-language models (issue 47): save_tiny("llava" | "idefics3" | "smolvlm", path) writes one with its
# processor ---
VLM_FAMILIES = ("llava", "idefics3", "smolvlm", "qwen2_5_vl")

IMAGE_SIZE, PATCH = 28, 7  # a 4 x 4 patch grid: 16 patches + CLS = 17 image tokens with the "full" feature strategy
IMAGE_TOKEN = "<image>"
CHAT_TEMPLATE = ("{% for m in messages %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>"
                 "{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endfor %}")
#: Idefics3 / SmolVLM: the 4 x 4 patch grid pixel-shuffled by 2: 4 image tokens per image
SCALE_FACTOR = 2
IDEFICS3_SPECIAL = ("<fake_token_around_image>", IMAGE_TOKEN, "<end_of_utterance>", "<global-img>")
#: Qwen2.5-VL: 28 x 28 images in 7 x 7 patches (two frames of one image), merged 2 x 2: 4 image tokens per image
QWEN_SPECIAL = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>")
QWEN_CHAT_TEMPLATE = ("{% for m in messages %}{% for c in m['content'] %}{% if c['type'] == 'image' %}"
                      "<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ c['text'] }}{% endif %}{% endfor %}"
                      "{% endfor %}")


def tiny_vlm_processor(family: str = "llava"):
    """The tiny VLM's processor (offline): the character tokenizer of :func:`secateur.testing.tiny_tokenizer` plus
    the family's image tokens, an image processor at 28 x 28 and a chat template.

    * ``llava``: CLIP image processor, ``<image>`` (id 98), the full feature strategy (the CLS token is an image
      token too);
    * ``idefics3`` / ``smolvlm``: ``Idefics3ImageProcessorPil`` (no tiling: ``do_image_splitting=False``, longest
      edge 28) and ``Idefics3Processor`` with ``<fake_token_around_image>`` (98), ``<image>`` (99),
      ``<end_of_utterance>`` (100), ``<global-img>`` (101). SmolVLM gets Idefics3's processor too: its own needs
      ``num2words`` and a video processor (torchvision), neither importable here, and writes the same prompt for one
      untiled image (``<fake_token_around_image><global-img><image>...<fake_token_around_image>``);
    * ``qwen2_5_vl``: ``Qwen2VLImageProcessorPil`` (patch 7, merge 2, 28 x 28 pixels) and the tokenizer with
      ``<|vision_start|>`` (98), ``<|image_pad|>`` (99), ``<|vision_end|>`` (100), ``<|video_pad|>`` (101) and the
      chat template, as a :class:`secateur.models.towers.ImageTextProcessor` (``Qwen2_5_VLProcessor`` needs a video
      processor, which needs torchvision; the folder's ``preprocessor_config.json`` and tokenizer are what its
      processor reads)."""
    if family not in VLM_FAMILIES:
        raise ValueError(f"no tiny VLM processor of family {family!r}")
    tok = tiny_tokenizer()
    if family == "qwen2_5_vl":
        from transformers import Qwen2VLImageProcessorPil

        from secateur.models.towers import ImageTextProcessor

        tok.add_special_tokens({"additional_special_tokens": list(QWEN_SPECIAL)})
        tok.chat_template = QWEN_CHAT_TEMPLATE
        ip = Qwen2VLImageProcessorPil(patch_size=PATCH, merge_size=2, temporal_patch_size=2,
                                      size={"shortest_edge": IMAGE_SIZE ** 2, "longest_edge": IMAGE_SIZE ** 2},
                                      image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
        return ImageTextProcessor(ip, tok, "<|image_pad|>")
    if family == "llava":
        from transformers import CLIPImageProcessor, LlavaProcessor

        tok.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
        ip = CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE,
                                                                                "width": IMAGE_SIZE},
                                image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
        return LlavaProcessor(image_processor=ip, tokenizer=tok, patch_size=PATCH,
                              vision_feature_select_strategy="full", chat_template=CHAT_TEMPLATE,
                              image_token=IMAGE_TOKEN, num_additional_image_tokens=1)
    from transformers import Idefics3ImageProcessorPil, Idefics3Processor

    tok.add_special_tokens({"additional_special_tokens": list(IDEFICS3_SPECIAL)})
    ip = Idefics3ImageProcessorPil(do_resize=True, size={"longest_edge": IMAGE_SIZE},
                                   max_image_size={"longest_edge": IMAGE_SIZE}, do_image_splitting=False,
                                   image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    return Idefics3Processor(image_processor=ip, tokenizer=tok, chat_template=CHAT_TEMPLATE,
                             image_seq_len=(IMAGE_SIZE // PATCH) ** 2 // SCALE_FACTOR ** 2)


def tiny_vlm(family: str = "llava", seed: int = 0, layers: int = 2) -> torch.nn.Module:
    """A float32 random VLM in eval mode, its image token the processor's (:func:`tiny_vlm_processor`).

    * ``llava``: CLIP vision tower ``layers`` x 32, Llama ``layers`` x 32 with 2 KV heads; the last vision block
      feeds the projector (``vision_feature_layer=-1``) and every patch and the CLS token are image features
      (``full``), so no unit of the vision tower is unused;
    * ``idefics3`` / ``smolvlm``: their SigLIP-like vision tower ``layers`` x 32 (2 heads of 16, MLP 64, 28 x 28
      images in 7 x 7 patches), the connector (pixel shuffle by 2 + a linear map), Llama ``layers`` x 32 with 2 KV
      heads; biases and norms made non-trivial.

    ``layers = 5``: one layer of each tower outside CoCurve's protected first and last two (``--towers joint``)."""
    import transformers as T

    if family not in VLM_FAMILIES:
        raise ValueError(f"no tiny VLM of family {family!r}")
    tok = tiny_vlm_processor(family).tokenizer
    image_id = tok.convert_tokens_to_ids(IMAGE_TOKEN)
    tc = T.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(seed)
    if family == "llava":
        vc = T.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                                image_size=IMAGE_SIZE, patch_size=PATCH, projection_dim=32)
        cfg = T.LlavaConfig(vision_config=vc, text_config=tc, image_token_index=image_id, vision_feature_layer=-1,
                            vision_feature_select_strategy="full", image_seq_length=(IMAGE_SIZE // PATCH) ** 2 + 1)
        return T.LlavaForConditionalGeneration(cfg).eval()
    if family == "qwen2_5_vl":
        ids = tok.convert_tokens_to_ids(list(QWEN_SPECIAL))
        vc = dict(depth=layers, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=PATCH,
                  spatial_merge_size=2, temporal_patch_size=2, window_size=IMAGE_SIZE, out_hidden_size=32,
                  fullatt_block_indexes=[layers - 1])
        tcd = tc.to_dict() | {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                  "mrope_section": [1, 1, 2]}}
        cfg = T.Qwen2_5_VLConfig(vision_config=vc, text_config=tcd, image_token_id=ids[1],
                                 vision_start_token_id=ids[0], vision_end_token_id=ids[2], video_token_id=ids[3])
        cfg._attn_implementation = "sdpa"
        return _nontrivial(T.Qwen2_5_VLForConditionalGeneration(cfg))
    vc = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=2,
              image_size=IMAGE_SIZE, patch_size=PATCH)
    config_class, model_class = ((T.Idefics3Config, T.Idefics3ForConditionalGeneration) if family == "idefics3"
                                 else (T.SmolVLMConfig, T.SmolVLMForConditionalGeneration))
    cfg = config_class(vision_config=vc, text_config=tc.to_dict(), image_token_id=image_id, scale_factor=SCALE_FACTOR,
                       pad_token_id=tok.eos_token_id)
    cfg._attn_implementation = "sdpa"
    return _nontrivial(model_class(cfg))


def save_tiny_vlm(family: str, path, seed: int = 0, layers: int = 2) -> str:
    tiny_vlm(family, seed, layers).save_pretrained(path)
    tiny_vlm_processor(family).save_pretrained(path)
    return str(path)
