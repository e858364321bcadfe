"""LoRA adapters (peft) on every attention and MLP projection of a pruned model, and their merge.

Targets: the projections the family adapter names (:attr:`secateur.models.families.base.Adapter.projections`:
q/k/v/o and gate/up/down, GPT-2's fused ``c_attn``/``c_fc`` as stored), by their full module names, so that one
list serves every family and every per-layer width; a projection of width 0 (a sliced-away attention or MLP) gets
none. GPT-2's ``Conv1D`` stores ``[in, out]``: ``fan_in_fan_out`` is set for it.

Masked runs (:func:`remask`): after ``merge_and_unload`` the run's masks are applied again exactly
(``W[mask] = 0``), so the output has the run's zero pattern and realized sparsity bit for bit. The part of the
merged LoRA delta that fell on pruned positions is discarded; :func:`merge` measures its share of the delta
(squared Frobenius norm) and the recovery reports the held-out loss before and after re-masking, so the cost of
the choice is measured, not assumed.
"""

from __future__ import annotations

import hashlib
import warnings

import torch
from torch import nn

from secateur.errors import SecateurError

ADAPTER_NAME = "default"


def target_modules(model: nn.Module) -> tuple[list[str], list[str]]:
    """``(full module names, roles)`` of the projections that get adapters (non-empty weights only)."""
    from secateur.models.adapters import get_adapter

    adapter = get_adapter(model)
    prefix = adapter.base_prefix
    names, roles = [], []
    for i, layer in enumerate(adapter.layers):
        for name, ref in adapter.linears(layer).items():
            if ref.module.weight.numel() == 0:
                continue
            names.append(f"{prefix}.{i}.{name}")
            if ref.role not in roles:
                roles.append(ref.role)
    if not names:
        raise SecateurError("the pruned model has no projection left to adapt; recover a run that kept some units")
    return names, roles


def attach(model: nn.Module, rank: int, alpha: float, dropout: float, seed: int):
    """``(peft model, target names, roles)``: LoRA adapters initialized from ``seed`` (A: Kaiming-uniform, B: 0, so
    the adapted model starts equal to the pruned one)."""
    from peft import LoraConfig, get_peft_model

    from secateur.models.adapters import get_adapter

    names, roles = target_modules(model)
    conv1d = bool(get_adapter(model).layout and get_adapter(model).layout.conv1d)
    cfg = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=names, bias="none",
                     fan_in_fan_out=conv1d, task_type="CAUSAL_LM")
    torch.manual_seed(seed)
    with warnings.catch_warnings():  # transformers' deprecation of a name peft still reads: nothing for the user
        warnings.filterwarnings("ignore", category=FutureWarning)
        pm = get_peft_model(model, cfg)
    return pm, names, roles


def set_train_mode(pm: nn.Module) -> None:
    """The base model in evaluation mode (its own dropout off: the teacher's targets are deterministic), the LoRA
    dropout active."""
    pm.eval()
    for name, mod in pm.named_modules():
        if name.endswith(f"lora_dropout.{ADAPTER_NAME}"):
            mod.train()


def adapter_params(pm: nn.Module) -> dict[str, torch.Tensor]:
    """The trainable LoRA tensors by name (the order is the module order: the optimizer's too)."""
    return {n: p for n, p in pm.named_parameters() if p.requires_grad}


def tensors_sha256(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over ``name NUL bytes`` of each tensor in name order: identical bits, identical digest."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode() + b"\0")
        h.update(tensors[name].detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def merge(pm: nn.Module, masks: dict[str, torch.Tensor] | None = None, conv1d: bool = False
          ) -> tuple[nn.Module, dict | None]:
    """``(merged model, delta statistics)``: every adapter merged into its weight (``merge_and_unload``); with the
    masks of a masked run, the squared norm of the merged delta on pruned positions before it is discarded
    (:func:`remask` zeroes them)."""
    stats = None
    if masks:
        on_pruned = total = 0.0
        for key, m in masks.items():
            layer = pm.base_model.model.get_submodule(key)
            if not hasattr(layer, "get_delta_weight"):
                continue
            with torch.no_grad():
                d = layer.get_delta_weight(ADAPTER_NAME).double()
                mm = (m.T if conv1d else m).to(d.device)  # the delta is in the weight's layout
                on_pruned += float(d[mm].square().sum())
                total += float(d.square().sum())
        stats = {"delta_sq_norm": total, "delta_sq_norm_on_pruned": on_pruned,
                 "share_on_pruned": on_pruned / total if total else 0.0}
    return pm.merge_and_unload(), stats


@torch.no_grad()
def remask(model: nn.Module, masks: dict[str, torch.Tensor], conv1d: bool) -> None:
    """``W[mask] = 0`` for every masked projection (GPT-2 Conv1D: the transposed mask)."""
    for key, m in masks.items():
        w = model.get_submodule(key).weight
        mm = m.T if conv1d else m
        if mm.shape != w.shape:
            raise SecateurError(f"mask {key} has shape {tuple(m.shape)}, its weight {tuple(w.shape)}; the run folder's "
                                "masks do not belong to its weights: prune again")
        w.masked_fill_(mm.to(w.device), 0)


def realized(model: nn.Module, masks: dict[str, torch.Tensor], conv1d: bool, source: str | None = None) -> dict:
    """The realized sparsity of a masked model, counted from its weights at the mask positions and checked: every
    masked weight is exactly zero. ``source``: the masks file of a run read back (a weight that is not zero where
    it says is one line: the file is not the run's); None: the model was just re-masked (an internal error)."""
    pruned = total = 0
    for key, m in masks.items():
        w = model.get_submodule(key).weight
        mm = (m.T if conv1d else m).to(w.device)
        if bool((w[mm] != 0).any()):
            if source is not None:
                raise SecateurError(f"{source}: the mask of {key} marks weights as pruned that are not zero in the "
                                    "run's weights (the masks belong to another run); restore the run's own masks "
                                    "file, or prune again")
            raise RuntimeError(f"{key}: a masked weight is not zero after re-masking")
        pruned += int(mm.sum())
        total += mm.numel()
    n_params = sum(p.numel() for p in model.parameters())
    return {"targeted": pruned / total if total else 0.0, "of_all_parameters": pruned / n_params,
            "pruned_weights": pruned, "targeted_weights": total}
