"""Tiny random models of every supported family, for tests and examples (no download needed)."""

from __future__ import annotations

import torch
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    OPTConfig,
    Qwen2Config,
    Qwen3Config,
)

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "opt", "gpt2")


def tiny_config(family: str, vocab: int = 128, layers: int = 2):
    common = dict(vocab_size=vocab, num_hidden_layers=layers, hidden_size=32, intermediate_size=64,
                  num_attention_heads=4, max_position_embeddings=256)
    if family == "llama":
        return LlamaConfig(num_key_value_heads=2, **common)
    if family == "mistral":
        return MistralConfig(num_key_value_heads=2, sliding_window=None, **common)
    if family == "qwen2":  # q/k/v biases
        return Qwen2Config(num_key_value_heads=2, **common)
    if family == "qwen3":  # q/k norms, explicit head_dim
        return Qwen3Config(num_key_value_heads=2, head_dim=8, **common)
    if family == "opt":
        return OPTConfig(vocab_size=vocab, num_hidden_layers=layers, hidden_size=32, ffn_dim=64,
                         num_attention_heads=4, max_position_embeddings=256, word_embed_proj_dim=32)
    if family == "gpt2":
        return GPT2Config(vocab_size=vocab, n_layer=layers, n_embd=32, n_head=4, n_inner=64, n_positions=256,
                          bos_token_id=0, eos_token_id=0)
    raise ValueError(family)


def tiny_model(family: str, seed: int = 0, **kw) -> torch.nn.Module:
    """A float32 random model in eval mode with SDPA attention; biases made non-zero where they exist."""
    torch.manual_seed(seed)
    cfg = tiny_config(family, **kw)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
            elif "norm" in name and p.dim() == 1:
                p.uniform_(0.5, 1.5)
    return model.eval()


def random_ids(n: int, t: int, vocab: int = 128, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, t), generator=g)


def tiny_tokenizer():
    """A character-level fast tokenizer (printable ASCII, ids < 100) that works offline."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for c in range(32, 127):
        vocab[chr(c)] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def save_tiny(family: str, path, seed: int = 0) -> str:
    """Save a tiny model + tokenizer as a Hugging Face folder; returns the path."""
    model = tiny_model(family, seed=seed)
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return str(path)
