"""``secateur report``: run folders and results JSONL (:mod:`load`) -> sections (:mod:`sections`) -> Markdown +
HTML (:mod:`render`) with plots (:mod:`secateur.plots`); :mod:`build` composes them, writes the folder and
registers the CLI."""
