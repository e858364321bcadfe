"""Pruning methods as compositions of stages. ``registry.METHODS`` maps a CLI name to its runner.

One composition module per method family (``unstructured``, ``qk_wanda``, ``corp_qk``, ``structured``,
``cocurve``), each with a typed options dataclass (:mod:`~secateur.methods.knobs`: the CLI flags and the API
keywords are built from its fields), a ``*_config(opts)`` builder (the one path from options to the family's
validated config) and a ``run``; ``compensation`` is the compensation stage (and its options) shared by the
structured families; ``result.MethodResult`` is what every runner returns. The registry imports the
composition modules; they never import it. A new method: a composition module (or a function in one) plus one
``register(Method(...))`` line.
"""
