"""``secateur report``: run folders and results JSONL -> Markdown + HTML tables (:mod:`build`), plots
(:mod:`plots`)."""
