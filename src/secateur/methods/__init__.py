"""Pruning methods as compositions of stages. ``registry.METHODS`` maps a CLI name to its runner."""
