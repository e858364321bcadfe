"""The package as a user gets it (issue 48 §5): ``python -m build`` gives a wheel and an sdist that pass
``twine check``; the wheel installed into a fresh virtual environment runs ``secateur --version``, ``--help`` and a
tiny prune with no source tree on the path; the version agrees with CHANGELOG.md; each optional extra lists only
what its feature needs, and a feature whose extra is missing says so in one line.

The fresh environment is made with ``--system-site-packages`` and one ``.pth`` line naming this environment's
site-packages, so torch and the other dependencies come from here (nothing downloaded, seconds instead of
minutes); the ``.pth`` files of that folder are not run from there, so the editable install's path to ``src/`` is
not on the new environment's path (checked: ``secateur.__file__`` lies inside the new environment)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest

import secateur

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def changelog_version() -> str:
    """The latest release of CHANGELOG.md: its first ``## [X.Y.Z]`` heading ([Unreleased] is not one)."""
    m = re.search(r"^## \[(\d+\.\d+\.\d+)\] - \d{4}-\d{2}-\d{2}$", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert m, "CHANGELOG.md has no '## [X.Y.Z] - YYYY-MM-DD' release heading"
    return m.group(1)


def test_version_agrees_with_the_changelog(capsys):
    from secateur.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"secateur {secateur.__version__}"
    assert secateur.__version__ == changelog_version()
    assert "version" in PYPROJECT["project"]["dynamic"]  # one source: the package's __version__
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "secateur.__version__"}


def _names(reqs: list[str]) -> set[str]:
    return {re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0].lower() for r in reqs}


# what each feature extra may install (the list; [docs] is the documentation site's tooling)
EXTRA_PACKAGES = {"eval": {"lm-eval"}, "vision": {"pillow"}, "recover": {"peft"}, "deploy": {"llama-cpp-python"}}


def test_extras_install_only_what_they_need():
    extras = PYPROJECT["project"]["optional-dependencies"]
    base = _names(PYPROJECT["project"]["dependencies"])
    for extra, allowed in EXTRA_PACKAGES.items():
        assert _names(extras[extra]) == allowed, extra
        assert not allowed & base, f"{extra}'s packages are also base dependencies: {allowed & base}"
    if "docs" in extras:  # the documentation tooling: nothing of the library's own stack
        assert not _names(extras["docs"]) & (base | {"torch", "transformers"}), extras["docs"]
    from secateur.extras import EXTRAS

    for module, (dist, extra) in EXTRAS.items():
        assert dist in _names(extras[extra]), (module, extra)


@pytest.mark.parametrize("module", ["PIL", "peft"])
def test_a_missing_extra_is_one_line_naming_it(module, monkeypatch):
    from secateur.errors import SecateurError
    from secateur.extras import EXTRAS, require

    require(module, "x")  # installed here
    monkeypatch.setitem(sys.modules, module, None)  # as if it were not
    with pytest.raises(SecateurError) as e:
        require(module, "this feature")
    dist, extra = EXTRAS[module]
    assert str(e.value) == (f"this feature needs {dist}, which is not installed; install it with: "
                            f"pip install 'secateur[{extra}]'")


def _run(cmd: list[str], cwd: Path, env: dict | None = None, timeout: int = 300) -> str:
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{' '.join(map(str, cmd))}: exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return r.stdout


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    if importlib.util.find_spec("build") is None:
        pytest.skip("build is not installed (pip install -e '.[release]')")
    out = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "build", "--outdir", str(out), str(ROOT)], cwd=out, timeout=600)
    return out


@pytest.mark.slow
def test_wheel_and_sdist_pass_twine_check(dist):
    wheel, sdist = sorted(dist.glob("*.whl")), sorted(dist.glob("*.tar.gz"))
    assert [w.name for w in wheel] == [f"secateur-{secateur.__version__}-py3-none-any.whl"]
    assert [s.name for s in sdist] == [f"secateur-{secateur.__version__}.tar.gz"]
    if importlib.util.find_spec("twine") is None:
        pytest.skip("twine is not installed (pip install -e '.[release]')")
    out = _run([sys.executable, "-m", "twine", "check", "--strict", *map(str, wheel + sdist)], cwd=dist)
    assert out.count("PASSED") == 2, out


@pytest.mark.slow
def test_the_wheel_runs_from_a_fresh_environment(dist, tmp_path):
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)], cwd=tmp_path)
    py = venv / "bin" / "python"
    site = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=tmp_path)
                .strip())
    (site / "secateur-test-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")  # torch & co from here
    wheel = next(dist.glob("*.whl"))
    _run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index", "-q", str(wheel)],
         cwd=tmp_path)

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env |= {"OMP_NUM_THREADS": "1", "PATH": f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"}
    work = tmp_path / "work"
    work.mkdir()
    exe = str(venv / "bin" / "secateur")
    assert _run([exe, "--version"], work, env).strip() == f"secateur {changelog_version()}"
    assert "prune" in _run([exe, "--help"], work, env)
    where = _run([str(py), "-c", "import secateur, sys; print(secateur.__file__); print(sys.path)"], work, env)
    file, path = where.splitlines()
    assert Path(file).resolve().is_relative_to(venv.resolve()), file  # the wheel's copy, not the checkout's
    assert str(ROOT / "src") not in path

    # the tiny demo: a random tiny Llama pruned by the installed command, calibrated on a text file
    _run([str(py), "-c", "from secateur.testing import save_tiny; save_tiny('llama', 'tiny')"], work, env)
    (work / "calib.txt").write_text(" ".join(f"word{i % 97} text{i % 13}." for i in range(2000)))
    _run([exe, "prune", "--model", "tiny", "--method", "wanda", "--sparsity", "0.5", "--calib", "calib.txt",
          "--nsamples", "2", "--seqlen", "16", "--out", "run", "--quiet"], work, env)
    report = json.loads((work / "run" / "secateur-report.json").read_text())
    assert report["realized_sparsity"]["targeted"] == 0.5 and report["versions"]["secateur"] == secateur.__version__
