"""Held-out teacher-KL selection of the final mask (cocurve.md §6, the paper's "closing the loop").

    R(S; C') = mean over every token of the held-out sequences of KL( p_0(.|x<=t) || p_S(.|x<=t) )

with the full vocabulary, float32 logits and ``log_softmax`` differences (no probability underflow;
cocurve.md §11). A mask is evaluated without slicing: forward pre-hooks zero the removed input columns
of ``o_proj`` / ``down_proj``, which computes exactly the masked (and, by V9, the sliced) model.
``S_hat = argmin_S R(S; C')`` over the candidate family (``rule='min'``, the paper's rule); ties go to the smaller
lambda (candidates come ordered by their smallest lambda and the first minimum wins). The one-standard-error set
uses the spread of per-sequence mean KLs.

Paired rule (``rule='paired'``, issue 45; CoCurve's default): every candidate is scored on the same held-out
sequences, so candidate ``k`` is compared with the reference (candidate 0, the lambda = 0 diagonal mask) through
the per-sequence differences ``d_i = R_i(S_k) - R_i(S_0)`` (``R_i``: the mean token KL of sequence ``i``):

    mean  d_k = (1/n) sum_i d_i,      paired SE_k = sqrt( sum_i (d_i - d_k)^2 / (n - 1) / n )

(the SE of the differences, which the correlation between candidates makes far smaller than the unpaired
``sqrt(SE_k^2 + SE_0^2)``). A candidate *beats the diagonal* when ``d_k + SE_k < 0`` (lower by more than its paired
SE: a one-SE rule on the paired SE); the choice is the lowest mean KL among the reference and the candidates that
beat it (ties: the smaller lambda), so a lambda > 0 is chosen only when it beats the diagonal by more than noise.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from secateur.errors import SecateurError
from secateur.models.adapters import Adapter
from secateur.structured.units import ATTN_KINDS, MLP_KINDS, Inventory


def column_masks(inv: Inventory, removed: torch.Tensor) -> dict[tuple[int, str], torch.Tensor]:
    """``{(layer, 'attn_out'|'mlp_out'): removed input columns}`` of a removal mask over ``inv``."""
    out: dict[tuple[int, str], list[torch.Tensor]] = {}
    m = inv.head_dim
    for p in inv.pools:
        r = removed[p.offset:p.offset + p.n]
        if not bool(r.any()):
            continue
        mem = p.members[r[p.unit_of_member]]
        if p.kind in ATTN_KINDS:
            out.setdefault((p.layer, "attn_out"), []).append((mem[:, None] * m + torch.arange(m)).reshape(-1))
        elif p.kind in MLP_KINDS:
            out.setdefault((p.layer, "mlp_out"), []).append(mem)
        else:
            raise SecateurError("held-out masking handles head/KV-group and channel/FFN-group units only")
    return {k: torch.cat(v) for k, v in out.items()}


@contextmanager
def masked(adapter: Adapter, inv: Inventory, removed: torch.Tensor) -> Iterator[None]:
    """Within the block, the model computes as if the removed units were zeroed (weights untouched)."""
    handles = []
    try:
        for (li, group), cols in column_masks(inv, removed).items():
            mod = adapter.out_module(adapter.layers[li], group)
            width = adapter.role_refs(adapter.layers[li])["o" if group == "attn_out" else "down"].in_features
            keep = torch.ones(width, dtype=next(mod.parameters()).dtype, device=adapter.device)
            keep[cols.to(adapter.device)] = 0

            def pre(_m: nn.Module, args: tuple, keep=keep) -> tuple:
                return (args[0] * keep, *args[1:])

            handles.append(mod.register_forward_pre_hook(pre))
        yield
    finally:
        for h in handles:
            h.remove()


class HeldoutKL:
    """Dense teacher on a held-out set ``ids [n, T]``; :meth:`evaluate` gives the KL of the current model.

    Dense log-probabilities are cached when ``n T V <= cache_elems`` (else recomputed from the cached
    dense final hidden states, one LM-head pass per evaluation)."""

    def __init__(self, model: nn.Module, ids: torch.Tensor, chunk: int = 512, cache_elems: int = 2**28) -> None:
        if ids.dim() != 2 or ids.shape[0] < 1:
            raise SecateurError("held-out ids must be [n >= 1, T]")
        self.model, self.ids, self.chunk = model, ids, chunk
        self.head = model.get_output_embeddings()
        self.device = next(model.parameters()).device
        vocab = self.head.weight.shape[0]
        self.hidden = [self._final_hidden(ids[i:i + 1]) for i in range(ids.shape[0])]
        self.cached = ids.numel() * vocab <= cache_elems
        self.logp0 = [self._logp(h) for h in self.hidden] if self.cached else None

    @torch.no_grad()
    def _final_hidden(self, x: torch.Tensor, model: nn.Module | None = None) -> torch.Tensor:
        m = self.model if model is None else model
        return m.base_model(input_ids=x.to(self.device), use_cache=False).last_hidden_state[0]

    def _logp(self, h: torch.Tensor) -> torch.Tensor:
        return torch.cat([torch.log_softmax(self.head(h[s:s + self.chunk]).float(), -1)
                          for s in range(0, h.shape[0], self.chunk)])

    @torch.no_grad()
    def evaluate(self, model: nn.Module | None = None) -> dict:
        """Mean per-token KL(p_0 || p_model) over the held-out set, its per-sequence SE, and counts.

        ``model``: another model to score against the dense teacher (e.g. a sliced and compensated copy
        sharing the vocabulary); default the teacher's own model as it currently computes (masks/hooks)."""
        head = self.head if model is None else model.get_output_embeddings()
        per_seq = []
        for i in range(self.ids.shape[0]):
            h = self._final_hidden(self.ids[i:i + 1], model)
            h0 = self.hidden[i]
            tot = 0.0
            for s in range(0, h.shape[0], self.chunk):
                logq = torch.log_softmax(head(h[s:s + self.chunk]).float(), -1)
                logp = self.logp0[i][s:s + self.chunk] if self.cached else \
                    torch.log_softmax(self.head(h0[s:s + self.chunk]).float(), -1)
                tot += float((logp.exp() * (logp - logq)).sum(-1).to(torch.float64).sum())
            per_seq.append(tot / h.shape[0])
        return {"kl": sum(per_seq) / len(per_seq), "se": standard_error(per_seq), "per_sequence": per_seq,
                "tokens": int(self.ids.numel())}


RULES = ("paired", "min")


def standard_error(xs: list[float]) -> float:
    """``sqrt( sum_i (x_i - mean)^2 / (n - 1) / n )`` (0 for a single value): the SE of a mean over sequences."""
    n = len(xs)
    if n < 2:
        return 0.0
    mean = sum(xs) / n
    return math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1) / n)


def paired_choice(per_seq: list[list[float]], reference: int = 0) -> dict:
    """The paired one-SE rule of the module docstring over ``per_seq[k][i]`` (candidate ``k``, sequence ``i``)."""
    ref = per_seq[reference]
    if any(len(x) != len(ref) for x in per_seq):
        raise SecateurError("paired differences need every candidate scored on the same sequences")
    n = len(ref)
    means = [sum(x) / n for x in per_seq]
    diffs = [[a - b for a, b in zip(x, ref)] for x in per_seq]
    d_mean = [sum(d) / n for d in diffs]
    d_se = [standard_error(d) for d in diffs]
    beats = [k != reference and d_mean[k] + d_se[k] < 0 for k in range(len(per_seq))]
    eligible = [reference] + [k for k, b in enumerate(beats) if b]
    chosen = min(eligible, key=lambda k: (means[k], k))
    return {"chosen": chosen, "reference": reference, "diff": d_mean, "paired_se": d_se, "beats_reference": beats}


def select_heldout(adapter: Adapter | None, inv: Inventory, masks: list[torch.Tensor], teacher: HeldoutKL,
                   rule: str = "min", masker=None) -> dict:
    """Evaluate every mask by held-out teacher KL; ``chosen``: the first argmin (``rule='min'``, ``masks`` ordered
    by lambda) or the paired one-SE rule against ``masks[0]`` (``rule='paired'``); ``best`` is the argmin either
    way, ``per_sequence[k]`` mask ``k``'s per-sequence KLs and ``paired`` the paired statistics against mask 0.
    ``masker(mask)``: the context that applies a mask (default :func:`masked` on ``adapter`` and ``inv``); ``teacher``
    is anything with :meth:`HeldoutKL.evaluate`'s result (a VLM's caption-token KL)."""
    if rule not in RULES:
        raise SecateurError(f"unknown held-out rule {rule!r}; choose from {', '.join(RULES)}")
    if not masks:
        raise SecateurError("no candidate mask to select from")
    evals = []
    for r in masks:
        with masked(adapter, inv, r) if masker is None else masker(r):
            evals.append(teacher.evaluate())
    kls = [e["kl"] for e in evals]
    best = min(range(len(kls)), key=lambda i: (kls[i], i))
    one_se = [i for i, k in enumerate(kls) if k <= kls[best] + evals[best]["se"]]
    per_seq = [e["per_sequence"] for e in evals]
    paired = paired_choice(per_seq, 0)
    chosen = paired["chosen"] if rule == "paired" else best
    return {"chosen": chosen, "best": best, "rule": rule, "kl": kls, "se": [e["se"] for e in evals],
            "one_se_set": one_se, "per_sequence": per_seq, "paired": paired, "evals": evals}
