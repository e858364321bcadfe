"""Scorers that need more than one projection's statistics.

QK-Wanda (:mod:`secateur.scoring.qk_wanda`): exact single-deletion costs of query/key weights under the
QK-product reconstruction loss, all eight M/R/C variants, MHA and GQA, retained biases.

API::

    QKVariant.parse("MRC") / VARIANTS
    stats = QKStats(Wq, Wk, bq, bk, geometry, variants="base", rope=None)   # Accumulator
    stats.update(x)                        # x [B, T, d]: B independent sequences (q/k input)
    Sq, Sk = qk_wanda_scores(Wq, Wk, bq, bk, stats, geometry, variant)       # [H_Q*m, d], [H_K*m, d]
    rope_tables(head_dim, T, theta) / model_rope_tables(model, T)            # (cos, sin) [T, m]
    segment_sequences(x, length)           # [B, T, ...] -> [B*T/length, length, ...]

Masks: :mod:`secateur.budgets.masks` (``shared_mask([Sq, Sk], rho)`` is the paper's default budget).
"""

from secateur.calib.rope import model_rope_tables, rope_tables
from secateur.scoring.qk_segments import segment_sequences
from secateur.scoring.qk_wanda import VARIANTS, QKStats, QKVariant, qk_wanda_scores

__all__ = ["VARIANTS", "QKStats", "QKVariant", "model_rope_tables", "qk_wanda_scores", "rope_tables",
           "segment_sequences"]
