"""Method registry: every ``--method`` name, what it is and where its composition lives.

A method is declared here and nowhere else: its kind, whether the CLI must build a calibration set first, its
typed options class (:class:`secateur.methods.knobs.MethodOptions`: the CLI flags and the API keywords are built
from it), its config builder ``config(opts)`` (the one path from ``PruneOptions`` to the method's validated
configuration, used for model-free validation before anything is loaded) and its runner
``run(model, adapter, calib_ids, opts, blocks=...) -> MethodResult`` (``blocks``: where the blocks come from and
where the finished ones go, :mod:`secateur.models.blocks`; in memory unless the method is ``streamable``);
``check(adapter, opts)`` refuses a model before calibration data is built. The composition modules
(:mod:`~secateur.methods.unstructured`, :mod:`~secateur.methods.qk_wanda`, :mod:`~secateur.methods.corp_qk`,
:mod:`~secateur.methods.structured`, :mod:`~secateur.methods.cocurve`) never import this module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from secateur.errors import SecateurError
from secateur.methods import cocurve, corp_qk, qk_wanda, structured, unstructured
from secateur.methods.knobs import MethodOptions, flag_of
from secateur.methods.result import MethodResult

__all__ = ["METHODS", "Method", "MethodResult", "register", "resolve", "method_options", "all_options"]


@dataclass(frozen=True)
class Method:
    name: str
    kind: str  # "unstructured" | "structured"
    needs_calibration: bool
    run: Callable[..., MethodResult]
    help: str
    options: type[MethodOptions] = MethodOptions
    config: Callable[[Any], Any] | None = None  # config(opts): the validated method config (model-free checks)
    check: Callable[..., None] | None = None  # check(adapter, opts): refuse a model before calibration data
    # ``--stream`` runs it: its runner takes a streamed ``blocks`` (unstructured: each block pruned as the engine
    # visits it; structured: two block passes); ``memory(shape, config) -> {term: (bytes, formula)}``: its own
    # terms in the streamed memory plan (statistics, selection; unstructured methods: the structured plan reads the
    # config)
    streamable: bool = False
    memory: Callable[[Any, Any], dict[str, tuple[int, str]]] | None = None
    # why it cannot run on a vision encoder (None: it can); checked from the config before anything is loaded
    text_only: str | None = None


METHODS: dict[str, Method] = {}


def register(method: Method) -> Method:
    METHODS[method.name] = method
    return method


def _unstructured(name: str, help_: str) -> Method:
    return Method(name, "unstructured", name != "magnitude", partial(unstructured.run, name), help_,
                  unstructured.UnstructuredOptions, partial(unstructured.unstructured_config, name),
                  streamable=True, memory=unstructured.memory_terms)


register(_unstructured("magnitude", "|W| per layer (no data)"))
register(_unstructured("wanda", "|W| * ||X|| per output row (Sun et al. 2024)"))
register(_unstructured("sparsegpt", "OBS pruning with reconstruction (Frantar & Alistarh 2023)"))


def _cocurve(name: str, help_: str) -> Method:
    return Method(name, "structured", True, partial(cocurve.run, name), help_, cocurve.CoCurveOptions,
                  cocurve.cocurve_config,
                  text_only="its graph is the KL of a next-token teacher, which a vision encoder does not have (a "
                            "class-logit teacher is not defined yet); use --method corp, wanda-sp or flap")


register(_cocurve("cocurve", "co-pruning curvature: KV/FFN-group Fisher-Gram + conditional greedy (Gong et al.)"))
register(_cocurve("cocurve-diag", "CoCurve's diagonal control (lambda = 0, isolated KL-Fisher saliency)"))


def _model_check(check_supported: Callable[..., None]) -> Callable[..., None]:
    return lambda adapter, opts: check_supported(adapter)


register(Method("qk-wanda", "unstructured", True, qk_wanda.run,
                "query/key-coupled Wanda on W_Q, W_K; --budget shared|separate|row, --variant, --scope "
                "(Ilin & Richtarik)", qk_wanda.QKWandaOptions, qk_wanda.qk_wanda_config,
                _model_check(qk_wanda.check_supported),
                text_only="its statistics assume causal attention over token positions (QK-Wanda Eq. 49); a vision "
                          "encoder attends both ways: use --method corp-qk for its query/key dims"))
register(Method("corp-qk", "unstructured", True, corp_qk.run,
                "CORP Q/K: remove each head's lowest-scoring query/key dims and fold the ridge logit "
                "compensation into W_Q/W_K (non-RoPE models: OPT, GPT-2)", corp_qk.CorpQKOptions,
                corp_qk.corp_qk_config, _model_check(corp_qk.check_supported)))


def _structured(name: str, help_: str) -> Method:
    options = structured.CorpOptions if name == "corp" else structured.StructuredOptions
    return Method(name, "structured", name not in ("magnitude-sp", "random"), partial(structured.run, name), help_,
                  options, partial(structured.structured_config, name),
                  partial(structured.check_reachable, name), streamable=name in structured.STREAMED)


# structured selection scores (secateur.methods.structured); compensate with --compensation
register(_structured("wanda-sp", "structured: ||W_:,j|| * ||X_j|| per KV group / channel (COEC's Wanda-sp)"))
register(_structured("flap", "structured: FLAP WIFV fluctuation score; native compensation: bias (An et al. 2024)"))
register(_structured("rcpu", "structured: ||W_:,j|| ||X_j|| Var(X_j); native compensation: rcpu (Haruta et al.)"))
register(_structured("magnitude-sp", "structured: ||W_:,j|| column magnitude (no data)"))
register(_structured("random", "structured: seeded uniform random units (--seed)"))
register(_structured("shortgpt", "structured: remove whole blocks of lowest block influence (Men et al. 2024)"))
register(_structured("corp", "structured: CORP MLP channel score E[h^2] ||W2_:,i||; native compensation: corp"))
register(_structured("vbp", "structured: VBP post-activation variance of MLP neurons; native compensation: bias "
                            "(the removed neurons' means folded into the next bias) (Berisha et al. 2025)"))


#: methods ``--stream`` runs: the unstructured ones the engine streams and the score-based structured ones
STREAMABLE = tuple(n for n, m in METHODS.items() if m.streamable)

# --- names and options -----------------------------------------------------------------------------------

def resolve(name: str, structured_flag: bool = False) -> Method:
    """The registered method of ``--method name`` (``--structured`` maps ``magnitude``/``wanda`` to
    ``magnitude-sp``/``wanda-sp``; structured names pass through; anything else is an error)."""
    if structured_flag:
        alias = structured.STRUCTURED_ALIASES.get(name, name)
        if alias not in METHODS or METHODS[alias].kind != "structured":
            names = sorted(n for n, m in METHODS.items() if m.kind == "structured")
            raise SecateurError(f"--structured: {name!r} has no structured form; choose from {', '.join(names)}")
        name = alias
    if name not in METHODS:
        raise SecateurError(f"unknown method {name!r}; choose from {', '.join(sorted(METHODS))}")
    return METHODS[name]


def all_options() -> list[type[MethodOptions]]:
    """Every options class, in registration order (each once): the CLI's knobs."""
    out: list[type[MethodOptions]] = []
    for m in METHODS.values():
        if m.options not in out:
            out.append(m.options)
    return out


def knob_names() -> frozenset[str]:
    return frozenset().union(*(o.knob_names() for o in all_options()))


def _flags(knobs: list[str]) -> str:
    """``--coec-rounds, --ffn-groups``: the CLI flags of ``knobs`` (the name itself for an API-only knob)."""
    fields = {f.name: f for o in all_options() for f in o.knob_fields()}
    return ", ".join(flag_of(fields[k]) or k for k in knobs)


def _owners_text(knob: str) -> str:
    """The methods that take ``knob``: by name, the structured ones as the structured pipeline when many do."""
    owners = [m for m in METHODS.values() if knob in m.options.knob_names()]
    structured_ = [m.name for m in owners if m.kind == "structured"]
    if len(structured_) <= 2:
        return "--method " + " / ".join(m.name for m in owners)
    pipeline = f"the structured pipeline (--structured with {', '.join(structured_)})"
    others = [m.name for m in owners if m.kind != "structured"]
    return f"--method {' / '.join(others)} and {pipeline}" if others else pipeline


def _instead(knob: str, value: Any, method: Method, same: list[str]) -> str:
    """What to do when ``method`` is given a knob of another method: the equivalent option where there is one."""
    own = method.options.knob_names()
    if knob == "scope" and "targets" in own:
        if value == "qk":
            return "the same projections with this method: --targets q,k (or --method qk-wanda for QK-Wanda)"
        return "this method prunes every projection by default (--targets narrows it); or use --method qk-wanda"
    if knob in ("pattern", "targets") and "scope" in own:
        return "choose the projections with --scope qk (W_Q, W_K) or --scope all (hybrid with row-wise Wanda)"
    if knob == "targets" and "units" in own:
        return "choose what is removed with --units"
    return f"drop {_flags(same)}, or choose a method it applies to"


def method_options(method: Method, knobs: dict[str, Any]) -> MethodOptions:
    """``method``'s typed options from flat keywords (``None`` = unset); a knob of another method is refused."""
    given = [k for k, v in knobs.items() if v is not None]
    unknown = [k for k in given if k not in knob_names()]
    if unknown:
        raise SecateurError(f"unknown option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
                            f"{method.name} takes {', '.join(sorted(method.options.knob_names())) or 'none'}")
    bad = [k for k in given if k not in method.options.knob_names()]
    if bad:
        where = _owners_text(bad[0])
        same = [k for k in bad if _owners_text(k) == where]
        own = method.kind == "structured" and "units" not in method.options.knob_names()
        tail = " that selects its own units" if own else ""
        verb = "applies" if len(same) == 1 else "apply"
        article = "an" if method.kind[0] in "aeiou" else "a"
        raise SecateurError(f"{_flags(same)} only {verb} to {where}, and {method.name!r} is {article} "
                            f"{method.kind} method{tail}; {_instead(bad[0], knobs[bad[0]], method, same)}")
    return method.options.from_kwargs(knobs)
