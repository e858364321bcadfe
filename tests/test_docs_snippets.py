"""Every command and Python snippet of README.md and docs/*.md runs (on tiny models): a renamed function or flag
fails here instead of for a reader. The convention is in tests/docs_snippets.py and docs/development.md."""

from __future__ import annotations

import contextlib
import os
import sys
import time

import pytest
from docs_snippets import MODELS, PAGES, ROOT, blocks, commands, needs_data, python_needs_data, shrink, shrink_python

from secateur.cli import main
from secateur.data.sources import resolve_data_dir

TEXT = ("The quick brown fox jumps over the lazy dog while the cat sleeps in the sun. " * 60 + "\n") * 4


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """Tiny random models by family, saved once for every page (a page never writes into them)."""
    from secateur.testing import save_tiny, tiny_bpe_tokenizer, tiny_model, tiny_tokenizer, write_tiny_gguf

    root, made = tmp_path_factory.mktemp("tiny"), {}

    def model_for(name: str, where: str, deep: bool = False) -> str:
        if os.path.exists(name):
            return name
        if name not in MODELS:
            raise AssertionError(f"{where}: model {name!r} is neither a folder the page wrote nor in "
                                 "tests/docs_snippets.py MODELS; add it there with the tiny family it stands for")
        family = MODELS[name] + ("-deep" if deep else "")
        if family not in made:
            if family.endswith("-deep"):
                path = root / family
                tiny_model(family.removesuffix("-deep"), layers=16).save_pretrained(path)
                tiny_tokenizer().save_pretrained(path)
                made[family] = str(path)
            elif family == "gguf-llama":
                write_tiny_gguf(root / "tiny.gguf", "llama")
                made[family] = str(root / "tiny.gguf")
            elif family.endswith("-headless"):
                made[family] = save_tiny(family.removesuffix("-headless"), root / family, headless=True)
            elif family == "llama":  # a long context: Python snippets keep the documented 2048-token windows;
                model = tiny_model("llama")  # a byte-level BPE tokenizer: GGUF export takes no other
                model.config.max_position_embeddings = 4096
                model.save_pretrained(root / family)
                tiny_bpe_tokenizer().save_pretrained(root / family)
                made[family] = str(root / family)
            else:
                made[family] = save_tiny(family, root / family)
        return made[family]

    return model_for


def _runnable(page):
    return [b for b in blocks(page) if b.lang in ("bash", "sh", "python") and b.skip is None]


PAGES_WITH_SNIPPETS = [p for p in PAGES if _runnable(p)]


def test_every_page_is_parsed_and_marks_are_well_formed():
    """Every fence of every page parses, every skip names a reason, every bash block holds only secateur commands
    (or is marked), and at least the README's usage runs."""
    for page in PAGES:
        for b in blocks(page):
            if b.lang in ("bash", "sh") and b.skip is None:
                commands(b)
    assert ROOT / "README.md" in PAGES_WITH_SNIPPETS


@pytest.mark.parametrize("page", PAGES_WITH_SNIPPETS, ids=lambda p: str(p.relative_to(ROOT)))
def test_snippets_run(page, tiny_models, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("SECATEUR_CACHE", str(tmp_path / "cache"))  # digests of this page's models only
    text_file = str(tmp_path / "corpus.txt")
    (tmp_path / "corpus.txt").write_text(TEXT)
    data = resolve_data_dir(None)  # the shared data the DATA_WORDS commands read
    has_data = data is not None and all((data / d).is_dir() for d in ("zeroshot", "fashion-mnist", "c4-validation-2k"))
    namespace: dict = {"__name__": "__docs__"}
    skipped = False
    for block in _runnable(page):
        if block.lang == "python":
            src = shrink_python(block.text, tiny_models, text_file, block.where)
            skipped = skipped or (not has_data and python_needs_data(src))
            if skipped:
                continue
            with contextlib.redirect_stdout(open(os.devnull, "w")):  # noqa: SIM115
                exec(compile(src, block.where, "exec"), namespace)  # noqa: S102
            continue
        for cmd in commands(block):
            where = f"{page.relative_to(ROOT)}:{cmd.line}"
            skipped = skipped or (not has_data and needs_data(cmd.argv))
            if skipped:  # without the shared data, and after it: later commands may read what it would have made
                continue
            argv = shrink(cmd.argv, tiny_models, text_file, where)
            start = time.perf_counter()
            rc = main(argv)
            err = capsys.readouterr().err
            if os.environ.get("SECATEUR_DOCS_TIMES"):
                print(f"{time.perf_counter() - start:6.2f}s {where} {argv[:3]}", file=sys.__stderr__)
            assert rc == 0, f"{where}: secateur {' '.join(argv)} exited {rc}:\n{err[-2000:]}"
