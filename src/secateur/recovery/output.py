"""The output of a recovery: a run folder like any other (merged weights, tokenizer, report, card, recipe), written
atomically by the prune's own savers, and the optional peft adapter folder (``--save-adapter``).

* sliced (structured) runs: :func:`secateur.export.sliced.save_structured` (stock config when every layer has the
  same widths, else the per-layer config and ``secateur_hetero.py``; one ``from_pretrained`` reloads it);
* masked runs: :func:`secateur.export.hf.save_run` with the run's masks (re-applied to the merged weights);
* the prune's method files (``secateur_selection.json``, figures, CoCurve's files) are copied as they were;
* ``secateur-report.json``: the prune's report with a ``recovery`` section added (and ``peak_rss_mb`` of this process;
  the prune's is kept in ``recovery.prune_peak_rss_mb``);
* ``README.md``: the run's card, its "training-free" sentence replaced and a Recovery section appended;
  ``secateur-recipe.yaml``: the prune's recipe (it still replays the prune), headed by comment lines naming the
  recovery and its command.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from secateur.errors import SecateurError
from secateur.export.card import CARD_NAME, RECIPE_NAME
from secateur.safe_write import MASKS_NAME, METHOD_NAMES, REPORT_NAME, usual_permissions

ADAPTER_MARKER = "secateur-adapter.json"
ADAPTER_NAMES = {"adapter_config.json", "adapter_model.safetensors", "README.md", ADAPTER_MARKER}
TRAINING_FREE = "Training-free: no weight was trained."


def method_files(run_dir: Path) -> dict[str, bytes]:
    """The prune's method files, copied into the output (the exporter writes ``secateur_hetero.py`` itself)."""
    return {p.name: p.read_bytes() for p in sorted(run_dir.iterdir())
            if p.name in METHOD_NAMES and p.name != "secateur_hetero.py" and p.is_file()}


def _recovery_lines(rec: dict) -> list[str]:
    s, held = rec["settings"], rec.get("heldout") or {}
    lines = ["## Recovery", "",
             f"After pruning, LoRA adapters (rank {s['rank']}, alpha {s['alpha']}, dropout {s['dropout']}) on "
             f"{', '.join(s['targets'])} were trained for {rec['steps']} steps on {rec['data']['tokens']:,} tokens "
             f"of `{rec['data']['source']}` ({rec['data']['split']}) with "
             + ("top-" + str(s['topk']) + " distillation KL from the teacher `" + str(rec['teacher']['spec']) + "`"
                if s["loss"] == "kl" else "next-token cross-entropy")
             + ", then merged into the weights.", "",
             "| | |", "|---|---|",
             f"| training loss, first / last step | {rec['loss']['first']:.4f} / {rec['loss']['last']:.4f} |"]
    if held:
        lines.append(f"| held-out {held['metric']} ({held['windows']} windows): pruned / adapters / output | "
                     f"{held['pruned']:.4f} / {held['adapters']:.4f} / {held['output']:.4f} |")
    if rec.get("masks"):
        m = rec["masks"]
        lines.append(f"| masks re-applied after the merge | share of the LoRA delta discarded on pruned positions "
                     f"{m['share_on_pruned']:.4f}; realized sparsity {m['realized_sparsity']['targeted']:.4f} "
                     "(the run's) |")
    lines += ["", "Training tokens' sha256 (little-endian int64, row-major): " + f"`{rec['data']['sha256']}`.", "",
              "The command that recovered it from the pruned run:", "", "```bash", rec["command"], "```", ""]
    return lines


def card_and_recipe(run_dir: Path, report: dict) -> dict[str, bytes]:
    """The output's ``README.md`` and ``secateur-recipe.yaml`` (module docstring)."""
    from secateur.export.card import model_card

    rec = report["recovery"]
    card_path = run_dir / CARD_NAME
    try:
        card = card_path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        card = model_card(report, {}, "(the prune's command was not recorded)")
    card = card.replace(TRAINING_FREE, "Pruned training-free, then recovered with LoRA adapters merged into the "
                                       "weights (see Recovery).")
    card = card.replace("- pruned\n", "- pruned\n- recovered\n- lora\n", 1)
    marker = "## Reproduce"
    extra = "\n".join(_recovery_lines(rec)) + "\n"
    card = card.replace(marker, extra + marker, 1) if marker in card else card.rstrip("\n") + "\n\n" + extra
    files = {CARD_NAME: card.encode()}
    recipe_path = run_dir / RECIPE_NAME
    if recipe_path.is_file():
        head = ("# This folder is the prune below followed by `secateur recover` (LoRA adapters merged into the\n"
                "# weights; settings in secateur-report.json `recovery`). This recipe replays the prune only;\n"
                "# then run:\n"
                f"#   {rec['command']}\n")
        files[RECIPE_NAME] = head.encode() + recipe_path.read_bytes()
    return files


def save_output(model, tokenizer, run, out: str, report: dict, masks, overwrite: bool) -> None:
    """Write the output folder atomically with the prune's savers."""
    from secateur.export.hf import save_run
    from secateur.export.sliced import save_structured

    files = method_files(run.path) | card_and_recipe(run.path, report)
    if run.masked:
        save_run(model, tokenizer, out, report, masks, overwrite, files)
    else:
        save_structured(model, tokenizer, out, report, files, overwrite)


# --- the peft adapter folder ----------------------------------------------------------------------------------

def check_adapter_dest(dest: str, overwrite: bool) -> None:
    """``--save-adapter``: a new folder, or (with ``--overwrite``) an adapter folder this command wrote."""
    from secateur.safe_write import check_writable_output

    p = Path(dest)
    if os.path.lexists(p):
        if not overwrite:
            raise SecateurError(f"--save-adapter {dest} already exists; pass --overwrite to replace it")
        names = {q.name for q in p.iterdir()} if p.is_dir() and not p.is_symlink() else None
        if names is None or ADAPTER_MARKER not in names or not names <= ADAPTER_NAMES:
            raise SecateurError(f"--save-adapter {dest} is not an adapter folder secateur recover wrote; --overwrite "
                                "only replaces one: choose another folder")
    check_writable_output(p)


@contextlib.contextmanager
def adapter_folder(pm, dest: str | None, overwrite: bool, info: dict):
    """Save the adapters (before the merge) into a temporary sibling of ``dest``, yield, then move it into place
    (after the main output is written); removed on any failure."""
    if dest is None:
        yield
        return
    d = Path(dest).absolute()
    d.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{d.name}.secateur-adapter-{os.getpid()}-", dir=d.parent))
    try:
        pm.save_pretrained(tmp)
        (tmp / ADAPTER_MARKER).write_text(json.dumps(info, indent=1))
        yield
        check_adapter_dest(str(d), overwrite)
        usual_permissions(tmp)  # mkdtemp's 0700 would hide it from other accounts
        if os.path.lexists(d):
            shutil.rmtree(d)
        os.replace(tmp, d)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


__all__ = ["MASKS_NAME", "REPORT_NAME", "adapter_folder", "card_and_recipe", "check_adapter_dest", "save_output"]
