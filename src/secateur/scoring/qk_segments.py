"""Calibration segmentation: cut each calibration window into independent shorter sequences.

QK-Wanda's paper protocol (§4.1, App. E.1) samples 2048-token windows and splits each into 32 segments
of 64 tokens; every segment is an independent sequence (positions restart, no attention across segments).
"""

from __future__ import annotations

import torch

from secateur.errors import SecateurError


def segment_sequences(x: torch.Tensor, length: int) -> torch.Tensor:
    """Reshape ``x [B, T, ...]`` (token ids ``[B, T]`` or activations ``[B, T, d]``) into
    ``[B*T/length, length, ...]``.

    Segment ``k`` of window ``b`` becomes row ``b * (T/length) + k`` (windows in order, then segments in
    order). Rotary positions restart in every segment: run the model on the segmented ids, or build
    RoPE tables of length ``length`` for the statistics.
    """
    if x.dim() < 2:
        raise SecateurError(f"segmentation needs [B, T, ...] input, got shape {tuple(x.shape)}")
    b, t = x.shape[0], x.shape[1]
    if length <= 0 or t % length:
        raise SecateurError(f"segment length {length} must be positive and divide the window length {t}")
    return x.reshape(b * (t // length), length, *x.shape[2:])
