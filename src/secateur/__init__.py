"""secateur: training-free pruning of large language models.

Pipeline stages (see docs/architecture.md): model adapters -> calibration capture ->
statistics accumulators -> scorers -> budgets/allocators -> compensators ->
materialize (mask / zero / slice) -> export -> evaluate.
"""

from secateur.errors import SecateurError

__version__ = "0.1.0"
__all__ = ["SecateurError", "__version__"]
