"""Structured units and their removal: :mod:`units` (inventory of removable KV groups, heads, MLP channels,
FFN groups and blocks, with their parameter costs), :mod:`selection` (the kept set of every layer, the hand-off
from selection to materialization) and :mod:`slicing` (physical slicing, masking, bias folding).

Scores live in :mod:`secateur.scoring.structured`, allocation in :mod:`secateur.budgets` (``select_units``:
score then allocate), the export of sliced models in :mod:`secateur.export.sliced`, their efficiency in
:mod:`secateur.eval.efficiency`.
"""
