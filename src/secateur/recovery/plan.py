"""The memory plan of a recovery, printed before training and refused (one line) when it exceeds the memory this
machine has available (:func:`secateur.models.memory.available_bytes`).

Terms (b bytes per element of the run's dtype; B batch, T seqlen, L layers, d hidden, F FFN width, H heads, V vocab,
k top-k, r rank)::

    student      P_s x b                    every tensor of the run folder (read from the safetensors headers)
    teacher      P_t x b                    the dense model (none with --loss ce and text that is not `self`)
    adapters     16 x r x sum(in + out)     LoRA A and B in float32 + their gradients + AdamW's two moments
    activations  B T L (12 d + 5 F) b + B H T^2 L b
                                            what autograd keeps per layer (norms, q/k/v/o, residuals, gate, up,
                                            their product) + attention probabilities if SDPA falls back to its math
                                            kernel (an upper bound: the fused kernels keep none)
    logits       3 x B T V x 4              the student's float32 logits, their log-softmax and its gradient
    teacher top-k  B T V x 4 + B T k x 12   the teacher's logits of one batch (freed after the top-k) + the top-k
                                            log-probabilities (float32) and ids (int64)
    windows      (N + N_h) T x 16           the training and held-out token ids (int64) and the lists they are
                                            drawn into: a ``--tokens`` no machine can hold is refused here, before
                                            any model is loaded

F is the dense width read from the config (sliced runs: an upper bound).
"""

from __future__ import annotations

import math
from pathlib import Path

from secateur.models.memory import MemoryPlan

_ELEM = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def _headers(folder: Path) -> dict[str, tuple[int, ...]]:
    """name -> shape of every tensor of a folder's safetensors files (headers only: :class:`LazyWeights`)."""
    from secateur.models.streaming import LazyWeights

    return {name: tuple(i.shape) for name, i in LazyWeights(folder).info.items()}


def folder_params(folder: str | Path | None) -> int | None:
    """Parameters of a local model folder (None: not a local safetensors folder)."""
    if folder is None or not Path(folder).is_dir() or not any(Path(folder).glob("*.safetensors")):
        return None
    return sum(math.prod(s) for s in _headers(Path(folder)).values())


def lora_params(folder: str | Path, projections: list[str], rank: int) -> int:
    """``r x (in + out)`` summed over the folder's non-empty 2-D weights whose name ends with a projection name."""
    n = 0
    for name, shape in _headers(Path(folder)).items():
        if len(shape) == 2 and math.prod(shape) and any(name.endswith(f".{p}.weight") for p in projections):
            n += rank * (shape[0] + shape[1])
    return n


def recovery_plan(cfg: dict, student_params: int, teacher_params: int | None, teacher_note: str, n_lora: int,
                  elem: int, batch: int, seqlen: int, topk: int, with_teacher: bool, windows: int = 0
                  ) -> MemoryPlan:
    d = int(cfg.get("hidden_size") or cfg.get("n_embd") or 0)
    f = int(cfg.get("intermediate_size") or cfg.get("ffn_dim") or cfg.get("n_inner") or 4 * d)
    L = int(cfg.get("num_hidden_layers") or cfg.get("n_layer") or 0)
    H = int(cfg.get("num_attention_heads") or cfg.get("n_head") or 0)
    V = int(cfg.get("vocab_size") or 0)
    B, T, b = batch, seqlen, elem
    p = MemoryPlan("recovery", fix="use a smaller --batch or --seqlen (or --rank, --tokens)")
    p.add("student", student_params * b, f"{student_params} parameters x {b} B")
    if with_teacher:
        tp = teacher_params if teacher_params is not None else student_params
        p.add("teacher", tp * b, f"{tp} parameters x {b} B{teacher_note}")
    p.add("adapters", 16 * n_lora, f"{n_lora} LoRA parameters x 16 B (float32 weight, gradient, 2 AdamW moments)")
    p.add("activations", B * T * L * (12 * d + 5 * f) * b + B * H * T * T * L * b,
          f"B {B} x T {T} x L {L} x ((12 d {d} + 5 F {f}) + H {H} x T) x {b} B")
    p.add("logits", 3 * B * T * V * 4, f"3 x B x T x V {V} x 4 B")
    if with_teacher:
        p.add("teacher top-k", B * T * V * 4 + B * T * topk * 12, f"B x T x (V x 4 + k {topk} x 12) B")
    if windows:
        p.add("windows", windows * T * 16, f"{windows} windows x T x 16 B (int64 ids + the lists they are drawn into)")
    return p
