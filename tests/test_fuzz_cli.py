"""Generated inputs at the command line and the Python API, each held to the promise of ``tests/contract.py``.

Three classes, each a hypothesis strategy rather than a list:

* ``api-arguments``: ``api.prune`` with one keyword (a common option or any method's knob) set to a value of a
  random type (text, numbers incl. NaN/inf, bools, None, lists, dicts, paths): a ``SecateurError`` naming the
  keyword, never a TypeError/AttributeError, nothing written; or, when the value happens to be valid, the
  run's own error about the missing model (checked before any weight is read).
* ``cli-flags``: ``secateur prune`` on a tiny model with one to three flags drawn from the parser's own options
  and values from a pool of awkward strings: exit 0 with a complete output folder, or exit 2 and one line.
* ``paths``: ``--model``, ``--out``, ``--calib`` and ``--recipe`` pointed at the kinds of filesystem entries a user
  can get wrong (a file for a folder, a folder for a file, the model itself, inside the model, a missing parent,
  an empty folder, a dangling link, ``/dev/null``).
"""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

import pytest
from contract import check, record, tree
from hypothesis import given
from hypothesis import strategies as st

from secateur import api
from secateur.errors import SecateurError
from secateur.methods.registry import knob_names

pytestmark = pytest.mark.usefixtures("one_thread")

COMMON = ["method", "sparsity", "pattern", "budget", "rounding", "targets", "calib", "nsamples", "seqlen", "seed",
          "data_dir", "mode", "chunk_size", "dtype", "device", "overwrite", "quiet", "resume", "structured", "stream",
          "eval_ppl", "eval_windows"]
KNOBS = sorted(knob_names())

values = st.one_of(
    st.text(max_size=6), st.integers(-3, 3), st.integers(min_value=10**6, max_value=10**12),
    st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.none(),
    st.lists(st.sampled_from(["q", "k", "v", 1, 0.5]), max_size=3), st.dictionaries(st.text(max_size=3),
                                                                                     st.integers(), max_size=2),
    st.sampled_from([Path("x"), b"bytes", object(), math.pi, "0.5", "2:4", "q,k", "ceil", "wanda", "cpu"]))


@pytest.fixture(scope="module")
def ws(tiny_inputs):
    return tiny_inputs


@given(key=st.sampled_from(COMMON + KNOBS), value=values)
def test_api_argument_types(ws, tmp_path_factory, key, value):
    out = tmp_path_factory.mktemp("api") / "out"
    absent = str(ws["root"] / "no-such-model")
    before = tree(ws["root"], out.parent)
    verdict = None
    try:
        api.prune(**({"model": absent, "out": str(out), "quiet": True} | {key: value}))
        verdict = "a prune of a missing model returned"
    except SecateurError as e:
        msg = str(e)
        if "\n" in msg or ";" not in msg:
            verdict = f"not one line with a fix: {msg!r}"
    except Exception as e:  # noqa: BLE001 - the broken promise under test
        verdict = f"{type(e).__name__}: {e}"
    if verdict is None and tree(ws["root"], out.parent) != before:
        verdict = "wrote to disk"
    record("api-arguments", 2 if verdict is None else 1, verdict)
    assert verdict is None, f"{key}={value!r}: {verdict}"


FLAGS = ["--sparsity", "--pattern", "--budget", "--rounding", "--targets", "--nsamples", "--seqlen", "--seed",
         "--mode", "--chunk-size", "--dtype", "--device", "--method", "--units", "--allocation", "--compensation",
         "--variant", "--scope", "--segment-len", "--width-multiple", "--eval-ppl", "--eval-windows", "--coec-rounds",
         "--ls-lambda", "--heldout"]
SWITCHES = ["--structured", "--overwrite", "--resume", "--stream"]
AWKWARD = ["", "abc", "-1", "0", "1", "2", "3", "0.3", "0.99", "1.5", "nan", "inf", "-inf", "1e9", "2:4", "4:8",
           "0:4", "q,k", "q,,k", ",", "all", "shared", "row", "ceil", "floor", "float16", "bfloat16", "cuda", "meta",
           "wanda", "sparsegpt", "magnitude", "wanda-sp", "flap", "channel", "kv_group,channel", "ls", "coec",
           "none", "wikitext2", "MRC", "qk", "ünï", "--quiet", "8"]


@given(flags=st.lists(st.tuples(st.sampled_from(FLAGS), st.sampled_from(AWKWARD)), min_size=1, max_size=3),
       switches=st.lists(st.sampled_from(SWITCHES), max_size=2, unique=True))
def test_cli_flags(ws, tmp_path_factory, flags, switches):
    work = tmp_path_factory.mktemp("cli")
    out = work / "out"
    argv = ["prune", "--model", ws["model"], "--calib", ws["text"], "--nsamples", "2", "--seqlen", "16", "--quiet",
            "--out", str(out)]
    for flag, v in flags:
        if flag in ("--nsamples", "--seqlen", "--chunk-size", "--segment-len", "--coec-rounds", "--heldout") \
                and v in ("1e9",):
            v = "17"  # valid but slow sizes belong to the memory plan's tests, not to a generator's budget
        argv += [flag, v]
    argv += switches
    code, _, _ = check("cli-flags", argv, [ws["root"], work], allowed_new=[out])
    if code == 0:
        assert (out / "secateur-report.json").is_file() and (out / "config.json").is_file()


def _path_kinds(ws: dict, work: Path) -> dict[str, str]:
    """Filesystem entries a user can point an option at, made fresh in ``work``."""
    f = work / "a-file.txt"
    f.write_text("not a model\n")
    empty = work / "empty-dir"
    empty.mkdir()
    dangling = work / "dangling"
    dangling.symlink_to(work / "nowhere")
    link_model = work / "link-to-model"
    link_model.symlink_to(ws["model"])
    return {"file": str(f), "empty-dir": str(empty), "dangling-link": str(dangling), "missing": str(work / "gone"),
            "missing-parent": str(work / "gone" / "deeper" / "x"), "under-a-file": str(f) + "/x",
            "model": ws["model"], "inside-model": ws["model"] + "/sub", "link-to-model": str(link_model),
            "dev-null": os.devnull, "text": ws["text"], "root": "/", "cwd": ".", "home": str(Path.home()),
            "empty": ""}


OPTIONS = ["--model", "--out", "--calib", "--recipe", "--data-dir"]


KINDS = ["file", "empty-dir", "dangling-link", "missing", "missing-parent", "under-a-file", "model", "inside-model",
         "link-to-model", "dev-null", "text", "root", "cwd", "home", "empty"]


@given(option=st.sampled_from(OPTIONS), kind=st.sampled_from(KINDS))
def test_paths(ws, tmp_path_factory, option, kind):
    work = tmp_path_factory.mktemp("paths")
    target = _path_kinds(ws, work)[kind]
    out = work / "out"
    opts = {"--model": ws["model"], "--out": str(out), "--calib": ws["text"]} | {option: target}
    argv = ["prune", "--nsamples", "2", "--seqlen", "16", "--quiet"]
    for k, v in opts.items():
        argv += [k, v]
    before = sorted(os.listdir(target)) if kind in ("home", "cwd", "root") else None  # not hashed: can be large
    allowed = [out]
    if option == "--out" and kind in ("missing", "missing-parent"):  # a new output folder, its parents made
        allowed.append(str(work / "gone"))
    check("paths", argv, [ws["root"], work], allowed_new=allowed)
    if before is not None:
        assert sorted(os.listdir(target)) == before
    shutil.rmtree(work, ignore_errors=True)
