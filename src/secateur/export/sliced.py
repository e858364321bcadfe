"""Save a structurally pruned model so that ONE ``AutoModelForCausalLM.from_pretrained(dir)`` reloads it
with identical logits.

Route (chosen automatically, recorded in the returned dict and in ``config.json``):

* ``stock``  every layer has the same widths and biases the family's stock config can express (and the
  stock config validates, e.g. Llama needs ``hidden % num_attention_heads == 0``): the stock config with
  updated ``num_attention_heads`` / ``num_key_value_heads`` / explicit ``head_dim`` /
  ``intermediate_size`` (OPT ``ffn_dim``, GPT-2 ``n_inner``) and layer count. Loads anywhere.
* ``hetero`` anything else (uneven widths, removed attention, biases added to a bias-free
  architecture, GPT-2/OPT head pruning whose stock classes derive ``head_dim`` from the head count):
  ``model_type = secateur_<family>`` with ``secateur_layers`` (see :mod:`secateur.models.hetero`),
  ``hetero.py`` copied into the folder as ``secateur_hetero.py`` (with the family's layout appended, so the
  copy is self-contained: :func:`secateur.models.hetero.standalone_source`) and ``auto_map`` pointing at it. Loads
  with plain ``from_pretrained(dir)`` once secateur is imported (``secateur.models.loading`` registers the
  classes), and without secateur via ``from_pretrained(dir, trust_remote_code=True)``.

The candidate config is checked before writing: a model built from it on the meta device must have
exactly the parameter names and shapes of the pruned model. The folder is written to a temporary
sibling and renamed into place (atomic on one filesystem).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

from secateur.errors import SecateurError
from secateur.export.hf import export_size
from secateur.models import hetero
from secateur.models.families import ADAPTERS, family_of, layout_of
from secateur.safe_write import (
    EXPORT_MARKER,
    atomic_dir,
    check_output_dir,
    write_report,
)

_DROP = ("model_type", "transformers_version", "architectures", "auto_map", "secateur_layers",
         "_name_or_path")


def _shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def _meta_shapes(config_cls, model_cls, d: dict) -> dict[str, tuple[int, ...]] | None:
    try:
        cfg = config_cls.from_dict(d)
        with torch.device("meta"):
            m = model_cls._from_config(cfg) if hasattr(model_cls, "_from_config") else model_cls(cfg)
        return _shapes(m)
    except Exception:  # noqa: BLE001 - any failure means "this config cannot describe the model"
        return None


def _base_dict(model: nn.Module) -> dict:
    d = model.config.to_dict()
    for k in _DROP:
        d.pop(k, None)
    stages = d.get("stage_names")
    if stages is not None and len(stages) != d.get("num_hidden_layers", len(stages) - 1) + 1:
        # a backbone config (DINOv2) names one stage per block: after blocks are removed its defaults apply again
        for k in ("stage_names", "out_features", "out_indices", "_out_features", "_out_indices"):
            d.pop(k, None)
    return d


def _stock_dict(fam: str, d: dict, specs: list[dict]) -> dict | None:
    first = specs[0]
    if any(s != first for s in specs) or first["n_heads"] == 0:
        return None
    layout = layout_of(fam)
    top = d = dict(d)
    if layout.sub_config:  # a composite classifier's sizes live in its sub-config
        d = top[layout.sub_config] = dict(top[layout.sub_config])
    if layout.gqa:  # explicit head_dim: head counts can change
        d.update({layout.heads_key: first["n_heads"], layout.kv_heads_key: first["n_kv_heads"]})
    elif first["n_heads"] != d[layout.heads_key]:
        return None  # the stock classes derive head_dim = hidden / heads
    if layout.inter_ratio:  # DINOv2: an integer mlp_ratio; any other width needs the per-layer config
        if first["intermediate"] % d["hidden_size"]:
            return None
        d[layout.inter_key] = first["intermediate"] // d["hidden_size"]
    else:
        d[layout.inter_key] = first["intermediate"]
    return top


def export_config(model: nn.Module):
    """The config to save ``model`` with, and its route (``'stock'`` or ``'hetero'``)."""
    from secateur.structured.slicing import sync_config

    sync_config(model)
    cfg = model.config
    fam = family_of(cfg)
    specs = cfg.secateur_layers
    want = _shapes(model)
    base = _base_dict(model)
    stock = _stock_dict(fam, base, specs)
    stock_cls = stock_model_class(model)
    if stock is not None:
        cfg_cls = ADAPTERS[fam].config_class
        if _meta_shapes(cfg_cls, stock_cls, stock) == want:
            return cfg_cls.from_dict(stock), "stock"
    h_cfg = hetero.HETERO_CLASSES[fam][0]
    h_mdl = hetero.HETERO_MODELS[stock_cls.__name__]
    d = {**base, "secateur_layers": specs}
    got = _meta_shapes(h_cfg, h_mdl, d)
    if got != want:
        diff = sorted(set(got or {}) ^ set(want)) or [k for k in want if (got or {}).get(k) != want[k]]
        raise SecateurError(f"cannot describe the pruned model with a config (mismatch at {diff[:3]})")
    out = h_cfg.from_dict(d)
    out.auto_map = {"AutoConfig": f"secateur_hetero.{h_cfg.__name__}",
                    hetero.AUTO_CLASSES[stock_cls.__name__]: f"secateur_hetero.{h_mdl.__name__}"}
    out.architectures = [h_mdl.__name__]
    return out, "hetero"


def stock_model_class(model: nn.Module) -> type:
    """The stock class ``model`` is (or extends: a per-layer ``Secateur<Stock>`` model): one of its family's."""
    fam = family_of(model.config)
    known = (ADAPTERS[fam].model_class, *(c for c, _ in ADAPTERS[fam].more_classes))
    return next((c for c in known if isinstance(model, c)), ADAPTERS[fam].model_class)


def save_pruned(model: nn.Module, out_dir: str | os.PathLike, tokenizer=None, overwrite: bool = False,
                extra_files: dict[str, dict | bytes] | None = None) -> dict:
    """Write ``model`` (and ``tokenizer``) to ``out_dir`` atomically; returns ``{"path", "route"}``.
    ``secateur-export.json`` (the route) marks the folder as secateur's, so ``overwrite`` may replace it
    later; ``overwrite`` replaces nothing else (:func:`secateur.safe_write.check_replaceable`).

    ``extra_files``: files to add inside the same atomic folder: JSON documents (e.g.
    ``{"secateur_selection.json": selection.to_dict()}``) or raw bytes (written as they are).
    """
    out = Path(out_dir)
    check_output_dir(out, overwrite)  # before the config search; overwrite replaces only a secateur output
    cfg, route = export_config(model)
    old_cfg, arch = model.config, cfg.architectures
    with atomic_dir(out, overwrite, need=export_size(model)) as tmp:
        model.config = cfg
        try:
            model.save_pretrained(tmp)
        finally:
            model.config = old_cfg
        cfg.architectures = arch or [type(model).__name__]  # save_pretrained writes the in-memory class
        cfg.save_pretrained(tmp)
        if route == "hetero":
            (tmp / "secateur_hetero.py").write_text(hetero.standalone_source(family_of(cfg), stock_model_class(model)))
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        (tmp / EXPORT_MARKER).write_text(json.dumps({"route": route, "architectures": cfg.architectures}))
        for name, doc in (extra_files or {}).items():
            if isinstance(doc, bytes):
                (tmp / name).write_bytes(doc)
            else:
                (tmp / name).write_text(json.dumps(doc, indent=1))
    return {"path": str(out), "route": route}


def save_structured(model: nn.Module, tokenizer, out, report: dict, extra_files: dict[str, bytes] | None = None,
                    overwrite: bool = False) -> dict:
    """Write a sliced model with :func:`save_pruned` (stock config when every layer has the same widths, else the
    heterogeneous classes; one ``from_pretrained(dir)`` reloads it), plus ``secateur-report.json`` and
    ``extra_files``, all in one atomic folder. No masks: the removed units are gone from the tensors."""
    with atomic_dir(out, overwrite, need=export_size(model)) as tmp:
        info = save_pruned(model, tmp / "model", tokenizer)
        for f in sorted((tmp / "model").iterdir()):
            os.replace(f, tmp / f.name)
        (tmp / "model").rmdir()
        for name, data in (extra_files or {}).items():
            if name == "secateur_hetero.py" and (tmp / name).exists():
                continue  # the exporter already wrote the current copy
            (tmp / name).write_bytes(data)
        report["export_route"] = info["route"]
        write_report(tmp, report)
    return {"path": str(out), "route": info["route"]}


def finish_structured_export(folder: str | os.PathLike, model: nn.Module, tokenizer, report: dict,
                             extra_files: dict[str, bytes] | None = None) -> str:
    """Everything of :func:`save_structured`'s folder but the weights, for a block-streamed structured prune
    whose sliced blocks were written to ``folder``'s shards as they were done (``model``: its blocks sliced on
    the meta device): the same config (stock or per-layer, with ``secateur_hetero.py``), generation config,
    tokenizer, export marker, ``extra_files`` and ``secateur-report.json``; returns the route."""
    folder = Path(folder)
    cfg, route = export_config(model)
    arch = cfg.architectures
    cfg.dtype = str(model.dtype).split(".")[1]  # what save_pretrained records
    cfg.architectures = arch or [type(model).__name__]
    cfg.save_pretrained(folder)
    if getattr(model, "generation_config", None) is not None and model.can_generate():
        model.generation_config.save_pretrained(folder)
    if route == "hetero":
        (folder / "secateur_hetero.py").write_text(hetero.standalone_source(family_of(cfg), stock_model_class(model)))
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    (folder / EXPORT_MARKER).write_text(json.dumps({"route": route, "architectures": cfg.architectures}))
    for name, data in (extra_files or {}).items():
        if name == "secateur_hetero.py" and (folder / name).exists():
            continue
        (folder / name).write_bytes(data)
    report["export_route"] = route
    write_report(folder, report)
    return route
