"""The files that make an output folder explain itself and replay: a Hugging Face model card (``README.md``) and
``secateur-recipe.yaml``.

* the card: YAML front matter after the Hub's model-card conventions (``base_model``, ``library_name``, ``tags``,
  ``license`` when the base model's own card names one) and a body with the method, target and realized sparsity,
  the calibration manifest, the perplexities measured during the run (each with its protocol) and the exact
  command;
* the recipe: every option that determines the result (the keywords of ``api.prune``), the sha256 of the
  calibration tokens (and of a GGUF input) to check a replay against, and the versions that made it.
  ``secateur prune --recipe FILE --out DIR`` replays it (:func:`read_recipe` reads it back).

Both are built from the report and handed to the exporters as extra files, so they are written inside the same
atomic folder (:func:`secateur.safe_write.atomic_dir`) as the weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from secateur.errors import SecateurError

CARD_NAME = "README.md"
RECIPE_NAME = "secateur-recipe.yaml"
# Hub relations (https://huggingface.co/docs/hub/model-cards#specifying-a-base-model): adapter, merge, quantized,
# finetune. None describes pruning, so the card names none (the Hub infers one) and says "pruned" in its tags.
BASE_MODEL_RELATION: str | None = None


def card_files(report: dict, recipe: dict, command: str) -> dict[str, bytes]:
    """``{README.md, secateur-recipe.yaml}`` of a run, to be written with the rest of its folder."""
    return {CARD_NAME: model_card(report, recipe, command).encode(), RECIPE_NAME: recipe_text(recipe).encode()}


def recipe_text(recipe: dict) -> str:
    head = ("# secateur recipe: every option that determines this run's weights and masks.\n"
            "# Replay: secateur prune --recipe secateur-recipe.yaml --out DIR   (flags given explicitly override it)\n")
    return head + yaml.safe_dump(recipe, sort_keys=False, default_flow_style=False)


def base_license(model: str | None) -> str | None:
    """The ``license`` of a local base model folder's own card (its README front matter), if it names one."""
    if not model:
        return None
    readme = Path(model) / CARD_NAME
    try:
        front = front_matter(readme.read_text(encoding="utf-8")) if readme.is_file() else {}
    except (OSError, UnicodeDecodeError, SecateurError):
        return None
    lic = front.get("license")
    return lic if isinstance(lic, str) and lic.strip() else None


def front_matter(text: str) -> dict:
    """The YAML front matter of a Markdown card (``---`` ... ``---`` at the top), ``{}`` without one."""
    lines = text.splitlines()
    if not lines or lines[0].strip() != "---":
        return {}
    try:
        end = next(i for i in range(1, len(lines)) if lines[i].strip() == "---")
    except StopIteration:
        raise SecateurError("model card front matter is not closed with ---") from None
    try:
        data = yaml.safe_load("\n".join(lines[1:end]))
    except yaml.YAMLError as e:
        raise SecateurError(f"model card front matter is not valid YAML ({e})") from None
    return data if isinstance(data, dict) else {}


def _base(report: dict) -> tuple[str, str | None]:
    """(``base_model`` as the card names it, a GGUF input's sha256): the spec the user passed, a GGUF by file."""
    src = report.get("model_source") or {}
    if src.get("gguf"):
        return Path(src["gguf"]).name, src.get("sha256")
    return str(report.get("model")), None


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4f}"
    return "-" if v is None else str(v)


def _sparsity_lines(report: dict) -> list[str]:
    rs = report.get("realized_sparsity") or {}
    target = report.get("target_sparsity")
    out = [f"| target sparsity | {_fmt(target)}" + (f" (pattern {report['pattern']})" if report.get("pattern")
                                                    else "") + " |"]
    if rs.get("targeted") is not None:
        counts = (f" ({rs['pruned_weights']:,} of {rs['targeted_weights']:,} weights)"
                  if rs.get("pruned_weights") is not None and rs.get("targeted_weights") else "")
        out.append(f"| realized sparsity, targeted weights | {_fmt(rs['targeted'])}{counts} |")
    if rs.get("of_all_parameters") is not None:
        out.append(f"| realized sparsity, all parameters | {_fmt(rs['of_all_parameters'])} |")
    return out


def _calibration_lines(cal: dict | None) -> list[str]:
    if not cal:
        return ["None: this method uses no calibration data."]
    return ["| source | windows | seqlen | seed | rule | token sha256 |", "|---|---|---|---|---|---|",
            f"| {cal.get('source')} | {cal.get('n')} | {cal.get('seqlen')} | {cal.get('seed')} | {cal.get('rule')} "
            f"| `{cal.get('sha256')}` |",
            "", f"Tokenizer: `{cal.get('tokenizer')}`. The token sha256 is of the ids as little-endian int64, "
            "row-major; a replay checks it."]


def _ppl_lines(report: dict) -> list[str]:
    ppl = report.get("perplexity") or []
    if not ppl:
        return ["None measured during the run (`secateur eval ppl --model DIR --dataset wikitext2` measures one, "
                "with its protocol)."]
    rows = ["| dataset | protocol | windows | scored tokens | perplexity | text sha256 |", "|---|---|---|---|---|---|"]
    for r in ppl:
        rows.append(f"| {r.get('dataset')} | {r.get('protocol')} | {r.get('windows')}/{r.get('windows_total')} | "
                    f"{r.get('scored_tokens')} | {r.get('ppl'):.4f} | `{r.get('tokens_sha256')}` |")
    return rows


def model_card(report: dict, recipe: dict, command: str) -> str:
    """The ``README.md`` of a run folder (see the module docstring)."""
    base, gguf_sha = _base(report)
    method = report.get("method")
    lic = report["base_license"] if "base_license" in report else base_license(report.get("model"))
    meta: dict[str, Any] = {"base_model": base}
    if BASE_MODEL_RELATION:
        meta["base_model_relation"] = BASE_MODEL_RELATION
    meta |= {"library_name": "transformers", "tags": ["secateur", "pruned", str(method)]}
    if lic:
        meta["license"] = lic
    kind = report.get("kind")
    versions = report.get("versions") or {}
    body = [
        f"# {base}, pruned with {method}",
        "",
        f"Pruned by [secateur](https://pypi.org/project/secateur/) {versions.get('secateur', '')} from `{base}` "
        f"with `{method}` ({kind}: {_KIND_TEXT.get(kind, '')}). Training-free: no weight was trained.",
        "",
        "## Base model",
        "",
        f"- model: `{report.get('model')}`",
    ]
    if gguf_sha:
        body.append(f"- GGUF file `{base}`, sha256 `{gguf_sha}` (dequantized to `{recipe.get('dtype')}` before "
                    "pruning)")
    body.append(f"- license: {lic}" if lic else "- license: see the base model")
    body += ["", "## Pruning", "", "| | |", "|---|---|", f"| method | {method} ({kind}) |", *_sparsity_lines(report)]
    body += ["", "Every option that determines the result (`secateur-recipe.yaml`):", "", "```yaml",
             yaml.safe_dump({k: v for k, v in recipe.items() if k not in ("check", "made_with")}, sort_keys=False)
             .rstrip(), "```"]
    body += ["", "## Calibration", "", *_calibration_lines(report.get("calibration"))]
    body += ["", "## Perplexity measured during the run", "", *_ppl_lines(report)]
    body += ["", "## Reproduce", "", "The command that made this folder:", "", "```bash", command, "```", "",
             "Replay it from the recipe (bit-identical weights and masks with the same versions on the same kind of "
             "machine; flags given explicitly override the recipe's values):", "", "```bash",
             f"secateur prune --recipe {RECIPE_NAME} --out pruned-again", "```", "",
             "Made with " + ", ".join(f"{k} {v}" for k, v in versions.items()) + ".",
             "", "## Files", "",
             "- `secateur-report.json`: options, calibration manifest, realized sparsity per module, timings, "
             "versions and machine",
             f"- `{RECIPE_NAME}`: the recipe above"]
    if kind == "unstructured":
        body.append("- `secateur-masks.npz`: the masks, bit-packed (True = pruned; "
                    "`secateur.masks_file.load_masks` reads them)")
    auto = report.get("loads_with") or "AutoModelForCausalLM"
    body += ["", f"Load it with `{auto}.from_pretrained(\"<this folder>\")`"
             + (" (when `config.json` has a `secateur_*` model type, the widths differ per layer: import secateur "
                "first, or pass `trust_remote_code=True`)." if kind == "structured" else ".")]
    head = yaml.safe_dump(meta, sort_keys=False, default_flow_style=False)
    return f"---\n{head}---\n\n" + "\n".join(body) + "\n"


_KIND_TEXT = {"unstructured": "weights set to zero, shapes unchanged",
              "structured": "whole units removed, a smaller dense model"}
