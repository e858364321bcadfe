"""``recover(run_dir, out, ...)``: LoRA recovery of a pruned run, from its folder to a new run folder.

Order (everything the user can get wrong is refused before any weight is read): options; the run folder (report,
kind, masks file, config and weight files); the output folders; device, dtype, context; the teacher's spec and files;
the training text; the memory plan (printed, refused when it does not fit). Then: load the student (the run, one
``load_model`` call, per-layer widths included) and the teacher, draw the windows (:mod:`secateur.recovery.data`),
attach the adapters (:mod:`secateur.recovery.lora`), train (:mod:`secateur.recovery.train`, checkpointed), merge,
re-apply the masks of a masked run, write the output (:mod:`secateur.recovery.output`) and remove the checkpoint.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from secateur.errors import SecateurError
from secateur.recovery.options import RecoverOptions, command_line


@dataclass(frozen=True)
class RecoverResult:
    """What :func:`recover` returns: the output's ``report`` (as written to ``secateur-report.json``), the merged
    ``model`` and its ``tokenizer``."""

    report: dict
    model: torch.nn.Module
    tokenizer: object


def recover(run_dir: str, out: str | None = None, *, command: str | None = None, **kwargs) -> RecoverResult:
    """Recover the pruned run ``run_dir`` (a ``secateur prune --out`` folder) with LoRA adapters distilled from its
    dense teacher, merged into its weights and written to ``out`` (see :class:`RecoverOptions` for the keywords:
    ``teacher``, ``rank``, ``alpha``, ``dropout``, ``loss``, ``topk``, ``data``, ``tokens``, ``seqlen``, ``batch``,
    ``lr``, ``warmup``, ``seed``, ``checkpoint_every``, ``resume``, ``save_adapter``, ...)."""
    from secateur.safe_write import output_lock

    opts = RecoverOptions.from_kwargs(run_dir, out=out, **kwargs).validate()
    with output_lock(opts.out), output_lock(opts.save_adapter):  # one output, one writer, for the whole run
        return _run(opts, command or command_line(opts))


def _log(msg: str) -> None:
    print(f"secateur: {msg}", file=sys.stderr)


def _checks(opts: RecoverOptions):
    """Every check before loading: ``(run, recipe, teacher spec and how found (or None), documents, plan)``."""
    from secateur.extras import require

    require("peft", "secateur recover")
    from secateur.models.loading import check_device, check_model, check_seqlen, parse_dtype
    from secateur.recovery.data import load_documents
    from secateur.recovery.output import check_adapter_dest
    from secateur.recovery.runfolder import open_run, read_recipe
    from secateur.recovery.teacher import teacher_spec
    from secateur.safe_write import check_output_dir

    check_device(opts.device)
    parse_dtype(opts.dtype)
    run = open_run(opts.run_dir)
    check_output_dir(opts.out, opts.overwrite, protect=[opts.run_dir])
    from secateur.calib.resume import checkpoint_dir, refuse_link

    refuse_link(checkpoint_dir(opts.out), opts.out)
    if opts.save_adapter is not None:
        check_output_dir(opts.save_adapter, False, protect=[opts.run_dir]) if not Path(opts.save_adapter).exists() \
            else check_adapter_dest(opts.save_adapter, opts.overwrite)
    check_seqlen(opts.run_dir, opts.seqlen, run.config)
    recipe = read_recipe(run)
    teacher = None
    if opts.loss == "kl" or opts.data == "self":
        teacher = teacher_spec(run.report, recipe, opts.teacher)
        check_seqlen(teacher[0], opts.seqlen, check_model(teacher[0]))
    docs = load_documents(opts.data, opts.data_dir)
    return run, recipe, teacher, docs


def _plan(opts: RecoverOptions, run, teacher):
    from secateur.models.adapters import ADAPTERS
    from secateur.models.hetero import base_model_type
    from secateur.models.loading import parse_dtype, resolve
    from secateur.models.memory import available_bytes
    from secateur.recovery.plan import folder_params, lora_params, recovery_plan

    cfg = run.config or {}
    fam = ADAPTERS[base_model_type(cfg.get("model_type", ""))]
    student = folder_params(run.path) or 0
    t_params, note = None, ""
    if teacher is not None:
        t_params = folder_params(resolve(teacher[0], opts.dtype)[0])
        note = "" if t_params is not None else " (not a local folder: the student's size counted)"
    elem = torch.empty((), dtype=parse_dtype(opts.dtype)).element_size()
    n_lora = lora_params(run.path, [name for name, _ in fam.projections], opts.rank)
    plan = recovery_plan(cfg, student, t_params, note, n_lora, elem, opts.batch, opts.seqlen, opts.topk,
                         teacher is not None and opts.loss == "kl", opts.windows + opts.heldout_windows)
    available = available_bytes()
    _log(plan.describe(available))
    plan.check(available)
    # the disk, before any step: the output (the run's tensors at --dtype, its masks) and the training checkpoint
    # (adapters, two AdamW moments and their copy: 16 B per LoRA parameter), written before the output is
    from secateur.safe_write import MASKS_NAME, check_free_space

    masks = run.path / MASKS_NAME
    need = student * elem + (masks.stat().st_size if masks.is_file() else 0) + 16 * n_lora + (1 << 20)
    check_free_space(opts.out, need, " and its checkpoint")
    return plan, available


def _vocab(model) -> int:
    return int(model.get_output_embeddings().weight.shape[0])


def _run(opts: RecoverOptions, command: str) -> RecoverResult:
    from secateur.calib import resume
    from secateur.recovery import lora
    from secateur.recovery.data import recovery_windows
    from secateur.recovery.loss import mean_loss
    from secateur.recovery.train import fingerprint, train

    t0 = time.perf_counter()
    run, recipe, teacher_found, docs = _checks(opts)
    plan, available = _plan(opts, run, teacher_found)
    model, tok, teacher = _models(opts, teacher_found)
    train_ids, held, manifest = recovery_windows(docs, tok, opts.windows, opts.seqlen, opts.seed,
                                                 opts.heldout_windows, opts.data, teacher)
    train_ids, held = train_ids.to(opts.device), None if held is None else held.to(opts.device)
    masks = run.masks() if run.masked else None
    conv1d = bool(getattr(getattr(_adapter(model), "layout", None), "conv1d", False))
    if masks:
        from secateur.safe_write import MASKS_NAME

        # the run's weights are zero where its masks say (else: not its masks)
        lora.realized(model, masks, conv1d, source=str(run.path / MASKS_NAME))
    pm, names, roles = lora.attach(model, opts.rank, opts.alpha, opts.dropout, opts.seed)

    def heldout(m) -> float | None:
        return None if held is None else mean_loss(m, held, opts.loss, teacher, opts.topk, opts.batch)

    def heldout_ppl(m) -> float:  # the recovery curve's measure: next-token perplexity of the held-out windows
        return math.exp(mean_loss(m, held, "ce", None, opts.topk, opts.batch))

    held_pruned = heldout(pm)
    ckpt = resume.Checkpoint.open(opts.out, fingerprint(opts, opts.run_dir, teacher_found and teacher_found[0],
                                                        manifest["sha256"]), opts.resume)
    try:
        result = train(pm, train_ids, opts, teacher, ckpt, probe=None if held is None else heldout_ppl)
        held_adapters = heldout(pm)
        adapter = lora.adapter_params(pm)
        adapter_sha, n_adapter = lora.tensors_sha256(adapter), sum(p.numel() for p in adapter.values())
        info = {"run": str(Path(opts.run_dir).name), "adapter_sha256": adapter_sha, "command": command}
        with lora_output(pm, opts, info):
            merged, mask_info, held_output = _merge(pm, masks, conv1d, run, heldout)
            report = _report(opts, run, teacher_found, manifest, result, names, roles, n_adapter, adapter_sha,
                             mask_info, (held_pruned, held_adapters, held_output), plan, available, command, t0)
            from secateur.recovery.output import save_output

            save_output(merged, tok, run, opts.out, report, masks, opts.overwrite)
    except SecateurError as e:
        if not isinstance(e, resume.CheckpointError):
            ckpt.remove()
        raise
    except BaseException:
        if ckpt.saved:
            _log(ckpt.describe())
        else:
            ckpt.remove()
        raise
    ckpt.remove()
    return RecoverResult(report, merged, tok)


def _models(opts: RecoverOptions, teacher_found):
    """``(student, tokenizer, teacher or None)``: the run loaded, and the teacher frozen with the run's vocabulary."""
    from secateur.models.loading import load_model

    model, tok = load_model(opts.run_dir, opts.dtype, opts.device)
    if teacher_found is None:
        return model, tok, None
    teacher, _ = load_model(teacher_found[0], opts.dtype, opts.device)
    teacher.requires_grad_(False)
    if _vocab(teacher) != _vocab(model):
        raise SecateurError(f"teacher {teacher_found[0]} has a vocabulary of {_vocab(teacher)}, the run "
                            f"{opts.run_dir} {_vocab(model)}; pass --teacher the dense model it was pruned from")
    return model, tok, teacher


def _merge(pm, masks, conv1d: bool, run, heldout):
    """``(merged model, mask record, held-out loss of the output)``: the adapters merged; a masked run's masks
    re-applied exactly (the held-out loss before re-masking measures what the discarded delta cost) and its
    realized sparsity checked against the run's."""
    from secateur.recovery import lora

    merged, delta = lora.merge(pm, masks, conv1d)
    mask_info = None
    if masks:
        held_unmasked = heldout(merged)
        lora.remask(merged, masks, conv1d)
        rs = lora.realized(merged, masks, conv1d)
        _same_sparsity(rs, run.report.get("realized_sparsity"))
        mask_info = {"reapplied": True, **(delta or {}), "realized_sparsity": rs,
                     "heldout_before_remask": held_unmasked}
    return merged, mask_info, heldout(merged)


def _adapter(model):
    from secateur.models.adapters import get_adapter

    return get_adapter(model)


def lora_output(pm, opts: RecoverOptions, info: dict):
    from secateur.recovery.output import adapter_folder

    return adapter_folder(pm, opts.save_adapter, opts.overwrite, info)


def _same_sparsity(rs: dict, run_rs) -> None:
    if not isinstance(run_rs, dict):
        return
    for k in ("pruned_weights", "targeted_weights"):
        if run_rs.get(k) is not None and run_rs[k] != rs[k]:
            raise RuntimeError(f"realized sparsity after re-masking differs from the run's ({k}: {rs[k]} != "
                               f"{run_rs[k]})")


def _report(opts, run, teacher_found, manifest, result, names, roles, n_adapter, adapter_sha, mask_info, held, plan,
            available, command, t0) -> dict:
    import copy

    from secateur.models.digest import local_digest
    from secateur.runinfo import peak_rss_mb, portable, versions

    losses = result["losses"]
    settings = {k: getattr(opts, k) for k in ("rank", "alpha", "dropout", "loss", "topk", "tokens", "seqlen", "batch",
                                              "epochs", "lr", "warmup", "weight_decay", "seed", "dtype")}
    settings |= {"targets": roles, "adapted_modules": len(names), "adapter_params": n_adapter, "optimizer": "AdamW",
                 "schedule": "cosine, linear warmup"}
    teacher = None
    if teacher_found is not None:
        spec, how = teacher_found
        with_digest = local_digest(spec) if Path(spec).exists() else None
        teacher = {"spec": portable(spec), "found": how, "sha256": with_digest}
    metric = "kl_topk" if opts.loss == "kl" else "nll"
    manifest = dict(manifest, source=portable(manifest["source"]), tokenizer=portable(manifest["tokenizer"]))
    rec = {
        "method": "lora-distillation" if opts.loss == "kl" else "lora-ce",
        "run": portable(opts.run_dir), "command": command, "settings": settings, "teacher": teacher,
        "data": manifest, "steps": result["steps"], "resumed_from_step": result["resumed_from"],
        "loss": {"first": losses[0], "last": losses[-1], "per_step": losses},
        "curve": {"measure": "heldout_ppl", "windows": manifest["heldout"]["windows"], "every": opts.heldout_every,
                  "points": result["curve"]} if result.get("curve") else None,
        "adapter_sha256": adapter_sha,
        "heldout": None if held[0] is None else {"metric": metric, "windows": manifest["heldout"]["windows"],
                                                 "pruned": held[0], "adapters": held[1], "output": held[2]},
        "masks": mask_info,
        "memory_plan": {"total_bytes": plan.total, "available_bytes": available,
                        "terms": {k: {"bytes": b, "formula": f} for k, (b, f) in plan.terms.items()}},
        "wall_s": time.perf_counter() - t0, "train_s": result["wall_s"], "peak_rss_mb": peak_rss_mb(),
        "versions": versions(),
    }
    report = copy.deepcopy(run.report)
    rec["prune_peak_rss_mb"] = report.get("peak_rss_mb")
    report["recovery"] = rec
    return report
