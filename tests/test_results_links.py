"""results/ is indexed and nothing points at a file that is not there (issue 48 §4).

Source-level checks, no model: every file under results/ is named on results/README.md in its topic's section,
on a line that names the command that made it; every relative Markdown link of the repository's pages resolves;
every bare ``results/...`` path written in the repository's text files (pages, bench scripts' default outputs,
docstrings) names a file or folder that exists. The built documentation site has its own link test."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"
SKIP_DIRS = {".git", ".venv", ".venv-vllm", "_work", "__pycache__", ".pytest_cache", ".ruff_cache", "site", "build",
             "dist", "out", ".devcarry"}
TEXT_SUFFIXES = {".md", ".py", ".sh", ".txt", ".toml", ".json", ".jsonl", ".yml", ".yaml", ".cfg", ""}


def _files(*tops: str, suffixes: set[str] = TEXT_SUFFIXES) -> list[Path]:
    out = []
    for top in tops:
        p = ROOT / top
        if p.is_file():
            out.append(p)
            continue
        for f in sorted(p.rglob("*")) if p.is_dir() else []:
            rel = f.relative_to(ROOT).parts
            if f.is_file() and f.suffix in suffixes and not SKIP_DIRS.intersection(rel) \
                    and not any(x.endswith(".egg-info") for x in rel):
                out.append(f)
    return out


def expand_braces(s: str) -> list[str]:
    """``a.{md,jsonl}`` -> ``a.md``, ``a.jsonl`` (nested and repeated groups too; ``{}`` and ``{N}`` stay)."""
    m = re.search(r"\{([^{}]*,[^{}]*)\}", s)
    if not m:
        return [s]
    return [y for alt in m.group(1).split(",") for y in expand_braces(s[:m.start()] + alt + s[m.end():])]


def _sections(index: str) -> dict[str, str]:
    parts = re.split(r"^## ([a-z]+)/:.*$", index, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def test_every_results_file_is_indexed_in_its_topic_with_its_command():
    index = (RESULTS / "README.md").read_text()
    sections = _sections(index)
    assert sections, "results/README.md has no '## topic/: ...' sections"
    loose = sorted(p.name for p in RESULTS.iterdir() if p.is_file() and p.name != "README.md")
    assert not loose, f"files directly under results/ (put them in a topic folder): {loose}"
    assert sorted(p.name for p in RESULTS.iterdir() if p.is_dir()) == sorted(sections), \
        "the topic folders of results/ and the sections of results/README.md differ"
    for topic, body in sections.items():
        rows = [r for r in body.splitlines() if r.startswith("| ") and not r.startswith(("| study", "|---"))]
        named: set[str] = set()
        pending: set[str] = set()  # files of a study marked (in progress): written when its command finishes
        for r in rows:
            cells = [c.strip() for c in r.strip("|").split("|")]
            assert len(cells) == 3, f"{topic}: a row is not 'study | files | command': {r}"
            assert re.search(r"`[^`]*bench/\S+\.(py|sh)[^`]*`", cells[2]), f"{topic}: no command in: {r}"
            for token in re.findall(r"`([^`]+)`", cells[1]):
                (pending if "(in progress)" in cells[0] else named).update(expand_braces(token))
        on_disk = {p.name for p in (RESULTS / topic).iterdir()
                   if p.is_file() and not p.name.endswith((".lock", ".tmp"))}
        assert on_disk - named - pending == set(), \
            f"results/{topic}/ files not on results/README.md: {sorted(on_disk - named - pending)}"
        assert named - on_disk == set(), f"results/README.md names files not in results/{topic}/: {named - on_disk}"


def _strip_code_blocks(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


def md_links(path: Path) -> list[str]:
    """The relative targets of ``[text](target)`` / ``![alt](target)`` links outside fenced code blocks."""
    out = []
    for target in re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", _strip_code_blocks(path.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith(("#", "/")):
            continue  # a URL, an anchor on the same page, a site-absolute path
        out.append(target.split("#", 1)[0])
    return out


PAGES = _files("README.md", "CHANGELOG.md", "docs", "results", "bench", "examples", suffixes={".md"})
# README.md and docs/ link to pages the documentation site generates (CLI and API reference): their links are
# checked on the built site (the docs' own test); here only their links into results/ and examples/.
SITE_PAGES = ("README.md", "docs")


def _checked(page: Path, target: str) -> bool:
    site = page.relative_to(ROOT).parts[0] in SITE_PAGES
    return bool(target) and (not site or "results/" in target or "examples/" in target)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_markdown_links_resolve(page):
    broken = [t for t in md_links(page) if _checked(page, t) and not (page.parent / t).exists()]
    assert not broken, f"{page.relative_to(ROOT)}: links to missing files: {broken}"


MENTION = re.compile(r"(?<![\w$])results/[\w./{},<>*$-]*")
PLACEHOLDER = re.compile(r"<[^<>]*>|\{[^,{}]*\}|[*$]+")


def results_mentions(text: str) -> list[str]:
    """The ``results/...`` paths written in ``text`` with their ``{a,b}`` groups expanded; placeholders
    (``<preset>``, ``{N}``, ``*``) kept for a glob check. Trailing sentence punctuation is not part of a path."""
    out = []
    for m in MENTION.findall(text):
        for s in expand_braces(m):
            s = s.rstrip(".,")
            if s.endswith("}") and "{" not in s:  # ``${OUT:-results/device}`` in a shell script
                s = s[:-1]
            if s.endswith("/..."):  # an ellipsis after a folder: the folder
                s = s[:-3]
            out.append(s)
    return out


def _exists(mention: str) -> bool:
    if PLACEHOLDER.search(mention):
        pattern = PLACEHOLDER.sub("*", mention).rstrip("/")
        return any(ROOT.glob(pattern)) or any(ROOT.glob(pattern + "*"))
    p = ROOT / mention
    if p.exists():
        return True
    # a path cut at the end of a line (``results/text/cocurve-smollm2-graph-`` + next line): a name prefix
    return not Path(mention).suffix and p.parent.is_dir() and any(x.name.startswith(p.name) for x in p.parent.iterdir())


# (.gitignore holds patterns, not paths; this file holds deliberately broken examples)
SOURCES = [f for f in _files("README.md", "CHANGELOG.md", "Makefile", "pyproject.toml", "docs", "bench", "src", "tests",
                             "examples", "results") if f != Path(__file__).resolve()]


def test_every_results_path_written_in_the_repository_exists():
    broken = {}
    for f in SOURCES:
        if f.suffix in (".json", ".jsonl") and f.stat().st_size > 5_000_000:
            continue
        try:
            text = f.read_text()
        except UnicodeDecodeError:
            continue
        bad = sorted({m for m in results_mentions(text) if not _exists(m)})
        if bad:
            broken[str(f.relative_to(ROOT))] = bad
    assert not broken, f"results/ paths that name nothing: {broken}"


def test_the_checks_catch_what_they_check(tmp_path):
    assert expand_braces("results/text/a{,-b}.{md,jsonl}") == [
        "results/text/a.md", "results/text/a.jsonl", "results/text/a-b.md", "results/text/a-b.jsonl"]
    assert results_mentions("see results/speed/x.{md,json}. and `results/*.lock`") == [
        "results/speed/x.md", "results/speed/x.json", "results/*.lock"]
    assert not _exists("results/coec-speed.md") and _exists("results/speed/coec-speed.md")
    assert _exists("results/speed/speed-ratio-{N}x{L}.md") and not _exists("results/speed/nothing-{N}.md")
    page = tmp_path / "p.md"
    page.write_text("[a](missing.md) [b](https://x.org/y.md) [c](#here) ![d](p.md)\n```\n[e](gone.md)\n```\n")
    assert md_links(page) == ["missing.md", "p.md"]
