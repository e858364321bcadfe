"""The GGUF cache verifies what it serves and names itself in every error (issue 25, the environment).

An entry altered in place, truncated, with a file missing or added, or with a damaged manifest is derived again
from the GGUF (one stderr line naming the entry) and the result is the fresh cache's, byte for byte; an entry of
an older secateur (no manifest) is adopted; ``SECATEUR_CACHE`` naming a file or a read-only folder is one line
naming the variable; a large first dequantization says what it does before doing it.
"""

import hashlib
import json
import os
from pathlib import Path

import pytest
from contract import check

from secateur.errors import SecateurError
from secateur.models import gguf_cache
from secateur.models.loading import resolve
from secateur.testing import write_tiny_gguf

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(path)
    return path


@pytest.fixture(scope="module")
def fresh(gguf_file, tmp_path_factory) -> dict[str, str]:
    """sha256 of every file of a fresh cache entry (the reference every re-derived entry must equal)."""
    cache = tmp_path_factory.mktemp("fresh-cache")
    old = os.environ.get("SECATEUR_CACHE")
    os.environ["SECATEUR_CACHE"] = str(cache)
    try:
        folder = Path(resolve(str(gguf_file))[0])
    finally:
        if old is None:
            del os.environ["SECATEUR_CACHE"]
        else:
            os.environ["SECATEUR_CACHE"] = old
    return _digests(folder)


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("SECATEUR_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())
            if p.name != gguf_cache.MANIFEST_NAME}


def _entry(gguf_file) -> Path:
    return Path(resolve(str(gguf_file))[0])


def _leftovers(cache: Path) -> list[Path]:
    return [p for p in (cache / "gguf").iterdir() if p.name.startswith(gguf_cache.TMP_PREFIX)]


def _text(folder: Path) -> Path:
    text = folder / "eval.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    return text


def _flip_byte(f: Path, at: int) -> None:
    with open(f, "r+b") as h:
        h.seek(at)
        b = h.read(1)
        h.seek(at)
        h.write(bytes([b[0] ^ 0xFF]))


def _damage(folder: Path, how: str) -> None:
    weights = folder / "model.safetensors"
    manifest = folder / gguf_cache.MANIFEST_NAME
    if how == "byte-altered":  # a weight byte, past the header: the file still parses, its values changed
        _flip_byte(weights, weights.stat().st_size - 10)
    elif how == "truncated":
        os.truncate(weights, weights.stat().st_size // 2)
    elif how == "file-missing":
        (folder / "tokenizer.json").unlink()
    elif how == "file-added":
        (folder / "model-extra.safetensors").write_bytes(weights.read_bytes())
    elif how == "manifest-garbage":
        manifest.write_text("{not json")
    elif how == "manifest-wrong-types":
        data = json.loads(manifest.read_text())
        data["files"]["model.safetensors"]["size"] = "abc"
        manifest.write_text(json.dumps(data))
    elif how == "manifest-other-gguf":
        data = json.loads(manifest.read_text())
        manifest.write_text(json.dumps(data | {"gguf_sha256": "0" * 64}))
    else:
        raise ValueError(how)


DAMAGE = ["byte-altered", "truncated", "file-missing", "file-added", "manifest-garbage", "manifest-wrong-types",
          "manifest-other-gguf"]


@pytest.mark.parametrize("how", DAMAGE)
def test_a_damaged_entry_is_derived_again_identical_to_a_fresh_one(gguf_file, fresh, cache, capsys, how):
    folder = _entry(gguf_file)
    assert _digests(folder) == fresh and (folder / gguf_cache.MANIFEST_NAME).is_file()
    capsys.readouterr()
    _damage(folder, how)
    assert _entry(gguf_file) == folder
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"the GGUF cache entry {folder} does not match" in err, err
    assert "deriving it again from tiny.gguf" in err
    assert _digests(folder) == fresh
    assert not _leftovers(cache)
    capsys.readouterr()
    assert _entry(gguf_file) == folder and capsys.readouterr().err == ""  # verified, served as it is now


def test_a_run_on_an_altered_entry_keeps_the_promise_and_names_the_cache(gguf_file, fresh, cache, tmp_path):
    """Through the CLI: the altered entry is re-derived (one line naming it), the run ends as on a fresh cache."""
    folder = _entry(gguf_file)
    _flip_byte(folder / "model.safetensors", (folder / "model.safetensors").stat().st_size - 10)
    text = _text(tmp_path)
    out = tmp_path / "run"
    out.mkdir()
    code, _, err = check("gguf-cache:altered", ["eval", "ppl", "--model", gguf_file, "--dataset", text, "--seqlen",
                                                "32", "--quiet", "--json", out / "ppl.json"],
                         [out], allowed_new=[out / "ppl.json"])
    assert code == 0 and str(folder) in err
    assert _digests(folder) == fresh


def test_cheap_check_reads_no_weight_byte_and_a_touch_is_forgiven(gguf_file, cache, monkeypatch, capsys):
    folder = _entry(gguf_file)
    calls = []
    real = gguf_cache._hash
    monkeypatch.setattr(gguf_cache, "_hash", lambda p: calls.append(Path(p).name) or real(p))
    assert _entry(gguf_file) == folder and calls == []  # sizes and mtimes only
    os.utime(folder / "model.safetensors", ns=(1, 1))  # same bytes, another mtime: hashed once, still served
    capsys.readouterr()
    assert _entry(gguf_file) == folder and calls == ["model.safetensors"]
    assert capsys.readouterr().err == ""
    assert _entry(gguf_file) == folder and calls == ["model.safetensors"]  # the manifest learned the new mtime


def test_an_entry_of_an_older_secateur_is_adopted(gguf_file, fresh, cache, monkeypatch, capsys):
    folder = _entry(gguf_file)
    (folder / gguf_cache.MANIFEST_NAME).unlink()
    derive = []
    monkeypatch.setattr(gguf_cache, "gguf_to_folder", lambda *a, **k: derive.append(a))
    capsys.readouterr()
    assert _entry(gguf_file) == folder and derive == [] and capsys.readouterr().err == ""
    manifest = json.loads((folder / gguf_cache.MANIFEST_NAME).read_text())
    assert {k: v["sha256"] for k, v in manifest["files"].items()} == fresh


def test_an_older_entry_that_is_incomplete_is_derived_again(gguf_file, fresh, cache, capsys):
    folder = _entry(gguf_file)
    (folder / gguf_cache.MANIFEST_NAME).unlink()
    os.truncate(folder / "model.safetensors", 100)
    capsys.readouterr()
    assert _entry(gguf_file) == folder
    assert "model.safetensors is truncated or corrupt" in capsys.readouterr().err
    assert _digests(folder) == fresh


def test_cache_env_naming_a_file_is_one_line(gguf_file, tmp_path, monkeypatch):
    not_a_folder = tmp_path / "cache-file"
    not_a_folder.write_text("mine")
    monkeypatch.setenv("SECATEUR_CACHE", str(not_a_folder))
    code, _, err = check("gguf-cache:env-file", ["eval", "ppl", "--model", gguf_file, "--dataset", _text(tmp_path),
                                                 "--seqlen", "32", "--quiet"], [tmp_path])
    assert code == 2 and f"SECATEUR_CACHE={not_a_folder} is a file, not a folder" in err
    assert "set SECATEUR_CACHE to a writable folder" in err


def test_cache_env_below_a_file_is_one_line(gguf_file, tmp_path, monkeypatch):
    """A path that cannot become a folder (a file on the way): the same line, from the write probe."""
    (tmp_path / "f").write_text("mine")
    monkeypatch.setenv("SECATEUR_CACHE", str(tmp_path / "f" / "cache"))
    with pytest.raises(SecateurError, match=r"SECATEUR_CACHE=\S+ is not writable \(.*\); set SECATEUR_CACHE to a "
                                            r"writable folder"):
        resolve(str(gguf_file))


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to a 0555 folder anyway: the probe write is what refuses "
                                              "it, and only a non-root user can see that (the file cases cover root)")
def test_cache_env_read_only_is_one_line(gguf_file, tmp_path, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    monkeypatch.setenv("SECATEUR_CACHE", str(ro))
    try:
        code, _, err = check("gguf-cache:env-read-only", ["eval", "ppl", "--model", gguf_file, "--dataset",
                                                          _text(tmp_path), "--seqlen", "32", "--quiet"], [tmp_path])
        assert code == 2 and f"SECATEUR_CACHE={ro} is not writable" in err
    finally:
        ro.chmod(0o755)


def test_a_read_only_cache_still_serves_a_verified_entry(gguf_file, cache, monkeypatch):
    """Only writing needs a writable cache: a complete entry is served from a cache the run cannot write to."""
    folder = _entry(gguf_file)
    monkeypatch.setattr(gguf_cache, "writable_cache_root", lambda: (_ for _ in ()).throw(AssertionError))
    assert _entry(gguf_file) == folder


def test_empty_cache_env_means_the_default(monkeypatch, tmp_path):
    monkeypatch.setenv("SECATEUR_CACHE", "")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert gguf_cache.cache_dir() == tmp_path / ".cache" / "secateur"


def test_first_use_says_what_it_writes_where(gguf_file, cache, monkeypatch, capsys):
    monkeypatch.setattr(gguf_cache, "ANNOUNCE_BYTES", 0)
    capsys.readouterr()
    folder = _entry(gguf_file)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("secateur: first use of tiny.gguf: dequantizing it to float32 "
                                                   f"into the cache folder {folder} (about ")
    assert _entry(gguf_file) == folder and capsys.readouterr().err == ""  # once
