"""Nothing the user owns is ever deleted; interruptions leave no debris; output problems fail before loading.

Every refusal is checked three ways: exit code 2, one ``secateur: error:`` line naming the path and why, and a
byte-for-byte unchanged tree (names, sizes, mtimes). Refusals run with ``load_model`` replaced by a function
that fails the test, which proves they happen before any model is loaded.
"""

import errno
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import secateur.api
from secateur.cli import main
from secateur.errors import SecateurError
from secateur.safe_write import REPORT_INDEX, REPORT_NAME, TEMP_MARKER, atomic_dir, remove_stale_temps
from secateur.testing import save_tiny, tiny_model, tiny_tokenizer


def _tree(root: Path) -> dict[str, tuple]:
    """Every entry under ``root`` (links not followed): kind, size, mtime."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            p = Path(dirpath) / n
            st = p.lstat()
            out[str(p.relative_to(root))] = (p.is_symlink(), p.is_dir(), st.st_size, st.st_mtime_ns)
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return Path(save_tiny("llama", tmp_path_factory.mktemp("m") / "tiny"))


@pytest.fixture
def no_load(monkeypatch):
    def fail(*a, **k):
        raise AssertionError("the model was loaded before the output was checked")

    # every load goes through these two names: a prune's ModelSpec.load and the evaluators (eval/entry.py)
    import secateur.models.loading
    import secateur.models.spec

    monkeypatch.setattr(secateur.models.loading, "load_model", fail)
    monkeypatch.setattr(secateur.models.spec, "load_model", fail)


def _err(capsys) -> str:
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("secateur: error: "), lines
    return lines[0]


def _prune_args(model, out, *extra):
    return ["prune", "--model", str(model), "--method", "magnitude", "--quiet", "--out", str(out), *extra]


def _refused(argv, root: Path, capsys, *msgs) -> str:
    before = _tree(root)
    assert main(argv) == 2
    line = _err(capsys)
    assert all(m in line for m in msgs), line
    assert _tree(root) == before
    return line


# ------------------------------------------------------------------------------ --overwrite and --out places


def test_overwrite_refuses_an_unrelated_folder(tmp_path, model_dir, no_load, capsys):
    out = tmp_path / "mine"
    (out / "data").mkdir(parents=True)
    (out / "notes.txt").write_text("keep me")
    (out / "data" / "x.bin").write_bytes(b"\0" * 10)
    _refused(_prune_args(model_dir, out, "--overwrite"), tmp_path, capsys, str(out), "did not write",
             "data/", "notes.txt")


def test_overwrite_refuses_a_secateur_output_with_foreign_files(tmp_path, model_dir, no_load, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / REPORT_NAME).write_text("{}")
    (out / "model.safetensors").write_bytes(b"x")
    (out / "ppl-wikitext2.json").write_text("{}")  # a measurement the user wrote there: kept
    _refused(_prune_args(model_dir, out, "--overwrite"), tmp_path, capsys, "ppl-wikitext2.json", "did not write")


def test_overwrite_refuses_a_folder_without_marker(tmp_path, model_dir, no_load, capsys):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text("{}")
    _refused(_prune_args(model_dir, out, "--overwrite"), tmp_path, capsys, "not a secateur output", REPORT_NAME)


def test_overwrite_refuses_a_regular_file(tmp_path, model_dir, no_load, capsys):
    (tmp_path / "f").write_text("data")
    _refused(_prune_args(model_dir, tmp_path / "f", "--overwrite"), tmp_path, capsys, "is a file")


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
def test_out_is_or_contains_the_model(tmp_path, no_load, capsys, overwrite):
    model = Path(save_tiny("llama", tmp_path / "a" / "model"))
    (tmp_path / "link").symlink_to(model)
    for out, msg in [(model, "is the --model"), (tmp_path / "a", "contains the --model"),
                     (tmp_path / "link", "is the --model"), (tmp_path, "contains the --model")]:
        _refused(_prune_args(model, out, *overwrite), tmp_path, capsys, str(out), msg)


def test_out_is_the_gguf_file(tmp_path, no_load, capsys):
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    _refused(_prune_args(tmp_path / "m.gguf", tmp_path / "m.gguf", "--overwrite"), tmp_path, capsys,
             "is the --model")


@pytest.mark.parametrize("out,msg", [(".", "the current directory"), ("/", "the root folder"),
                                     ("", "output path is empty"), ("HOME", "the home directory"),
                                     ("..", "contains the current directory")])
def test_out_refuses_protected_places(tmp_path, model_dir, monkeypatch, no_load, capsys, out, msg):
    (tmp_path / "home").mkdir()
    (tmp_path / "cwd").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path / "cwd")
    out = str(tmp_path / "home") if out == "HOME" else out
    _refused(_prune_args(model_dir, out, "--overwrite"), tmp_path, capsys, msg)


def test_overwrite_replaces_a_previous_output(tmp_path, model_dir, capsys):
    out = tmp_path / "run"
    assert main(_prune_args(model_dir, out, "--sparsity", "0.25")) == 0
    assert main(_prune_args(model_dir, out, "--sparsity", "0.75", "--overwrite")) == 0
    assert json.loads((out / REPORT_NAME).read_text())["target_sparsity"] == 0.75
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no temporary or old folder left


def test_save_pruned_overwrites_only_its_own_output(tmp_path):
    from secateur.export.sliced import save_pruned

    m = tiny_model("llama")
    save_pruned(m, tmp_path / "o")
    save_pruned(m, tmp_path / "o", overwrite=True)  # its marker, secateur-export.json, makes it replaceable
    (tmp_path / "o" / "mine.txt").write_text("x")
    with pytest.raises(SecateurError, match="did not write"):
        save_pruned(m, tmp_path / "o", overwrite=True)
    assert (tmp_path / "o" / "mine.txt").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["o"]


# ------------------------------------------------------------------------------ stale and foreign temporaries


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _temp(parent: Path, name: str, marker: dict | None, payload: bool = True) -> Path:
    d = parent / name
    d.mkdir()
    if marker is not None:
        (d / TEMP_MARKER).write_text(json.dumps(marker))
    if payload:
        (d / "model.safetensors").write_bytes(b"\0" * 1000)
    return d


def test_next_run_removes_stale_temps_and_nothing_else(tmp_path, model_dir):
    dead, host = _dead_pid(), socket.gethostname()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        stale = [_temp(tmp_path, f".run.secateur-tmp-{dead}-abc", {"pid": dead, "host": host, "out": "run"}),
                 _temp(tmp_path, f".run.secateur-tmp-{dead}-empty", None, payload=False)]
        kept = [_temp(tmp_path, ".run.tmp-foo", None),  # someone else's (or an older version's): never touched
                _temp(tmp_path, f".run.secateur-tmp-{alive.pid}-x", {"pid": alive.pid, "host": host, "out": "run"}),
                _temp(tmp_path, f".run.secateur-tmp-{dead}-y", {"pid": dead, "host": "elsewhere", "out": "run"}),
                _temp(tmp_path, f".run.secateur-tmp-{dead}-z", None),  # no marker, not empty
                _temp(tmp_path, f".other.secateur-tmp-{dead}-w", {"pid": dead, "host": host, "out": "other"})]
        before = {p.name: _tree(p) for p in kept}
        assert main(_prune_args(model_dir, tmp_path / "run")) == 0
        assert not any(p.exists() for p in stale)
        assert {p.name: _tree(p) for p in kept} == before
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([p.name for p in kept] + ["run"])
    finally:
        alive.kill()
        alive.wait()


def test_output_moved_aside_by_a_killed_run_is_put_back(tmp_path):
    dead = _dead_pid()
    trash = _temp(tmp_path, f".run.secateur-old-{dead}-q", {"pid": dead, "host": socket.gethostname(),
                                                           "out": "run"}, payload=False)
    (trash / "run").mkdir()
    (trash / "run" / REPORT_NAME).write_text("{}")
    assert remove_stale_temps(tmp_path / "run") == [trash]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"] and (tmp_path / "run" / REPORT_NAME).exists()


# ------------------------------------------------------------------------------ interruptions


def test_sigterm_during_save_removes_the_temp_folder(tmp_path, model_dir, monkeypatch, capsys):
    """In process: SIGTERM arrives while the shards are written; the handler of ``main`` turns it into the
    same unwinding as Ctrl-C."""
    from transformers import PreTrainedModel

    def killed(self, path, *a, **k):
        (Path(path) / "model.safetensors").write_bytes(b"half")
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("SIGTERM was not turned into an exception")

    def library_handler(signum, frame):  # stands for a library user's own; without main's, it ends the test
        raise RuntimeError("main did not install its SIGTERM handler")

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", killed)
    previous = signal.signal(signal.SIGTERM, library_handler)
    try:
        assert main(_prune_args(model_dir, tmp_path / "run")) == 143
        assert signal.getsignal(signal.SIGTERM) is library_handler  # restored: library users keep theirs
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert "interrupted (SIGTERM)" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_sigterm_during_prune_exits_143_and_leaves_nothing(tmp_path):
    model = save_tiny("llama", tmp_path / "m")
    calib = tmp_path / "c.txt"
    calib.write_text("The quick brown fox jumps over the lazy dog. " * 400)
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "secateur.cli", "prune", "--model", model, "--method",
                             "sparsegpt", "--calib", str(calib), "--nsamples", "64", "--seqlen", "64", "--out",
                             str(out)], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env=os.environ | {"PYTHONUNBUFFERED": "1"})
    seen = ""
    while "blocks (sequential)" not in seen:  # the progress bar of the prune: the model is loaded by now
        ch = proc.stderr.read(1)
        assert ch, f"the prune ended before it started: {seen[-500:]}"
        seen += ch
    proc.send_signal(signal.SIGTERM)
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 143, err[-2000:]
    assert "secateur: interrupted (SIGTERM)" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.txt", "m"]


# ------------------------------------------------------------------------------ unwritable places, full disks


@pytest.mark.parametrize("where,msg", [("file/out", "is not a folder"), ("file/deeper/out", "is not a folder"),
                                       ("/proc/secateur-out", "is not writable")])
def test_unwritable_out_fails_before_loading(tmp_path, model_dir, no_load, capsys, where, msg):
    (tmp_path / "file").write_text("x")
    out = where if where.startswith("/") else tmp_path / where
    _refused(_prune_args(model_dir, out), tmp_path, capsys, str(out), msg)


def test_eval_json_checked_before_loading(tmp_path, model_dir, no_load, capsys):
    (tmp_path / "file").write_text("x")
    (tmp_path / "adir").mkdir()
    base = ["eval", "ppl", "--model", str(model_dir), "--quiet", "--json"]
    _refused(base + [str(tmp_path / "file" / "p.json")], tmp_path, capsys, "is not a folder")
    _refused(base + [str(tmp_path / "adir")], tmp_path, capsys, "is a folder")
    _refused(base + ["/proc/p.json"], tmp_path, capsys, "is not writable")


def _run_folder(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    (run / REPORT_NAME).write_text(json.dumps({"method": "wanda", "target_sparsity": 0.5}))
    return run


def test_report_out_checked_and_replaced_only_when_its_own(tmp_path, capsys):
    run = _run_folder(tmp_path)
    (tmp_path / "file").write_text("x")
    _refused(["report", str(run), "--out", str(tmp_path / "file" / "rep")], tmp_path, capsys, "is not a folder")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "report.md").write_text("my notes")
    _refused(["report", str(run), "--out", str(mine), "--overwrite"], tmp_path, capsys, "not a secateur output",
             REPORT_INDEX)
    rep = tmp_path / "rep"
    assert main(["report", str(run), "--out", str(rep)]) == 0
    assert main(["report", str(run), "--out", str(rep), "--overwrite", "--title", "again"]) == 0
    assert "again" in (rep / "report.md").read_text() and (rep / REPORT_INDEX).is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "mine", "rep", "run"]


def _disk_full_errors():
    from safetensors import SafetensorError

    return [OSError(errno.ENOSPC, "No space left on device"), OSError(errno.EDQUOT, "Disk quota exceeded"),
            SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: '
                            '"No space left on device" })')]


@pytest.mark.parametrize("i", range(3))
def test_disk_full_during_save_is_one_line_with_sizes(tmp_path, model_dir, monkeypatch, capsys, i):
    from transformers import PreTrainedModel

    exc = _disk_full_errors()[i]

    def full(self, path, *a, **k):
        (Path(path) / "model.safetensors").write_bytes(b"half")
        raise exc

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", full)
    assert main(_prune_args(model_dir, tmp_path / "run")) == 2
    line = _err(capsys)
    assert "disk full while writing" in line and str(tmp_path / "run") in line
    assert "the export needs about" in line and " free on " in line
    assert list(tmp_path.iterdir()) == []


def test_too_little_free_space_refused_before_the_prune(tmp_path, model_dir, monkeypatch, capsys):
    import shutil

    def calib(*a, **k):
        raise AssertionError("the prune started although the export cannot fit")

    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    monkeypatch.setattr(secateur.api, "calibration_set", calib)
    _refused(["prune", "--model", str(model_dir), "--method", "wanda", "--seqlen", "16", "--quiet", "--out",
              str(tmp_path / "run")], tmp_path, capsys, "not enough disk space", "needs about", "0.0 MB free")


def test_atomic_dir_removes_the_parents_it_made(tmp_path):
    with pytest.raises(RuntimeError):
        with atomic_dir(tmp_path / "a" / "b" / "out") as tmp:
            (tmp / "x").write_text("x")
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_tokenizer_files_are_export_names(tmp_path):
    """Every file a tokenizer save writes is one the overwrite check knows (else a rerun would be refused)."""
    from secateur.safe_write import check_replaceable

    tiny_tokenizer().save_pretrained(tmp_path)
    tiny_model("llama").save_pretrained(tmp_path)
    (tmp_path / REPORT_NAME).write_text("{}")
    check_replaceable(tmp_path)


@pytest.mark.parametrize("cmd", [["qk-error", "--dense", "M", "--quiet"], ["zeroshot", "--quiet"], ["efficiency"]])
def test_other_eval_json_checked_before_loading(tmp_path, model_dir, monkeypatch, capsys, cmd):
    import secateur.models.loading

    def fail(*a, **k):
        raise AssertionError("the model was loaded before --json was checked")

    monkeypatch.setattr(secateur.models.loading, "load_model", fail)
    (tmp_path / "file").write_text("x")
    argv = ["eval", *[str(model_dir) if a == "M" else a for a in cmd], "--model", str(model_dir), "--json",
            str(tmp_path / "file" / "r.json")]
    _refused(argv, tmp_path, capsys, "is not a folder")
