"""Write a 7B-shaped Llama (the Llama-2-7B config: hidden 4096, 32 layers, 32 heads, FFN 11008, vocab 32000) with
seeded random weights straight to bfloat16 safetensors shards, block by block (never the whole model in memory;
about 12.6 GiB = 13.5 GB on disk), plus a tokenizer, for the bigger-than-memory benchmarks (issue 16 section 3).

    python bench/tools/make_7b.py                      # -> $SECATEUR_CACHE/models/llama2-7b-shaped (~/.cache/secateur)
    python bench/tools/make_7b.py --layers 2 --hidden 64 --heads 4 --ffn 128 --vocab 300 --out /tmp/m   # a quick check

Weights: every linear and embedding N(0, 0.02) (Llama's initializer range), norms 1; tensor ``i`` (state-dict order)
drawn from ``torch.Generator().manual_seed(seed * 1_000_003 + i)`` in float32, then rounded to bfloat16, so the
folder is the same on every machine and any tensor can be regenerated alone. The shards are planned and written by
:class:`secateur.export.shards.ShardWriter` (the streamed prune's writer) into a temporary sibling renamed into place.

Tokenizer: :func:`secateur.testing.tiny_tokenizer` (character level, printable ASCII, ids < 100: only the first 100
of the 32000 embedding rows are ever read; enough for memory and timing, not for language).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

import torch


def default_out() -> Path:
    return Path(os.environ.get("SECATEUR_CACHE", Path.home() / ".cache" / "secateur")) / "models" / "llama2-7b-shaped"


def config(args):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
                       num_hidden_layers=args.layers, num_attention_heads=args.heads,
                       num_key_value_heads=args.kv_heads or args.heads, max_position_embeddings=4096,
                       rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1,
                       eos_token_id=2, dtype="bfloat16")


def value(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16)
    return torch.empty(shape, dtype=torch.float32).normal_(0.0, 0.02, generator=gen).to(torch.bfloat16)


def write(args) -> Path:
    from transformers import AutoModelForCausalLM, GenerationConfig

    from secateur.export.shards import ShardWriter, Spec
    from secateur.models.streaming import params_on_meta, saved_tensors
    from secateur.testing import tiny_tokenizer

    out = Path(args.out)
    if out.exists():
        if not args.overwrite:
            sys.exit(f"{out} exists (pass --overwrite to replace it)")
    cfg = config(args)
    with params_on_meta():  # names and shapes only: nothing allocated
        meta = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    specs = [Spec(k, torch.bfloat16, tuple(t.shape)) for k, t in saved_tensors(meta).items()]
    total = sum(s.nbytes for s in specs)
    out.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out.parent).free
    if free < total * 1.05:
        sys.exit(f"{out.parent}: {free / 1e9:.1f} GB free, the model needs {total / 1e9:.1f} GB")
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    tmp.mkdir()
    try:
        writer = ShardWriter(tmp, specs, int(args.max_shard_mb * 1024**2))
        t0 = time.perf_counter()
        for i, s in enumerate(specs):  # state-dict order: embeddings, block 0, 1, ..., norm, head
            writer.write(s.name, value(s.name, s.shape, torch.Generator().manual_seed(args.seed * 1_000_003 + i)))
            if s.name.endswith("down_proj.weight"):
                print(f"{s.name.rsplit('.mlp', 1)[0]} written ({time.perf_counter() - t0:.0f}s)", file=sys.stderr)
        writer.close()
        cfg.architectures = ["LlamaForCausalLM"]
        cfg.save_pretrained(tmp)
        GenerationConfig(bos_token_id=1, eos_token_id=2).save_pretrained(tmp)
        tiny_tokenizer().save_pretrained(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"{out}: {len(writer.shards)} shards, {total / 1e9:.2f} GB, {len(specs)} tensors")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(default_out()))
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads (Llama-2-7B is MHA)")
    p.add_argument("--ffn", type=int, default=11008)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-shard-mb", type=float, default=2000.0, help="largest shard (default: %(default)s MiB)")
    p.add_argument("--overwrite", action="store_true")
    write(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
