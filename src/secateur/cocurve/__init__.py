"""CoCurve: cross-module co-pruning curvature (Gong et al., arXiv 2607.17568; spec cocurve.md).

Interaction-aware structured selection over a joint KV-group / FFN-group inventory:

* :mod:`features`  single-unit ablation sweep (shared dense prefix, LM head at sampled positions only)
                   and the finite-ablation Fisher features on the teacher's top-r support;
* :mod:`graph`     ``H`` = Fisher-Gram of the features (nodes and signed edges), surrogate, persistence;
* :mod:`greedy`    cost-normalized conditional greedy under the shared budget + guards, lambda path;
* :mod:`heldout`   full-vocabulary teacher-KL selection of the final mask;
* :mod:`runner`    the pipeline composed with :mod:`secateur.structured` (slicing, export);
* :mod:`dist`      torch.distributed (gloo/NCCL) block split with a world-size independent reduction.
"""

from secateur.cocurve.features import SweepConfig, ablation_sweep, fisher_features, sample_positions
from secateur.cocurve.graph import CoPruningGraph
from secateur.cocurve.greedy import DEFAULT_LAMBDAS, Candidate, GreedyResult, conditional_greedy, lambda_path
from secateur.cocurve.heldout import HeldoutKL, masked, select_heldout
from secateur.cocurve.runner import CoCurveConfig, CoCurveSelection, build_graph, cocurve_inventory, prune, select

__all__ = [
    "DEFAULT_LAMBDAS", "Candidate", "CoCurveConfig", "CoCurveSelection", "CoPruningGraph", "GreedyResult",
    "HeldoutKL", "SweepConfig", "ablation_sweep", "build_graph", "cocurve_inventory", "conditional_greedy",
    "fisher_features", "lambda_path", "masked", "prune", "sample_positions", "select", "select_heldout",
]
