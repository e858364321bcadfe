"""Budgets and allocators: masks with explicit rounding and tie rules (:mod:`masks`), structured
allocation (:mod:`allocate`: uniform, global greedy, FLAP AL-AM, blocks; guards), score-then-allocate
(:mod:`select`), CoCurve's conditional greedy and lambda path (:mod:`greedy`) and its held-out KL choice
(:mod:`heldout`)."""
