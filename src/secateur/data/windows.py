"""Seeded calibration windows, held-out windows, and token manifests (sha256 of the token ids)."""

from __future__ import annotations

import hashlib
import random
from dataclasses import asdict, dataclass

import numpy as np
import torch

from secateur.data.sources import calib_documents
from secateur.errors import SecateurError


@dataclass
class Manifest:
    source: str
    n: int
    seqlen: int
    seed: int
    sha256: str
    tokenizer: str
    rule: str

    def to_dict(self) -> dict:
        return asdict(self)


def token_sha256(ids: torch.Tensor) -> str:
    """sha256 of the token ids as little-endian int64, row-major: identical tokens, identical hash."""
    return hashlib.sha256(np.ascontiguousarray(ids.cpu().numpy().astype("<i8")).tobytes()).hexdigest()


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def sample_windows(docs: list[str], tokenizer, n: int, seqlen: int, seed: int,
                   source: str = "calibration text") -> tuple[torch.Tensor, str]:
    """N windows of L tokens.

    Several documents (C4): the Wanda/SparseGPT rule - ``random.seed(seed)``; repeatedly draw a random
    document until one has more than L tokens, then a random offset inside it. If fewer than 8
    documents are long enough, fall back to windows of the concatenated stream (documents joined with
    a space). One document: windows at random offsets of its token stream.
    """
    rng = random.Random(seed)
    if len(docs) > 1:
        encoded = [None] * len(docs)
        long_enough = 0
        for i, d in enumerate(docs):  # one pass to count; cached for the draws
            encoded[i] = _encode(tokenizer, d)
            long_enough += len(encoded[i]) > seqlen
        if long_enough >= 8:
            out = []
            while len(out) < n:
                i = rng.randint(0, len(docs) - 1)
                ids = encoded[i]
                if len(ids) <= seqlen:
                    continue
                j = rng.randint(0, len(ids) - seqlen - 1)
                out.append(ids[j:j + seqlen])
            return torch.tensor(out, dtype=torch.long), "random long document, random offset (Wanda/SparseGPT)"
        stream = [t for ids in encoded for t in ids]
        rule = "random offsets in the concatenated document stream"
    else:
        stream = _encode(tokenizer, docs[0])
        rule = "random offsets in the token stream"
    if len(stream) <= seqlen:
        raise SecateurError(f"{source} has {len(stream)} tokens; one calibration window of --seqlen {seqlen} needs "
                            f"{seqlen + 1}; use a longer text or a smaller --seqlen")
    starts = [rng.randint(0, len(stream) - seqlen - 1) for _ in range(n)]
    return torch.tensor([stream[s:s + seqlen] for s in starts], dtype=torch.long), rule


def generate_windows(model, tokenizer, n: int, seqlen: int, seed: int, batch_size: int = 16) -> torch.Tensor:
    """Text sampled from the dense model (temperature 1, top-k 50), starting at BOS; seeded."""
    torch.manual_seed(seed)
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    device = next(model.parameters()).device
    rows = []
    for start in range(0, n, batch_size):
        b = min(batch_size, n - start)
        prompt = torch.full((b, 1), bos, dtype=torch.long, device=device)
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=True, top_k=50,
                             temperature=1.0, max_new_tokens=seqlen, min_new_tokens=seqlen,
                             pad_token_id=bos, eos_token_id=None)
        rows.append(out[:, 1:seqlen + 1].cpu())
    return torch.cat(rows)


def calibration_set(source: str, tokenizer, n: int, seqlen: int, seed: int = 0, data_dir=None,
                    model=None) -> tuple[torch.Tensor, Manifest]:
    """``[n, seqlen]`` token ids and their manifest. ``source``: self, c4, wikitext2, ptb or a .txt path."""
    if n < 1 or seqlen < 2:
        raise SecateurError("calibration needs --nsamples >= 1 and --seqlen >= 2")
    if source == "self":
        if model is None:
            raise SecateurError("self-generated calibration needs the dense model")
        ids, rule = generate_windows(model, tokenizer, n, seqlen, seed), "sampled from the dense model"
    else:
        ids, rule = sample_windows(calib_documents(source, data_dir), tokenizer, n, seqlen, seed,
                                   f"calibration text {source}")
    name = getattr(tokenizer, "name_or_path", type(tokenizer).__name__)
    return ids, Manifest(source, n, seqlen, seed, token_sha256(ids), str(name), rule)


def eval_ids(text: str, tokenizer) -> torch.Tensor:
    """Tokenize an evaluation corpus once (no special tokens), as a 1-D tensor."""
    return torch.tensor(_encode(tokenizer, text), dtype=torch.long)
