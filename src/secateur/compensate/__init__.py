"""Post-pruning compensators: pure functions of (weights, calibration statistics, kept indices).

Every compensator has the signature (see :mod:`secateur.compensate.base`)::

    fn(w0: Tensor[d_out, d_in], stats: InputStats | Gram, kept: Tensor | Sequence[int], *,
       bias: Tensor[d_out] | None = None, **options) -> Compensation(weight[d_out, |K|], bias | None, kept,
                                                                     diagnostics)

Registered compensators (``COMPENSATORS`` / :func:`compensate`):

* ``none``      - ``W0[:, K]`` (:func:`base.slice_only`)
* ``flap_bias`` - ``b + W0[:, P] mu_P`` (:func:`flap_bias.flap_bias`)
* ``ls``        - ``G_yx (G_xx + lambda I)^-1``, optional intercept (:func:`ls.ls_refit`)
* ``rcpu``      - ``s* polar(G_yx W_K^T) W_K`` (:func:`rcpu.rcpu`)
* ``coec``      - ``Q_l W_K^(S) Q_r`` with tempering, GCV, reduced-Stiefel right rotation, alignment
  (:func:`coec.coec`, options :class:`coec.COECOptions`, Table-3 presets :func:`coec.coec_ablation_options`)
* ``corp_mlp``  - ``W2[:, S] + W2[:, P] B`` and bias ``b2 + W2[:, P] c`` (ridge affine, :func:`corp.corp_mlp`)

CORP's Q/K logit compensator acts on q/k projections instead: :func:`corp.corp_qk_layer`.
Shared numerics live in :mod:`secateur.linalg`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from secateur.calib.stats import Gram
from secateur.compensate.base import (
    Compensation,
    Compensator,
    InputStats,
    recon_error,
    relative_recon_error,
    slice_only,
)
from secateur.compensate.coec import COECOptions, ValueProjection, coec, coec_ablation_options
from secateur.compensate.corp import corp_mlp, corp_qk_layer
from secateur.compensate.flap_bias import flap_bias
from secateur.compensate.ls import ls_refit
from secateur.compensate.rcpu import rcpu
from secateur.errors import SecateurError

COMPENSATORS: dict[str, Compensator] = {
    "none": slice_only,
    "flap_bias": flap_bias,
    "ls": ls_refit,
    "rcpu": rcpu,
    "coec": coec,
    "corp_mlp": corp_mlp,
}


#: the float64 n x n matrices (n: the widest compensated input) each structured ``--compensation`` holds at once,
#: the solver term of the streamed memory plan (:func:`secateur.models.memory.structured_prune_plan`):
#: coec: four matrices + LAPACK's eigh workspace (syevd: 1 + 6n + 2n^2 doubles), measured at 7B widths
#: (results/speed/scale.md: a plan with 4 fell 2.0 GiB short of the peak on an 11008-wide down_proj); ls: G_xx + ridge,
#: its symmetrized copy and Cholesky factor, and the error diagnostic (W0 C, W0 and C_KK, base.ReconError): a plan
#: with 2 fell 1.54 GiB short at 7B widths; rcpu, corp: the Gram and one product; none, bias: none.
SOLVER_MATRICES: dict[str, int] = {"none": 0, "bias": 0, "ls": 4, "grail": 4, "rcpu": 2, "corp": 2, "coec": 6}


def solver_matrices(compensation: str) -> int:
    """:data:`SOLVER_MATRICES` of a structured ``--compensation`` (an unknown one is an error, never a guess)."""
    try:
        return SOLVER_MATRICES[compensation]
    except KeyError:
        raise SecateurError(f"no memory term for compensation {compensation!r}; declare it in "
                            "secateur.compensate.SOLVER_MATRICES") from None


def compensate(method: str, w0: torch.Tensor, stats: InputStats | Gram, kept: torch.Tensor | Sequence[int], *,
               bias: torch.Tensor | None = None, **options: Any) -> Compensation:
    """Run the compensator registered as ``method`` (see the table above)."""
    try:
        fn = COMPENSATORS[method]
    except KeyError:
        raise SecateurError(f"unknown compensator {method!r}; choose from {sorted(COMPENSATORS)}") from None
    return fn(w0, stats, kept, bias=bias, **options)


__all__ = [
    "COMPENSATORS", "SOLVER_MATRICES", "solver_matrices", "compensate", "Compensation", "Compensator",
    "InputStats", "recon_error",
    "relative_recon_error", "slice_only", "flap_bias", "ls_refit", "rcpu", "coec", "COECOptions",
    "ValueProjection", "coec_ablation_options", "corp_mlp", "corp_qk_layer",
]
