"""Rotary-embedding helpers for the RoPE-aware QK-Wanda variants (paper App. C.2-C.3, O.4).

Hugging Face's Llama-family attention rotates a head vector ``v`` (width ``m``) at position ``t`` as
``v * cos[t] + rotate_half(v) * sin[t]`` with ``rotate_half(v) = (-v[m/2:], v[:m/2])``. Raw coordinate
``a`` is therefore paired with ``a + m/2`` (the pair ``P_a = (a, a+m/2)`` of App. C.3) and the 2x2 map of
pair ``a`` at position ``t`` is::

    R_{t,a} = [[cos[t, a],        -sin[t, a]      ],
               [sin[t, a + m/2],   cos[t, a + m/2]]]

(Eq. 46 when the two halves of ``cos``/``sin`` agree, which they do in HF). The code never assumes
``cos^2 + sin^2 = 1``: frequency/attention scaling (YaRN, ``attention_scaling``) is used as given. The
rotated direction of raw coordinate ``i`` is column ``b`` of ``R_{t,a}`` (``b = 0`` for ``i = a``,
``b = 1`` for ``i = a + m/2``)::

    r0 = (cos[t, a],  sin[t, a + m/2])      r1 = (-sin[t, a],  cos[t, a + m/2])
"""

from __future__ import annotations

import torch
from torch import nn

from secateur.errors import SecateurError


def rope_tables(head_dim: int, length: int, theta: float = 10000.0, *, positions: torch.Tensor | None = None,
                attention_scaling: float = 1.0, dtype: torch.dtype = torch.float64,
                device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Default (unscaled-frequency) RoPE tables ``cos, sin`` of shape ``[T, head_dim]`` in HF layout.

    ``positions`` defaults to ``0..length-1`` (positions restart in every calibration segment). Prefer
    :func:`model_rope_tables` for a real model: it returns the tables the model actually uses (frequency
    scaling, dtype rounding).
    """
    if head_dim % 2:
        raise SecateurError(f"RoPE needs an even head_dim, got {head_dim}")
    pos = torch.arange(length, dtype=torch.float64) if positions is None else positions.to(torch.float64)
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    freqs = pos[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return ((emb.cos() * attention_scaling).to(dtype=dtype, device=device),
            (emb.sin() * attention_scaling).to(dtype=dtype, device=device))


def model_rope_tables(model: nn.Module, length: int, *,
                      device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``cos, sin`` tables (``[T, head_dim]``, model dtype) a HF Llama-family model applies at
    positions ``0..length-1``, taken from its own ``rotary_emb`` module."""
    base = getattr(model, "model", model)
    rot = getattr(base, "rotary_emb", None)
    if rot is None:
        raise SecateurError(f"{type(model).__name__} has no rotary embedding; RoPE-aware scores need one")
    p = next(model.parameters())
    dev = torch.device(device) if device is not None else p.device
    pos = torch.arange(length, device=dev)[None]
    with torch.no_grad():
        cos, sin = rot(torch.zeros(1, length, 1, dtype=p.dtype, device=dev), pos)
    return cos[0], sin[0]


def normalize_tables(rope: tuple[torch.Tensor, torch.Tensor], batch: int, length: int, head_dim: int,
                     dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Bring ``(cos, sin)`` given as ``[T', m]``, ``[1, T', m]`` (first ``T`` positions used, ``T' >= T``) or
    ``[B, T, m]`` (per-sequence positions) to ``[B or 1, T, m]`` in ``dtype``."""
    out = []
    for name, t in zip(("cos", "sin"), rope):
        if not torch.is_tensor(t):
            raise SecateurError(f"rotary {name} must be a tensor")
        if t.dim() == 2:
            t = t[None]
        if t.dim() != 3 or t.shape[-1] != head_dim:
            raise SecateurError(f"rotary {name} has shape {tuple(t.shape)}; expected [T, {head_dim}] "
                                f"or [B, T, {head_dim}]")
        if t.shape[0] == 1:
            if t.shape[1] < length:
                raise SecateurError(f"rotary {name} covers {t.shape[1]} positions, sequences have {length}")
            t = t[:, :length]
        elif t.shape[:2] != (batch, length):
            raise SecateurError(f"rotary {name} has shape {tuple(t.shape)}; expected [{batch}, {length}, "
                                f"{head_dim}] for this batch")
        out.append(t.detach().to(device=device, dtype=dtype))
    return out[0], out[1]


def apply_rope(v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF rotation of ``v [B, T, H, m]`` with tables ``[B or 1, T, m]`` (broadcast over heads)."""
    h = v.shape[-1] // 2
    rot = torch.cat((-v[..., h:], v[..., :h]), dim=-1)
    return v * cos[:, :, None, :] + rot * sin[:, :, None, :]


def pair_columns(cos: torch.Tensor, sin: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """Rotated directions ``R_{t,a} e_b`` as ``((r0x, r0y), (r1x, r1y))``, each ``[..., T, m/2]``."""
    h = cos.shape[-1] // 2
    return (cos[..., :h], sin[..., h:]), (-sin[..., :h], cos[..., h:])


def rotated_diag(v11: torch.Tensor, v12: torch.Tensor, v22: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> torch.Tensor:
    """``[R_t^T V R_t]_bb`` for both coordinates of every pair (Eqs. 44-48), in raw HF coordinate order.

    ``v11, v12, v22``: symmetric 2x2 moments ``[B, T, H, m/2]`` (per position ``t``); ``cos, sin``:
    ``[B or 1, T, m]``. Returns ``[B, T, H, m]`` (coordinate ``a`` then ``a + m/2``).
    """
    outs = []
    for rx, ry in pair_columns(cos, sin):
        rx, ry = rx[:, :, None, :], ry[:, :, None, :]
        outs.append(rx * rx * v11 + 2 * rx * ry * v12 + ry * ry * v22)
    return torch.cat(outs, dim=-1)
