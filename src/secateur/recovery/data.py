"""Training and held-out windows of a recovery, disjoint from every evaluation split.

Text comes from the calibration pools of :func:`secateur.data.sources.calib_documents`, never from an evaluation
text (:func:`secateur.data.sources.eval_text`):

=========  ===============================================  ===============================================
corpus     recovery text (local data folder / the hub)      evaluation text (``secateur eval ppl``)
=========  ===============================================  ===============================================
c4         C4 validation documents [0, 1500) / C4 train     C4 validation documents [1500, 2000)
wikitext2  ``wiki.valid.tokens`` / WikiText-2 train         ``wiki.test.raw`` (test)
ptb        ``ptb.valid.txt`` / PTB train                    ``ptb.test.txt`` (test)
self       text sampled from the teacher                    -
FILE.txt   the file (the user's choice: no check)           -
=========  ===============================================  ===============================================

The windows are drawn with seed ``--seed + SEED_OFFSET``, so a recovery with the default seeds draws other windows
than the prune's calibration (seed 0). A held-out part is split off first, so that the held-out KL measures text the
adapters never saw: several documents (C4): the last 5% of the documents (at least one); one stream (WikiText-2, PTB,
a .txt file): the last 5% of its tokens (at least one window and a token); ``self``: windows sampled with the next
seed. Training windows follow :func:`secateur.data.windows.sample_windows`'s rules on the remaining part.
"""

from __future__ import annotations

import math
import random

import torch

from secateur.data.windows import generate_windows, sample_windows, token_sha256
from secateur.errors import SecateurError

SEED_OFFSET = 7919  # recovery windows: --seed + 7919; held-out windows of `self`: --seed + 7920
HELDOUT_SHARE = 20  # 1/20 of the documents or of the token stream is held out


def load_documents(data: str, data_dir: str | None) -> list[str] | None:
    """The recovery corpus as documents (``None`` for ``self``), read now: a missing data file is one line before
    any model is loaded."""
    from secateur.data.sources import calib_documents

    return None if data == "self" else calib_documents(data, data_dir)


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def check_tokens(have: int, n: int, seqlen: int, source: str) -> None:
    """``--tokens`` (``n`` windows of ``seqlen``) no more than the ``have`` tokens the text holds for training:
    refused before training, in one line (windows past the text would only repeat it)."""
    if n * seqlen > have:
        raise SecateurError(f"--tokens asks for {n} windows of --seqlen {seqlen} ({n * seqlen} tokens), more than the "
                            f"{have} tokens --data {source} holds for training (after its held-out part); pass "
                            f"--tokens {have - have % seqlen} or less (and --epochs N to see the text again), or use "
                            "a longer text")


def _stream_windows(stream: list[int], n: int, seqlen: int, seed: int, what: str) -> torch.Tensor:
    """``n`` windows at random offsets of one token stream (the one-document rule of ``sample_windows``)."""
    if len(stream) <= seqlen:
        raise SecateurError(f"{what} has {len(stream)} tokens; a window of --seqlen {seqlen} needs {seqlen + 1}; use "
                            "a longer text or a smaller --seqlen")
    rng = random.Random(seed)
    starts = [rng.randint(0, len(stream) - seqlen - 1) for _ in range(n)]
    return torch.tensor([stream[s:s + seqlen] for s in starts], dtype=torch.long)


def recovery_windows(docs: list[str] | None, tokenizer, n: int, seqlen: int, seed: int, n_held: int, source: str,
                     teacher=None) -> tuple[torch.Tensor, torch.Tensor | None, dict]:
    """``(train [n, seqlen], held [n_held, seqlen] or None, manifest)`` (see the module docstring)."""
    s = seed + SEED_OFFSET
    held = None
    if docs is None:  # self: sampled from the teacher
        train = generate_windows(teacher, tokenizer, n, seqlen, s)
        if n_held:
            held = generate_windows(teacher, tokenizer, n_held, seqlen, s + 1)
        rule, split = "sampled from the teacher", f"held-out windows sampled with seed {s + 1}"
    elif len(docs) > 1:
        h = max(1, len(docs) // HELDOUT_SHARE) if n_held else 0
        if len(docs) - h < 1:
            raise SecateurError(f"--data {source} has too few documents to hold some out; use a longer corpus")
        check_tokens(sum(len(_encode(tokenizer, d)) for d in docs[:len(docs) - h]), n, seqlen, source)
        train, rule = sample_windows(docs[:len(docs) - h], tokenizer, n, seqlen, s, f"recovery text {source}")
        if n_held:
            held, _ = sample_windows(docs[len(docs) - h:], tokenizer, n_held, seqlen, s, f"held-out text {source}")
        split = f"last {h} of {len(docs)} documents held out"
    else:
        stream = _encode(tokenizer, docs[0])
        h = max(math.ceil(len(stream) / HELDOUT_SHARE), seqlen + 1) if n_held else 0
        if len(stream) - h <= seqlen:
            raise SecateurError(f"--data {source} has {len(stream)} tokens: too few for windows of --seqlen {seqlen} "
                                f"and a held-out part ({h} tokens); use a longer text or a smaller --seqlen")
        check_tokens(len(stream) - h, n, seqlen, source)
        train = _stream_windows(stream[:len(stream) - h], n, seqlen, s, f"recovery text {source}")
        if n_held:
            held = _stream_windows(stream[len(stream) - h:], n_held, seqlen, s, f"held-out text {source}")
        rule, split = "random offsets in the token stream", f"last {h} of {len(stream)} tokens held out"
    manifest = {"source": source, "windows": int(train.shape[0]), "seqlen": seqlen, "tokens": int(train.numel()),
                "seed": s, "rule": rule, "sha256": token_sha256(train),
                "tokenizer": str(getattr(tokenizer, "name_or_path", type(tokenizer).__name__)),
                "split": _SPLITS.get(source, "the user's text file (no evaluation split is known)"),
                "heldout": None if held is None else {"windows": int(held.shape[0]), "sha256": token_sha256(held),
                                                      "rule": split}}
    return train, held, manifest


_SPLITS = {"c4": "C4 calibration documents [0, 1500) of the local file (hub: C4 train); evaluation uses [1500, 2000)",
           "wikitext2": "WikiText-2 validation (local) / train (hub); evaluation uses test",
           "ptb": "PTB validation (local) / train (hub); evaluation uses test",
           "self": "text sampled from the teacher"}
