"""Peak-memory plans of block-streamed runs, printed with their formula before the run and checked against the
memory this machine has free (``MemAvailable`` of ``/proc/meminfo``; ``SECATEUR_MEM_AVAILABLE_MB`` overrides it).

A streamed prune (:mod:`secateur.models.streaming`, ``secateur prune --stream``) holds, at its peak::

    resident     embeddings + final norm + LM head (tied once), in the run's dtype; an untied head is not held
                 by a prune (copied from the input files to the output when the writer opens)
  + block        one decoder block in the run's dtype, + its largest tensor as read from the file (before the cast)
  + activations  N x T x (3 d + F) x b   (N windows of T tokens, hidden d, FFN F, b bytes per element; the
                 engine's live buffers at the MLP stage of a block: the block input, h2 = h + o(a), the MLP
                 norm's output and the MLP core's output of width F, then the block output replacing the norm's;
                 --mode dense-block keeps one more d-wide list for the re-run: 4 d + F; magnitude: none)
  + workspace    one chunk of c windows on the device: c T (3 F + 4 d) b (gate, up, their product, norms,
                 attention in/out) + c H T^2 b (attention scores if SDPA falls back to its math kernel)
                 + c T max(d, F) 8 (a float64 statistics update)
  + statistics   the method's own term, declared by the method (``Method.memory``: wanda 8 (2 d + d_att + F);
                 sparsegpt the block's four float64 Grams + its OBS solver on the widest input)
  + selection    declared by the method too: magnitude's and wanda's scores and selection transients on the
                 largest projection, P_max = d max(F, d_att) entries: (8 + b) P_max + 16 x 2^22 (row budget, N:M:
                 rows at a time) or (24 + b) P_max (a matrix budget: one pool)
  + masks        every pruned weight's mask bit-packed (P / 8 bytes) + one block's boolean masks

A streamed structured prune (:func:`secateur.methods.structured.prune_structured` with a streamed block source:
two passes, one block at a time) holds resident + block + activations + workspace as above (without calibration
data: none) and::

  + statistics   the selection statistics of every layer 24 L (d_att + F) (sumsq, mean, M2 in float64; only the
                 scores that read them) + the unit scores 8 L (H + F)
  + grams        with --compensation: one block's float64 Grams 8 (d_att^2 + F^2) (o_proj and down_proj inputs)
                 + its compensated projections 8 d (d_att + F) + the solver on the widest input
                 k 8 max(d_att, F)^2, k the solver matrices the compensator declares
                 (``secateur.compensate.SOLVER_MATRICES``)

and a streamed evaluation: resident + block + 2 W T d b (every window's hidden states, the block's inputs and
outputs) + T (3 F + 4 d) b + H T^2 b (one window through a block) + 2 x 512 x V x 4 (float32 logits of one
scoring chunk and its softmax).

An ordinary prune of a local folder by a streamable method is checked too (:func:`whole_prune_plan`: every weight + the
activations), silently when it fits; when it does not, the refusal names ``--stream``.

This module keeps the arithmetic and names no method or compensator: a method declares its own terms (statistics,
selection) and whether it reads activations, a compensator its solver matrices, and the caller hands them in.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from secateur.errors import SecateurError

GIB = 1024**3
ENV = "SECATEUR_MEM_AVAILABLE_MB"


def available_bytes() -> int | None:
    """Memory this process may still take: ``$SECATEUR_MEM_AVAILABLE_MB`` (tests, cgroups), else MemAvailable,
    else None (unknown: nothing is refused)."""
    env = os.environ.get(ENV)
    if env:
        try:
            return int(float(env) * 1024**2)
        except ValueError:
            raise SecateurError(f"{ENV}={env!r} is not a number of MB") from None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def current_rss() -> int | None:
    """This process's resident memory now (the interpreter and libraries the plan's terms come on top of)."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _gb(n: float) -> str:
    for unit, size in (("GiB", GIB), ("MiB", 1024**2)):
        if n >= size / 10:
            return f"{n / size:.2f} {unit}"
    return f"{n / 1024:.1f} KiB"


@dataclass
class MemoryPlan:
    """Named terms (bytes, and how each is computed) of a run's peak memory."""

    what: str
    terms: dict[str, tuple[int, str]] = field(default_factory=dict)
    fix: str = "use fewer --nsamples or a shorter --seqlen"

    def add(self, name: str, nbytes: float, how: str) -> None:
        self.terms[name] = (int(nbytes), how)

    @property
    def total(self) -> int:
        return sum(b for b, _ in self.terms.values())

    def describe(self, available: int | None = None) -> str:
        parts = " + ".join(f"{k} {_gb(b)} [{how}]" for k, (b, how) in self.terms.items())
        avail = "unknown" if available is None else _gb(available)
        own = current_rss()
        now = f"this process holds {_gb(own)} now; " if own else ""
        return (f"memory plan ({self.what}): {now}the {self.what} adds about {_gb(self.total)} more at its peak "
                f"= {parts}; {avail} more is available")

    def check(self, available: int | None = None) -> None:
        """Refuse (one line) when the plan does not fit in ``available`` (default: :func:`available_bytes`)."""
        available = available_bytes() if available is None else available
        if available is not None and self.total > available:
            raise SecateurError(f"not enough memory for the {self.what}: it needs about {_gb(self.total)} "
                                f"(the memory plan above), {_gb(available)} is available; {self.fix}")


@dataclass(frozen=True)
class Shape:
    """What the plans need of a model: bytes of the resident tensors, of one block and its largest file tensor,
    the widths, the prunable weights and the run's bytes per element."""

    resident: int
    block: int
    read: int
    hidden: int
    ffn: int
    attn: int  # query heads x head_dim (the o_proj input width)
    heads: int
    vocab: int
    layers: int
    prunable: int
    elem: int
    head: int = 0  # bytes of an untied LM head (a streamed prune copies it to the output without holding it)


_RESIDENT = "embeddings + final norm + head"
_RESIDENT_NO_HEAD = "embeddings + final norm; the untied head is copied file to file, never held"


def prune_plan(s: Shape, method_terms: dict[str, tuple[int, str]], activations: bool, nsamples: int, seqlen: int,
               chunk: int, mode: str = "sequential") -> MemoryPlan:
    """The streamed prune's plan (module docstring): ``activations``: whether the method reads the calibration
    activations; ``method_terms``: the terms the method declares (``Method.memory``: statistics, selection)."""
    d, f, b, n, t = s.hidden, s.ffn, s.elem, nsamples, seqlen
    c = min(chunk, n)
    p = MemoryPlan("streamed prune")
    p.add("resident", s.resident - s.head, _RESIDENT if not s.head else _RESIDENT_NO_HEAD)
    p.add("block", s.block + s.read, "one decoder block + its largest tensor as read")
    if activations:
        k = 4 if mode == "dense-block" else 3
        p.add("activations", n * t * (k * d + f) * b, f"N {n} x T {t} x ({k} x d {d} + F {f}) x {b} B")
        p.add("workspace", c * t * (3 * f + 4 * d) * b + c * s.heads * t * t * b + c * t * max(d, f) * 8,
              f"c {c} x T {t} x ((3 F + 4 d) x {b} + H {s.heads} x T x {b} + max(d, F) x 8)")
    for name, (nbytes, how) in method_terms.items():
        p.add(name, nbytes, how)
    p.add("masks", s.prunable // 8 + s.prunable // s.layers, f"P {s.prunable} / 8 + P / L {s.layers}")
    return p


def structured_prune_plan(s: Shape, nsamples: int, seqlen: int, chunk: int, score_stats: bool,
                          solver: tuple[str, int] | None) -> MemoryPlan:
    """The streamed structured prune's plan (module docstring); ``nsamples`` 0 without calibration data;
    ``score_stats``: the selection score reads the per-channel statistics; ``solver``: (compensation, the solver
    matrices its compensator declares), None without compensation."""
    d, f, a, b, n, t, L = s.hidden, s.ffn, s.attn, s.elem, nsamples, seqlen, s.layers
    c = min(chunk, n)
    p = MemoryPlan("streamed structured prune")
    p.add("resident", s.resident - s.head, _RESIDENT if not s.head else _RESIDENT_NO_HEAD)
    p.add("block", s.block + s.read, "one decoder block + its largest tensor as read")
    if n:
        p.add("activations", n * t * (3 * d + f) * b, f"N {n} x T {t} x (3 x d {d} + F {f}) x {b} B")
        p.add("workspace", c * t * (3 * f + 4 * d) * b + c * s.heads * t * t * b + c * t * max(d, f) * 8,
              f"c {c} x T {t} x ((3 F + 4 d) x {b} + H {s.heads} x T x {b} + max(d, F) x 8)")
    sel = 24 * L * (a + f) if score_stats else 0
    p.add("statistics", sel + 8 * L * (s.heads + f), f"{'24 L (d_att + F) + ' if sel else ''}8 L {L} (H + F)")
    if solver is not None:
        name, k = solver
        p.add("grams", 8 * (a * a + f * f) + 8 * d * (a + f) + k * 8 * max(a, f) ** 2,
              f"8 (d_att^2 {a}^2 + F^2 {f}^2) + 8 d (d_att + F) + {k} x 8 max(d_att, F)^2 ({name})")
    return p


def eval_plan(s: Shape, windows: int, seqlen: int) -> MemoryPlan:
    """The streamed evaluation's plan (see the module docstring)."""
    d, f, b, w, t = s.hidden, s.ffn, s.elem, windows, seqlen
    p = MemoryPlan("streamed evaluation", fix="use fewer --max-windows or a shorter --seqlen")
    p.add("resident", s.resident, "embeddings + final norm + head")
    p.add("block", s.block + s.read, "one decoder block + its largest tensor as read")
    p.add("hidden states", 2 * w * t * d * b, f"2 x W {w} x T {t} x d {d} x {b} B")
    p.add("workspace", t * (3 * f + 4 * d) * b + s.heads * t * t * b + 2 * 512 * s.vocab * 4,
          f"T {t} x ((3 F + 4 d) x {b} + H {s.heads} x T x {b}) + 2 x 512 x V {s.vocab} x 4")
    return p


def shape_of(model, adapter, stream) -> Shape:
    """The :class:`Shape` of a model built by :func:`secateur.models.streaming.load_streamed` (or on meta)."""
    g = adapter.geometry
    params = dict(adapter.model.named_parameters(remove_duplicate=False))
    tensors = {k: params.get(k) for k in stream.file_keys}

    def nbytes(k: str) -> int:
        t = tensors[k]
        return 0 if t is None else t.numel() * t.element_size()

    block0 = stream.block_names(0)
    read = max((stream.weights.info[stream.file_keys[k]].dtype.itemsize * tensors[k].numel()
                for k in block0 if tensors[k] is not None), default=0)
    prefix = stream.prefix + "."
    prunable = sum(r.weight.numel() for layer in adapter.layers for r in adapter.linears(layer).values())
    elem = next(p for p in model.parameters()).element_size()
    return Shape(resident=sum(nbytes(k) for k in stream.file_keys if not k.startswith(prefix)),
                 head=sum(nbytes(k) for k in stream.untied_head()),
                 block=sum(nbytes(k) for k in block0), read=read, hidden=g.hidden, ffn=g.intermediate,
                 attn=g.n_heads * g.head_dim, heads=g.n_heads,
                 vocab=int(getattr(model.config, "vocab_size", 0) or getattr(model.config, "num_labels", 0)),
                 layers=adapter.n_layers, prunable=prunable, elem=elem)


def whole_prune_plan(folder: str | Path, cfg: dict, elem: int, activations: bool, nsamples: int, seqlen: int
                     ) -> MemoryPlan:
    """An ordinary (not streamed) unstructured prune: every weight in memory (read from the safetensors headers,
    in the run's dtype) + the activations of :func:`prune_plan`; its fix names ``--stream``."""
    from secateur.models.streaming import LazyWeights

    weights = LazyWeights(folder)
    n = sum(_numel(i.shape) for i in weights.info.values())
    d = int(cfg.get("hidden_size") or cfg.get("n_embd") or 0)
    f = int(cfg.get("intermediate_size") or cfg.get("ffn_dim") or cfg.get("n_inner") or 4 * d)
    p = MemoryPlan("prune", fix="pass --stream (one decoder block in memory at a time), or use fewer --nsamples")
    p.add("weights", n * elem, f"{n} parameters x {elem} B")
    if activations:
        p.add("activations", nsamples * seqlen * (3 * d + f) * elem,
              f"N {nsamples} x T {seqlen} x (3 x d {d} + F {f}) x {elem} B")
    return p


def _numel(shape) -> int:
    return math.prod(int(s) for s in shape)
