"""Every input a user can fix ends with one stderr line, exit code 2, no traceback and nothing written.

The rows live in ``tests/error_cases.py`` (shared with ``bench/checks/reliability_table.py``); each runs in-process
through ``secateur.cli.main``; rows marked ``subprocess`` also run through ``python -m secateur.cli`` to prove no
traceback or warning reaches the real stderr.
"""

import os
import subprocess
import sys

import pytest
from error_cases import CASES, Case, Workspace, check_stderr, snapshot

from secateur.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tmp_path_factory.mktemp("inputs")


def _run_inprocess(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as e:  # argparse
        return int(e.code)


def _check(case: Case, models, tmp_path, run) -> None:
    if case.when is not None and not case.when():
        pytest.skip("does not apply on this machine")
    ws = Workspace(models, tmp_path)
    argv = case.argv(ws)
    before = snapshot(models, tmp_path)
    code, err = run(argv)
    assert code == case.exit, err
    assert (why := check_stderr(case, err)) is None, why
    assert snapshot(models, tmp_path) == before, "the command wrote to disk"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_error_row(case, models, tmp_path, capsys):
    def run(argv):
        capsys.readouterr()
        code = _run_inprocess(argv)
        return code, capsys.readouterr().err

    _check(case, models, tmp_path, run)


SUBPROCESS = [c for c in CASES if c.subprocess]


@pytest.mark.parametrize("case", SUBPROCESS, ids=[c.id for c in SUBPROCESS])
def test_error_row_subprocess(case, models, tmp_path):
    def run(argv):
        env = os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)}
        p = subprocess.run([sys.executable, "-m", "secateur.cli", *argv], capture_output=True, text=True, env=env,
                           stdin=subprocess.DEVNULL, timeout=300)
        return p.returncode, p.stderr

    _check(case, models, tmp_path, run)


def test_table_ids_are_unique():
    assert len({c.id for c in CASES}) == len(CASES)


def test_uniform_reach_is_what_the_rounding_rule_delivers_near_one():
    """``uniform_reach`` (the upfront refusal) equals the realized fraction of the uniform allocator at a
    sparsity just below 1, and a selection short of its target by more than the rounding bound is refused."""
    import torch

    from secateur.budgets.allocate import allocate_uniform, check_reached, shortfall_bound, uniform_reach
    from secateur.errors import SecateurError
    from secateur.models.adapters import get_adapter
    from secateur.structured.units import inventory
    from secateur.testing import tiny_model

    inv = inventory(get_adapter(tiny_model("llama")), ("kv_group", "channel"))
    scores = torch.arange(len(inv), dtype=torch.float64)
    near_one = allocate_uniform(inv, scores, 1 - 1e-9).info["realized"]
    assert abs(uniform_reach(inv) - near_one) < 1e-12 and near_one < 0.99
    bound = shortfall_bound(inv, "uniform")
    at_half = allocate_uniform(inv, scores, 0.5).info
    check_reached(inv, at_half, 0.5, "uniform")  # rounding alone: accepted
    assert 0.5 - at_half["realized"] <= bound
    with pytest.raises(SecateurError, match="cannot be reached"):
        check_reached(inv, {"realized": 0.5 - bound - 0.01}, 0.5, "uniform")
