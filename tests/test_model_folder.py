"""A model folder that disagrees with itself is refused before any weight is used (issue 25, class 2).

For every supported family: a config that says more or fewer layers than the weights hold, a hidden or
vocabulary size that disagrees with them, a deleted tensor, an extra tensor, a non-positive size; each through
``secateur prune`` and ``secateur eval ppl``, each one line and exit 2 with nothing written. Then a generator
mutates the integer fields of a valid tiny config (any field, any integer: 0, negatives, huge values) and
asserts the promise of :mod:`tests.contract` for each case: exit 0 with a correct output, or exit 2 with one line.
"""

import json
import math
import shutil
from pathlib import Path

import pytest
from contract import check
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from secateur.errors import SecateurError
from secateur.models.families import ADAPTERS
from secateur.models.loading import check_model
from secateur.testing import VISION_FAMILIES, save_tiny

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = sorted(f for f, a in ADAPTERS.items() if a.modality == "text")
TEXT = "The quick brown fox jumps over the lazy dog. " * 20


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    """One tiny folder per family (2 layers, hidden 32, vocab 128), built once for the module."""
    root = tmp_path_factory.mktemp("tiny")
    return {fam: Path(save_tiny(fam, root / fam)) for fam in FAMILIES + list(VISION_FAMILIES)}


def _cfg_key(cfg: dict, *names: str) -> str:
    return next(n for n in names if n in cfg)


def variant(src: Path, dst: Path, cfg_edit=None, weights_edit=None) -> Path:
    """A copy of the folder ``src`` with its config and/or its weights edited."""
    shutil.copytree(src, dst)
    if cfg_edit is not None:
        cfg = json.loads((dst / "config.json").read_text())
        cfg_edit(cfg)
        (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    if weights_edit is not None:
        sd = load_file(dst / "model.safetensors")
        weights_edit(sd)
        save_file(sd, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def _layers(n):
    return lambda c: c.update({_cfg_key(c, "num_hidden_layers", "n_layer"): n})


def _hidden(c):
    c[_cfg_key(c, "hidden_size", "n_embd")] = 64


def _nonpositive(c):
    c[_cfg_key(c, "max_position_embeddings", "n_positions")] = -5


def _delete(sd):
    del sd[sorted(k for k in sd if ".0." in k)[-1]]  # a tensor of the first block


def _extra(sd):
    sd["model.unexpected.weight"] = sd[sorted(sd)[0]].clone()


#: case -> (config edit, weights edit, the message it must give)
CASES = {
    "layers-more": (_layers(3), None,
                    r"config\.json implies \S+\.2\.\S+ \[[\d, ]+\], which the weights do not hold \(they hold 2 "
                    r"layers; config says (num_hidden_layers|n_layer) 3\); fix config\.json"),
    "layers-fewer": (_layers(1), None,
                     r"the weights hold \S+\.1\.\S+ \[[\d, ]+\], which config\.json does not imply \(they hold 2 "
                     r"layers; config says (num_hidden_layers|n_layer) 1\); fix config\.json"),
    "hidden": (_hidden, None,  # OPT: its positions speak first (its embedding has its own width)
               r"config\.json implies \S+ \[[\d, ]*64[\d, ]*\] but the weights hold \[[\d, ]+\]( \(config says "
               r"(hidden_size|n_embd) 64 where the weights have 32\)|); fix config\.json"),
    "vocab": (lambda c: c.update(vocab_size=200), None,
              r"config\.json implies \S+ \[200, 32\] but the weights hold \[128, 32\] \(config says vocab_size "
              r"200 where the weights have 128\); fix config\.json"),
    "deleted-tensor": (None, _delete, r"config\.json implies \S+\.0\.\S+ \[[\d, ]+\], which the weights do not "
                                      r"hold; .*re-download or re-export"),
    "extra-tensor": (None, _extra, r"the weights hold model\.unexpected\.weight \[[\d, ]+\], which config\.json does "
                                   r"not imply .*re-download or re-export"),
    "nonpositive-size": (_nonpositive, None, r"config\.json: (max_position_embeddings|n_positions): input should be "
                                             r"greater than or equal to 1 \(got -5\); fix config\.json"),
}


def _commands(model: Path, tmp: Path) -> dict[str, list[str]]:
    text = tmp / "eval.txt"
    if not text.exists():
        text.write_text(TEXT)
    return {"prune": ["prune", "--model", model, "--calib", "self", "--nsamples", "2", "--seqlen", "16", "--quiet",
                      "--out", tmp / "out"],
            "eval-ppl": ["eval", "ppl", "--model", model, "--dataset", text, "--seqlen", "32", "--quiet",
                         "--json", tmp / "ppl.json"]}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("family", FAMILIES)
def test_folder_that_disagrees_with_itself_is_one_line(tiny, tmp_path, family, case):
    import re

    cfg_edit, weights_edit, message = CASES[case]
    model = variant(tiny[family], tmp_path / "model", cfg_edit, weights_edit)
    for name, argv in _commands(model, tmp_path).items():
        code, _, err = check(f"model-folder:{case}", argv, [tmp_path])
        assert code == 2, f"{name}: {family} {case} was accepted"
        assert re.search(message, err), f"{name}: {err!r} does not match {message!r}"
        assert f"model {model}" in err


#: the cases that apply to a vision encoder (no vocabulary, no position-count key)
VISION_CASES = ("layers-more", "layers-fewer", "hidden", "deleted-tensor", "extra-tensor")


def _vision_commands(model: Path, tmp: Path) -> dict[str, list[str]]:
    import numpy as np

    images = tmp / "images.npz"
    if not images.exists():
        rng = np.random.default_rng(0)
        np.savez(images, images=rng.integers(0, 256, (4, 16, 16, 3), dtype=np.uint8), labels=np.arange(4))
    return {"prune": ["prune", "--model", model, "--method", "wanda-sp", "--calib", images, "--nsamples", "2",
                      "--quiet", "--out", tmp / "out"],
            "eval-accuracy": ["eval", "accuracy", "--model", model, "--dataset", images, "--quiet",
                              "--json", tmp / "acc.json"]}


@pytest.mark.parametrize("case", VISION_CASES)
@pytest.mark.parametrize("family", VISION_FAMILIES)
def test_vision_folder_that_disagrees_with_itself_is_one_line(tiny, tmp_path, family, case):
    """The same promise for the vision encoders, through ``prune`` and ``eval accuracy`` on images."""
    import re

    cfg_edit, weights_edit, message = CASES[case]
    if cfg_edit is not None and family in ("siglip", "clip"):  # a composite classifier's sizes: its vision_config
        edit = cfg_edit
        cfg_edit = lambda c: edit(c["vision_config"])  # noqa: E731
    model = variant(tiny[family], tmp_path / "model", cfg_edit, weights_edit)
    for name, argv in _vision_commands(model, tmp_path).items():
        if name == "eval-accuracy" and family in ("siglip_vision_model", "clip_vision_model", "idefics3_vision",
                                                  "smolvlm_vision"):
            continue  # backbones have no class logits: eval accuracy refuses them whatever their folder holds
        code, _, err = check(f"model-folder:{case}", argv, [tmp_path])
        assert code == 2, f"{name}: {family} {case} was accepted"
        assert re.search(message, err), f"{name}: {err!r} does not match {message!r}"
        assert f"model {model}" in err


def test_layer_count_is_checked_before_the_model_is_built(tiny, tmp_path):
    """A config's absurd layer count costs nothing: refused from the headers, no meta model built."""
    model = variant(tiny["llama"], tmp_path / "m", _layers(10**9))
    with pytest.raises(SecateurError, match="they hold 2 layers; config says num_hidden_layers 1000000000"):
        check_model(str(model))


def test_sharded_folder_is_checked_through_its_index(tmp_path):
    from conftest import save_sharded_tiny

    folder = Path(save_sharded_tiny(tmp_path / "sharded", "llama", layers=2))
    assert check_model(str(folder))["model_type"] == "llama"
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(cfg | {"num_hidden_layers": 3}))
    with pytest.raises(SecateurError, match=r"model\.layers\.2\.\S+ .* which the weights do not hold"):
        check_model(str(folder))
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    (folder / "config.json").write_text(json.dumps(cfg))
    shard = sorted(set(index["weight_map"].values()))[-1]
    (folder / shard).rename(folder / (shard + ".moved"))
    with pytest.raises(SecateurError, match=f"shard {shard} named by model.safetensors.index.json is missing"):
        check_model(str(folder))


def test_tied_and_untied_heads_pass(tiny):
    """Tied embeddings (gpt2, opt, gemma3: lm_head saved once, under the embedding's name) and untied ones pass."""
    for fam in FAMILIES:
        check_model(str(tiny[fam]))


def test_streamed_prune_refuses_a_folder_that_disagrees(tiny, tmp_path):
    model = variant(tiny["llama"], tmp_path / "m", _hidden)
    calib = tmp_path / "calib.txt"
    calib.write_text(TEXT * 4)
    code, _, err = check("model-folder:stream", ["prune", "--model", model, "--stream", "--calib", calib,
                                                 "--nsamples", "2", "--seqlen", "16", "--quiet",
                                                 "--out", tmp_path / "out"], [tmp_path])
    assert code == 2 and "but the weights hold" in err


# --- generated cases: any integer in any integer field of a valid config -------------------------------------

def _int_fields(cfg: dict) -> list[str]:
    return sorted(k for k, v in cfg.items() if isinstance(v, int) and not isinstance(v, bool))


INTS = st.one_of(st.integers(-3, 3), st.integers(-2**31, 2**31), st.sampled_from([0, -1, 1, 2**40, -2**40]))


@given(data=st.data())
def test_generated_config_mutations_keep_the_promise(tiny, tmp_path_factory, data):
    family = data.draw(st.sampled_from(FAMILIES), label="family")
    cfg = json.loads((tiny[family] / "config.json").read_text())
    field = data.draw(st.sampled_from(_int_fields(cfg)), label="field")
    value = data.draw(INTS, label="value")
    command = data.draw(st.sampled_from(["prune", "eval-ppl"]), label="command")
    tmp = tmp_path_factory.mktemp("gen")
    model = variant(tiny[family], tmp / "model", lambda c: c.update({field: value}))
    argv = _commands(model, tmp)[command]
    allowed = [tmp / "out"] if command == "prune" else [tmp / "ppl.json"]
    code, _, err = check(f"config-field:{field}", argv, [tmp], allowed_new=allowed)
    if code == 2:
        assert f"model {model}" in err or "--seqlen" in err, err
        return
    if command == "prune":  # a correct output: a folder that agrees with itself and loads
        out = tmp / "out"
        assert (out / "config.json").is_file() and any(out.glob("*.safetensors"))
        check_model(str(out))
    else:
        res = json.loads((tmp / "ppl.json").read_text())
        assert isinstance(res["ppl"], float) and math.isfinite(res["ppl"]), res
