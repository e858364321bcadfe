"""Materialize a structured selection: the stage that applies it (compensate, then slice), and its options
(shared by the score-based selections of
:mod:`secateur.methods.structured` and CoCurve's, :mod:`secateur.methods.cocurve`).

Compensation of every ``o_proj`` / ``down_proj`` that lost columns, from the dense weight ``W0`` and the dense
statistics (:func:`secateur.compensate.compensate`): ``none`` (slice), ``bias`` (FLAP: ``b + W0[:, P] mu_P``),
``ls`` (ridge ``G_yx (G_xx + lambda I)^-1``, COEC Sec. 3.2), ``rcpu`` (left rotation + global scale), ``coec``
(COEC Alg. 1; the value projection is passed for ``o_proj`` so the anchored alignment of Sec. 4.5 acts there
only), ``corp`` (CORP's ridge-affine refit, ``W2[:, S] + W2[:, P] B`` with bias ``b2 + W2[:, P] c``; on
``o_proj`` this generic affine refit is a toolkit extension - CORP's own attention pruning shrinks Q/K head
dimensions, which RoPE forbids). Then :func:`materialize_selection` slices the selection out with the
compensated weights as replacements (bias-free projections get a bias where the compensator returns one).

Memory **[impl]** (issue 16): the Grams are not kept for every layer. Without statistics passed in,
:func:`materialize_selection` runs one dense engine pass (:class:`BlockCompensation`) after the selection that
accumulates one block's Grams, compensates that block's projections and frees them before the next block; the
replacements are sliced in after the pass (the walk stays dense, so every Gram is the dense model's, bit for
bit those of a single pass that kept them all). Peak memory of the statistics, independent of the depth ``L``::

    8 (d_o^2 + d_down^2)   one block's float64 Grams (o_proj and down_proj inputs; each becomes E[x x^T] in place)
  + 8 d_in^2               COEC's tempered copy C^alpha of the projection being solved (alpha != 1; not cached)
  + the solver's workspace (a few |K| x |K| / d_in x d_in float64 matrices of that one projection)
  + 24 d bytes per layer and group: the selection statistics (sumsq, meanvar), kept for every layer

instead of ``L`` times the first two lines. Each run reports the numbers as ``statistics_memory``. The price is
a second dense forward of the calibration set. Statistics that already hold every layer's Gram (a benchmark's
cache) are used as they are.

Safeguard **[impl]** (``no_worse=True``, default): the relative calibration reconstruction error
``E||W0 x + b - W~ x_K - b~||^2 / E||W0 x||^2`` (untempered, from the same dense statistics) of every
compensated projection is compared with the slice-only error; a compensator that would raise it (COEC
optimizes the *tempered* metric, ridge solutions are not monotone in lambda) is replaced by the plain
slice and the fallback is reported. Neither paper states this rule; the report counts how often it fired.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from secateur.calib.collect import GROUP_ROLE, StructuredStats
from secateur.calib.dist import Owners as dist_owners
from secateur.calib.engine import BlockContext, Handler
from secateur.calib.stats import Accumulator
from secateur.compensate import COECOptions, coec_ablation_options
from secateur.compensate.coec import COEC_ABLATION_STAGES
from secateur.errors import SecateurError
from secateur.methods.knobs import MethodOptions, knob
from secateur.models.adapters import Adapter
from secateur.models.blocks import RESIDENT, Blocks

#: compensation name (``--compensation``) -> registered compensator (secateur.compensate.COMPENSATORS)
COMPENSATIONS: dict[str, str] = {"none": "none", "bias": "flap_bias", "ls": "ls", "rcpu": "rcpu", "coec": "coec",
                                 "corp": "corp_mlp"}


@dataclass
class CompensationConfig:
    """How the kept columns are repaired: ``compensation`` (one of :data:`COMPENSATIONS`), ``coec``
    (:class:`secateur.compensate.COECOptions`, None = paper defaults; ``coec_align`` passes the value
    projection to o_proj), ``ls_lambda_rel`` (ridge ``lambda = ls_lambda_rel * mean(diag G_xx)``, baselines.md
    Sec. 6 [A]) and ``no_worse`` (the slice-only fallback of the module docstring)."""

    compensation: str = "none"
    coec: Any = None  # COECOptions (None = paper defaults)
    coec_align: bool = True
    ls_lambda_rel: float = 0.01
    no_worse: bool = True

    def validate(self) -> None:
        if self.compensation not in COMPENSATIONS:
            raise SecateurError(f"unknown compensation {self.compensation!r}; choose from "
                                f"{', '.join(COMPENSATIONS)}")

    @property
    def needs_gram(self) -> bool:
        return self.compensation != "none"


@dataclass
class CompensationOptions(MethodOptions):
    """``--compensation`` and its knobs (every structured method takes them)."""

    CLI_GROUP = "structured pruning (secateur.methods.structured; every default below is None = unset)"

    compensation: str | None = knob("repair o_proj/down_proj after selection (default: the method's own: bias for "
                                    "flap, rcpu for rcpu, corp for corp, none otherwise)", choices=COMPENSATIONS)
    coec_stage: str | None = knob("COEC Table 3 preset (cumulative components); the knobs below override it",
                                  choices=COEC_ABLATION_STAGES)
    coec_alpha: float | None = knob("COEC Gram tempering exponent (default 0.9)", type=float)
    coec_no_left: bool | None = knob("COEC without the left rotation", action="store_true")
    coec_rescale: str | None = knob("COEC rescale (default gcv)", choices=("gcv", "global", "none"))
    coec_right: str | None = knob("COEC right rotation solver (default reduced)", choices=("reduced", "full", "none"))
    coec_align: bool | None = knob("COEC anchored alignment on o_proj (default on)", action="boolean_optional")
    coec_rounds: int | None = knob("COEC alternation rounds (default 50)", type=int)
    ls_lambda: float | None = knob("ridge lambda relative to mean(diag G_xx) for --compensation ls (default 0.01)",
                                   type=float)
    no_worse: bool | None = knob("the slice-only fallback (default on)", flag=None, action="store_true")

    @property
    def needs_calibration(self) -> bool:
        return self.compensation not in (None, "none")

    def compensation_fields(self, default: str = "none") -> dict[str, Any]:
        """The :class:`CompensationConfig` fields (``compensation`` unset: ``default``, the method's native one)."""
        coec = coec_ablation_options(self.coec_stage) if self.coec_stage else COECOptions()
        over: dict[str, Any] = {}
        if self.coec_alpha is not None:
            over["alpha"] = float(self.coec_alpha)
        if self.coec_no_left:
            over["left_rotation"] = False
        if self.coec_rescale is not None:
            over["rescale"] = self.coec_rescale
        if self.coec_right is not None:
            over["right_solver"] = self.coec_right
            if self.coec_right == "none" and self.coec_rounds is None:
                over["max_rounds"] = 0
        if self.coec_rounds is not None:
            over["max_rounds"] = int(self.coec_rounds)
        return {"compensation": self.compensation or default, "coec": dataclasses.replace(coec, **over),
                "coec_align": True if self.coec_align is None else bool(self.coec_align),
                "ls_lambda_rel": 0.01 if self.ls_lambda is None else float(self.ls_lambda),
                "no_worse": True if self.no_worse is None else bool(self.no_worse)}

    def compensation_config(self, default: str = "none") -> CompensationConfig:
        return CompensationConfig(**self.compensation_fields(default))


# --- the stage -------------------------------------------------------------------------------------------

def _value_projection(adapter: Adapter, index: int):
    """The dense value projection read by layer ``index``'s o_proj (COEC Sec. 4.5 alignment)."""
    from secateur.compensate import ValueProjection
    from secateur.structured.units import layer_shape

    refs = adapter.role_refs(adapter.layers[index])
    if "v" not in refs:
        return None
    shape = layer_shape(adapter, index)
    return ValueProjection(refs["v"].weight.detach().clone(), shape.n_heads, shape.n_kv_heads)


def _options(cfg: CompensationConfig, group: str, adapter: Adapter, index: int) -> dict:
    if cfg.compensation == "coec":
        opts: dict[str, Any] = {"options": cfg.coec or COECOptions()}
        if group == "attn_out" and cfg.coec_align and opts["options"].lambda_align > 0:
            opts["value"] = _value_projection(adapter, index)
        return opts
    if cfg.compensation == "ls":
        return {"lam_rel": cfg.ls_lambda_rel}
    return {}


def _summary(value) -> Any:
    """JSON-friendly copy of a diagnostic (no tensors, no long histories)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if torch.is_tensor(value):
        return value.tolist() if value.numel() <= 8 else f"tensor{tuple(value.shape)}"
    if isinstance(value, (list, tuple)):
        return [_summary(v) for v in value[:64]]
    if isinstance(value, dict):
        return {k: _summary(v) for k, v in value.items()}
    return value


_KEEP_DIAG = ("method", "recon_before", "recon_after", "gcv_lambda", "gcv_lambda_rel", "rounds", "scale",
              "lambda", "rho_sh", "fallback", "objective_before", "objective_after", "right_iters",
              "gcv_clamped", "solve_method")


def _solve(cfg: CompensationConfig, adapter: Adapter, i: int, group: str, w0, st, kept, bias,
           opts: dict | None = None):
    """One compensator call on projection ``(i, group)``. COEC with ``alpha != 1`` runs as ``alpha = 1`` on the
    tempered Gram ``G^alpha`` (the same computation: ``G^alpha`` is taken before slicing, COEC Alg. 1 l. 1),
    taken here and freed when the call returns: never cached across projections (memory, module docstring)."""
    from secateur.compensate import InputStats, compensate
    from secateur.compensate.base import ReconError
    from secateur.linalg import psd_power

    fn = COMPENSATIONS[cfg.compensation]
    opts = dict(_options(cfg, group, adapter, i) if opts is None else opts)
    if fn != "coec" or opts["options"].alpha == 1.0:
        return compensate(fn, w0, st, kept, bias=bias, **opts)
    alpha = opts["options"].alpha
    g_alpha = psd_power(st.second_moment, alpha)
    opts["options"] = dataclasses.replace(opts["options"], alpha=1.0)
    comp = compensate(fn, w0, InputStats(g_alpha, st.mean, st.n), kept, bias=bias, **opts)
    del g_alpha
    recon = ReconError(w0, st)  # the untempered metric: what the guard and the record compare
    comp.diagnostics.update(alpha=alpha, recon_before=recon.before(kept), recon_after=recon.relative(kept, comp.weight))
    return dataclasses.replace(comp, recon=recon)


def _guarded(cfg: CompensationConfig, comp, rec: dict, w0, st, kept, bias):
    """Apply the no-worse guard to ``comp`` and record the error of what is actually written."""
    from secateur.compensate.base import ReconError

    d = comp.diagnostics
    if cfg.no_worse and d["recon_after"] > d["recon_before"]:
        # [impl] never return a layer worse than the plain slice on the calibration statistics
        rec.update(guard="slice", recon_rejected=d["recon_after"], recon_after=d["recon_before"])
        return dataclasses.replace(comp, weight=w0[:, kept].clone(), bias=None)
    # the weights are cast to the model dtype: report the error of what is actually written
    db = None if comp.bias is None else comp.bias.double() - (
        torch.zeros_like(comp.bias, dtype=torch.float64) if bias is None else bias.double())
    recon = comp.recon if comp.recon is not None else ReconError(w0, st)
    rec["recon_after"] = recon.relative(kept, comp.weight, db)
    return comp


@dataclass(frozen=True)
class _Frozen:
    """What a solve reads of a projection and its block, copied when the block ends (a pipelined solve runs while
    the walk has moved on, and a block read from disk or another device may be gone by then)."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    opts: dict

    @classmethod
    def of(cls, cfg: CompensationConfig, adapter: Adapter, i: int, group: str, ref) -> _Frozen:
        return cls(ref.weight.detach().cpu().clone(), None if ref.bias is None else ref.bias.detach().cpu().clone(),
                   _options(cfg, group, adapter, i))


def _compensate_one(cfg: CompensationConfig, adapter: Adapter, i: int, group: str, ref, kept,
                    st) -> tuple[Any, dict]:
    """``(Compensation or None, record)`` of one projection that lost columns (None: nothing kept), from its
    dense input statistics ``st`` (:class:`secateur.compensate.InputStats`; unused when nothing is kept).
    ``ref``: the projection, or its :class:`_Frozen` copy."""
    w0 = ref.weight.detach().cpu()  # compensators solve on the CPU, next to the statistics
    bias = None if ref.bias is None else ref.bias.detach().cpu()
    rec: dict[str, Any] = {"layer": i, "group": group, "kept": int(kept.numel()), "width": int(w0.shape[1])}
    if kept.numel() == 0:  # everything removed: nothing to compensate into
        rec.update(method=COMPENSATIONS[cfg.compensation], recon_before=1.0, recon_after=1.0, seconds=0.0,
                   skipped="no kept columns")
        return None, rec
    t = time.perf_counter()
    comp = _solve(cfg, adapter, i, group, w0, st, kept, bias, opts=ref.opts if isinstance(ref, _Frozen) else None)
    dt = time.perf_counter() - t
    rec.update({k: _summary(comp.diagnostics[k]) for k in _KEEP_DIAG if k in comp.diagnostics}, seconds=dt)
    comp = _guarded(cfg, comp, rec, w0, st, kept, bias)
    # only what slicing reads is kept until the end of the stage (diagnostics may hold solver tensors)
    return dataclasses.replace(comp, diagnostics={}, recon=None), rec


def _to_compensate(adapter: Adapter, sel):
    """``(layer, group, projection ref, kept columns)`` of every projection that lost columns."""
    for i in sorted(sel.layers):
        refs = adapter.role_refs(adapter.layers[i])
        for group, role in GROUP_ROLE.items():
            kept = sel.kept_columns(i, group)
            if kept is not None and kept.numel() != refs[role].weight.shape[1]:
                yield i, group, refs[role], kept


class _Results:
    """The compensations of a stage and their records; with an active checkpoint (``--resume``) every
    compensated projection is saved as it is done (``comp<k>-<layer>-<group>.pt``) and reloaded instead of
    solved again."""

    def __init__(self) -> None:
        from secateur.calib import resume

        self.reps: dict = {}
        self.records: list[dict] = []
        self.ck = resume.current()
        self.stage = self.ck.stage("comp") if self.ck is not None else ""

    def _name(self, i: int, group: str) -> str:
        return f"{self.stage}-{i}-{group}.pt"

    def _saved(self, i: int, group: str) -> bool:
        return self.ck is not None and self.ck.has(self._name(i, group))

    def restore(self, i: int, group: str) -> bool:
        """Reload a checkpointed projection; False when it must be solved."""
        from secateur.compensate.base import Compensation

        name = self._name(i, group)
        if self.ck is None or not self.ck.has(name):
            return False
        got = self.ck.load(name)
        self.reps[(i, group)] = Compensation(got["weight"], got["bias"], got["kept"])
        self.records.append(got["rec"])
        return True

    def add(self, i: int, group: str, comp, rec: dict) -> None:
        self.records.append(rec)
        if comp is None:
            return
        self.reps[(i, group)] = comp
        if self.ck is not None:
            self.ck.save(self._name(i, group), {"weight": comp.weight.clone(), "rec": rec, "kept": comp.kept.clone(),
                                                "bias": None if comp.bias is None else comp.bias.clone()})

    def _pend(self, i: int, group: str) -> str:
        return f"{self.stage}-pend-{i}-{group}.pt"

    def save_pending(self, i: int, group: str, kept: torch.Tensor, st) -> None:
        """The statistics of a projection whose solve is still running when its block is checkpointed."""
        if self.ck is not None and st is not None:
            self.ck.save(self._pend(i, group), {"kept": kept.clone(), "second_moment": st.second_moment,
                                                "mean": st.mean, "n": int(st.n)})

    def load_pending(self, i: int, group: str):
        """:class:`secateur.compensate.InputStats` saved by :meth:`save_pending`, or None."""
        from secateur.compensate import InputStats

        if self.ck is None or not self.ck.has(self._pend(i, group)):
            return None
        got = self.ck.load(self._pend(i, group))
        return InputStats(second_moment=got["second_moment"], mean=got["mean"], n=int(got["n"]))

    def drop_pending(self, i: int, group: str) -> None:
        if self.ck is not None:
            self.ck.delete(self._pend(i, group))

    @property
    def seconds(self) -> float:
        return sum(r.get("seconds", 0.0) for r in self.records)


def compensate_selection(model: nn.Module, adapter: Adapter, sel, stats: StructuredStats,
                         cfg: CompensationConfig) -> tuple[dict, list[dict], float]:
    """Replacements ``{(layer, group): Compensation}`` for every projection that lost columns, the
    per-layer records and the total compensation time (seconds), from statistics that already hold every
    layer's Gram (``stats``, e.g. cached by a benchmark across sparsities: ``L`` Grams in memory, the caller's
    choice; :func:`materialize_selection` without them keeps one block's). Checkpointed like the per-block
    pass (:class:`_Results`)."""
    from secateur.compensate import InputStats

    res = _Results()
    todo = [(i, group, ref, kept) for i, group, ref, kept in _to_compensate(adapter, sel) if not res._saved(i, group)]
    for i, group, _, _ in todo:
        if "gram" not in stats.groups.get(i, {}).get(group, {}):
            raise SecateurError(f"compensation {cfg.compensation!r} needs the input Gram of layer {i} {group}")

    def solve(job):  # on its owner rank (calib.dist.owned_map): every projection's solve in parallel
        i, group, ref, kept = job
        return _compensate_one(cfg, adapter, i, group, ref, kept,
                               InputStats.from_gram(stats.groups[i][group]["gram"]))

    solved = dict(zip([(i, g) for i, g, _, _ in todo], dist_owners("compensation").map(todo, solve), strict=True))
    for i, group, _, _ in _to_compensate(adapter, sel):
        if not res.restore(i, group):
            res.add(i, group, *solved[(i, group)])
    return res.reps, res.records, res.seconds


class _DaemonPool:
    """``n`` daemon threads taking jobs first in, first out. Daemon threads, unlike ``ThreadPoolExecutor``'s, do
    not hold the process at an interrupt: Ctrl-C ends a run at once instead of after the solves that are
    running (minutes each at 7B widths); their results are not needed then."""

    def __init__(self, n: int) -> None:
        import queue
        import threading

        self.n = n
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        for j in range(n):
            threading.Thread(target=self._loop, daemon=True, name=f"secateur-comp-{j}").start()

    def _loop(self) -> None:
        while (item := self.jobs.get()) is not None:
            fut, fn, arg = item
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(arg))
                except BaseException as e:  # noqa: BLE001 - handed to the caller by fut.result()
                    fut.set_exception(e)

    def submit(self, fn, arg):
        from concurrent.futures import Future

        fut: Future = Future()
        self.jobs.put((fut, fn, arg))
        return fut

    def close(self) -> None:
        for _ in range(self.n):
            self.jobs.put(None)


class BlockCompensation(Handler):
    """The per-block compensation pass (engine mode ``dense``): accumulates the dense input Grams of one block's
    ``o_proj`` / ``down_proj`` that lost columns, compensates them as soon as the block's forward is done
    (``on_block_end``, recorded in the order attn_out, mlp_out; over several processes each projection is solved
    on its owner rank, :func:`secateur.calib.dist.owned_map`) and drops them once solved. The Gram becomes
    ``E[x x^T]`` in place (the same values as :attr:`secateur.calib.stats.Gram.second_moment`). Nothing is written
    to the model: the walk stays dense and the replacements are sliced in after the pass. Resumable: a finished
    block's projections are in the checkpoint's ``comp`` files, reloaded by :meth:`load_block_state`.

    Pipelined **[impl]** (issue 29; :meth:`pipelined`, one process with ``w = torch.get_num_threads() > 1``): the
    walk stops waiting for a block's solves. With :attr:`pipeline` ``"auto"`` this starts after the first block
    whose solves took longer than its walk. From then on the solves run on ``w`` worker threads, torch pinned to
    one intra-op thread until the pass ends, while the next blocks are walked, so the solves of ``w`` blocks use
    ``w`` cores (the eigendecompositions, pinned to one thread anyway, no longer leave the other cores idle).
    Results are bit for bit those of the sequential pass: every solve runs on one thread either way, and results
    are recorded in block order. At most ``w`` blocks are in flight (the walk waits for the oldest before it
    submits another), so the Grams alive are at most ``w + 1`` blocks'. A block checkpointed while its solves are
    still running leaves their statistics in the checkpoint (``pend`` files, deleted once the result is saved),
    which ``--resume`` solves first.

    ``live_bytes`` / ``peak_bytes``: the Gram state alive now and at most (8 d^2 bytes each)."""

    resumable = True
    modifies_weights = False
    #: ``"auto"``: the pool starts once a block's solves took longer than its walk (cheap solves, as the least-squares
    #: or RCPU ones, would gain nothing and the walk would lose its threads); ``"always"`` / ``"never"``
    pipeline = "auto"

    def __init__(self, cfg: CompensationConfig, adapter: Adapter, sel) -> None:
        self.cfg, self.adapter = cfg, adapter
        self.todo = {(i, g): (kept, int(ref.weight.shape[1])) for i, g, ref, kept in _to_compensate(adapter, sel)}
        self.results = _Results()
        self.live_bytes = 0
        self.peak_bytes = 0
        self.owners = dist_owners("compensation")  # the solves over several processes: round-robin owners
        self.pending: list[tuple[int, str, Any, Any, Any]] = []  # this block's projections, solved at its end
        self.pending_bytes = 0  # their Grams' bytes
        self.pool = None  # the worker threads of a pipelined pass
        self.workers = 1
        # blocks whose solves run: (block, [(key, job, future)], their Grams' bytes), oldest first
        self.inflight: list[tuple[int, list[tuple[tuple[int, str], Any, Any]], int]] = []
        self.waited_s = 0.0  # seconds the walk spent waiting for solves (pipelined) or solving (sequential)
        self.can_pipeline = False  # inside pipelined(), where a pool may start
        self.threads_before = 1
        self.mark = time.perf_counter()  # when the walk of the current block began (its previous block's end)

    @contextmanager
    def pipelined(self) -> Iterator[None]:
        """Run the pass (the caller's ``engine.run``) with the solves on worker threads when that helps: one
        process, more than one torch thread, and (``pipeline = "auto"``) solves that outlast the walk. Every
        solve is collected before the block returns, and the thread count is given back."""
        from secateur.calib.dist import rank_world

        if torch.get_num_threads() <= 1 or rank_world()[1] > 1 or self.pipeline == "never":
            yield
            return
        self.can_pipeline, self.mark = True, time.perf_counter()
        if self.pipeline == "always":
            self._start_pool()
        try:
            yield
            while self.inflight:
                self._collect_oldest()
        finally:
            for _, jobs, _ in self.inflight:  # an error or an interrupt: what has not started never will
                for _, _, fut in jobs:
                    fut.cancel()
            self.inflight.clear()
            if self.pool is not None:
                self.pool.close()
                self.pool = None
                torch.set_num_threads(self.threads_before)
            self.can_pipeline = False

    def _start_pool(self) -> None:
        """From now on the solves run on ``w`` worker threads and the walk on one intra-op thread (each solve is
        pinned to one thread anyway, so the weights do not change; the walk's GEMMs do not depend on it)."""
        self.threads_before = self.workers = torch.get_num_threads()
        torch.set_num_threads(1)
        self.pool = _DaemonPool(self.workers)

    @property
    def layers(self) -> list[int]:
        """The blocks the pass must visit: up to the last one with a projection to compensate."""
        return list(range(max(i for i, _ in self.todo) + 1)) if self.todo else []

    def accumulators(self, ctx: BlockContext, group: str, names: list[str]) -> dict[str, Accumulator]:
        got = self.todo.get((ctx.index, group))
        if got is None or got[0].numel() == 0 or self._saved(ctx.index, group):
            return {}
        from secateur.calib.stats import Gram

        self.live_bytes += 8 * got[1] ** 2
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        return {"gram": Gram(got[1])}

    def _saved(self, i: int, group: str) -> bool:
        return self.results._saved(i, group)

    def on_group(self, ctx: BlockContext, group: str, names: list[str], accs: dict[str, Accumulator]) -> None:
        from secateur.compensate import InputStats

        key = (ctx.index, group)
        if key not in self.todo or self.results.restore(*key):
            return
        kept, width = self.todo[key]
        st = None
        if "gram" in accs:
            gram = accs.pop("gram")  # the engine's reference goes: the Gram lives in ``pending`` until the block ends
            if gram.n <= 0:
                raise SecateurError("the Gram accumulator saw no tokens")
            st = InputStats(second_moment=gram.G.div_(gram.n), mean=gram.mean, n=int(gram.n))
            del gram
        ref = self.adapter.role_refs(ctx.layer)[GROUP_ROLE[group]]
        self.pending.append((*key, ref, kept, st))
        self.pending_bytes += 0 if st is None else 8 * width ** 2

    def _solve(self, job) -> tuple[Any, dict]:
        return _compensate_one(self.cfg, self.adapter, *job)

    def on_block_end(self, ctx: BlockContext) -> None:
        """The block's projections solved (each on its owner rank over several processes, in parallel:
        :func:`secateur.calib.dist.owned_map`; pipelined: submitted to the workers), their Grams freed once
        solved, the results recorded in the single process's order (attn_out, mlp_out)."""
        jobs, self.pending = self.pending, []
        nbytes, self.pending_bytes = self.pending_bytes, 0
        t = time.perf_counter()
        if self.pool is not None:
            while len(self.inflight) >= self.workers:  # bounded memory: at most ``workers`` blocks in flight
                self._collect_oldest()
            if jobs:
                frozen = [(i, g, _Frozen.of(self.cfg, self.adapter, i, g, ref), kept, st)
                          for i, g, ref, kept, st in jobs]
                self.inflight.append((ctx.index, [(job[:2], job, self.pool.submit(self._solve, job))
                                                  for job in frozen], nbytes))
            self.mark = time.perf_counter()  # the waits were counted by _collect_oldest
            return
        keys = [job[:2] for job in jobs]
        try:
            solved = self.owners.map(jobs, self._solve)
        finally:
            del jobs[:]  # every Gram of the block goes
            self.live_bytes -= nbytes
        for (i, group), (comp, rec) in zip(keys, solved, strict=True):
            self.results.add(i, group, comp, rec)
        now = time.perf_counter()
        self.waited_s += now - t
        if self.can_pipeline and self.pool is None and keys and now - t > t - self.mark:
            self._start_pool()  # the solves outlast the walk: from the next block on they run beside it
        self.mark = time.perf_counter()

    def _collect_oldest(self) -> None:
        """Wait for the oldest block in flight, record its results in order, drop its Grams and ``pend`` files."""
        t = time.perf_counter()
        _, jobs, nbytes = self.inflight[0]
        done = [(key, fut.result()) for key, _, fut in jobs]  # a failed solve raises here, in block order
        self.inflight.pop(0)
        self.live_bytes -= nbytes
        for key, (comp, rec) in done:
            self.results.add(*key, comp, rec)
            self.results.drop_pending(*key)
        self.waited_s += time.perf_counter() - t

    def block_state(self, ctx: BlockContext) -> dict:
        """Nothing: a finished block's compensations are in the checkpoint's ``comp`` files, and those of a block
        still in flight (pipelined) are saved as ``pend`` files here, so the checkpoint can always continue."""
        while self.inflight and all(fut.done() for _, _, fut in self.inflight[0][1]):
            self._collect_oldest()  # in block order; a failed solve raises here
        for index, jobs, _ in self.inflight:
            if index == ctx.index:
                for key, job, _ in jobs:
                    self.results.save_pending(*key, job[3], job[4])
        return {}

    def load_block_state(self, index: int, state: dict) -> None:
        for i, group in self.todo:
            if i == index and not self.results.restore(i, group):
                kept, _ = self.todo[(i, group)]
                st = self.results.load_pending(i, group)
                if kept.numel() and st is None:
                    from secateur.calib.resume import CheckpointError

                    raise CheckpointError(f"checkpoint {self.results.ck.path} lacks the compensation of layer {i} "
                                          f"{group}; remove it and run without --resume")
                ref = self.adapter.role_refs(self.adapter.layers[i])[GROUP_ROLE[group]]
                self.results.add(i, group, *_compensate_one(self.cfg, self.adapter, i, group, ref, kept, st))
                self.results.drop_pending(i, group)


def _aggregate(records: list[dict]) -> dict:
    out: dict[str, dict] = {}
    for g in GROUP_ROLE:
        rs = [r for r in records if r["group"] == g and "skipped" not in r]
        if not rs:
            continue
        lam = [r["gcv_lambda_rel"] for r in rs if isinstance(r.get("gcv_lambda_rel"), float)]
        out[g] = {"layers": len(rs), "recon_before_mean": sum(r["recon_before"] for r in rs) / len(rs),
                  "recon_after_mean": sum(r["recon_after"] for r in rs) / len(rs),
                  "guard_fired": sum(r.get("guard") == "slice" for r in rs),
                  "seconds": sum(r["seconds"] for r in rs)}
        rounds = [r["rounds"] for r in rs if isinstance(r.get("rounds"), int)]
        if rounds:
            out[g]["rounds_mean"] = sum(rounds) / len(rounds)
            out[g]["rounds_max"] = max(rounds)
        if lam:
            out[g]["gcv_lambda_rel_median"] = sorted(lam)[len(lam) // 2]
    return out


#: the memory of the statistics of a compensated structured run (also in the report: ``statistics_memory``)
MEMORY_FORMULA = ("per block: 8 (d_o^2 + d_down^2) bytes for the float64 input Grams of its o_proj and down_proj, "
                  "+ 8 d_in^2 for COEC's tempered copy C^alpha (alpha != 1) + the solver's workspace, one block at "
                  "a time (independent of the depth L; w + 1 blocks' Grams and w solves' workspaces when the "
                  "solves run on w threads beside the walk); plus 24 d bytes per layer and group for the selection "
                  "statistics (sumsq, meanvar)")


def _nbytes(acc) -> int:
    return sum(v.numel() * v.element_size() for v in vars(acc).values() if torch.is_tensor(v))


def statistics_memory(adapter: Adapter, sel, cfg: CompensationConfig, stats: StructuredStats | None,
                      per_block: bool, peak_bytes: int | None = None, workers: int = 1) -> dict:
    """The report's ``statistics_memory``: bytes of the Grams alive at once (one block's with the per-block
    pass, every layer's with statistics passed in), of COEC's tempered copy, of the selection statistics, and
    :data:`MEMORY_FORMULA`."""
    widths: dict[int, list[int]] = {}
    for i, _, ref, kept in _to_compensate(adapter, sel):
        if kept.numel():
            widths.setdefault(i, []).append(int(ref.weight.shape[1]))
    blocks = [sum(8 * d * d for d in ds) for ds in widths.values()] or [0]
    coec = cfg.compensation == "coec" and (cfg.coec or COECOptions()).alpha != 1.0
    selection = sum(_nbytes(a) for g in (stats.groups.values() if stats else ()) for accs in g.values()
                    for k, a in accs.items() if k != "gram")
    # pipelined (``workers`` > 1): the largest w + 1 blocks at most, never more than all of them
    alive = sum(sorted(blocks, reverse=True)[: workers + 1]) if workers > 1 else max(blocks)
    out = {"mode": ("one block at a time" if workers <= 1 else f"one block at a time, solves on {workers} threads "
                    f"beside the walk (at most {workers + 1} blocks' Grams)") if per_block
           else "every layer (statistics passed in)",
           "grams_bytes": alive if per_block else sum(blocks), "grams_bytes_all_layers": sum(blocks),
           "tempered_bytes": 8 * max((d * d for ds in widths.values() for d in ds), default=0) if coec else 0,
           "selection_bytes": selection, "formula": MEMORY_FORMULA}
    if peak_bytes is not None:
        out["grams_bytes_measured_peak"] = peak_bytes
    return out


def materialize_selection(model: nn.Module, adapter: Adapter, sel, cfg: CompensationConfig,
                          stats: StructuredStats | None = None, ids: torch.Tensor | None = None, *,
                          chunk_size: int = 8, device=None, progress: bool = False,
                          blocks: Blocks = RESIDENT) -> tuple[list[dict], dict[str, float], dict | None]:
    """Compensate (``cfg.compensation``, from dense statistics) and slice ``sel`` out of ``model`` in place:
    the last two stages of every structured method, whatever made the selection. The dense Grams come from
    ``stats`` when it holds them (every layer's, reused by the caller), else from one dense engine pass over
    ``ids`` that keeps one block's Grams at a time (:class:`BlockCompensation`). Returns the per-layer
    compensation records, the timings and the ``statistics_memory`` report (None without compensation).
    ``blocks``: the Gram pass's block context (in memory; split over processes, its shard)."""
    from secateur.calib import engine
    from secateur.structured.slicing import apply_selection

    reps, records, comp_s, memory = {}, [], 0.0, None
    timings: dict[str, float] = {}
    if cfg.compensation != "none":
        if stats is not None and stats.groups and stats.has(("gram",)):
            reps, records, comp_s = compensate_selection(model, adapter, sel, stats, cfg)
            memory = statistics_memory(adapter, sel, cfg, stats, per_block=False)
        elif ids is not None:
            t = time.perf_counter()
            h = BlockCompensation(cfg, adapter, sel)
            if h.todo:
                with h.pipelined():
                    engine.run(model, adapter, ids, h, mode="dense", chunk_size=chunk_size, device=device,
                               progress=progress, layers=h.layers, blocks=blocks)
            reps, records, comp_s = h.results.reps, h.results.records, h.results.seconds
            # the walk's own time: the solves (sequential) or the waits for them (pipelined) taken out
            timings["gram_pass_s"] = time.perf_counter() - t - h.waited_s
            timings["compensation_wall_s"] = h.waited_s
            memory = statistics_memory(adapter, sel, cfg, stats, per_block=True, peak_bytes=h.peak_bytes,
                                       workers=h.workers)
        else:
            raise SecateurError(f"compensation {cfg.compensation!r} needs dense calibration statistics")
    t = time.perf_counter()
    apply_selection(model, adapter, sel, reps)
    return records, {"compensation_s": comp_s, **timings, "slice_s": time.perf_counter() - t}, memory


def compensation_details(cfg: CompensationConfig, records: list[dict], seconds: float,
                         memory: dict | None = None) -> dict:
    """The report fields of a compensation stage (shared by every structured method)."""
    return {"statistics_memory": memory,
        "compensation": cfg.compensation, "compensation_seconds": seconds,
        "compensation_summary": _aggregate(records), "per_layer": records,
        "coec_options": None if cfg.compensation != "coec" else _summary(
            {k: str(v) if isinstance(v, torch.dtype) else v for k, v in dataclasses.asdict(cfg.coec).items()}),
        "coec_align": cfg.coec_align if cfg.compensation == "coec" else None,
        "no_worse_guard": cfg.no_worse,
    }
