"""Model-family adapters: where blocks, projections, heads, KV groups, RoPE and biases live.

A new architecture is a new adapter module in :mod:`secateur.models.families` (with its layout) plus its
tiny-model fixture, and nothing else: the calibration engine, scorers, compensators, slicers and evaluators
only talk to models through this interface. This module is the public face: the interface
(:mod:`secateur.models.families.base`) and the family registry (:mod:`secateur.models.families`).
"""

from __future__ import annotations

from secateur.models.families import ADAPTERS, adapter_class, get_adapter, supported_model_types
from secateur.models.families.base import GROUPS, HETERO_PREFIX, Adapter, Geometry, run_until

__all__ = ["ADAPTERS", "GROUPS", "HETERO_PREFIX", "Adapter", "Geometry", "adapter_class", "get_adapter",
           "run_until", "supported_model_types"]
