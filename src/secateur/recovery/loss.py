"""The recovery losses: top-k distillation KL from the teacher, or next-token cross-entropy.

Top-k KL, per token position t (``--loss kl``, k = ``--topk``)::

    S_t      = the k ids of the largest teacher logits z_t (ties: torch.topk's order)
    p_t(i)   = exp(z_t,i) / sum_{j in S_t} exp(z_t,j)          for i in S_t   (the teacher's top k, renormalized)
    log q_t  = log_softmax(student logits at t)                 over the FULL vocabulary, read at S_t
    KL_t     = sum_{i in S_t} p_t(i) (log p_t(i) - log q_t(i))  >= 0, 0 iff q_t = p_t on S_t

and the loss is the mean of KL_t over every position of every window in the batch. Because ``q`` is normalized over
the whole vocabulary, mass the student puts outside the teacher's top k is penalized (sum q_t(S_t) < 1 raises the
KL), so the truncation only drops the teacher's tail (a few percent of its mass for k = 64). The teacher's logits are
computed per batch under ``no_grad`` and only the top-k log-probabilities and ids are kept (B x T x k x 12 bytes).

Cross-entropy (``--loss ce``): the mean next-token negative log-likelihood of the window's own tokens (T - 1
positions per window); no teacher.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


@torch.no_grad()
def teacher_topk(teacher: torch.nn.Module, ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log p [B, T, k], ids [B, T, k])``: the teacher's top-k log-probabilities, renormalized over the k."""
    logits = teacher(input_ids=ids).logits.float()
    vals, top = logits.topk(min(k, logits.shape[-1]), dim=-1)
    del logits
    return torch.log_softmax(vals, dim=-1), top


def topk_kl(student_logits: torch.Tensor, logp_t: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """Mean over positions of ``sum_S p (log p - log q)`` (module docstring)."""
    logq = torch.log_softmax(student_logits.float(), dim=-1).gather(-1, top)
    return (logp_t.exp() * (logp_t - logq)).sum(-1).mean()


def next_token_ce(student_logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    v = student_logits.shape[-1]
    return F.cross_entropy(student_logits[:, :-1].float().reshape(-1, v), ids[:, 1:].reshape(-1))


def batch_loss(student: torch.nn.Module, ids: torch.Tensor, kind: str, teacher=None, k: int = 64) -> torch.Tensor:
    """The loss of one batch (the teacher's top-k computed first, then the student's forward)."""
    if kind == "kl":
        logp_t, top = teacher_topk(teacher, ids, k)
        return topk_kl(student(input_ids=ids).logits, logp_t, top)
    return next_token_ce(student(input_ids=ids).logits, ids)


@torch.no_grad()
def mean_loss(student: torch.nn.Module, windows: torch.Tensor, kind: str, teacher=None, k: int = 64,
              batch: int = 4) -> float:
    """The loss averaged over ``windows`` (every batch weighted by its windows), no gradients; ``student`` is left
    in evaluation mode (the training loop sets its own modes before each step)."""
    student.eval()
    total = 0.0
    for i in range(0, windows.shape[0], batch):
        ids = windows[i:i + batch]
        total += float(batch_loss(student, ids, kind, teacher, k)) * ids.shape[0]
    return total / windows.shape[0]
