"""Non-regular files as data are refused up front, never read (issue 25, the environment).

A FIFO, a character device (``/dev/zero`` never ends, ``/dev/null`` is empty), or a socket given where secateur
reads a file (``--calib``, an evaluation text, a data directory's corpus, a ``.gguf``, a file of a model folder,
a ``--recipe``) is one line naming it ("... is not a regular file (a FIFO); ..."), exit 2. The FIFO cases run in
a subprocess with a timeout, so a regression (a read that waits for a writer) fails instead of hanging the suite.
"""

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from contract import check

from secateur.testing import save_tiny

pytestmark = pytest.mark.usefixtures("one_thread")
TEXT = "The quick brown fox jumps over the lazy dog. " * 20


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return Path(save_tiny("llama", tmp_path_factory.mktemp("tiny") / "llama"))


def _prune(model, calib, out):
    return ["prune", "--model", model, "--calib", calib, "--nsamples", "2", "--seqlen", "16", "--quiet", "--out", out]


def _ppl(model, dataset, tmp, *extra):
    return ["eval", "ppl", "--model", model, "--dataset", dataset, "--seqlen", "32", "--quiet",
            "--json", tmp / "ppl.json", *extra]


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/null"])
@pytest.mark.parametrize("command", ["prune", "eval-ppl"])
def test_a_character_device_as_text_is_refused(model, tmp_path, device, command):
    link = tmp_path / "corpus.txt"  # the .txt a user typed, which is a link to a device
    link.symlink_to(device)
    argv = _prune(model, link, tmp_path / "out") if command == "prune" else _ppl(model, link, tmp_path)
    code, _, err = check("nonregular:device", argv, [tmp_path])
    assert code == 2 and f"text file {link} is not a regular file (a character device); pass a UTF-8 .txt" in err


def test_a_socket_as_text_is_refused(model, tmp_path):
    path = tmp_path / "s.txt"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))
        code, _, err = check("nonregular:socket", _prune(model, path, tmp_path / "out"), [tmp_path])
    assert code == 2 and "is not a regular file (a socket)" in err


def test_a_device_in_a_model_folder_is_refused(model, tmp_path):
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(model, folder)
    (folder / "tokenizer.json").unlink()
    (folder / "tokenizer.json").symlink_to("/dev/zero")
    (tmp_path / "eval.txt").write_text(TEXT)
    code, _, err = check("nonregular:model-file", _ppl(folder, tmp_path / "eval.txt", tmp_path), [tmp_path])
    assert code == 2 and f"model folder {folder}: file {folder / 'tokenizer.json'} is not a regular file" in err


# --- FIFOs: each case in one subprocess, each with an alarm, the whole under a timeout -----------------------------

FIFO_CASES = ["calib", "eval-text", "data-dir-corpus", "gguf", "model-config", "recipe"]

_RUNNER = textwrap.dedent("""
    import json, signal, sys
    from contract import run_cli

    class Hang(Exception):
        pass

    def alarm(*_):
        raise Hang()

    signal.signal(signal.SIGALRM, alarm)
    results = {}
    for name, argv in json.loads(sys.argv[1]).items():
        signal.alarm(20)
        try:
            code, out, err = run_cli(argv)
        except Hang:
            code, err = -1, "hung (no answer in 20 s)"
        finally:
            signal.alarm(0)
        results[name] = [code, err]
    print(json.dumps(results))
""")


@pytest.fixture(scope="module")
def fifo_results(model, tmp_path_factory):
    import shutil

    tmp = tmp_path_factory.mktemp("fifo")
    fifo = {}
    for name in ("calib.txt", "eval.txt", "tiny.gguf", "recipe.yaml"):
        os.mkfifo(tmp / name)
        fifo[name] = tmp / name
    data = tmp / "data" / "wikitext2-raw"
    data.mkdir(parents=True)
    os.mkfifo(data / "wiki.test.raw")
    folder = tmp / "m"
    shutil.copytree(model, folder)
    (folder / "config.json").unlink()
    os.mkfifo(folder / "config.json")
    (tmp / "ok.txt").write_text(TEXT)
    argv = {
        "calib": _prune(model, fifo["calib.txt"], tmp / "out"),
        "eval-text": _ppl(model, fifo["eval.txt"], tmp),
        "data-dir-corpus": _ppl(model, "wikitext2", tmp, "--data-dir", tmp / "data"),
        "gguf": _ppl(fifo["tiny.gguf"], tmp / "ok.txt", tmp),
        "model-config": _ppl(folder, tmp / "ok.txt", tmp),
        "recipe": ["prune", "--recipe", fifo["recipe.yaml"], "--out", tmp / "out"],
    }
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}
    proc = subprocess.run([sys.executable, "-c", _RUNNER, json.dumps({k: [str(a) for a in v]
                                                                        for k, v in argv.items()})],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), fifo, folder, data


@pytest.mark.parametrize("case", FIFO_CASES)
def test_a_fifo_is_refused_without_waiting_for_a_writer(fifo_results, case):
    results, fifo, folder, data = fifo_results
    code, err = results[case]
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("secateur: error: ") and ";" in lines[0], err
    assert "is not a regular file" in err
    named = {"calib": fifo["calib.txt"], "eval-text": fifo["eval.txt"], "gguf": fifo["tiny.gguf"],
             "recipe": fifo["recipe.yaml"], "model-config": folder / "config.json",
             "data-dir-corpus": data / "wiki.test.raw"}[case]
    assert str(named) in err
