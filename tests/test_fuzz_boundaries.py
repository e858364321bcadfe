"""Issue 50 section 3: the generator of ``tests/test_fuzz_*.py`` at the boundaries that arrived since round two,
every case held to the promise of ``tests/contract.py`` (exit 0 with a correct output, or exit 2 with one
``secateur: error: ...; fix`` line; never a traceback, debris or a user file touched). Classes
(``SECATEUR_FUZZ_LOG`` counts them; ``bench/checks/reliability_fuzz.py`` runs them longer):

* ``recover-masks-mutated``: the masks file of a masked run changed by one to three generated edits (an entry
  dropped, added, renamed, a shape changed, the bits of another dtype or length, a whole layer gone, an object
  array); exit 0 must give the run's own masks re-applied (the silent wrong result of round three: a dense model).
* ``shard-sets``: a sharded model folder with a tensor of another dtype, a shard that is a folder, a symlink (in or
  out of the folder, dangling), a tensor added or removed, a shard gone; pruned with and without ``--stream``. Exit
  0 must give the original weights with at most the asked fraction zeroed (integers read as weights would not).
* ``out-paths``: ``--out`` names of generated length and characters, under symlinked parents, or itself a symlink
  (to an empty folder, a user's folder, a file, nowhere).
* ``api-signature``: every public function (``api.prune``, ``api.recover``, ``eval_ppl``, ``eval_zeroshot``,
  ``eval_efficiency``, ``eval_accuracy``, ``eval_captions``, ``eval_features``, ``export_gguf``, ``export_vllm``,
  ``write_report``, ``load_masks``) with one argument drawn from its signature set to a generated value of any type.
* ``vlm``: ``prune --towers`` on a tiny LLaVA folder with generated methods, calibrations (``fashion-mnist-captions``
  among them) and sparsities, and ``eval captions`` with generated counts.

The distributed environment variables, two processes at once and faults at random points need real processes:
``tests/test_fuzz_processes.py``.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import DATA_DIR, save_sharded_tiny
from contract import check, record
from hypothesis import given, settings
from hypothesis import strategies as st

from secateur.errors import SecateurError

pytestmark = pytest.mark.usefixtures("one_thread")

LONG = "The quick brown fox jumps over the lazy dog. " * 320


def examples(ci: int) -> int:
    """``ci`` cases in the suite; the bench's long run (``HYPOTHESIS_PROFILE=long``) sets its own count."""
    if os.environ.get("HYPOTHESIS_PROFILE") == "long":
        return int(os.environ.get("SECATEUR_FUZZ_EXAMPLES", "200"))
    return ci


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out |= load_file(str(f))
    return out


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> dict:
    from secateur import api
    from secateur.testing import save_tiny

    root = tmp_path_factory.mktemp("fuzz-boundaries")
    save_tiny("llama", root / "tiny")
    api.prune(model=str(root / "tiny"), method="magnitude", sparsity=0.5, out=str(root / "run"), quiet=True)
    (root / "train.txt").write_text(LONG)
    save_sharded_tiny(root / "sharded", "llama", layers=2)
    return {"root": root, "model": str(root / "tiny"), "run": root / "run", "data": str(root / "train.txt"),
            "sharded": root / "sharded"}


# --- recover: the masks file mutated ------------------------------------------------------------------------------

MASK_EDITS = st.sampled_from(["drop-entry", "add-entry", "rename-entry", "shape-swap", "shape-plus-one",
                              "shape-float", "bits-dtype", "bits-short", "bits-long", "bits-2d", "drop-layer",
                              "object-array", "empty", "keep"])
DTYPES = st.sampled_from(["float32", "int64", "bool", "int8", "float16", "uint16"])


def _edit_masks(arrays: dict[str, np.ndarray], edit: str, data: st.DataObject) -> dict[str, np.ndarray]:
    keys = sorted(arrays)
    if not keys and edit not in ("add-entry", "object-array"):
        return arrays
    pick = data.draw(st.sampled_from(keys)) if keys else ""
    a = dict(arrays)
    if edit == "drop-entry":
        del a[pick]
    elif edit == "add-entry":
        a[data.draw(st.sampled_from(["extra::bits", "model.layers.9.mlp.up_proj::bits", "weights", "x::shape"]))] = \
            np.zeros(data.draw(st.integers(0, 4)), dtype=np.uint8)
    elif edit == "rename-entry":
        a[pick.upper()] = a.pop(pick)
    elif edit in ("shape-swap", "shape-plus-one", "shape-float"):
        s = pick.split("::")[0] + "::shape"
        if s in a:
            a[s] = {"shape-swap": a[s][::-1].copy(), "shape-plus-one": a[s] + 1,
                    "shape-float": a[s].astype(np.float64) + 0.5}[edit]
    elif edit.startswith("bits"):
        b = pick.split("::")[0] + "::bits"
        if b in a:
            a[b] = {"bits-dtype": lambda: a[b].astype(data.draw(DTYPES)), "bits-short": lambda: a[b][:-1],
                    "bits-long": lambda: np.concatenate([a[b], np.zeros(3, np.uint8)]),
                    "bits-2d": lambda: a[b].reshape(1, -1)}[edit]()
    elif edit == "drop-layer":
        layer = pick.split("::")[0]
        a = {k: v for k, v in a.items() if not k.startswith(layer + "::")}
    elif edit == "object-array":
        a["payload::bits"] = np.array([{"code": "print(1)"}], dtype=object)
    elif edit == "empty":
        a = {}
    return a


@settings(max_examples=examples(5))
@given(edits=st.one_of(st.just(["keep"]), st.lists(MASK_EDITS, min_size=1, max_size=3)), data=st.data())
def test_recover_with_a_mutated_masks_file(ws, tmp_path_factory, edits, data):
    work = tmp_path_factory.mktemp("rmask")
    run = work / "run"
    shutil.copytree(ws["run"], run)
    with np.load(run / "secateur-masks.npz") as z:
        original = {k: z[k] for k in z.files}
    arrays = original
    for e in edits:
        arrays = _edit_masks(arrays, e, data)
    np.savez(run / "secateur-masks.npz", **arrays)
    out = work / "out"
    code, _, _ = check("recover-masks-mutated", ["recover", str(run), "--out", str(out), "--data", ws["data"],
                                                 "--tokens", "128", "--seqlen", "16", "--loss", "ce", "--quiet"],
                       [ws["root"], work], allowed_new=[out])
    if code == 0:  # the run's own masks, re-applied; never a dense model (round three's silent wrong result)
        from secateur.masks_file import load_masks

        want, got = load_masks(ws["run"] / "secateur-masks.npz"), load_masks(out / "secateur-masks.npz")
        assert sorted(want) == sorted(got) and all(torch.equal(want[k], got[k]) for k in want), edits
        weights = _tensors(out)
        for name, m in want.items():
            assert not weights[name + ".weight"][m].any(), f"{name}: pruned weights came back ({edits})"
        masks = json.loads((out / "secateur-report.json").read_text())["recovery"]["masks"]
        assert masks and masks["reapplied"] is True, masks


# --- shard sets -----------------------------------------------------------------------------------------------------

SHARD_EDITS = st.sampled_from(["dtype", "folder", "symlink-out", "symlink-in", "dangling", "extra-tensor",
                               "missing-tensor", "missing-shard", "duplicate-tensor", "index-escape", "none"])
TENSOR_DTYPES = st.sampled_from([torch.int32, torch.int64, torch.int8, torch.bool, torch.float16, torch.bfloat16,
                                 torch.float64, torch.uint8])


def _edit_shards(folder: Path, outside: Path, edit: str, data: st.DataObject) -> None:
    from safetensors.torch import load_file, save_file

    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    shard = folder / data.draw(st.sampled_from(shards))
    if edit in ("dtype", "extra-tensor", "missing-tensor", "duplicate-tensor"):
        t = load_file(str(shard))
        name = data.draw(st.sampled_from(sorted(t)))
        if edit == "dtype":
            t[name] = t[name].to(data.draw(TENSOR_DTYPES))
        elif edit == "extra-tensor":
            t["model.extra.weight"] = torch.ones(3)
        elif edit == "missing-tensor":
            del t[name]
        else:
            other = folder / data.draw(st.sampled_from(shards))
            o = load_file(str(other))
            if other != shard and o:
                first = sorted(o)[0]
                t[first] = o[first] + 1.0 if o[first].is_floating_point() else o[first]
        shard.unlink()
        save_file({k: v.contiguous() for k, v in t.items()}, str(shard), metadata={"format": "pt"})
    elif edit == "folder":
        shard.unlink()
        shard.mkdir()
    elif edit in ("symlink-out", "dangling"):
        target = outside / shard.name
        shutil.move(str(shard), target)
        if edit == "dangling":
            target.unlink()
        shard.symlink_to(target)
    elif edit == "symlink-in":
        shutil.move(str(shard), folder / ("blob-" + shard.name))
        shard.symlink_to("blob-" + shard.name)
    elif edit == "missing-shard":
        shard.unlink()
    elif edit == "index-escape":
        key = sorted(index["weight_map"])[0]
        index["weight_map"][key] = "../" + outside.name + "/" + index["weight_map"][key]
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))


@settings(max_examples=examples(8))
@given(edits=st.one_of(st.sampled_from([["none"], ["symlink-in"], ["symlink-out"]]),
                      st.lists(SHARD_EDITS, min_size=1, max_size=2)), stream=st.booleans(), data=st.data())
def test_prune_a_mutated_shard_set(ws, tmp_path_factory, edits, stream, data):
    work = tmp_path_factory.mktemp("shards")
    model, outside = work / "model", work / "elsewhere"
    shutil.copytree(ws["sharded"], model, symlinks=True)
    outside.mkdir()
    for e in edits:
        _edit_shards(model, outside, e, data)
    out = work / "out"
    argv = ["prune", "--model", str(model), "--method", "magnitude", "--sparsity", "0.5", "--quiet", "--out", str(out)]
    code, _, _ = check("shard-sets", argv + (["--stream"] if stream else []), [ws["root"], work],
                       allowed_new=[out])
    if code == 0:  # the original weights, at most half of each pruned matrix zeroed; nothing read as a weight
        orig = _tensors(ws["sharded"])
        got = _tensors(out)
        for name, w in got.items():
            if name not in orig or not w.is_floating_point():
                continue
            o = orig[name].to(torch.float32)
            w = w.to(torch.float32)
            kept = w != 0
            assert torch.allclose(w[kept], o[kept], rtol=1e-2, atol=1e-4), f"{name}: weights changed ({edits})"
            assert kept.float().mean() >= 0.45, f"{name}: {1 - kept.float().mean():.2f} zeroed ({edits})"


# --- output paths ---------------------------------------------------------------------------------------------------

NAME_CHARS = st.sampled_from(list("abcXYZ019 _.-~+=,;:'\"!@#$%^&()[]{}*?\\|<>`") + ["é", "ß", "名", "\u200b", "\t",
                                                                                    "\n", "🙂", "\x7f"])
NAMES = st.one_of(st.text(NAME_CHARS, min_size=1, max_size=12),
                  st.integers(200, 300).map(lambda n: "o" * n),
                  st.sampled_from([".", "..", "...", " ", "-", "~", "$HOME", "con", "a" * 255, "é" * 128]))
LINKS = st.sampled_from(["none", "parent-link", "link-to-empty", "link-to-user-folder", "link-to-file", "dangling",
                         "deep"])


@settings(max_examples=examples(10))
@given(name=NAMES, link=LINKS)
def test_out_paths(ws, tmp_path_factory, name, link):
    work = tmp_path_factory.mktemp("outp")
    user = work / "user"
    user.mkdir()
    (user / "thesis.txt").write_text("mine\n")
    parent = work
    allowed = []
    if link == "parent-link":
        (work / "real").mkdir()
        (work / "via").symlink_to(work / "real")
        parent = work / "via"
        allowed.append(work / "real")
    elif link == "deep":
        parent = work / ("d" * 100) / ("e" * 100) / ("f" * 100)
        allowed.append(work / ("d" * 100))
    out = parent / name
    if link in ("link-to-empty", "link-to-user-folder", "link-to-file", "dangling"):
        out = work / "out-link"
        target = {"link-to-empty": work / "empty", "link-to-user-folder": user, "link-to-file": user / "thesis.txt",
                  "dangling": work / "nowhere" / name}[link]
        if link == "link-to-empty":
            target.mkdir()
            allowed.append(target)
        if link == "dangling":
            allowed.append(work / "nowhere")
        out.symlink_to(target)
    if name in (".", "..") and link in ("none", "parent-link", "deep"):
        allowed = []
    allowed.append(out)
    before = sorted(os.listdir(work.parent))
    code, _, _ = check("out-paths", ["prune", "--model", ws["model"], "--method", "magnitude", "--sparsity", "0.5",
                                     "--quiet", "--out", str(out)], [ws["root"], work], allowed_new=allowed)
    if code == 0:
        assert (out / "secateur-report.json").is_file() and (out / "config.json").is_file()
    assert (user / "thesis.txt").read_text() == "mine\n" and sorted(os.listdir(user)) == ["thesis.txt"]
    assert sorted(os.listdir(work.parent)) == before  # nothing beside the case's own folder (a name of '..')


# --- every public function, one argument of a generated type ---------------------------------------------------------

def _public() -> dict:
    from secateur import api
    from secateur.eval.accuracy import eval_accuracy
    from secateur.eval.captions import eval_captions
    from secateur.eval.features import eval_features
    from secateur.export.gguf import export_gguf
    from secateur.export.vllm import export_vllm
    from secateur.masks_file import load_masks
    from secateur.recovery.options import RecoverOptions
    from secateur.report.build import write_report

    fns = {f.__name__: f for f in (api.eval_ppl, api.eval_zeroshot, api.eval_efficiency, eval_accuracy,
                                   eval_captions, eval_features, export_gguf, export_vllm, write_report, load_masks)}
    params = {n: [p for p, v in inspect.signature(f).parameters.items()
                  if v.kind not in (v.VAR_KEYWORD, v.VAR_POSITIONAL)] for n, f in fns.items()}
    fns |= {"prune": api.prune, "recover": api.recover}
    from test_fuzz_cli import COMMON, KNOBS

    params["prune"] = ["model", "out", *COMMON, *KNOBS]
    import dataclasses

    params["recover"] = [f.name for f in dataclasses.fields(RecoverOptions)]
    return {"fns": fns, "params": params}


PUBLIC = _public()
CALLS = [(f, p) for f, ps in PUBLIC["params"].items() for p in ps]
ANY = st.one_of(st.text(max_size=5), st.integers(-3, 3), st.integers(2**40, 2**70), st.floats(), st.booleans(),
                st.none(), st.binary(max_size=3), st.lists(st.integers(0, 2), max_size=2),
                st.dictionaries(st.text(max_size=2), st.integers(), max_size=2), st.just(Path("no/such")),
                st.just(object()), st.just(math.inf), st.just(torch.zeros(2)), st.just(np.int64(3)),
                st.just(np.float32(0.5)), st.just(("a", 1)), st.just(frozenset({1})))


def _required(name: str, missing: Path) -> dict:
    """The call's other arguments: everything it reads is missing (a valid drawn value must still fail before any
    work, in one line), everything it writes goes under ``missing``'s parent."""
    m = str(missing)
    w = str(missing.parent / "written")
    return {"eval_ppl": {"model": m}, "eval_zeroshot": {"model": m}, "eval_efficiency": {"model": m},
            "eval_accuracy": {"model": m}, "eval_captions": {"model": m}, "eval_features": {"model": m, "reference": m},
            "export_gguf": {"run_dir": m, "out": w + ".gguf"}, "export_vllm": {"run_dir": m, "out": w},
            "write_report": {"run_paths": [m], "out": w}, "load_masks": {"path": m},
            "prune": {"model": m, "out": w, "quiet": True}, "recover": {"run_dir": m, "out": w}}[name]


@settings(max_examples=examples(40))
@given(call=st.sampled_from(CALLS), value=ANY)
def test_every_public_function_with_a_generated_argument(tmp_path_factory, monkeypatch, call, value):
    fn_name, arg = call
    work = tmp_path_factory.mktemp("api")
    monkeypatch.chdir(work)  # a path argument of '5' or '' would land here
    kwargs = _required(fn_name, work / "missing") | {arg: value}
    verdict = None
    try:
        PUBLIC["fns"][fn_name](**kwargs)
        verdict = "returned with a missing input"
    except SecateurError as e:
        msg = str(e)
        if "\n" in msg or ";" not in msg:
            verdict = f"not one line with a fix: {msg!r}"
    except Exception as e:  # noqa: BLE001 - the broken promise under test
        verdict = f"{type(e).__name__}: {str(e)[:200]}"
    if verdict is None and list(work.iterdir()):
        verdict = f"wrote {sorted(p.name for p in work.iterdir())}"
    record("api-signature", 2 if verdict is None else 1, verdict)
    assert verdict is None, f"{fn_name}({arg}={value!r}): {verdict}"


# --- a VLM: --towers, caption calibration, eval captions ----------------------------------------------------------

@pytest.fixture(scope="module")
def vlm(tmp_path_factory) -> dict:
    from secateur.testing import save_tiny

    root = tmp_path_factory.mktemp("vlm")
    save_tiny("llava", root / "llava")
    (root / "calib.txt").write_text(LONG)
    return {"root": root, "model": str(root / "llava"), "text": str(root / "calib.txt")}


@settings(max_examples=examples(6))
@given(towers=st.sampled_from(["vision", "language", None, "both", "", "vision=0.3,language=0.5", "language=2"]),
       method=st.sampled_from(["magnitude", "wanda", "wanda-sp", "corp", "sparsegpt"]),
       calib=st.sampled_from(["fashion-mnist-captions", "fashion-mnist", "self", "text", None]),
       sparsity=st.sampled_from(["0.3", "0.5", "0", "1.5", "abc"]))
def test_vlm_towers(vlm, tmp_path_factory, towers, method, calib, sparsity):
    work = tmp_path_factory.mktemp("towers")
    out = work / "out"
    argv = ["prune", "--model", vlm["model"], "--method", method, "--sparsity", sparsity, "--nsamples", "2",
            "--seqlen", "16", "--quiet", "--out", str(out), "--data-dir", str(DATA_DIR)]
    if towers is not None:
        argv += ["--towers", towers]
    if calib is not None:
        argv += ["--calib", vlm["text"] if calib == "text" else calib]
    code, _, _ = check("vlm", argv, [vlm["root"], work], allowed_new=[out])
    if code == 0:
        report = json.loads((out / "secateur-report.json").read_text())
        assert (out / "config.json").is_file() and report


@settings(max_examples=examples(4))
@given(n=st.sampled_from(["1", "2", "0", "-1", "abc", "1e3"]), json_kind=st.sampled_from(["file", "folder", None]))
def test_eval_captions(vlm, tmp_path_factory, n, json_kind):
    work = tmp_path_factory.mktemp("captions")
    argv = ["eval", "captions", "--model", vlm["model"], "--max-images", n, "--data-dir", str(DATA_DIR)]
    target = work / "c.json"
    if json_kind == "folder":
        target.mkdir()
    if json_kind is not None:
        argv += ["--json", str(target)]
    code, out, _ = check("vlm", argv, [vlm["root"], work], allowed_new=[target])
    if code == 0 and json_kind == "file":
        res = json.loads(target.read_text())
        assert 0 <= res["caption_accuracy"] <= 1 and res["caption_ppl"] > 1 and res["images"] == int(n)


# --- regressions of what the generator found ------------------------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("how", ["folder", "dangling"])
def test_a_shard_that_is_a_folder_or_a_dangling_link_is_one_line(ws, tmp_path, how, stream):
    """Found by ``shard-sets``: without ``--stream``, a shard replaced by a folder was an IsADirectoryError
    traceback (from the safetensors check), a dangling link a FileNotFoundError."""
    model = tmp_path / "model"
    shutil.copytree(ws["sharded"], model, symlinks=True)
    shard = sorted(model.glob("*.safetensors"))[0]
    shard.unlink()
    shard.mkdir() if how == "folder" else shard.symlink_to(tmp_path / "nowhere")
    _, _, err = check("shard-sets", ["prune", "--model", str(model), "--method", "magnitude", "--sparsity", "0.5",
                                     "--quiet", "--out", str(tmp_path / "out")] + (["--stream"] if stream else []),
                      [ws["root"], tmp_path])
    assert shard.name in err.strip().splitlines()[-1], err


@pytest.mark.parametrize(("fn", "kwargs", "says"), [
    ("eval_accuracy", {"model": "m", "json_path": 5}, r"eval_accuracy\(\): argument json_path"),
    ("eval_accuracy", {"model": None}, r"eval_accuracy\(\): argument model"),
    ("eval_captions", {"model": 5}, r"eval_captions\(\): argument model"),
    ("eval_captions", {"model": "m", "max_images": "3"}, r"eval_captions\(\): argument max_images"),
    ("eval_features", {"model": "m", "reference": "r", "json_path": [1]}, r"eval_features\(\): argument json_path"),
])
def test_vision_eval_functions_refuse_wrong_types_in_one_line(tmp_path, monkeypatch, fn, kwargs, says):
    """Found by ``api-signature``: eval_accuracy, eval_captions and eval_features raised TypeError from ``open``
    or ``Path`` on a wrong type (and eval_accuracy(model=5) asked for a processor folder); now one line naming the
    argument, like the other public functions."""
    import re

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SecateurError) as e:
        PUBLIC["fns"][fn](**kwargs)
    assert "\n" not in str(e.value) and ";" in str(e.value) and re.search(says, str(e.value)), str(e.value)
    assert list(tmp_path.iterdir()) == []
