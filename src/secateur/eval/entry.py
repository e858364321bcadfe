"""The evaluation entry points of the API and the CLI (``secateur eval ppl|zeroshot|efficiency``): a model spec,
folder or in-memory model in, the evaluator of :mod:`secateur.eval` run on it (whole or block-streamed, split over
the processes of a ``torch.distributed`` group), a result dict out. ``secateur.api`` re-exports them."""

from __future__ import annotations

import json
import os
import sys

import torch

from secateur.calib.dist import shard
from secateur.data.sources import eval_text
from secateur.data.windows import eval_ids, token_sha256
from secateur.errors import SecateurError
from secateur.eval.ppl import check_ppl_args, perplexity
from secateur.models import loading, streaming
from secateur.models.adapters import get_adapter
from secateur.models.blocks import RESIDENT, Blocks
from secateur.models.loading import check_device, check_seqlen, check_tokenizer
from secateur.models.spec import ModelSpec
from secateur.runinfo import SCHEMA_VERSION, machine, versions
from secateur.safe_write import check_writable_output, write_file_atomic
from secateur.schemas.api import checked_call


def _fspath(value):
    """An ``os.PathLike`` argument as the str path the evaluators take; anything else unchanged."""
    return os.fspath(value) if isinstance(value, os.PathLike) else value


def _model_and_tokenizer(model, tokenizer, dtype: str, device: str):
    """A spec/folder is loaded; an in-memory model needs its tokenizer. Returns (model, tokenizer, name)."""
    if isinstance(model, str):
        loaded, tok = loading.load_model(model, dtype, device)
        return loaded, tok, model
    check_tokenizer(model, tokenizer)
    return model, tokenizer, getattr(model.config, "_name_or_path", "in-memory")


@checked_call
def eval_ppl(model: str | os.PathLike | torch.nn.Module = "smollm2-135m", dataset: str | os.PathLike = "wikitext2",
             seqlen: int = 2048, stride: int | None = None, max_windows: int | None = None,
             data_dir: str | os.PathLike | None = None, tokenizer=None, dtype: str = "float32", device: str = "cpu",
             json_path: str | os.PathLike | None = None, progress: bool = True, stream: bool = False) -> dict:
    """Perplexity of a model spec/folder (or an in-memory model with its tokenizer) on a named corpus.
    ``stream``: the same window loop over a streamed block source, one decoder block in memory at a time over all
    windows (a model folder larger than memory; its memory plan printed and checked first). Called by every process
    of an initialized ``torch.distributed`` group, window ``w`` is scored by rank ``w % N`` and every rank returns the
    same result as one process, bit for bit (rank 0 alone writes ``json_path``). Arguments of the wrong type are one
    line naming them (:func:`~secateur.schemas.api.checked_call`)."""
    model, dataset, data_dir, json_path = (_fspath(v) for v in (model, dataset, data_dir, json_path))
    if json_path is not None:  # an unwritable --json fails now, not after the evaluation
        check_writable_output(json_path, folder=False)
    check_tokenizer(model, tokenizer)
    check_ppl_args(seqlen, stride, max_windows)  # numbers, data, device, context: before the model is loaded
    text = eval_text(dataset, data_dir)
    if stream and not isinstance(model, str):
        raise SecateurError("--stream reads a model folder block by block; this model is already in memory: pass "
                            "its folder, or drop stream=True")
    if isinstance(model, str):
        check_device(device)
        spec = ModelSpec(model, dtype)
        spec.check_seqlen(seqlen)
        model, tokenizer, stream_src = _eval_model(spec, device, stream)
        name = spec.name
    else:
        name = getattr(model.config, "_name_or_path", "in-memory")
        check_seqlen(name, seqlen, model.config.to_dict())
        stream_src = None
    ids = eval_ids(text, tokenizer)
    if ids.numel() < seqlen:
        raise SecateurError(f"evaluation text {dataset} has {ids.numel()} tokens, fewer than one window of --seqlen "
                            f"{seqlen}; use a longer text or a smaller --seqlen")
    plan = None if stream_src is None else _eval_plan(stream_src, ids, seqlen, stride, max_windows)
    split = shard()
    blocks = (RESIDENT if stream_src is None else Blocks(stream_src)).with_shard(split)
    res = perplexity(model, ids, seqlen, stride, max_windows, progress, tokenizer=tokenizer,  # BOS rule: the tokenizer
                     blocks=blocks)
    res.update({"model": name, "dataset": dataset, "tokens_sha256": token_sha256(ids), "versions": versions(),
                "machine": machine(), "schema_version": SCHEMA_VERSION})
    if plan is not None:
        res["memory_plan_bytes"] = plan.total
    if split.split:
        res["processes"] = split.world
    if json_path and split.rank == 0:
        write_file_atomic(json_path, json.dumps(res, indent=2))
    return res


def _eval_model(spec: ModelSpec, device: str, stream: bool
                ) -> tuple[torch.nn.Module, object, streaming.BlockStream | None]:
    """``(model, tokenizer, stream)``: loaded whole (``stream`` None), or built on the meta device with its blocks
    read from the folder when visited (residents loaded once the memory plan fits, :func:`_eval_plan`)."""
    if not stream:
        model, tok = spec.load(device)
        return model, tok, None
    src = streaming.open_streamed(spec.given, spec.dtype, device, folder=spec.local_folder())
    return src.model, src.tokenizer(), src


def _eval_plan(stream: streaming.BlockStream, ids: torch.Tensor, seqlen: int, stride: int | None,
               max_windows: int | None):
    """The streamed evaluation's memory plan, printed and refused when it does not fit (split over processes: each
    rank's, its windows only; rank 0's printed); then the tensors outside the blocks are loaded."""
    from secateur.eval.ppl import window_plan
    from secateur.models.memory import available_bytes, eval_plan, shape_of

    n_windows = len(window_plan(ids.numel(), seqlen, stride)[:max_windows])
    split = shard()  # split over processes: this rank's windows only (window w on rank w % N)
    n_windows = sum(1 for w in range(n_windows) if split.owns(w))
    plan = eval_plan(shape_of(stream.model, get_adapter(stream.model), stream), n_windows, seqlen)
    available = available_bytes()
    print(f"secateur: {plan.describe(available)}", file=sys.stderr)
    plan.check(available)
    stream.load_resident()
    return plan


@checked_call
def eval_zeroshot(model: str | os.PathLike | torch.nn.Module = "smollm2-135m", tasks=None, limit: int | None = None,
                  data_dir: str | os.PathLike | None = None, tokenizer=None, dtype: str = "float32",
                  device: str = "cpu", progress: bool = True) -> dict:
    """The seven-task zero-shot suite (``secateur eval zeroshot``): per-task scores, the mean and its SE."""
    from secateur.eval.zeroshot import evaluate_zeroshot

    model, data_dir = _fspath(model), _fspath(data_dir)

    model, tokenizer, name = _model_and_tokenizer(model, tokenizer, dtype, device)
    res = evaluate_zeroshot(model, tokenizer, tasks=tasks, limit=limit, data_dir=data_dir, progress=progress)
    return res | {"model": name, "versions": versions(), "machine": machine()}


@checked_call
def eval_efficiency(model: str | os.PathLike | torch.nn.Module, dtype: str = "float32", device: str = "cpu",
                    **settings) -> dict:
    """Params, FLOPs/token, peak memory, prefill/decode tokens/s (``secateur eval efficiency``); ``settings``
    go to :func:`secateur.eval.efficiency.measure_efficiency` (prompt_len, new_tokens, repeats, ...)."""
    from secateur.eval.efficiency import measure_efficiency

    model = _fspath(model)

    if isinstance(model, str):
        model, _ = loading.load_model(model, dtype, device)
    return measure_efficiency(model, None, **settings)
