"""``secateur report``: a Markdown and an HTML report of pruning runs, built only from their JSON.

Inputs (``RUN_DIRS``), each one of

* a **run folder** written by ``secateur prune --out RUN``: ``RUN/secateur-report.json`` (required), plus
  any evaluation JSON written next to it with ``--json`` (the convention, docs/report.md)::

      secateur eval ppl      --model RUN --dataset wikitext2 --json RUN/ppl-wikitext2.json
      secateur eval zeroshot --model RUN --json RUN/zeroshot.json
      secateur eval qk-error --model RUN --json RUN/qk-error.json

  Every other ``*.json`` in the folder is classified by its ``protocol`` field, not by its name:
  ``nonoverlap-L`` / ``sliding-L-S`` (perplexity), ``zeroshot-lmeval-mc-0shot`` (zero-shot; several files
  merge task by task), ``qk-error-eq49`` (QK error). Hugging Face files (config, tokenizer, ...) are
  skipped; a structured run's ``secateur_selection.json`` supplies kept widths when the report's
  ``details`` have none; anything else is listed as ignored. A file that is not valid JSON is an error.
* a **JSONL results file** from ``bench/`` (``results/*/*.jsonl``): one run per row, with keys such as
  ``row``/``key``, ``method``, ``sparsity``/``rho``, ``preset``, ``wikitext2``/``c4``/``ptb`` or
  ``ppl: {dataset: {...}}``, ``realized_sparsity``/``realized``, ``prune_s``, ``peak_rss_mb``,
  ``calibration``. A later row with the same ``(preset, row)`` replaces an earlier one (as the bench
  renderers do); ``kind: "qk-error"`` rows attach their QK error to the row of the same name.

Output (``--out DIR``, written atomically with :func:`secateur.safe_write.atomic_dir`): ``report.md`` (plots as
``plots/*.png`` next to it), ``secateur-report-index.json`` (schema version, title and inputs; the marker that lets
``--overwrite`` replace the folder later) and ``report.html`` (one self-contained file: inline CSS, the same plots
embedded as base64 PNG). Numbers: perplexity 3 decimals, percentages 2 decimals, seconds 2 decimals, MiB
whole. Perplexity columns are keyed by (dataset, protocol id, windows used): numbers from different
protocols or window subsets never share a column. Plots need matplotlib (extra ``plots``); without it
the report says so and keeps every table.

Modules: :mod:`~secateur.report.load` (inputs -> :class:`Run`), :mod:`~secateur.report.sections` (one
function per section), :mod:`~secateur.report.render` (the Markdown/HTML document), :mod:`~secateur.plots`;
this module composes them, writes the folder and registers the CLI.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from secateur.errors import SecateurError
from secateur.report import sections
from secateur.report.load import Run, load_inputs
from secateur.report.render import Doc
from secateur.runinfo import SCHEMA_VERSION
from secateur.safe_write import REPORT_INDEX, atomic_dir, check_output_dir
from secateur.schemas.api import checked_call


def build(runs: list[Run], title: str, with_plots: bool = True) -> Doc:
    """The report document: intro, perplexity, zero-shot, structured, allocation, QK error, manifests."""
    plots = None
    note = None
    if with_plots:
        try:
            from secateur import plots  # needs matplotlib
        except ImportError:
            note = "Plots skipped: matplotlib is not installed (`pip install 'secateur[plots]'`)."
    runs = sorted(runs, key=sections.order_key)  # stable: input order within a sparsity level
    doc = Doc()
    sections.intro(doc, runs, title, note)
    sections.perplexity(doc, runs, plots)
    sections.zeroshot(doc, runs)
    sections.accuracy(doc, runs)
    sections.structured(doc, runs)
    sections.allocation(doc, runs, plots)
    sections.qk_error(doc, runs, plots)
    sections.manifests(doc, runs)
    return doc


@checked_call
def write_report(run_paths: list[str | os.PathLike], out: str | os.PathLike, title: str = "secateur report",
                 overwrite: bool = False, preset: str | None = None) -> Path:
    """Read every input (all errors before anything is written), then write ``out/`` atomically. Arguments of the
    wrong type are one line naming them (:func:`~secateur.schemas.api.checked_call`)."""
    run_paths = [os.fspath(p) for p in run_paths]
    runs = load_inputs(run_paths, preset)
    out_r = Path(out).resolve()
    for s in run_paths:
        p = Path(s).resolve()
        if out_r == p or out_r in p.parents:
            raise SecateurError(f"--out {out} would replace the input {s}")
    check_output_dir(out, overwrite, kind="report")
    doc = build(runs, title)
    md, page = doc.markdown(), doc.html(title)
    with atomic_dir(out, overwrite, kind="report") as tmp:
        (tmp / REPORT_INDEX).write_text(json.dumps({"schema_version": SCHEMA_VERSION, "title": title,
                                                     "inputs": list(run_paths)}, indent=1))
        (tmp / "report.md").write_text(md)
        (tmp / "report.html").write_text(page)
        if doc.plots:
            (tmp / "plots").mkdir()
            for name, png in doc.plots.items():
                (tmp / "plots" / name).write_bytes(png)
    return Path(out)


# ------------------------------------------------------------------------------------------- CLI


def register_cli(subparsers) -> argparse.ArgumentParser:
    """Add ``secateur report``."""
    p = subparsers.add_parser(
        "report", help="Markdown + HTML report of pruning runs (tables and plots from their JSON)",
        description="Tables in the papers' layouts (perplexity by method and sparsity, zero-shot, structured "
                    "widths, QK error), plots and the protocol manifests, from secateur prune output folders "
                    "(secateur-report.json plus eval JSON written beside it with --json RUN/<name>.json) and "
                    "bench results files (*.jsonl). See docs/report.md.")
    p.add_argument("runs", nargs="+", metavar="RUN", help="secateur prune output folder or bench .jsonl file")
    p.add_argument("--out", default="report", help="output folder, written atomically (default: %(default)s)")
    p.add_argument("--title", default="secateur report", help="report title (default: %(default)s)")
    p.add_argument("--preset", default=None, help="keep only JSONL rows of this bench preset")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    p.set_defaults(func=cli_report)
    return p


def cli_report(args) -> int:
    out = write_report(args.runs, args.out, args.title, args.overwrite, args.preset)
    n_plots = len(list((out / "plots").glob("*.png"))) if (out / "plots").is_dir() else 0
    print(f"wrote {out / 'report.md'} and {out / 'report.html'} ({n_plots} plots)")
    return 0
