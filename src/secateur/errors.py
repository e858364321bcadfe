"""One exception type for every user-facing failure; the CLI turns it into exit code 2."""


class SecateurError(Exception):
    """A problem with the user's input (model, data, options) or environment, with a one-line message."""


#: where each kind of problem is explained: (module path prefix under ``secateur/``, the input it is about, its page
#: under ``docs/``); the first prefix that matches wins. The CLI's error line ends with the page of the module that
#: raised it (:func:`docs_page`), and the docs site's troubleshooting page groups every message by the same table.
TOPICS: list[tuple[str, str, str]] = [
    ("cli.py", "Command line", "getting-started.md"),
    ("options.py", "Options and recipes", "concepts/export.md"),
    ("schemas/", "Files read back (recipes, reports, manifests)", "errors.md"),
    ("launch.py", "Several processes (--procs, torchrun)", "distributed.md"),
    ("calib/dist.py", "Several processes (--procs, torchrun)", "distributed.md"),
    ("calib/resume.py", "Checkpoints and --resume", "concepts/export.md"),
    ("calib/", "Calibration", "protocols.md"),
    ("data/images.py", "Images (--calib, --dataset)", "vision.md"),
    ("data/captions.py", "Image-caption pairs (VLM)", "vlm.md"),
    ("data/", "Text data (--calib, --dataset, --data-dir)", "protocols.md"),
    ("models/streaming.py", "Models larger than memory (--stream)", "streaming.md"),
    ("models/memory.py", "Memory plans", "streaming.md"),
    ("models/towers.py", "Vision-language models (--towers)", "vlm.md"),
    ("vlm_run.py", "Vision-language models (--towers)", "vlm.md"),
    ("vlm_joint.py", "Vision-language models: one budget (--towers joint)", "vlm-joint.md"),
    ("masks_file.py", "Outputs (--out, --overwrite)", "concepts/export.md"),
    ("api.py", "Python API", "reference/api.md"),
    ("extras.py", "Optional extras (pip install secateur[...])", "getting-started.md"),
    ("models/", "Models (--model, GGUF, families)", "models.md"),
    ("methods/qk_wanda.py", "QK-Wanda", "methods/qk-wanda.md"),
    ("scoring/qk", "QK-Wanda", "methods/qk-wanda.md"),
    ("calib/qk.py", "QK-Wanda", "methods/qk-wanda.md"),
    ("methods/cocurve.py", "CoCurve", "methods/cocurve.md"),
    ("scoring/cocurve", "CoCurve", "methods/cocurve.md"),
    ("budgets/greedy.py", "CoCurve", "methods/cocurve.md"),
    ("budgets/heldout.py", "CoCurve", "methods/cocurve.md"),
    ("methods/corp_qk.py", "CORP", "methods/corp.md"),
    ("scoring/corp.py", "CORP", "methods/corp.md"),
    ("compensate/corp.py", "CORP", "methods/corp.md"),
    ("compensate/", "Compensators", "concepts/compensators.md"),
    ("budgets/", "Budgets and allocation", "concepts/budgets.md"),
    ("structured/", "Units and slicing", "concepts/units.md"),
    ("methods/", "Methods and their options", "methods/index.md"),
    ("scoring/", "Methods and their options", "methods/index.md"),
    ("eval/", "Evaluation (secateur eval)", "protocols.md"),
    ("export/gguf", "Export to GGUF (llama.cpp)", "concepts/export.md"),
    ("export/vllm.py", "Export for vLLM", "concepts/deployment.md"),
    ("export/", "Outputs (--out, --overwrite)", "concepts/export.md"),
    ("safe_write.py", "Outputs (--out, --overwrite)", "concepts/export.md"),
    ("files.py", "Outputs (--out, --overwrite)", "concepts/export.md"),
    ("recovery/", "Recovery (secateur recover)", "recovery.md"),
    ("report/", "Reports (secateur report)", "report.md"),
    ("", "Everything else", "errors.md"),
]


def topic(rel: str) -> tuple[str, str]:
    """``(input, page)`` of a module path under ``secateur/`` (e.g. ``"calib/dist.py"``)."""
    for prefix, title, page in TOPICS:
        if rel.startswith(prefix):
            return title, page
    raise AssertionError(rel)  # the "" prefix matches everything


def docs_page(e: BaseException) -> str:
    """The docs page that explains ``e``: the page of the innermost secateur module in its traceback (where it was
    raised), ``errors.md`` when none is."""
    from pathlib import Path

    root = Path(__file__).resolve().parent
    rel, tb = None, e.__traceback__
    while tb is not None:
        try:
            rel = Path(tb.tb_frame.f_code.co_filename).resolve().relative_to(root).as_posix()
        except ValueError:
            pass
        tb = tb.tb_next
    return topic(rel)[1] if rel else "errors.md"


def check_fraction(value, name: str = "sparsity", closed: bool = False, unit: str = "weights") -> float:
    """``value`` as a float in [0, 1) (``closed``: [0, 1]), or one line naming ``name`` and what to pass. The one
    range check of every sparsity and ratio secateur takes (bools and NaN refused)."""
    import math

    try:
        if isinstance(value, bool):
            raise TypeError
        v = float(value)
    except (TypeError, ValueError):
        raise SecateurError(f"{name} must be a number, got {value!r}; pass the fraction of {unit} to remove, "
                            "e.g. 0.5") from None
    if math.isnan(v) or not (0.0 <= v <= 1.0 if closed else 0.0 <= v < 1.0):
        raise SecateurError(f"{name} must be in [0, 1{']' if closed else ')'}, got {value!r}; pass the fraction of "
                            f"{unit} to remove, e.g. 0.5")
    return v


def one_line(text: str) -> str:
    """``text`` as one printable line: control characters (``\\n``, and the record separators that
    ``str.splitlines`` also breaks on, such as ``\\x1e``) and other unprintable characters escaped, so a value
    echoed from a damaged file can never split the CLI's single error line."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
