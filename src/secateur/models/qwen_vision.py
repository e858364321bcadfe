"""MLP channels of Qwen2.5-VL's vision tower (issue 47 §1): ``secateur prune --towers vision`` on a
``Qwen2_5_VLForConditionalGeneration``.

The tower (``model.visual``: blocks ``blocks.N`` with ``norm1`` / ``attn.qkv`` (fused, reshaped by ``num_heads``) /
``attn.proj`` / ``norm2`` / ``mlp.gate_proj, up_proj, down_proj`` (SiLU-gated, biased), window attention over the
patch rows, then ``merger``) is not a model the staged calibration engine runs (its blocks take patch rows and
``cu_seqlens``, not ``[B, T, d]``), so its MLP channels are scored and sliced here, over the VLM's own forward:

* statistics: ``SumSq`` of each block's ``down_proj`` input (the gated activations ``act(gate) * up``, float64 state)
  from forward pre-hooks while the vision tower runs on the calibration images (``[N, h, w, D]`` patch rows,
  :func:`secateur.models.towers.vlm_inputs`; ``chunk`` images a call);
* scores (higher = keep), per channel ``j`` of block ``l``, as the text baselines define them
  (:mod:`secateur.scoring.structured`): Wanda-sp ``||W_down[:, j]||_2 ||X_j||_2`` (COEC §3.1), magnitude-sp
  ``||W_down[:, j]||_2`` (FLAP's mag-sp); random: seeded uniform;
* selection: the uniform allocation (COEC §1), each block keeps ``ceil((1 - rho) I)`` channels, its best by a
  stable descending sort (ties: the lower index kept), kept in their original order;
* slicing: ``gate_proj`` / ``up_proj`` rows (and biases) and ``down_proj`` columns; ``down_proj``'s bias stays; the
  vision config's ``intermediate_size`` becomes the kept width (every block the same: the stock config, which the VLM
  builds its tower from, reloads it with one ``from_pretrained``).

The attention heads (``num_heads``), the patch embedding, the norms and the merger are never touched.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from secateur.errors import SecateurError
from secateur.models.towers import VISION_MLP_METHODS

METHODS = VISION_MLP_METHODS


def blocks(vlm: nn.Module) -> nn.ModuleList:
    return vlm.model.visual.blocks


@torch.no_grad()
def down_input_energy(vlm: nn.Module, pixels: torch.Tensor, chunk: int = 8) -> list:
    """Per block, the :class:`~secateur.calib.stats.SumSq` of its ``down_proj`` input over ``pixels [N, h, w, D]``."""
    from secateur.calib.stats import SumSq
    from secateur.models.towers import vlm_inputs

    bl = blocks(vlm)
    acc = [SumSq(b.mlp.down_proj.in_features) for b in bl]
    hooks = [b.mlp.down_proj.register_forward_pre_hook(lambda _m, a, i=i: acc[i].update(a[0].detach()))
             for i, b in enumerate(bl)]
    try:
        for s in range(0, pixels.shape[0], chunk):
            px = pixels[s:s + chunk]
            kw = vlm_inputs(vlm, torch.zeros(px.shape[0], 1, dtype=torch.long), px)
            vlm.model.visual(kw["pixel_values"], grid_thw=kw["image_grid_thw"])
    finally:
        for h in hooks:
            h.remove()
    return acc


def channel_scores(vlm: nn.Module, method: str, stats=None, seed: int = 0) -> list[torch.Tensor]:
    """float64 scores of every block's MLP channels (module docstring)."""
    from secateur.scoring.structured import magnitude, wanda_sp

    if method not in METHODS:
        raise SecateurError(f"Qwen2.5-VL's vision tower prunes MLP channels with {', '.join(METHODS)}; got --method "
                            f"{method}")
    out = []
    g = torch.Generator().manual_seed(seed)
    for i, b in enumerate(blocks(vlm)):
        w = b.mlp.down_proj.weight
        if method == "wanda-sp":
            out.append(wanda_sp(w, stats[i]))
        elif method == "magnitude-sp":
            out.append(magnitude(w))
        else:
            out.append(torch.rand(w.shape[1], generator=g, dtype=torch.float64))
    return out


def keep_uniform(scores: list[torch.Tensor], rho: float) -> list[torch.Tensor]:
    """Each block's kept channels: its ``ceil((1 - rho) I)`` best (stable sort, descending), in index order."""
    out = []
    for s in scores:
        k = max(1, math.ceil((1 - rho) * s.numel() - 1e-9))
        order = torch.sort(s, descending=True, stable=True).indices
        out.append(torch.sort(order[:k]).values)
    return out


def _rows(lin: nn.Linear, idx: torch.Tensor) -> None:
    lin.weight = nn.Parameter(lin.weight.data[idx].clone())
    if lin.bias is not None:
        lin.bias = nn.Parameter(lin.bias.data[idx].clone())
    lin.out_features = int(idx.numel())


@torch.no_grad()
def slice_channels(vlm: nn.Module, keep: list[torch.Tensor]) -> int:
    """Keep ``keep[l]`` channels in block ``l``'s MLP (in place), the width into ``vision_config.intermediate_size``;
    returns the parameters removed. Refuses (before touching anything) widths that differ between blocks."""
    widths = {int(k.numel()) for k in keep}
    if len(widths) != 1:
        raise SecateurError(f"Qwen2.5-VL's vision blocks would keep {sorted(widths)} MLP channels; its config holds "
                            "one width: use the uniform allocation")
    before = sum(p.numel() for p in vlm.parameters())
    for b, idx in zip(blocks(vlm), keep, strict=True):
        _rows(b.mlp.gate_proj, idx)
        _rows(b.mlp.up_proj, idx)
        d = b.mlp.down_proj
        d.weight = nn.Parameter(d.weight.data[:, idx].clone())
        d.in_features = int(idx.numel())
    vlm.config.vision_config.intermediate_size = widths.pop()
    return before - sum(p.numel() for p in vlm.parameters())


def prune_vision_mlp(vlm: nn.Module, method: str, rho: float, pixels: torch.Tensor | None, seed: int = 0,
                     chunk: int = 8) -> dict:
    """Score, select and slice (module docstring); returns the report's ``vision_mlp`` entry."""
    from secateur.errors import check_fraction

    check_fraction(float(rho))
    stats = down_input_energy(vlm, pixels, chunk) if method == "wanda-sp" else None
    width = int(vlm.config.vision_config.intermediate_size)
    keep = keep_uniform(channel_scores(vlm, method, stats, seed), float(rho))
    removed = slice_channels(vlm, keep)
    removable = 3 * width * int(vlm.config.vision_config.hidden_size) * len(keep) + 2 * width * len(keep)
    return {"method": method, "target": float(rho), "intermediate_before": width,
            "intermediate_after": int(vlm.config.vision_config.intermediate_size), "removed_params": removed,
            "removable": removable, "realized": removed / removable, "rule": "uniform: ceil((1 - rho) I) per block",
            "kept": [k.tolist() for k in keep]}
