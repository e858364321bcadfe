"""Issue 50: the boundaries that arrived with recover, several processes, shards and several runs at once keep the
promise of ``tests/contract.py`` (exit 0 with a correct output, or exit 2 with one ``secateur: error:`` line; no
traceback, hang, debris or user file touched). The single-line input errors are rows of ``tests/error_cases.py``
(``recover-masks-*``, ``model-integer-weights*``, ...); what needs more than one command line lives here.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from contract import check
from error_cases import Workspace

from secateur.safe_write import lock_path

pytestmark = pytest.mark.usefixtures("one_thread")

LONG = "The quick brown fox jumps over the lazy dog. " * 80


@pytest.fixture(scope="module")
def ws_models(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("boundaries")


def _env(**extra: str) -> dict:
    return os.environ | {"PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"} | extra


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "secateur.cli", *args]


def _wait_for(path: Path, proc: subprocess.Popen, seconds: float = 180) -> None:
    end = time.monotonic() + seconds
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        assert time.monotonic() < end, "the first run never reached its hold point"
        time.sleep(0.1)


# --- 1. a run's own files are inputs: masks of another run ---------------------------------------------------


def test_recover_refuses_masks_that_are_not_the_runs(ws_models, tmp_path):
    """A masks file with the run's names, shapes and counts but its bits elsewhere (another run's masks) is one
    line naming the file once the weights are loaded, exit 2, nothing written. Failed before the fix: a
    RuntimeError traceback (``a masked weight is not zero after re-masking``)."""
    ws = Workspace(ws_models, tmp_path)
    run = ws.masked_run("shuffled")
    data = ws.text("train.txt", LONG)
    _, _, err = check("recover-masks", ["recover", run, "--out", ws.out, "--data", data, "--tokens", "128",
                                         "--seqlen", "16", "--loss", "ce", "--quiet"], [ws_models, tmp_path])
    assert re.search(r"secateur-masks\.npz: the mask of \S+ marks weights as pruned that are not zero", err), err


def test_recover_accepts_the_runs_own_masks(ws_models, tmp_path):
    """The checks refuse nothing a prune wrote: the intact run recovers (exit 0) with its masks re-applied."""
    ws = Workspace(ws_models, tmp_path)
    run = ws.masked_run("intact")
    data = ws.text("train.txt", LONG)
    code, _, _ = check("recover-masks", ["recover", run, "--out", ws.out, "--data", data, "--tokens", "128",
                                          "--seqlen", "16", "--loss", "ce", "--quiet"], [ws_models, tmp_path],
                       allowed_new=[ws.out])
    assert code == 0 and (Path(ws.out) / "secateur-masks.npz").is_file()


# --- 2. one output, one writer ---------------------------------------------------------------------------------


def test_second_run_onto_one_out_is_refused_and_a_dead_runs_lock_is_taken_over(ws_models, tmp_path):
    """Two real processes onto one ``--out``: while the first is held at its save, the second exits 2 in one
    line naming the first's PID, and writes nothing; the first is then killed with SIGKILL (its lock file stays,
    its ``flock`` does not), and a third run takes the lock over, finishes and removes the lock file. Failed
    before the fix: the second run was not refused (both ran onto one folder)."""
    ws = Workspace(ws_models, tmp_path)
    model, out = ws.model(), tmp_path / "out"
    args = ["prune", "--model", model, "--method", "magnitude", "--sparsity", "0.5", "--quiet", "--out", str(out)]
    marker = tmp_path / "held"
    first = subprocess.Popen(_cli(*args), env=_env(SECATEUR_STALL=f"save:{marker}"),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(marker, first)
        assert lock_path(out).is_file()
        before = sorted(p.name for p in tmp_path.iterdir())
        second = subprocess.run(_cli(*args), env=_env(), capture_output=True, text=True, timeout=120)
        lines = second.stderr.strip().splitlines()
        assert second.returncode == 2 and len(lines) == 1, second.stderr
        assert re.fullmatch(rf"secateur: error: output \S+out is being written by another secateur run "
                            rf"\(PID {first.pid}\); wait for it to end, or choose another --out "
                            r"\(docs/concepts/export\.md\)", lines[0]), lines
        assert sorted(p.name for p in tmp_path.iterdir()) == before
    finally:
        first.send_signal(signal.SIGKILL)
        first.communicate()
    assert lock_path(out).is_file() and not out.exists()  # SIGKILL: the file stays, the kernel dropped the lock
    third = subprocess.run(_cli(*args), env=_env(), capture_output=True, text=True, timeout=300)
    assert third.returncode == 0, third.stderr
    assert (out / "secateur-report.json").is_file() and not lock_path(out).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["held", "out"])


@pytest.mark.parametrize("command", ["recover", "export-gguf", "eval-json"])
def test_every_output_kind_is_refused_while_another_process_writes_it(ws_models, tmp_path, command):
    """Another process holding the lock of ``--out`` (as a running prune does): ``recover``, ``export gguf`` and an
    eval ``--json`` onto that output are refused in one line naming its PID, and write nothing. Failed before the
    fix: nothing was locked, both wrote."""
    ws = Workspace(ws_models, tmp_path)
    run = ws.masked_run("intact")
    out = tmp_path / ("out.gguf" if command == "export-gguf" else "out.json" if command == "eval-json" else "out")
    marker = tmp_path / "held"
    code = ("import sys, time\nfrom secateur.safe_write import output_lock\nwith output_lock(sys.argv[1]):\n"
            "    open(sys.argv[2], 'w').close()\n    time.sleep(120)\n")
    holder = subprocess.Popen([sys.executable, "-c", code, str(out), str(marker)], env=_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(marker, holder, 60)
        argv = {"recover": ["recover", run, "--out", str(out), "--data", ws.text("t.txt", LONG), "--tokens", "128",
                            "--seqlen", "16", "--loss", "ce", "--quiet"],
                "export-gguf": ["export", "gguf", run, "--out", str(out)],
                "eval-json": ["eval", "ppl", "--model", run, "--dataset", ws.text("e.txt", LONG), "--seqlen", "16",
                              "--max-windows", "1", "--quiet", "--json", str(out)]}[command]
        _, _, err = check("lock", argv, [ws_models, tmp_path])
        assert f"is being written by another secateur run (PID {holder.pid})" in err.strip().splitlines()[-1], err
    finally:
        holder.kill()
        holder.communicate()


# --- 3. checkpoint folders hold user files ---------------------------------------------------------------------


def test_checkpoint_removal_deletes_only_what_secateur_wrote(tmp_path, capsys):
    """A checkpoint folder holding secateur's manifest plus a user's file: a new run onto it is refused in one line
    naming the file (nothing deleted); removal deletes the manifest, the pieces named in ``files-rank*.txt`` and
    those lists, and keeps the user's file and the folder (with a note); a list naming a path outside the folder
    deletes nothing there. Failed before the fix: the whole folder was deleted, the user's file with it."""
    from secateur.calib.resume import Checkpoint, CheckpointError, checkpoint_dir

    out = tmp_path / "out"
    ck = Checkpoint.open(out, {"options": {}}, resume=False, log=lambda m: None)
    ck.save("engine0-block0.pt", {"x": 1})
    victim = tmp_path / "victim.pt"
    victim.write_text("mine")
    (ck.path / "files-rank0.txt").open("a").write("../victim.pt\n")
    (ck.path / "notes.md").write_text("mine")
    with pytest.raises(CheckpointError, match=r"holds files secateur did not write \(notes\.md\); secateur deletes "
                                              r"only what it wrote: move them out of it, then run again"):
        Checkpoint.open(out, {"options": {}}, resume=False, log=lambda m: None)
    assert sorted(p.name for p in ck.path.iterdir()) == ["engine0-block0.pt", "files-rank0.txt", "manifest.json",
                                                         "notes.md"]
    capsys.readouterr()
    ck.remove()
    assert sorted(p.name for p in checkpoint_dir(out).iterdir()) == ["notes.md"] and victim.read_text() == "mine"
    assert "kept " in capsys.readouterr().err
    (ck.path / "notes.md").unlink()
    ck2 = Checkpoint.open(out, {"options": {}}, resume=False, log=lambda m: None)  # an empty folder: reused
    ck2.save("a.pt", 1)
    ck2.remove()
    assert not checkpoint_dir(out).exists()


def test_checkpoint_symlink_is_never_followed(tmp_path):
    """The checkpoint path a symbolic link to a user's folder: opening refuses it in one line and removal does
    nothing through it. Failed before the fix: a traceback (and a checkpoint written into the user's folder)."""
    from secateur.calib.resume import Checkpoint, CheckpointError, checkpoint_dir

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "manifest.json").write_text('{"secateur_checkpoint": 1}')
    (mine / "thesis.pt").write_text("mine")
    out = tmp_path / "out"
    checkpoint_dir(out).symlink_to(mine, target_is_directory=True)
    with pytest.raises(CheckpointError, match="is a symbolic link"):
        Checkpoint.open(out, {}, resume=False, log=lambda m: None)
    Checkpoint(checkpoint_dir(out)).remove()
    assert sorted(p.name for p in mine.iterdir()) == ["manifest.json", "thesis.pt"]


# --- 4. anything that waits has a bound and a message ------------------------------------------------------------


def _one_line_exit_2(p: subprocess.CompletedProcess) -> str:
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and "Traceback" not in p.stderr and lines, p.stderr[-2000:]
    assert lines[-1].startswith("secateur: error: ") and ";" in lines[-1], p.stderr[-2000:]
    assert sum(ln.startswith("secateur: error:") for ln in lines) == 1, p.stderr[-2000:]
    return lines[-1]


@pytest.mark.parametrize("name", ["WORLD_SIZE", "RANK"])
def test_world_size_that_is_not_an_integer_is_one_line(ws_models, tmp_path, name):
    """``WORLD_SIZE=abc`` (or ``RANK``): one line naming the variable, exit 2. Failed before the fix: a traceback
    (the SecateurError raised again inside the error handler, which asked the same environment)."""
    ws = Workspace(ws_models, tmp_path)
    p = subprocess.run(_cli("prune", "--model", ws.model(), "--out", ws.out, "--quiet"), env=_env(**{name: "abc"}),
                       capture_output=True, text=True, timeout=120)
    assert re.search(rf"{name}='abc' is not an integer; unset it", _one_line_exit_2(p))
    assert sorted(tmp_path.iterdir()) == []


def test_master_addr_that_does_not_resolve_fails_in_seconds(ws_models, tmp_path):
    """``WORLD_SIZE=2`` with a ``MASTER_ADDR`` that does not resolve: one line naming MASTER_ADDR and the port,
    within seconds, nothing written. Failed before the fix: 300 s of c10d warnings and no secateur line."""
    ws = Workspace(ws_models, tmp_path)
    env = _env(WORLD_SIZE="2", RANK="0", LOCAL_RANK="0", MASTER_ADDR="no-such-host.invalid", MASTER_PORT="29533",
               SECATEUR_DIST_TIMEOUT="60")
    t0 = time.monotonic()
    p = subprocess.run(_cli("prune", "--model", ws.model(), "--method", "magnitude", "--out", ws.out, "--quiet"),
                       env=env, capture_output=True, text=True, timeout=150)
    assert time.monotonic() - t0 < 60
    line = _one_line_exit_2(p)
    assert re.search(r"rank 0: MASTER_ADDR 'no-such-host\.invalid' \(port 29533\) does not resolve", line), line
    assert sorted(tmp_path.iterdir()) == []


def test_procs_beyond_the_memory_is_refused_up_front(ws_models, tmp_path, monkeypatch):
    """``--procs 2`` where the available memory does not hold two processes before they load the model: one line
    before any process starts. Failed before the fix: the processes were started."""
    monkeypatch.setenv("SECATEUR_MEM_AVAILABLE_MB", "200")
    ws = Workspace(ws_models, tmp_path)
    _, _, err = check("procs", ["prune", "--model", ws.model(), "--out", ws.out, "--quiet", "--procs", "2"],
                      [ws_models, tmp_path])
    assert re.search(r"--procs 2: each process holds about [\d.]+ GiB before it loads the model \([\d.]+ GiB for 2\), "
                     r"and 0\.20 GiB is available; pass --procs 1 or fewer", err), err


def test_stale_supervisor_folders_are_removed(tmp_path, monkeypatch):
    """The rank folder of a supervisor killed with SIGKILL is removed by the next supervisor (and by a rank that
    outlives its supervisor); a live supervisor's folder is kept. Failed before the fix: they stayed in /tmp."""
    import tempfile

    from secateur import launch

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    gone, alive = tmp_path / f"secateur-procs-{dead.pid}-abc", tmp_path / f"secateur-procs-{os.getppid()}-def"
    for d in (gone, alive):
        d.mkdir()
        (d / "rank-1.json").write_text("{}")
    assert launch.remove_stale_folders() == [gone] and alive.is_dir() and not gone.exists()
    monkeypatch.setenv(launch.ERRORS_ENV, str(alive))
    monkeypatch.setenv(launch.SUPERVISOR_ENV, str(os.getppid()))  # the supervisor is this process's parent: kept
    launch.orphan_cleanup()
    assert alive.is_dir()
    monkeypatch.setenv(launch.SUPERVISOR_ENV, str(dead.pid))  # the supervisor is gone
    launch.orphan_cleanup()
    assert not alive.exists()


@pytest.mark.parametrize(("tokens", "says"), [
    ("1000000000000000", r"not enough memory for the recovery.*--tokens"),
    ("100000", r"--tokens asks for 6250 windows of --seqlen 16 \(100000 tokens\), more than the \d+ tokens --data "
               r"\S+train\.txt holds for training \(after its held-out part\); pass --tokens \d+ or less"),
])
def test_recover_tokens_beyond_memory_or_data_is_refused_before_training(ws_models, tmp_path, tokens, says):
    """``recover --tokens`` that no memory holds (refused by the plan, before any model is loaded) or that is more
    than the data holds (refused before training): one line, exit 2, nothing written. Failed before the fix: 10^15
    tokens started and did not stop; 100000 tokens of a 3600-character text trained on repeats of it."""
    ws = Workspace(ws_models, tmp_path)
    run, data = ws.masked_run("intact"), ws.text("train.txt", LONG)
    _, _, err = check("recover-tokens", ["recover", run, "--out", ws.out, "--data", data, "--tokens", tokens,
                                          "--seqlen", "16", "--loss", "ce", "--quiet"], [ws_models, tmp_path])
    assert re.search(says, err.strip().splitlines()[-1]), err


# --- 5. every write and exit path ----------------------------------------------------------------------------------


def test_stdout_closed_early_after_a_complete_output_is_quiet_exit_0(ws_models, tmp_path):
    """``secateur prune ... | true``: the reader is gone before the summary is printed; the output is complete, so
    the command dies quietly with exit 0 (nothing on stderr). Failed before the fix: BrokenPipeError (exit 120 and
    'Exception ignored' on stderr)."""
    ws = Workspace(ws_models, tmp_path)
    argv = _cli("prune", "--model", ws.model(), "--method", "magnitude", "--quiet", "--out", ws.out)
    p = subprocess.Popen(argv, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    p.stdout.close()  # the reader goes away at once, as `| true` does
    err = p.stderr.read()
    assert p.wait(timeout=300) == 0 and err.strip() == "", err
    assert (Path(ws.out) / "secateur-report.json").is_file()


def test_full_stdout_after_a_complete_output_is_one_note_and_exit_0(ws_models, tmp_path):
    """``> /dev/full``: the summary cannot be written; the output is complete: exit 0 and one note saying the
    lines are lost. Failed before the fix: OSError (ENOSPC) at the interpreter's last flush, exit 120."""
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full on this system")
    ws = Workspace(ws_models, tmp_path)
    with open("/dev/full", "w") as full:
        p = subprocess.run(_cli("prune", "--model", ws.model(), "--method", "magnitude", "--quiet", "--out", ws.out),
                           env=_env(), stdout=full, stderr=subprocess.PIPE, text=True, timeout=300)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 0 and len(lines) == 1, p.stderr
    assert lines[0].startswith("secateur: note: stdout cannot be written (No space left on device)"), lines
    assert (Path(ws.out) / "secateur-report.json").is_file()


@pytest.mark.parametrize("error", [MemoryError(), ImportError("libtorch_cpu.so: failed to map segment from shared "
                                                               "object"), RuntimeError("[enforce fail at alloc_cpu."
                                                                                       "cpp:117] DefaultCPUAllocator: "
                                                                                       "can't allocate memory")])
def test_out_of_memory_is_one_line(ws_models, tmp_path, monkeypatch, error):
    """MemoryError in from_pretrained, a library that cannot be mapped under ``ulimit -v``, torch's allocator: one
    line saying out of memory and what to ask for less of, exit 2, nothing written. Failed before the fix: a
    traceback."""
    from secateur.models import spec

    def boom(*a, **k):
        raise error

    monkeypatch.setattr(spec, "load_model", boom)  # where ModelSpec.load finds it
    ws = Workspace(ws_models, tmp_path)
    _, _, err = check("memory", ["prune", "--model", ws.model(), "--method", "magnitude", "--quiet", "--out", ws.out],
                      [ws_models, tmp_path])
    assert re.search(rf"secateur: error: out of memory \({type(error).__name__}.*\); free memory or raise the limit",
                     err), err


def test_checkpoint_write_that_fails_is_one_line(ws_models, tmp_path, monkeypatch):
    """torch's writer failing while a checkpoint block is written (a full disk reads ``file write failed``, with no
    errno): one line naming the checkpoint, exit 2, no output. Failed before the fix: a RuntimeError traceback."""
    import torch

    from secateur.calib import resume

    def full(*a, **k):
        raise RuntimeError("[enforce fail at inline_container.cc:603] . PytorchStreamWriter failed writing file "
                           "data/0: file write failed")

    monkeypatch.setattr(resume.torch, "save", full)
    assert resume.torch is torch
    ws = Workspace(ws_models, tmp_path)
    from contract import run_cli

    code, _, err = run_cli(["prune", "--model", ws.model(), "--method", "wanda", "--calib", "self", "--nsamples", "2",
                            "--seqlen", "16", "--quiet", "--out", ws.out])
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert re.match(r"secateur: error: cannot write while writing the checkpoint \S+\.out\.secateur-ckpt \(.* free\); "
                    r"free space and run the same command with --resume, or delete it", lines[0]), lines
    assert not Path(ws.out).exists()


def test_recover_checks_the_disk_for_its_output_and_checkpoint_before_training(ws_models, tmp_path, monkeypatch):
    """A disk without room for the recovered output and its checkpoint: refused in one line before any training
    step. Failed before the fix: training ran and wrote its checkpoint first; the disk was checked at the save."""
    import shutil

    from secateur.recovery import train

    ws = Workspace(ws_models, tmp_path)
    run, data = ws.masked_run("intact"), ws.text("train.txt", LONG)
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=10_000))
    steps = []
    monkeypatch.setattr(train, "_after_step", steps.append)
    _, _, err = check("recover-disk", ["recover", run, "--out", ws.out, "--data", data, "--tokens", "128",
                                        "--seqlen", "16", "--loss", "ce", "--quiet"], [ws_models, tmp_path])
    assert re.search(r"not enough disk space for \S+out: the export and its checkpoint needs about", err), err
    assert steps == []


# --- 6. the API validates like the CLI -----------------------------------------------------------------------------


def _api_calls(run: str, tmp: Path):
    from secateur import api
    from secateur.export.gguf import export_gguf
    from secateur.masks_file import load_masks
    from secateur.report.build import write_report

    return [
        (lambda: api.eval_ppl(seqlen="64"), r"eval_ppl\(\): argument seqlen: input should be a valid integer "
                                            r"\(got '64'\); pass a whole number"),
        (lambda: api.eval_ppl(model=None), r"eval_ppl\(\): argument model: .*; pass a model name, folder"),
        (lambda: api.eval_ppl(run, max_windows=2.5), r"argument max_windows: input should be a valid integer"),
        (lambda: api.eval_ppl(run, progress="no"), r"argument progress: input should be a valid boolean"),
        (lambda: api.eval_zeroshot(run, limit="3"), r"eval_zeroshot\(\): argument limit"),
        (lambda: api.eval_efficiency(model=None), r"eval_efficiency\(\): argument model"),
        (lambda: export_gguf(run, out=None), r"export_gguf\(\): argument out: .*; pass a path \(a str or os\.PathLike"
                                             r"\)"),
        (lambda: export_gguf(run, tmp / "m.gguf", overwrite=1), r"export_gguf\(\): argument overwrite"),
        (lambda: write_report(run_paths=None, out=tmp / "rep"), r"write_report\(\): argument run_paths: input should "
                                                                r"be a valid list"),
        (lambda: write_report([run], out=7), r"write_report\(\): argument out"),
        (lambda: load_masks(str(tmp / "missing.npz")), r"masks file \S+missing\.npz does not exist"),
        (lambda: load_masks(5), r"masks file: path must be a str or os\.PathLike, not int"),
        (lambda: api.recover(run, out=5), r"recover: out \(--out\) must be a path \(a str or os\.PathLike\), not int "
                                          r"5; pass the output folder"),
        (lambda: api.recover(5, out=str(tmp / "o")), r"recover: run_dir must be a path"),
        (lambda: api.recover(run, out=str(tmp / "o"), overwrite="yes"), r"--overwrite must be True or False"),
        (lambda: api.recover(run, out=str(tmp / "o"), data=3.5), r"recover: data \(--data\) must be a path"),
        (lambda: api.recover(run, out=str(tmp / "o"), teacher=["a"]), r"recover: teacher \(--teacher\) must be a "
                                                                      r"path"),
    ]


def test_public_functions_refuse_wrong_argument_types_in_one_line(ws_models, tmp_path, monkeypatch):
    """Every public function called with an argument of the wrong type raises one SecateurError naming the
    function and the argument and what to pass, before anything is loaded or written; ``recover(out=5)`` writes no
    folder named ``5``. Failed before the fix: TypeError, AttributeError, StatisticsError or a raw numpy error
    from deep inside, and ``recover(out=5)`` recovered into ./5."""
    from secateur.errors import SecateurError

    ws = Workspace(ws_models, tmp_path)
    run = ws.masked_run("intact")
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    for call, says in _api_calls(run, tmp_path):
        with pytest.raises(SecateurError) as e:
            call()
        msg = str(e.value)
        assert "\n" not in msg and ";" in msg and re.search(says, msg), msg
    assert list(work.iterdir()) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["cwd"]


def test_path_arguments_accept_os_pathlike(ws_models, tmp_path):
    """The path arguments take any ``os.PathLike`` (the checks refuse types, not paths): eval_ppl with a Path
    model, dataset and json_path writes its JSON."""
    from secateur import api

    ws = Workspace(ws_models, tmp_path)
    text = Path(ws.text("eval.txt", LONG))
    res = api.eval_ppl(Path(ws.model()), text, seqlen=16, max_windows=2, progress=False, json_path=tmp_path / "p.json")
    assert res["ppl"] > 1 and (tmp_path / "p.json").is_file()
