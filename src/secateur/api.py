"""Python API: the same names as the CLI.

>>> from secateur import api
>>> report = api.prune(model="smollm2-135m", method="wanda", sparsity=0.5, calib="c4", nsamples=128,
...                    seqlen=2048, seed=0, out="out/wanda50")
>>> api.eval_ppl(model="out/wanda50", dataset="wikitext2", max_windows=8)
"""

from __future__ import annotations

import contextlib
import shlex
import sys
from dataclasses import dataclass

import torch

from secateur import stall
from secateur.calib import resume as _resume
from secateur.calib.dist import shard as shard
from secateur.data.sources import eval_text
from secateur.data.windows import calibration_set
from secateur.errors import SecateurError
from secateur.eval.entry import eval_efficiency as eval_efficiency
from secateur.eval.entry import eval_ppl as eval_ppl
from secateur.eval.entry import eval_zeroshot as eval_zeroshot
from secateur.eval.ppl import check_ppl_args
from secateur.export.card import base_license, card_files
from secateur.export.hf import export_size
from secateur.export.outputs import SavedAtEnd, StreamedOutput, WrittenByRankZero
from secateur.export.shards import Spec
from secateur.methods.registry import METHODS
from secateur.methods.result import PruneResult as PruneResult
from secateur.methods.unstructured import parse_pattern
from secateur.models import streaming
from secateur.models.adapters import Adapter, get_adapter
from secateur.models.blocks import ALONE, Blocks, BlockSource, ResidentSource, Shard
from secateur.models.memory import Shape
from secateur.models.spec import ModelSpec
from secateur.options import STREAM_REFUSED as STREAM_REFUSED
from secateur.options import STREAMABLE as STREAMABLE
from secateur.options import PruneOptions as PruneOptions
from secateur.options import RunSettings as RunSettings
from secateur.options import check_recipe_calibration, check_recipe_model
from secateur.options import options_from_recipe as options_from_recipe
from secateur.options import recipe_of as recipe_of
from secateur.recovery import RecoverResult as RecoverResult
from secateur.recovery import recover as recover
from secateur.runinfo import SCHEMA_VERSION, Timer, machine, peak_rss_mb, portable, portable_source, versions
from secateur.safe_write import check_free_space, output_lock


def realized_sparsity(model: torch.nn.Module, masks: dict[str, torch.Tensor]) -> dict:
    per = {k: float(m.float().mean()) for k, m in masks.items()}
    pruned = sum(int(m.sum()) for m in masks.values())
    total = sum(m.numel() for m in masks.values())
    n_params = sum(p.numel() for p in model.parameters())
    return {"targeted": pruned / total if total else 0.0, "of_all_parameters": pruned / n_params,
            "pruned_weights": pruned, "targeted_weights": total, "per_module": per}


def prune(**kwargs) -> PruneResult:
    """Prune a model; return a :class:`PruneResult` (its report is also written to ``out/secateur-report.json``
    when ``out`` is set).

    ``model``: a name, folder or ``.gguf`` file, or an already loaded model with its ``tokenizer`` (pruned in
    place; its model-file checks are skipped). The method's knobs are plain keywords (``compensation="coec",
    coec_rounds=2``; see ``secateur prune --help``), or pass a ready ``options=PruneOptions(...)``.

    One sequence for every run: checks -> the block source (the model loaded whole, or ``stream``: built on the
    meta device, its memory plan printed and checked) -> the output and its block sink (free space; streamed: the
    shards, written as blocks finish) -> calibration set -> recipe check -> run -> report -> card -> save ->
    checkpoint removal (resident runs checkpoint for ``--resume``; streamed ones do not).

    Called by every process of an initialized ``torch.distributed`` group (``secateur prune --procs N``, torchrun),
    the run is split over them (:func:`shard`: chunks of calibration windows and evaluation windows) with the same
    result as one process, bit for bit; rank 0 alone writes the output (:mod:`secateur.calib.dist`). Streamed, every
    rank streams the blocks and prints its own memory plan (through rank 0); rank 0's sink writes the shards, the
    others' write nothing. Checkpointed, rank 0 writes the blocks and each rank its chunks' hidden states
    (:mod:`secateur.calib.resume`)."""
    opts = _options(kwargs)
    split = shard()
    if split.split:
        opts.check_split()
    with output_lock(opts.out if split.rank == 0 else None):  # one output, one writer: for the run's whole life
        if opts.towers is not None:
            from secateur.extras import require
            from secateur.vlm_run import prune_tower

            require("PIL", "pruning a vision-language model")

            return prune_tower(opts, split, _prune)
        return _prune(opts, split)


def _prune(opts: PruneOptions, split: Shard, calibration: tuple | None = None) -> PruneResult:
    spec = ModelSpec(opts.model, opts.dtype)  # resolved once; every later stage reads it
    method = METHODS[opts.method]
    _check_modality(opts, spec, method)
    _check_eval(opts, spec)
    needs_calibration = method.needs_calibration or opts.method_options.needs_calibration
    timer = Timer()
    run = _open(opts, spec, method, needs_calibration, timer)
    if method.check is not None:  # e.g. a RoPE model for corp-qk, an unreachable structured target
        method.check(run.adapter, opts)
    output = _output(opts, method, run, needs_calibration, split)
    run.ready(timer)
    # ``calibration``: a caller's own (inputs, manifest) (a VLM's language tower: merged image + caption embeddings)
    ids, manifest = calibration if calibration is not None and needs_calibration else \
        _calibration(opts, run, needs_calibration, timer)
    if split.split and ids is not None:  # every rank calibrates on rank 0's tokens (the same by construction)
        from secateur.calib.dist import broadcast

        ids = broadcast(ids, 0)
    ckpt = None if output.streamed else _checkpoint(opts, run.model, manifest, split)
    with output.opened():  # streamed: the atomic output folder, written during the run
        if split.split and output.streamed and opts.eval_ppl:
            _share_folder(output, split)
        with timer("prune"):
            result = _run_checkpointed(method, run, ids, opts, ckpt, Blocks(run.source, output.sink, split))
        with _kept_on_interrupt(ckpt):  # the final save: an interruption names the checkpoint it leaves
            report = _finish(opts, method, run, output, result, manifest, timer, split)
    report["timings"]["phases"] = timer.phases
    report["peak_rss_mb"] = peak_rss_mb()  # the process's peak so far (the file's: read once its weights were written)
    if ckpt is not None:  # the output is in place: the checkpoint has served
        if split.split:  # every rank is done reading it
            from secateur.calib.dist import barrier

            barrier()
        ckpt.remove()  # by rank 0
    return PruneResult(report, run.model, run.tokenizer)


def _share_folder(output, split: Shard) -> None:
    """``--stream --eval-ppl`` split over processes: every rank evaluates rank 0's (temporary) output folder once it
    is saved, so every rank must see it; checked now, before the prune, and refused in one line when a rank (on
    another machine) does not."""
    from pathlib import Path

    from secateur.calib.dist import agree, broadcast

    folder = Path(broadcast(str(output.folder) if split.rank == 0 else None, 0))
    if split.rank > 0:
        output.folder = folder
    agree(None if folder.is_dir() else
          f"rank {split.rank} does not see rank 0's output folder {folder}, which --stream --eval-ppl evaluates "
          "(several machines without a shared --out); drop --eval-ppl and run secateur eval ppl --model OUT --stream "
          f"--procs {split.world} on the output afterwards, or put --out on a filesystem every process sees")


def _options(kwargs: dict) -> PruneOptions:
    """The run's validated options from ``prune``'s keywords (``options=``, ``recipe=`` or plain keywords), a
    recipe's model checked (and found by its digest) before anything reads the model spec."""
    opts = kwargs.pop("options", None)
    recipe = kwargs.pop("recipe", None)
    if opts is not None and (kwargs or recipe is not None):
        extra = sorted(kwargs) + (["recipe"] if recipe is not None else [])
        raise SecateurError(f"pass either options= or keywords, not both (got {', '.join(extra)})")
    if recipe is not None:
        opts = options_from_recipe(recipe, **kwargs)
    opts = opts or PruneOptions.from_kwargs(**kwargs)
    opts.validate()
    check_recipe_model(opts)  # before anything reads the model spec: a portable name may resolve to a local path
    return opts


@dataclass
class _Run:
    """The model a run prunes and its block source: loaded whole (:class:`ResidentSource`), or built on the meta
    device with each block read from the files when visited (``stream``: the :class:`BlockStream`; ``shape`` and
    ``plan``: its memory plan's model shape and report entry)."""

    spec: ModelSpec
    model: torch.nn.Module
    tokenizer: object
    adapter: Adapter
    source: BlockSource
    stream: streaming.BlockStream | None = None
    shape: Shape | None = None
    plan: dict | None = None

    def ready(self, timer: Timer) -> None:
        """Streamed: the tensors outside the blocks loaded (an untied head is not: no prune computes logits, it
        goes file to file) and the tokenizer read; a resident model is ready already."""
        if self.stream is not None:
            with timer("load"):
                self.stream.load_resident(defer_head=True)
                self.tokenizer = self.stream.tokenizer()


def _open(opts: PruneOptions, spec: ModelSpec, method, needs_calibration: bool, timer: Timer) -> _Run:
    """The run's model and block source: the model files checked (family, shipped code, weight files, context)
    before any weight is read, then loaded whole, or (``--stream``) built on the meta device with its memory plan
    printed and refused when it does not fit; an in-memory model is used as it is (its context checked)."""
    if spec.in_memory:
        if needs_calibration:
            spec.check_seqlen(opts.seqlen)
        with timer("load"):
            return _Run(spec, opts.model, opts.tokenizer, get_adapter(opts.model), ResidentSource())
    cfg = spec.config
    if needs_calibration:
        spec.check_seqlen(opts.seqlen)
    if opts.stream:
        with timer("load"):
            stream = streaming.open_streamed(opts.model, opts.dtype, opts.device, folder=spec.local_folder())
        run = _Run(spec, stream.model, None, get_adapter(stream.model), stream, stream)
        run.shape, run.plan = _stream_plan(opts, method, needs_calibration, stream, run.adapter)
        return run
    if opts.method in STREAMABLE and cfg:
        _check_whole_memory(opts, spec, cfg, needs_calibration)
    with timer("load"):
        model, tok = spec.load(opts.device)
        return _Run(spec, model, tok, get_adapter(model), ResidentSource())


def _output(opts: PruneOptions, method, run: _Run, needs_calibration: bool, split: Shard = ALONE
            ) -> SavedAtEnd | StreamedOutput | WrittenByRankZero:
    """Where the pruned model goes, its size known now rather than after the prune: a resident run's folder is
    written at the end (the free space checked now: sliced models at least the kept share, with the checkpoint
    beside ``--out``, which holds every pruned block until the export is in place); a streamed run's shards are
    planned from the dense tensors (structured: at least the kept share; unstructured: every weight + the masks)
    and written as blocks finish (split over processes: by rank 0; the other ranks' sinks write nothing)."""
    structured = method.kind == "structured"
    if run.stream is not None and split.rank > 0:
        return WrittenByRankZero()
    if run.stream is not None:
        specs = [Spec(k, t.dtype, tuple(t.shape)) for k, t in streaming.saved_tensors(run.model).items()]
        dense = sum(s.nbytes for s in specs)
        need = int(dense * (1 - opts.sparsity)) if structured else dense + run.shape.prunable // 8
        return StreamedOutput(opts.out, opts.overwrite, structured, need, specs, run.stream.resident_items)
    if opts.out:
        keep = 1.0 - opts.sparsity if structured else 1.0
        ckpt_bytes = (_resume.size_estimate(run.model, opts.nsamples, run.adapter.sample_tokens(opts.seqlen))
                      if needs_calibration else 0)
        check_free_space(opts.out, export_size(run.model, keep=keep) + ckpt_bytes,
                         f" (with its checkpoint, about {ckpt_bytes / 2**20:.0f} MB)" if ckpt_bytes else "")
    return SavedAtEnd(opts.out, opts.overwrite, structured)


def _calibration(opts: PruneOptions, run: _Run, needs_calibration: bool, timer: Timer):
    """``(ids, manifest)``: the calibration set checked against a recipe's digest (``(None, None)`` without one)."""
    if not needs_calibration:
        return None, None
    with timer("calibration_data"):
        if run.adapter.modality == "vision":
            from secateur.data.images import calibration_images

            ids, manifest = calibration_images(opts.calib, run.tokenizer, run.model.config, opts.nsamples, opts.seed,
                                               opts.data_dir)
        else:
            ids, manifest = calibration_set(opts.calib, run.tokenizer, opts.nsamples, opts.seqlen, opts.seed,
                                            opts.data_dir, model=run.model)
    check_recipe_calibration(opts, manifest)
    stall.point("calibration")
    return ids, manifest


def _finish(opts: PruneOptions, method, run: _Run, output, result, manifest, timer: Timer,
            split: Shard = ALONE) -> dict:
    """The report, ``--eval-ppl`` and the output folder (split over processes: written by rank 0 alone, the report
    saying ``processes`` and every rank's peak RSS so far, ``peak_rss_mb_per_rank``). A resident model is evaluated
    in memory before the save; a streamed one's pruned blocks are in the (temporary) output folder only, so it is
    evaluated block by block there after the save (split: by every rank, windows split), then its card and report
    are written again with the perplexity."""
    report = _report(opts, run.spec, method, run.model, result, manifest, timer)
    if split.split:
        from secateur.calib.dist import gather_objects

        report["processes"] = split.world
        # every rank's peak so far (the prune done; rank 0's own save comes after): rank r's at index r
        report["peak_rss_mb_per_rank"] = gather_objects(peak_rss_mb())
    if run.plan is not None:
        report["memory_plan"] = run.plan
    if opts.eval_ppl and not output.streamed:
        report["perplexity"] = [_eval_entry(_eval_pruned(opts, run.model, run.tokenizer, timer))]
    if opts.out and split.rank == 0:
        files = result.extra_files | _card_files(opts, report)
        stall.point("save")
        with timer("save"):
            output.save(run.model, run.tokenizer, report, result.masks, files)
    if opts.eval_ppl and output.streamed:
        if split.split:  # rank 0's folder is saved: every rank evaluates it, its windows split
            from secateur.calib.dist import barrier

            barrier()
        report["perplexity"] = [_eval_entry(_eval_pruned(opts, str(output.folder), None, timer))]
        if split.rank == 0:
            output.rewrite(report, _card_files(opts, report))
    return report


def _eval_pruned(opts: PruneOptions, model, tokenizer, timer: Timer) -> dict:
    """``--eval-ppl`` of the pruned model: in memory, or (a folder) read block by block as it was streamed."""
    with timer("eval_ppl"):
        return eval_ppl(model, opts.eval_ppl, seqlen=_eval_seqlen(opts), max_windows=opts.eval_windows,
                        data_dir=opts.data_dir, tokenizer=tokenizer, dtype=opts.dtype, device=opts.device,
                        progress=not opts.run.quiet, stream=isinstance(model, str))


def _stream_plan(opts: PruneOptions, method, needs_calibration: bool, stream: streaming.BlockStream,
                 adapter: Adapter) -> tuple[Shape, dict]:
    """``(shape, report entry)``: the streamed prune's memory plan, printed, and refused when it does not fit.

    Split over processes, the plan is each rank's: its activations are those of the windows of its own chunks
    (chunk ``c`` of ``--chunk-size`` windows on rank ``c % N``), plus the merge of the statistics (a chunk's
    contribution and the one being merged). Rank 0 prints every rank's plan (the others print nothing), and the
    plans of the ranks on one machine must fit in its memory together: refused on every rank otherwise."""
    from secateur.compensate import solver_matrices
    from secateur.methods.structured import selection_kinds
    from secateur.models.memory import available_bytes, current_rss, prune_plan, shape_of, structured_prune_plan

    split = shard()
    windows = _rank_windows(opts.nsamples, opts.run.chunk_size, split) if needs_calibration else 0
    shape = shape_of(stream.model, adapter, stream)
    tokens = adapter.sample_tokens(opts.seqlen)
    if method.kind == "structured":  # the terms each stage declares: the score's statistics, the solver's matrices
        cfg = method.config(opts)
        solver = None if cfg.compensation == "none" else (cfg.compensation, solver_matrices(cfg.compensation))
        plan = structured_prune_plan(shape, windows, tokens, opts.run.chunk_size, bool(selection_kinds(cfg)), solver)
    else:
        terms = method.memory(shape, method.config(opts)) if method.memory else {}
        plan = prune_plan(shape, terms, needs_calibration, windows, tokens, opts.run.chunk_size, opts.run.mode)
    available = available_bytes()
    # the process's own memory when it planned: the plan counts what the run adds on top (peak <= rss + total)
    entry = {"total_bytes": 0, "available_bytes": available, "rss_bytes_at_plan": current_rss(), "terms": {}}
    if split.split:
        if needs_calibration and "statistics" in plan.terms:
            plan.add("merge", 2 * plan.terms["statistics"][0], "2 x statistics (a chunk's contribution and the one "
                     "being merged)")
        plan.what += f" ({windows} of the {opts.nsamples} windows: this rank's chunks)"
        _check_rank_plans(plan, available, split, entry)
    else:
        print(f"secateur: {plan.describe(available)}", file=sys.stderr)
        plan.check(available)
    entry |= {"total_bytes": plan.total, "terms": {k: {"bytes": b, "formula": f} for k, (b, f) in plan.terms.items()}}
    return shape, entry


def _rank_windows(nsamples: int, chunk: int, split: Shard) -> int:
    """Calibration windows this rank embeds and carries: those of its chunks (chunk ``c`` on rank ``c % N``)."""
    return sum(min(chunk, nsamples - s) for c, s in enumerate(range(0, nsamples, chunk)) if split.owns(c))


def _check_rank_plans(plan, available: int | None, split: Shard, entry: dict) -> None:
    """Every rank's plan printed by rank 0 (the other ranks print nothing), then checked per machine: the ranks
    that share one must fit in its memory together; every rank refuses when one machine does not fit."""
    import socket

    from secateur.calib.dist import agree, gather_objects
    from secateur.models.memory import _gb

    host = socket.gethostname()
    plans = gather_objects({"rank": split.rank, "host": host, "line": plan.describe(available),
                            "total": plan.total, "available": available, "rss_at_plan": entry["rss_bytes_at_plan"]})
    if split.rank == 0:
        for p in plans:
            print(f"secateur: rank {p['rank']} ({p['host']}): {p['line']}", file=sys.stderr)
    entry["ranks"] = [{k: p[k] for k in ("rank", "host", "total", "available", "rss_at_plan")} for p in plans]
    same = [p for p in plans if p["host"] == host]
    need = sum(p["total"] for p in same)
    avail = [p["available"] for p in same if p["available"] is not None]
    error = None
    if avail and need > min(avail):
        ranks = ", ".join(str(p["rank"]) for p in same)
        error = (f"not enough memory for the streamed prune on {host}: its {len(same)} processes (ranks {ranks}) need "
                 f"about {_gb(need)} together (the memory plans above), {_gb(min(avail))} is available; run fewer "
                 f"--procs on it, or {plan.fix}")
    agree(error)


def _report(opts: PruneOptions, spec: ModelSpec, method, model, result, manifest, timer: Timer) -> dict:
    """The run's report (``secateur-report.json``); adds the method's figures to ``result.extra_files``."""
    result.extra_files |= _figures(result.details)
    calibration = manifest.to_dict() if manifest else None
    if calibration:
        calibration["tokenizer"] = portable(calibration.get("tokenizer"))
        calibration["source"] = portable(calibration.get("source"))
    options = opts.to_dict()
    pattern = parse_pattern(options["pattern"])  # an N:M method's pattern sets the target
    for k in ("model", "out", "data_dir", "calib"):  # published: no absolute path of this machine
        options[k] = portable(options.get(k))
    return {
        "schema_version": SCHEMA_VERSION, "method": opts.method, "kind": method.kind,
        "model": portable(opts.model_name), "modality": get_adapter(model).modality, "loads_with": _loads_with(model),
        "base_license": base_license(opts.model_name),  # read from the model's own folder (its card, config)
        # GGUF input: file (by name), sha256, cached folder (by name); else None
        "model_source": None if opts.in_memory else portable_source(spec.source),
        "target_sparsity": (1 - pattern[0] / pattern[1]) if pattern else opts.sparsity,
        "pattern": options["pattern"],
        "options": options,
        "realized_sparsity": result.details.get("realized_sparsity") or realized_sparsity(model, result.masks),
        "calibration": calibration,
        "timings": {"phases": timer.phases, "engine": result.timings},
        "peak_rss_mb": peak_rss_mb(), "versions": versions(), "machine": machine(), "details": result.details,
    }


def _card_files(opts: PruneOptions, report: dict) -> dict[str, bytes]:
    """The folder's model card and recipe (:mod:`secateur.export.card`), naming files portably: an absolute path
    of this machine by its last component. The recipe's model is tied to its content by ``check.model_sha256``
    (a replay here finds it again by that digest; elsewhere it takes ``--model``); a calibration text or data
    folder keeps the path the user gave in the recipe (the calibration tokens' digest checks what it holds)."""
    recipe = recipe_of(opts, report)
    command = opts.command_line()
    for k in ("model", "calib", "data_dir", "out"):
        v = opts.model_name if k == "model" else getattr(opts, k)
        if isinstance(v, str) and portable(v) != v:
            if k == "model" and recipe.get("check", {}).get("model_sha256"):
                recipe[k] = portable(v)
            command = command.replace(shlex.quote(v), shlex.quote(portable(v)))
    return card_files(report, recipe, command)


def _eval_seqlen(opts: PruneOptions) -> int:
    return min(opts.seqlen, 2048)


def modality_of(spec: ModelSpec) -> str:
    """``text`` or ``vision``: the modality of the spec's family (read from its config: nothing is loaded)."""
    from secateur.models.families import family_class

    if spec.in_memory:
        return get_adapter(spec.given).modality
    cfg = spec.config or {}
    fam = family_class(cfg.get("model_type"))
    return fam.modality if fam is not None else "text"


def _check_modality(opts: PruneOptions, spec: ModelSpec, method) -> None:
    """What a vision encoder cannot take, before anything is loaded: a text-only method, text calibration,
    perplexity, streaming (not yet)."""
    if modality_of(spec) != "vision":
        return
    from secateur.data.images import check_image_source

    if method.text_only:
        raise SecateurError(f"--method {method.name} does not apply to a vision model: {method.text_only}")
    needs_calibration = method.needs_calibration or opts.method_options.needs_calibration
    if needs_calibration:
        check_image_source(opts.calib, opts.data_dir)
    if opts.eval_ppl:
        raise SecateurError("--eval-ppl measures next-token perplexity, which a vision model has no head for; "
                            "drop it and run secateur eval accuracy --model OUT afterwards")


def _check_eval(opts: PruneOptions, spec: ModelSpec) -> None:
    """``eval_ppl``'s corpus, window count and context, before anything is loaded."""
    if opts.eval_windows is not None and not opts.eval_ppl:
        raise SecateurError("--eval-windows limits --eval-ppl; pass --eval-ppl DATASET too")
    if not opts.eval_ppl:
        return
    check_ppl_args(_eval_seqlen(opts), None, opts.eval_windows)
    eval_text(opts.eval_ppl, opts.data_dir)
    if not opts.in_memory:
        spec.check_seqlen(_eval_seqlen(opts), "--seqlen (of --eval-ppl)")


def _eval_entry(res: dict) -> dict:
    """A perplexity measured during the run, as the report and the card record it (with its protocol)."""
    keys = ("dataset", "protocol", "ppl", "windows", "windows_total", "scored_tokens", "tokens_sha256")
    return {k: res.get(k) for k in keys}


def _figures(details: dict) -> dict[str, bytes]:
    """``qk-removal.png`` for a method whose details carry a per-block Q/K allocation (QK-Wanda); nothing
    without matplotlib (extra "plots")."""
    alloc = details.get("allocation")
    if not (isinstance(alloc, dict) and alloc.get("per_block")):
        return {}
    try:
        from secateur.plots import qk_removal_png
    except ImportError:
        return {}
    cfg = details.get("config") or {}
    title = f"{details['method']}, {cfg.get('budget')} budget, {cfg.get('sparsity'):.0%}"
    return {"qk-removal.png": qk_removal_png({details["method"]: alloc}, title=title)}


def _loads_with(model) -> str:
    """The transformers Auto factory that reloads the output (``AutoModelForCausalLM``, a vision classifier's
    ``AutoModelForImageClassification``, a backbone's ``AutoModel``)."""
    from secateur.export.sliced import stock_model_class
    from secateur.models import hetero

    return hetero.AUTO_CLASSES.get(stock_model_class(model).__name__, "AutoModelForCausalLM")


def _sample_tokens(opts: PruneOptions, cfg: dict) -> int:
    """Tokens one calibration sample gives the blocks, from the config alone (before the model is loaded)."""
    from secateur.models.families import family_class

    fam = family_class(cfg.get("model_type"))
    if fam is None or fam.modality == "text":
        return opts.seqlen
    from secateur.models.families.encoder import image_tokens

    return image_tokens(cfg.get("vision_config") or cfg, fam.special_tokens)


def _check_whole_memory(opts: PruneOptions, spec: ModelSpec, cfg: dict, needs_calibration: bool) -> None:
    """A prune of a local model folder (a method ``--stream`` could run) that cannot fit in memory is refused before
    loading, naming ``--stream`` (silent when it fits: the plan is printed only by streamed runs)."""
    from pathlib import Path

    from secateur.models.loading import parse_dtype
    from secateur.models.memory import whole_prune_plan

    folder = Path(spec.location[0])
    if not folder.is_dir() or not any(folder.glob("*.safetensors")):
        return
    elem = torch.empty((), dtype=parse_dtype(opts.dtype)).element_size()
    plan = whole_prune_plan(folder, cfg, elem, needs_calibration, opts.nsamples, _sample_tokens(opts, cfg))
    try:
        plan.check()
    except SecateurError:
        print(f"secateur: {plan.describe()}", file=sys.stderr)
        raise


@contextlib.contextmanager
def _kept_on_interrupt(ckpt: _resume.Checkpoint | None):
    """Ctrl-C / SIGTERM after the prune (evaluation, the final save): the checkpoint holds the whole prune, so it is
    kept and named with its size and both ways out (resume, or delete it)."""
    try:
        yield
    except BaseException as e:
        if ckpt is not None and ckpt.path.exists():
            if isinstance(e, SecateurError):
                ckpt.remove()  # a fixable problem with the output: fixing it changes nothing the prune did
            else:
                print(f"secateur: {ckpt.describe()}", file=sys.stderr)
        raise


def _run_checkpointed(method, run: _Run, ids, opts: PruneOptions, ckpt: _resume.Checkpoint | None,
                      blocks: Blocks):
    """``method.run`` over ``blocks`` with its checkpoint active (None: a streamed run, or nothing to resume): kept
    for ``--resume`` when interrupted, removed when the input was at fault (fixing it changes the run, so the
    checkpoint could never be resumed)."""
    with _resume.active(ckpt):
        try:
            return method.run(run.model, run.adapter, ids, opts, blocks=blocks)
        except SecateurError as e:
            if ckpt is not None and not isinstance(e, _resume.CheckpointError):
                ckpt.remove()
            raise
        except BaseException:  # interrupted (or a crash): keep what is done for --resume
            if ckpt is not None and ckpt.saved:
                print(f"secateur: {ckpt.describe()}", file=sys.stderr)
            elif ckpt is not None:  # nothing checkpointed yet: leave no empty folder behind
                ckpt.remove()
            raise


def _checkpoint(opts: PruneOptions, model: torch.nn.Module, manifest, split: Shard = ALONE
                ) -> _resume.Checkpoint | None:
    """The run's checkpoint beside ``--out`` (written whenever there is an output, so a killed run can be
    resumed; reused only with ``--resume``). Methods without a calibration pass have nothing to resume. Split over
    processes: opened by rank 0, shared by every rank (:meth:`~secateur.calib.resume.Checkpoint.open_shared`)."""
    if not opts.out or manifest is None:
        if opts.resume:
            print(f"secateur: {opts.method} has no calibration pass to resume; running it in full", file=sys.stderr)
        return None
    fp = _resume.fingerprint(opts, model, manifest.sha256)
    if split.split:
        return _resume.Checkpoint.open_shared(opts.out, fp, opts.resume, split.rank)
    return _resume.Checkpoint.open(opts.out, fp, opts.resume)
