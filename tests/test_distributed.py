"""Many processes, one answer (issue 28): a prune or a perplexity split over 2 or 3 gloo processes gives the bits of
one process without torch.distributed; a failing rank ends every rank with one line, exit 2, nothing written."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from collections import Counter
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from secateur.calib import dist
from secateur.calib.dist import spawn_gloo
from secateur.calib.qk import ProjectedQKStats, QKOutputGrams
from secateur.calib.stats import BlockInfluence, Gram, MeanVar, PerSampleGram, SumSq
from secateur.cli import main
from secateur.errors import SecateurError
from secateur.models.adapters import get_adapter
from secateur.testing import folder_digest, tiny_model, tiny_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

SRC = str(Path(__file__).resolve().parents[1] / "src")
CALIB = ["--nsamples", "6", "--seqlen", "32", "--chunk-size", "2"]  # 3 chunks: uneven on 2 ranks, one each on 3
# (family, run name, prune arguments): every method family of the issue, several model families
RUNS = [
    ("llama", "wanda-50", ["--method", "wanda", "--sparsity", "0.5"]),
    ("llama", "sparsegpt-2:4", ["--method", "sparsegpt", "--pattern", "2:4"]),
    ("llama", "qk-wanda-MRC", ["--method", "qk-wanda", "--sparsity", "0.5", "--variant", "MRC"]),
    ("llama", "wanda-sp-ls", ["--method", "wanda-sp", "--sparsity", "0.3", "--compensation", "ls"]),
    ("llama", "rcpu-coec", ["--method", "rcpu", "--sparsity", "0.3", "--compensation", "coec", "--coec-rounds", "2"]),
    ("llama", "flap", ["--method", "flap", "--sparsity", "0.2"]),
    ("qwen2", "wanda-dense-block", ["--method", "wanda", "--sparsity", "0.5", "--mode", "dense-block"]),
    ("qwen2", "sparsegpt-50", ["--method", "sparsegpt", "--sparsity", "0.5"]),
    ("qwen2", "qk-wanda-all", ["--method", "qk-wanda", "--sparsity", "0.5", "--scope", "all"]),
    ("qwen2", "corp", ["--method", "corp", "--sparsity", "0.3"]),
    ("opt", "wanda-2:4", ["--method", "wanda", "--pattern", "2:4"]),
    ("opt", "corp-qk", ["--method", "corp-qk", "--sparsity", "0.25"]),
    ("opt", "rcpu-coec", ["--method", "rcpu", "--sparsity", "0.3", "--compensation", "coec", "--coec-rounds", "2"]),
    ("opt", "shortgpt", ["--method", "shortgpt", "--sparsity", "0.25"]),
]
FAMILIES = sorted({f for f, _, _ in RUNS})


def _cli(argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with redirect_stderr(err), redirect_stdout(io.StringIO()):
        rc = main(argv)
    return rc, err.getvalue()


def _all_runs(root: Path, tag: str, solves: dict | None = None) -> dict:
    """Every prune of :data:`RUNS` and a perplexity per family through the CLI: digests and ppl bits (``solves``:
    filled with the solves this process ran in each prune, by kind: ``calib.dist.SOLVES``)."""
    out = {}
    for fam, name, args in RUNS:
        dest = root / f"out-{tag}-{fam}-{name}"
        before = Counter(dist.SOLVES)
        rc, err = _cli(["prune", "--model", str(root / fam), "--calib", str(root / "calib.txt"), *CALIB, *args,
                        "--quiet", "--out", str(dest), "--overwrite"])
        assert rc == 0, err
        if solves is not None:
            solves[(fam, name)] = dict(dist.SOLVES - before)
        out[(fam, name)] = folder_digest(dest)
    for fam in FAMILIES:
        js = root / f"ppl-{tag}-{fam}.json"
        rc, err = _cli(["eval", "ppl", "--model", str(root / fam), "--dataset", str(root / "calib.txt"), "--seqlen",
                        "32", "--max-windows", "5", "--quiet", "--json", str(js)])
        assert rc == 0, err
        if js.exists():  # rank 0 writes it
            res = json.loads(js.read_text())
            out[(fam, "ppl")] = (res["ppl"].hex(), res["legacy_ppl"].hex(), res["windows"])
    return out


def _worker(rank: int, world: int, root: str) -> None:
    solves: dict = {}
    got = _all_runs(Path(root), f"n{world}", solves)
    torch.save(solves, Path(root) / f"n{world}-solves-{rank}.pt")
    if rank == 0:
        torch.save(got, Path(root) / f"n{world}.pt")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("dist")
    for fam in FAMILIES:
        tiny_model(fam, seed=0, layers=3).save_pretrained(root / fam)
        tiny_tokenizer().save_pretrained(root / fam)
    (root / "calib.txt").write_text("The quick brown fox jumps over the lazy dog, again and again. 0123456789 " * 40)
    return root


@pytest.fixture(scope="module")
def reference(inputs) -> dict:
    """One process, no torch.distributed (the solves it ran: ``n1-solves.pt``)."""
    solves: dict = {}
    out = _all_runs(inputs, "n1", solves)
    torch.save(solves, inputs / "n1-solves.pt")
    return out


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "SECATEUR_FAIL")}
    return env | {"PYTHONPATH": SRC + os.pathsep + env.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1",
                  "SECATEUR_DIST_TIMEOUT": "30"} | extra


def _secateur(args: list[str], **env) -> tuple[subprocess.CompletedProcess, float]:
    t = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "secateur", *args], env=_env(**env), capture_output=True, text=True,
                       timeout=240)
    return p, time.monotonic() - t


# --- the statistics: a chunk's contribution merged elsewhere is the same update, bit for bit -----------------------

def _split_equal(make, chunks) -> None:
    whole, merged = make(), make()
    for x in chunks:
        whole.update(*x) if isinstance(x, tuple) else whole.update(x)
        part = merged.fresh()
        part.update(*x) if isinstance(x, tuple) else part.update(x)
        merged.merge(merged.with_state(part.state()))
    for k, v in whole.__dict__.items():
        w = merged.__dict__[k]
        if torch.is_tensor(v):
            assert torch.equal(v, w), k
        elif isinstance(v, dict):
            assert all(torch.equal(v[i], w[i]) for i in v), k
        elif isinstance(v, list) and v and torch.is_tensor(v[0]):
            assert all(torch.equal(a, b) for a, b in zip(v, w, strict=True)), k
        elif isinstance(v, (int, float)):
            assert v == w, k


def test_every_accumulator_merges_a_chunk_as_its_update():
    g = torch.Generator().manual_seed(0)
    chunks = [torch.randn(2, 5, 16, generator=g) * 3 + 1 for _ in range(4)]
    for make in (lambda: SumSq(16), lambda: MeanVar(16), lambda: Gram(16), lambda: PerSampleGram(4, 4)):
        _split_equal(make, chunks)
    _split_equal(BlockInfluence, [(x, x.flip(-1)) for x in chunks])
    model = tiny_model("llama", layers=1)
    a = get_adapter(model)
    refs = a.role_refs(a.layers[0])
    q, k = refs["q"], refs["k"]
    x32 = [torch.randn(2, 6, q.weight.shape[1], generator=g) for _ in range(3)]
    rope = a.capture_inputs(torch.zeros(1, 6, dtype=torch.long))[1].get("position_embeddings")
    for v in ("base", "MRC"):
        _split_equal(lambda v=v: ProjectedQKStats(q.weight, k.weight, None, None, a.geometry, v, rope=rope,
                                                  proj=(q.weight.detach(), None, k.weight.detach(), None)), x32)
    g_ = a.geometry
    whole = QKOutputGrams(q, k, g_.n_heads, g_.n_kv_heads, g_.head_dim)
    merged = QKOutputGrams(q, k, g_.n_heads, g_.n_kv_heads, g_.head_dim)
    for x in x32:
        whole.update(x)
        part = merged.fresh()
        part.update(x)
        merged.merge(merged.with_state(part.state()))
    assert torch.equal(whole.qa.grams, merged.qa.grams) and torch.equal(whole.ka.sums, merged.ka.sums)


# --- owned_map: each solve on its owner rank, every result on every rank -------------------------------------------

@dataclass
class _Solved:
    w: torch.Tensor
    note: str
    extra: tuple | None = None


def _solve(x: int):
    g = torch.Generator().manual_seed(x)
    return _Solved(torch.randn(3, 4, generator=g, dtype=torch.float64), f"item {x}",
                   (torch.rand(5, generator=g) > 0.5, {"n": x, "t": torch.arange(x)}))


def _owned_worker(rank: int, world: int, root: str, workers: int = 1) -> None:
    ran: list[int] = []

    def fn(x):
        ran.append(x)
        return _solve(x)

    got = dist.owned_map(list(range(7)), fn, first=1, workers=workers)
    ran.sort()  # side by side (workers > 1) the solves start in any order
    owners = dist.Owners()
    owners.map([0, 1, 2], lambda x: x)
    again = owners.map([10, 11], lambda x: (x, rank))  # the count goes on: solve 3 on rank 3 % N, 4 on 4 % N
    failed = None

    def boom(x):
        if x == 3:
            raise ValueError("boom")
        return x

    try:
        dist.owned_map(list(range(5)), boom, workers=workers)
    except Exception as e:  # noqa: BLE001 - what each rank ends with is the finding
        failed = f"{type(e).__name__}: {e}"
    torch.save({"ran": ran, "got": got, "again": again, "failed": failed}, Path(root) / f"owned-{world}-{rank}.pt")


@pytest.mark.parametrize("world,workers", [(2, 1), (3, 1), (2, 2)])
def test_owned_map_runs_each_solve_once_and_gives_every_rank_every_result(tmp_path, world, workers):
    spawn_gloo(_owned_worker, world, (str(tmp_path), workers), threads=1)
    want = [_solve(x) for x in range(7)]
    for rank in range(world):
        r = torch.load(tmp_path / f"owned-{world}-{rank}.pt", weights_only=False)
        assert r["ran"] == [x for x in range(7) if (1 + x) % world == rank]
        for a, b in zip(r["got"], want, strict=True):
            assert isinstance(a, _Solved) and a.note == b.note and a.extra[1]["n"] == b.extra[1]["n"]
            assert torch.equal(a.w, b.w) and a.w.dtype == torch.float64 and torch.equal(a.extra[0], b.extra[0])
            assert torch.equal(a.extra[1]["t"], b.extra[1]["t"])
        assert r["again"] == [(10, 3 % world), (11, 4 % world)]
        # item 3 is owned by rank 3 % N: it ends with its own error, every other rank with its line
        assert r["failed"] == ("ValueError: boom" if rank == 3 % world else
                               f"SecateurError: rank {3 % world}: ValueError: boom")


def test_owned_map_alone_is_the_plain_map():
    before = dist.SOLVES["t"]
    assert dist.owned_map([1, 2, 3], lambda x: x * 2, kind="t") == [2, 4, 6]
    assert dist.SOLVES["t"] - before == 3


@pytest.mark.parametrize("gpus,local,backend,joins", [(1, 1, None, False), (1, 0, None, True), (2, 1, None, True),
                                                       (1, 1, "gloo", True), (1, 3, "gloo", True)])
def test_nccl_refuses_more_processes_than_gpus_before_joining(monkeypatch, gpus, local, backend, joins):
    """With --device cuda each process takes the GPU of its LOCAL_RANK; NCCL refuses two on one GPU, but only once
    the group talks, as a lost peer (seen on an H200: 'Duplicate GPU detected' after the load). So the join
    refuses first, in one line naming both ways out; gloo (SECATEUR_DIST_BACKEND) may share a GPU."""
    joined, devices = [], []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "set_device", devices.append)
    monkeypatch.setattr(dist.tdist, "init_process_group", lambda backend, **kw: joined.append(backend))

    class Store:  # the rendezvous store (rank 0 would wait for the other three): recorded, not served
        def __init__(self, *a, **kw):
            pass

        def set_timeout(self, t):
            pass

    monkeypatch.setattr(dist.tdist, "TCPStore", Store)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", str(local))
    monkeypatch.setenv("LOCAL_RANK", str(local))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # the rendezvous is checked before joining (torchrun sets it)
    monkeypatch.setenv("MASTER_PORT", "29500")
    if backend:
        monkeypatch.setenv(dist.BACKEND_ENV, backend)
    else:
        monkeypatch.delenv(dist.BACKEND_ENV, raising=False)
    if joins:
        assert dist.init_from_env("cuda") is True
        assert joined == [backend or "nccl"] and devices == [local % gpus]
    else:
        with pytest.raises(SecateurError, match=rf"^LOCAL_RANK {local} but this machine shows {gpus} GPU.*one GPU per "
                                                rf"process.*at most {gpus} process.*{dist.BACKEND_ENV}=gloo"):
            dist.init_from_env("cuda")
        assert joined == [] and devices == []


def test_owned_map_workers_solve_side_by_side_and_report_the_first_failure_in_order():
    """``workers=2``: two solves wait for each other at a barrier, which only passes when they run at the same
    time (one after another, the first would time out); results in item order; with several failures the first in
    item order is raised, as in the sequential loop."""
    import threading

    meet = threading.Barrier(2, timeout=20)

    def fn(x):
        if x < 2:
            meet.wait()
        return _solve(x)

    got = dist.owned_map(list(range(5)), fn, workers=2)
    assert [g.note for g in got] == [f"item {x}" for x in range(5)]
    assert all(torch.equal(a.w, _solve(x).w) for x, a in enumerate(got))

    def boom(x):
        if x in (1, 3):
            raise ValueError(f"boom {x}")
        return x

    with pytest.raises(ValueError, match="boom 1"):
        dist.owned_map(list(range(5)), boom, workers=2)


# --- 2 and 3 processes == 1 process --------------------------------------------------------------------------------

@pytest.mark.parametrize("world", [2, 3])
def test_split_runs_equal_one_process(inputs, reference, world):
    spawn_gloo(_worker, world, (str(inputs),), threads=1)
    got = torch.load(inputs / f"n{world}.pt")
    assert set(got) == set(reference)
    bad = [k for k in reference if got[k] != reference[k]]
    assert not bad, f"{world} processes differ from one on {bad}"
    # the decisions that solve were split: solve k of a run on rank k % N only (round-robin owners)
    one = torch.load(inputs / "n1-solves.pt")
    ranks = [torch.load(inputs / f"n{world}-solves-{r}.pt") for r in range(world)]
    assert one[("llama", "sparsegpt-2:4")] == {"sparsegpt": 3 * 7}  # 3 blocks x 7 projections, one OBS each
    assert one[("llama", "wanda-50")] == {} and one[("opt", "corp-qk")]["corp_qk"] > 0
    for run in (("llama", "wanda-sp-ls"), ("llama", "rcpu-coec"), ("llama", "flap"), ("qwen2", "corp")):
        assert one[run]["compensation"] > 0, run
    for run, kinds in one.items():
        assert set().union(*(r[run] for r in ranks)) <= set(kinds), run
        for kind, total in kinds.items():
            got_k = [r[run].get(kind, 0) for r in ranks]
            assert got_k == [len(range(r, total, world)) for r in range(world)], (run, kind, got_k, total)


def test_procs_cli_prints_once_writes_once_same_bits(inputs, reference, tmp_path):
    out = tmp_path / "out"
    p, _ = _secateur(["prune", "--model", str(inputs / "llama"), "--calib", str(inputs / "calib.txt"), *CALIB,
                      "--method", "wanda", "--sparsity", "0.5", "--quiet", "--out", str(out), "--procs", "2",
                      "--eval-ppl", str(inputs / "calib.txt"), "--eval-windows", "4"])
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("saved to") == 1 and p.stdout.count("perplexity") == 1, p.stdout
    assert folder_digest(out) == reference[("llama", "wanda-50")]
    report = json.loads((out / "secateur-report.json").read_text())
    assert report["processes"] == 2
    js = tmp_path / "ppl.json"
    p, _ = _secateur(["eval", "ppl", "--model", str(inputs / "opt"), "--dataset", str(inputs / "calib.txt"),
                      "--seqlen", "32", "--max-windows", "5", "--quiet", "--json", str(js), "--procs", "3"])
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("perplexity") == 1
    res = json.loads(js.read_text())
    assert (res["ppl"].hex(), res["legacy_ppl"].hex(), res["windows"]) == reference[("opt", "ppl")]


# --- failures: one line, exit 2, no output, no hang ---------------------------------------------------------------

@pytest.mark.parametrize(("how", "says"), [("error", "rank 1: injected failure at calibration; unset SECATEUR_FAIL"),
                                           ("kill", "rank 1: ended by SIGKILL")])
def test_a_failing_rank_ends_every_rank_with_one_line(inputs, tmp_path, how, says):
    out = tmp_path / "out"
    p, took = _secateur(["prune", "--model", str(inputs / "llama"), "--calib", str(inputs / "calib.txt"), *CALIB,
                         "--method", "sparsegpt", "--quiet", "--out", str(out), "--procs", "2"],
                        SECATEUR_FAIL=f"calibration:1:{how}")
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"secateur: error: {says}"), p.stderr
    assert not out.exists() and not list(tmp_path.iterdir())  # nothing written, no temporary folder left
    assert took < 120


def test_without_supervisor_a_lost_rank_ends_the_others(inputs, tmp_path):
    """torchrun's way (every rank started alone): rank 1 killed mid-run; rank 0 ends by itself with one line."""
    from secateur.calib.dist import free_port

    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-m", "secateur", "prune", "--model", str(inputs / "opt"), "--calib",
                               str(inputs / "calib.txt"), *CALIB, "--quiet", "--out", str(tmp_path / "out")],
                              env=_env(WORLD_SIZE="2", RANK=str(r), LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                                       MASTER_PORT=port, SECATEUR_FAIL="calibration:1:kill"),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=240) for p in procs]
    assert procs[1].returncode == -9
    assert procs[0].returncode == 2
    lines = outs[0][1].strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("secateur: error: rank 0: lost contact with another process"), \
        outs[0][1]
    assert not (tmp_path / "out").exists()


# --- refused before any process starts ----------------------------------------------------------------------------

@pytest.mark.parametrize(("extra", "says"), [
    (["--method", "cocurve"], "--method cocurve is not split over processes yet"),
    (["--procs", "0"], "--procs must be >= 1"),
])
def test_refused_in_one_line(inputs, tmp_path, extra, says):
    procs = [] if "--procs" in extra else ["--procs", "2"]
    rc, err = _cli(["prune", "--model", str(inputs / "llama"), "--calib", str(inputs / "calib.txt"), *CALIB,
                    "--out", str(tmp_path / "out"), *procs, *extra])
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("secateur: error: ") and says in lines[0], err


# --- streamed and resumed runs split over processes ---------------------------------------------------------------

# (run name, prune arguments): a structured method with compensation and a method that solves
STREAMED = [("wanda-sp-ls", ["--method", "wanda-sp", "--sparsity", "0.3", "--compensation", "ls"]),
            ("sparsegpt-50", ["--method", "sparsegpt", "--sparsity", "0.5"])]
EVAL = ["--eval-ppl", "calib.txt", "--eval-windows", "4"]  # relative to the inputs folder: made absolute in _argv


def _argv(root: Path, out: Path, args: list[str], *extra: str) -> list[str]:
    extra = tuple(str(root / e) if e == "calib.txt" else e for e in extra)
    return ["prune", "--model", str(root / "llama"), "--calib", str(root / "calib.txt"), *CALIB, *args, "--quiet",
            "--out", str(out), *extra]


def _jobs_worker(rank: int, world: int, root: str, jobs: list) -> None:
    """Run each ``(tag, argv, kill_after, env)`` through the CLI on this rank: ``kill_after`` a block index after
    which every rank is interrupted (as Ctrl-C would), ``env`` set for the job; ``(rc, stderr, blocks finished)``
    saved by tag in ``jobs-<world>-<rank>.pt``."""
    from secateur.calib import engine

    out = {}
    for tag, argv, kill, env in jobs:
        seen: list[int] = []

        def hook(i: int, seen=seen, kill=kill) -> None:
            seen.append(i)
            if kill is not None and i == kill:
                raise KeyboardInterrupt

        engine._after_block = hook
        os.environ.update(env)
        try:
            rc, err = _cli(argv)
        finally:
            for k in env:
                os.environ.pop(k)
            engine._after_block = lambda i: None
        out[tag] = (rc, err, seen)
    torch.save(out, Path(root) / f"jobs-{world}-{rank}.pt")


def _jobs(root: Path, world: int, jobs: list) -> list[dict]:
    """:func:`_jobs_worker` over ``world`` gloo processes (one process: here); each rank's results."""
    if world == 1:
        _jobs_worker(0, 1, str(root), jobs)
    else:
        spawn_gloo(_jobs_worker, world, (str(root), jobs), threads=1)
    return [torch.load(root / f"jobs-{world}-{r}.pt") for r in range(world)]


def _ppl(out: Path) -> str:
    return json.loads((out / "secateur-report.json").read_text())["perplexity"][0]["ppl"].hex()


@pytest.fixture(scope="module")
def alone(inputs, tmp_path_factory) -> dict:
    """One process: each :data:`STREAMED` run resident and streamed (the streamed one with --eval-ppl)."""
    root = tmp_path_factory.mktemp("alone")
    got = {}
    for name, args in STREAMED:
        rc, err = _cli(_argv(inputs, root / f"{name}-resident", args))
        assert rc == 0, err
        rc, err = _cli(_argv(inputs, root / f"{name}-stream", args, "--stream", *EVAL))
        assert rc == 0, err
        got[name] = {"resident": folder_digest(root / f"{name}-resident"),
                     "stream": folder_digest(root / f"{name}-stream"), "ppl": _ppl(root / f"{name}-stream")}
        assert got[name]["resident"] == got[name]["stream"]
    return got


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_streamed_split_equals_one_process(inputs, alone, tmp_path, world):
    """--stream over N processes: every rank streams the blocks, rank 0 alone writes; the weights, masks and the
    --eval-ppl perplexity (every rank evaluating rank 0's folder, windows split) are one process's bits; rank 0
    prints every rank's memory plan (the windows of its own chunks: 3 chunks of 2 windows, chunk c on rank c % N)."""
    jobs = [(name, _argv(inputs, tmp_path / name, args, "--stream", *EVAL), None, {}) for name, args in STREAMED]
    ranks = _jobs(tmp_path, world, jobs)
    windows = [sum(2 for c in range(3) if c % world == r) for r in range(world)]
    for name, _ in STREAMED:
        for r, res in enumerate(ranks):
            assert res[name][0] == 0, (r, res[name][1])
        assert folder_digest(tmp_path / name) == alone[name]["stream"] == alone[name]["resident"], name
        assert _ppl(tmp_path / name) == alone[name]["ppl"]
        err = ranks[0][name][1]
        plans = [ln for ln in err.splitlines() if ln.startswith("secateur: rank ") and "memory plan" in ln]
        assert len(plans) == world, err
        for r, ln in enumerate(plans):
            assert ln.startswith(f"secateur: rank {r} (") and f"({windows[r]} of the 6 windows: this rank's" in ln, ln
        assert not [ln for r in ranks[1:] for ln in r[name][1].splitlines() if ln.startswith("secateur: rank ")]
        report = json.loads((tmp_path / name / "secateur-report.json").read_text())
        assert report["processes"] == world
        assert [p["rank"] for p in report["memory_plan"]["ranks"]] == list(range(world))
    written = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("jobs-"))
    assert written == sorted(n for n, _ in STREAMED)  # no temporary folder left


def test_streamed_split_memory_plan_counts_the_machine(inputs, tmp_path):
    """The ranks on one machine must fit together: each rank's plan alone fits in 0.45 MiB, both do not; every rank
    refuses in one line before anything is written."""
    out = tmp_path / "out"
    ranks = _jobs(tmp_path, 2, [("tight", _argv(inputs, out, ["--method", "wanda"], "--stream"), None,
                                 {"SECATEUR_MEM_AVAILABLE_MB": "0.45"})])
    for res in ranks:
        rc, err, _ = res["tight"]
        assert rc == 2
        line = [ln for ln in err.splitlines() if ln.startswith("secateur: error")]
        assert len(line) == 1 and "its 2 processes (ranks 0, 1) need about" in line[0] and "fewer --procs" in line[0]
    assert not out.exists()


def _ckpt_names(out: Path) -> list[str]:
    from secateur.calib.resume import FILES_PREFIX, checkpoint_dir

    return sorted(p.name for p in checkpoint_dir(out).iterdir() if not p.name.startswith(FILES_PREFIX))


@pytest.mark.parametrize(("name", "first", "then"), [
    ("sparsegpt-50", 2, 2), ("sparsegpt-50", 2, 1), ("wanda-sp-ls", 2, 2),
    pytest.param("sparsegpt-50", 3, 2, marks=pytest.mark.slow),
    pytest.param("wanda-sp-ls", 1, 3, marks=pytest.mark.slow),
])
def test_split_run_killed_resumes_at_any_number_of_processes(inputs, alone, tmp_path, name, first, then):
    """A run split over ``first`` processes interrupted after block 0 keeps block 0 (written by rank 0) and the next
    block's inputs one file per chunk (each by its rank); ``--resume`` over ``then`` processes continues from block 1
    and ends with one process's bits; no checkpoint is left."""
    from secateur.calib.resume import checkpoint_dir

    args = dict(STREAMED)[name]
    out = tmp_path / "out"
    (tmp_path / "a").mkdir()
    killed = _jobs(tmp_path / "a", first, [("killed", _argv(inputs, out, args), 0, {})])
    assert [r["killed"][0] for r in killed] == [130] * first
    assert _ckpt_names(out) == ["engine0-block0.pt", "engine0-hs0-c0.pt", "engine0-hs0-c1.pt", "engine0-hs0-c2.pt",
                                "manifest.json"]
    assert not out.exists()
    (tmp_path / "b").mkdir()
    resumed = _jobs(tmp_path / "b", then, [("resumed", _argv(inputs, out, args, "--resume"), None, {})])
    for r in resumed:
        assert r["resumed"][0] == 0, r["resumed"][1]
        assert r["resumed"][2][:2] == [1, 2]  # blocks 1 and 2 of the first pass: block 0 came from the checkpoint
    assert "resuming from the checkpoint" in resumed[0]["resumed"][1]
    assert not checkpoint_dir(out).exists()
    assert folder_digest(out) == alone[name]["resident"]


@pytest.mark.slow
def test_procs_rank_killed_then_resumed(inputs, alone, tmp_path):
    """``--procs 2``: rank 1 SIGKILLed once block 0 is checkpointed; the same command with --resume continues."""
    from secateur.calib.resume import checkpoint_dir

    out = tmp_path / "out"
    argv = _argv(inputs, out, dict(STREAMED)["sparsegpt-50"]) + ["--procs", "2"]
    p, _ = _secateur(argv, SECATEUR_FAIL="block-done:1:kill")
    assert p.returncode == 2 and "rank 1: ended by SIGKILL" in p.stderr and "--resume" in p.stderr, p.stderr
    assert "engine0-block0.pt" in _ckpt_names(out) and not out.exists()
    p, _ = _secateur(argv + ["--resume"])
    assert p.returncode == 0, p.stderr
    assert "resuming from the checkpoint" in p.stderr
    assert not checkpoint_dir(out).exists() and folder_digest(out) == alone["sparsegpt-50"]["resident"]


@pytest.mark.slow
def test_one_file_checkpoint_of_one_process_resumes_split(inputs, alone, tmp_path):
    """A one-process checkpoint of the earlier format (every chunk's hidden states in one ``<stage>-hs.pt``) is
    still read: resumed at 2 processes, each takes its own chunks from it."""
    from secateur.calib.resume import Checkpoint, checkpoint_dir

    args = dict(STREAMED)["sparsegpt-50"]
    out = tmp_path / "out"
    (tmp_path / "a").mkdir()
    assert _jobs(tmp_path / "a", 1, [("killed", _argv(inputs, out, args), 0, {})])[0]["killed"][0] == 130
    ck = Checkpoint(checkpoint_dir(out))
    chunks = [ck.load(f"engine0-hs0-c{j}.pt")["hs"] for j in range(3)]
    ck.save("engine0-hs.pt", {"after": 0, "hs": chunks})
    for j in range(3):
        ck.delete(f"engine0-hs0-c{j}.pt")
    (tmp_path / "b").mkdir()
    resumed = _jobs(tmp_path / "b", 2, [("resumed", _argv(inputs, out, args, "--resume"), None, {})])
    assert [r["resumed"][2][:2] for r in resumed] == [[1, 2], [1, 2]]
    assert not checkpoint_dir(out).exists() and folder_digest(out) == alone["sparsegpt-50"]["resident"]


def test_supervisor_sees_a_later_rank_die_while_an_earlier_one_waits(monkeypatch, tmp_path, capsys):
    """``--procs``: rank 1 dies at once while rank 0 would wait for it (in a rendezvous, up to
    SECATEUR_DIST_TIMEOUT): the supervisor must notice rank 1 within its polling, stop rank 0 and name rank 1.
    Regression: ``any(c.poll() is None ...)`` stopped at live rank 0, so rank 1's death went unseen for 600 s."""
    from secateur import launch

    popen = subprocess.Popen

    def fake_popen(argv, env, **kw):
        code = "import time; time.sleep(120)" if env["RANK"] == "0" else "import os; os.kill(os.getpid(), 9)"
        return popen([sys.executable, "-c", code], env=env, **kw)

    monkeypatch.setattr(launch.subprocess, "Popen", fake_popen)
    monkeypatch.setattr(launch.tempfile, "tempdir", str(tmp_path))
    started = time.monotonic()
    assert launch.supervise(["prune"], 2) == 2
    assert time.monotonic() - started < 60  # rank 0 sleeps 120 s: only stopping it ends the run this soon
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "rank 1: ended by SIGKILL" in err[0], err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("rank, says", [(1, "rank 0 did not answer"), (0, r"did not connect to this one \(rank 0\)")])
def test_a_rendezvous_nobody_answers_ends_within_the_join_timeout(monkeypatch, rank, says):
    """A rank alone at ``MASTER_ADDR:MASTER_PORT`` (rank 0 never started, or the others never came) gives up after
    ``SECATEUR_JOIN_TIMEOUT``, not after the collectives' ten minutes, in one line naming the address."""
    from secateur.calib.dist import free_port

    port = free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("SECATEUR_JOIN_TIMEOUT", "2")
    monkeypatch.delenv("SECATEUR_DIST_TIMEOUT", raising=False)
    started = time.monotonic()
    with pytest.raises(SecateurError, match=f"MASTER_PORT {port}: .*{says}.*SECATEUR_JOIN_TIMEOUT=2 s"):
        dist.init_from_env()
    assert time.monotonic() - started < 30 and not torch.distributed.is_initialized()


@pytest.mark.parametrize("raw", ["abc", "0", "-5", "inf", "nan"])
def test_join_timeout_must_be_positive_seconds(monkeypatch, raw):
    monkeypatch.setenv("SECATEUR_JOIN_TIMEOUT", raw)
    with pytest.raises(SecateurError, match="SECATEUR_JOIN_TIMEOUT.*set e.g. 120"):
        dist.join_timeout_s()
    monkeypatch.delenv("SECATEUR_JOIN_TIMEOUT")
    monkeypatch.setenv("SECATEUR_DIST_TIMEOUT", "15")
    assert dist.join_timeout_s() == 15 and dist.timeout_s() == 15  # a short collective bound shortens the join
