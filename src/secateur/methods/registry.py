"""Method registry: each runner composes adapter -> calibration -> stats -> scores -> budget -> compensate
-> materialize, and returns the masks plus details for the report.

A runner is ``fn(model, adapter, calib_ids, opts) -> MethodResult``; ``needs_calibration`` says whether
the CLI must build a calibration set first. New methods register here and nowhere else.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class MethodResult:
    masks: dict[str, torch.Tensor] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    details: dict = field(default_factory=dict)
    extra_files: dict[str, bytes] = field(default_factory=dict)


@dataclass(frozen=True)
class Method:
    name: str
    kind: str  # "unstructured" | "structured"
    needs_calibration: bool
    run: Callable[..., MethodResult]
    help: str
    check: Callable[..., None] | None = None  # check(adapter): refuse a model before calibration data is built


METHODS: dict[str, Method] = {}


def register(method: Method) -> Method:
    METHODS[method.name] = method
    return method


def _unstructured(name: str, help_: str) -> Method:
    def run(model, adapter, calib_ids, opts) -> MethodResult:
        from secateur.methods.unstructured import UnstructuredConfig, parse_targets, prune_unstructured

        cfg = UnstructuredConfig(method=name, sparsity=opts.sparsity, pattern=opts.pattern_nm,
                                 budget=opts.budget, rounding=opts.rounding,
                                 targets=parse_targets(opts.targets))
        chunk = opts.chunk_size
        if calib_ids is not None:  # --segment-len: same independent short sequences as qk-wanda
            from secateur.methods.qk_wanda import segment_calibration

            calib_ids, chunk = segment_calibration(calib_ids, getattr(opts, "segment_len", None), chunk)
        res = prune_unstructured(model, adapter, calib_ids, cfg, mode=opts.mode, chunk_size=chunk,
                                 device=opts.device, progress=not opts.quiet)
        return MethodResult(masks=res.masks, timings=res.timings)

    return Method(name, "unstructured", name != "magnitude", run, help_)


register(_unstructured("magnitude", "|W| per layer (no data)"))
register(_unstructured("wanda", "|W| * ||X|| per output row (Sun et al. 2024)"))
register(_unstructured("sparsegpt", "OBS pruning with reconstruction (Frantar & Alistarh 2023)"))


def _cocurve(name: str, help_: str) -> Method:
    def run(model, adapter, calib_ids, opts) -> MethodResult:
        from secateur.methods.cocurve import run_registered

        return run_registered(name, model, adapter, calib_ids, opts)

    return Method(name, "structured", True, run, help_)


register(_cocurve("cocurve", "co-pruning curvature: KV/FFN-group Fisher-Gram + conditional greedy (Gong et al.)"))
register(_cocurve("cocurve-diag", "CoCurve's diagonal control (lambda = 0, isolated KL-Fisher saliency)"))


def _supported_by(module: str) -> Callable[..., None]:
    """The model check of ``secateur.methods.<module>.check_supported``, imported only when called."""
    def check(adapter) -> None:
        import importlib

        importlib.import_module(f"secateur.methods.{module}").check_supported(adapter)

    return check


def _qk_wanda() -> Method:
    def run(model, adapter, calib_ids, opts) -> MethodResult:
        from secateur.errors import SecateurError
        from secateur.methods.qk_wanda import QKWandaConfig, prune_qk_wanda

        if opts.pattern or opts.targets:
            raise SecateurError("qk-wanda takes neither --pattern nor --targets; choose the projections with "
                                "--scope qk (W_Q, W_K) or --scope all (hybrid with row-wise Wanda)")
        cfg = QKWandaConfig(sparsity=opts.sparsity, budget=opts.budget or "shared",
                            variant=getattr(opts, "variant", None) or "base",
                            scope=getattr(opts, "scope", None) or "qk",
                            rounding=opts.rounding, segment_len=getattr(opts, "segment_len", None),
                            progressive=getattr(opts, "progressive", None) or 1)
        res = prune_qk_wanda(model, adapter, calib_ids, cfg, mode=opts.mode, chunk_size=opts.chunk_size,
                             device=opts.device, progress=not opts.quiet)
        extra = {}
        try:
            from secateur.report.plots import qk_removal_png

            extra["qk-removal.png"] = qk_removal_png({res.details["method"]: res.details["allocation"]},
                                                     title=f"{res.details['method']}, {cfg.budget} budget, "
                                                           f"{cfg.sparsity:.0%}")
        except ImportError:  # matplotlib is optional (extra "plots")
            pass
        return MethodResult(masks=res.masks, timings=res.timings, details=res.details, extra_files=extra)

    return Method("qk-wanda", "unstructured", True, run,
                  "query/key-coupled Wanda on W_Q, W_K; --budget shared|separate|row, --variant, --scope "
                  "(Ilin & Richtarik)", _supported_by("qk_wanda"))


register(_qk_wanda())


def _corp_qk() -> Method:
    def run(model, adapter, calib_ids, opts) -> MethodResult:
        from secateur.errors import SecateurError
        from secateur.methods.corp_qk import CorpQKConfig, prune_corp_qk

        if opts.pattern or opts.targets or opts.budget:
            raise SecateurError("corp-qk takes neither --pattern, --targets nor --budget: --sparsity is the "
                                "fraction of every head's query/key dims removed")
        res = prune_corp_qk(model, adapter, calib_ids, CorpQKConfig(sparsity=opts.sparsity), mode=opts.mode,
                            chunk_size=opts.chunk_size, device=opts.device, progress=not opts.quiet)
        return MethodResult(masks=res["masks"], timings=res["timings"], details=res["details"])

    return Method("corp-qk", "unstructured", True, run,
                  "CORP Q/K: remove each head's lowest-scoring query/key dims and fold the ridge logit "
                  "compensation into W_Q/W_K (non-RoPE models: OPT, GPT-2)", _supported_by("corp_qk"))


register(_corp_qk())


def _structured(name: str, help_: str) -> Method:
    def run(model, adapter, calib_ids, opts) -> MethodResult:
        from secateur.methods.structured import run_method

        return run_method(name, model, adapter, calib_ids, opts)

    return Method(name, "structured", name not in ("magnitude-sp", "random"), run, help_)


# structured selection scores (secateur.methods.structured); compensate with --compensation
register(_structured("wanda-sp", "structured: ||W_:,j|| * ||X_j|| per KV group / channel (COEC's Wanda-sp)"))
register(_structured("flap", "structured: FLAP WIFV fluctuation score; native compensation: bias (An et al. 2024)"))
register(_structured("rcpu", "structured: ||W_:,j|| ||X_j|| Var(X_j); native compensation: rcpu (Haruta et al.)"))
register(_structured("magnitude-sp", "structured: ||W_:,j|| column magnitude (no data)"))
register(_structured("random", "structured: seeded uniform random units (--seed)"))
register(_structured("shortgpt", "structured: remove whole blocks of lowest block influence (Men et al. 2024)"))
register(_structured("corp", "structured: CORP MLP channel score E[h^2] ||W2_:,i||; native compensation: corp"))
