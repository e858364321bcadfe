"""Every ``--out`` folder explains itself and replays (issue 17 §3): a Hugging Face model card (``README.md``) and
``secateur-recipe.yaml``.

* the card's front matter is YAML with ``base_model`` (a GGUF input by file name, its sha256 in the body),
  ``library_name``, ``tags`` and the base model's ``license`` when its own card names one;
* the command in the card, parsed by the CLI, gives the run's options;
* ``prune --recipe`` (CLI and API) gives bit-identical weights and masks (wanda, wanda-sp, qk-wanda); explicit
  flags override the recipe; a recipe with an unknown key or a newer schema is refused in one line;
* a ``--stream`` run has both files too, with the perplexity measured during the run in its card.
"""

from __future__ import annotations

import json
import random
import shlex
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from secateur import api
from secateur.cli import _explicit_prune_args, build_parser, main
from secateur.errors import SecateurError
from secateur.export.card import CARD_NAME, RECIPE_NAME, front_matter
from secateur.masks_file import load_masks
from secateur.methods.registry import resolve
from secateur.schemas.recipe import RECIPE_SCHEMA
from secateur.testing import save_tiny, tiny_model, tiny_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")
COMMON = dict(nsamples=2, seqlen=16, quiet=True)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("card")
    path = Path(save_tiny("llama", root / "llama"))
    (path / "README.md").write_text("---\nlicense: apache-2.0\ntags:\n- tiny\n---\n# a tiny model\n")
    random.seed(0)
    text = root / "calib.txt"
    text.write_text(" ".join("".join(random.choice("abcdefghij ,.") for _ in range(8)) for _ in range(2000)))
    return {"model": str(path), "text": str(text), "root": root}


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out |= load_file(f)
    return out


def _same_result(a: Path, b: Path) -> None:
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    ma, mb = a / "secateur-masks.npz", b / "secateur-masks.npz"
    assert ma.exists() == mb.exists()
    if ma.exists():
        assert ma.read_bytes() == mb.read_bytes()
        la, lb = load_masks(ma), load_masks(mb)
        assert la.keys() == lb.keys() and all(torch.equal(la[k], lb[k]) for k in la)
    assert (a / "config.json").read_text() == (b / "config.json").read_text()


def _command(card: str) -> str:
    body = card.split("The command that made this folder:", 1)[1]
    return body.split("```bash\n", 1)[1].split("\n```", 1)[0]


RUNS = {
    "wanda": dict(method="wanda", sparsity=0.4),
    "wanda-sp": dict(method="wanda", structured=True, sparsity=0.3, compensation="ls", ls_lambda=0.1),
    "qk-wanda": dict(method="qk-wanda", sparsity=0.5, budget="shared", variant="MR", segment_len=8),
}


@pytest.mark.parametrize("run", list(RUNS))
def test_card_and_recipe_replay_bit_identical(base, tmp_path, run):
    first = tmp_path / "first"
    rep = api.prune(model=base["model"], calib=base["text"], out=str(first), **COMMON, **RUNS[run])
    card = (first / CARD_NAME).read_text()
    meta = front_matter(card)
    assert meta["base_model"] == Path(base["model"]).name and meta["library_name"] == "transformers"
    assert meta["tags"] == ["secateur", "pruned", rep["method"]] and meta["license"] == "apache-2.0"
    assert "base_model_relation" not in meta  # the Hub knows adapter/merge/quantized/finetune only
    assert rep["calibration"]["sha256"] in card and f"{rep['target_sparsity']:.4f}" in card

    # the card's command, through the CLI parser, gives the same options
    argv = shlex.split(_command(card))
    assert argv[:2] == ["secateur", "prune"]
    args = build_parser().parse_args(argv[1:])
    parsed = api.PruneOptions.from_kwargs(**{k: v for k, v in vars(args).items()
                                             if k not in ("func", "command", "recipe")})
    parsed.method = resolve(parsed.method, parsed.structured).name  # as validate() does (--out exists now)
    assert parsed.to_dict() == rep["options"]

    # the recipe: the options that determine the result, and the calibration digest
    recipe = yaml.safe_load((first / RECIPE_NAME).read_text())
    assert recipe["secateur_recipe"] == RECIPE_SCHEMA and recipe["method"] == rep["method"]
    assert recipe["check"]["calibration_sha256"] == rep["calibration"]["sha256"]
    assert not {"out", "overwrite", "quiet", "resume"} & set(recipe)
    assert {k: v for k, v in recipe.items() if k not in ("secateur_recipe", "check", "made_with", "calib")} == \
        {k: v for k, v in rep["options"].items() if k not in ("out", "overwrite", "quiet", "resume", "calib")}
    # published portably: the model by name (its digest in check:), the report's paths by their last component;
    # the calibration text keeps the path given (its tokens' digest is checked on replay)
    assert recipe["model"] == Path(base["model"]).name and len(recipe["check"]["model_sha256"]) == 64
    assert recipe["calib"] == base["text"] and rep["options"]["calib"] == Path(base["text"]).name
    assert str(tmp_path) not in card and str(tmp_path) not in (first / "secateur-report.json").read_text()

    # replay through the CLI (only --out given) and the API (a path and a dict)
    cli = tmp_path / "cli"
    assert main(["prune", "--recipe", str(first / RECIPE_NAME), "--out", str(cli), "--quiet"]) == 0
    _same_result(first, cli)
    assert json.loads((cli / "secateur-report.json").read_text())["calibration"] == rep["calibration"]
    assert (cli / RECIPE_NAME).read_text() == (first / RECIPE_NAME).read_text()
    again = api.prune(recipe=recipe, out=str(tmp_path / "api"), quiet=True)
    _same_result(first, tmp_path / "api")
    assert again["options"] | {"out": None} == rep["options"] | {"out": None}


def test_explicit_flags_override_the_recipe(base, tmp_path):
    first = tmp_path / "a"
    api.prune(model=base["model"], calib=base["text"], method="wanda", sparsity=0.4, out=str(first), **COMMON)
    recipe = str(first / RECIPE_NAME)
    assert _explicit_prune_args(["prune", "--recipe", recipe, "--seed", "0", "--out", "x"]) == \
        {"command": "prune", "recipe": recipe, "seed": 0, "out": "x"}  # a flag at its default still counts
    assert main(["prune", "--recipe", recipe, "--sparsity", "0.6", "--seed", "3", "--out", str(tmp_path / "b"),
                 "--quiet"]) == 0
    rep = json.loads((tmp_path / "b" / "secateur-report.json").read_text())
    assert rep["options"]["sparsity"] == 0.6 and rep["options"]["seed"] == 3 and rep["options"]["nsamples"] == 2
    assert rep["options"]["model"] == Path(base["model"]).name  # --model's CLI default does not replace the recipe's


def _write_recipe(folder: Path, **edit) -> Path:
    data = yaml.safe_load((folder / RECIPE_NAME).read_text()) | edit
    p = folder.parent / f"edited-{len(list(folder.parent.iterdir()))}.yaml"
    p.write_text(yaml.safe_dump(data, sort_keys=False))
    return p


def test_bad_recipes_are_refused_in_one_line(base, tmp_path, capsys):
    first = tmp_path / "a"
    api.prune(model=base["model"], calib=base["text"], method="wanda", sparsity=0.4, out=str(first), **COMMON)
    model_sha = yaml.safe_load((first / RECIPE_NAME).read_text())["check"]["model_sha256"]
    cases = [(_write_recipe(first, sparsty=0.5), "unknown key 'sparsty'"),
             (_write_recipe(first, secateur_recipe=RECIPE_SCHEMA + 1), "newer than this secateur reads"),
             (_write_recipe(first, check={"calibration_sha256": "0" * 64, "tokens": 1}), "unknown key 'check.tokens'"),
             (_write_recipe(first, check={"calibration_sha256": "0" * 64, "model_sha256": model_sha}),
              "calibration tokens differ from the recipe's")]
    capsys.readouterr()  # the first prune's progress bars
    for path, msg in cases:
        out = tmp_path / "o"
        assert main(["prune", "--recipe", str(path), "--out", str(out), "--quiet"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("secateur: error: ") and "\n" not in err and msg in err, err
        assert not out.exists()
    with pytest.raises(SecateurError, match="unknown key 'extra'"):
        api.prune(recipe={"secateur_recipe": 1, "method": "wanda", "extra": 1})
    with pytest.raises(SecateurError, match="no secateur_recipe schema"):
        api.prune(recipe={"method": "wanda"})


def test_stream_run_has_card_and_recipe_with_its_perplexity(base, tmp_path):
    src = tmp_path / "sharded"
    model = tiny_model("llama", vocab=100, layers=2)
    model.save_pretrained(src, max_shard_size="20KB")
    tiny_tokenizer().save_pretrained(src)
    out = tmp_path / "st"
    assert main(["prune", "--model", str(src), "--method", "wanda", "--calib", base["text"], "--nsamples", "2",
                 "--seqlen", "16", "--out", str(out), "--stream", "--quiet", "--eval-ppl", base["text"],
                 "--eval-windows", "2"]) == 0
    card = (out / CARD_NAME).read_text()
    meta = front_matter(card)
    assert meta["base_model"] == src.name and "license" not in meta and "license: see the base model" in card
    rep = json.loads((out / "secateur-report.json").read_text())
    (ppl,) = rep["perplexity"]
    assert ppl["protocol"] == "nonoverlap-16" and ppl["windows"] == 2 and f"{ppl['ppl']:.4f}" in card
    assert "--stream" in _command(card) and "--eval-ppl" in _command(card)
    recipe = yaml.safe_load((out / RECIPE_NAME).read_text())
    assert recipe["stream"] is True and "eval_ppl" not in recipe
    again = tmp_path / "again"
    assert main(["prune", "--recipe", str(out / RECIPE_NAME), "--out", str(again), "--quiet"]) == 0
    _same_result(out, again)


def test_gguf_input_names_the_file_and_its_sha256(tmp_path, monkeypatch):
    from secateur.testing import write_tiny_gguf

    monkeypatch.setenv("SECATEUR_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "models" / "tiny.gguf"
    path.parent.mkdir()
    write_tiny_gguf(path)
    out = tmp_path / "o"
    rep = api.prune(model=str(path), method="magnitude", sparsity=0.5, out=str(out), quiet=True)
    card = (out / CARD_NAME).read_text()
    assert front_matter(card)["base_model"] == "tiny.gguf" and rep["model_source"]["sha256"] in card
    recipe = yaml.safe_load((out / RECIPE_NAME).read_text())
    assert recipe["check"] == {"model_sha256": rep["model_source"]["sha256"]}
    again = api.prune(recipe=str(out / RECIPE_NAME), out=str(tmp_path / "again"), quiet=True)
    _same_result(out, tmp_path / "again")
    assert again["model_source"]["sha256"] == rep["model_source"]["sha256"]


@pytest.mark.parametrize("run", ["wanda", "wanda-sp"])
def test_perplexity_measured_during_the_run_is_the_folders(base, tmp_path, run):
    """``eval_ppl`` is measured before the folder is written (so the card has it): it is the saved model's."""
    out = tmp_path / "o"
    rep = api.prune(model=base["model"], calib=base["text"], out=str(out), eval_ppl=base["text"], eval_windows=2,
                    **COMMON, **RUNS[run])
    (ppl,) = rep["perplexity"]
    again = api.eval_ppl(str(out), base["text"], seqlen=16, max_windows=2, progress=False)
    assert ppl["ppl"] == again["ppl"] and ppl["protocol"] == again["protocol"] == "nonoverlap-16"
    assert f"| {ppl['protocol']} | 2/" in (out / CARD_NAME).read_text()
    assert "eval_ppl" not in yaml.safe_load((out / RECIPE_NAME).read_text())


def test_structured_stream_run_replays_from_its_recipe(base, tmp_path):
    src = tmp_path / "sharded"
    tiny_model("llama", vocab=100, layers=2).save_pretrained(src, max_shard_size="20KB")
    tiny_tokenizer().save_pretrained(src)
    out = tmp_path / "st"
    rep = api.prune(model=str(src), method="wanda-sp", sparsity=0.3, calib=base["text"], stream=True, out=str(out),
                    **COMMON)
    assert front_matter((out / CARD_NAME).read_text())["tags"] == ["secateur", "pruned", "wanda-sp"]
    recipe = yaml.safe_load((out / RECIPE_NAME).read_text())
    assert recipe["stream"] is True and recipe["check"]["calibration_sha256"] == rep["calibration"]["sha256"]
    assert main(["prune", "--recipe", str(out / RECIPE_NAME), "--out", str(tmp_path / "again"), "--quiet"]) == 0
    _same_result(out, tmp_path / "again")
