"""The documentation site builds with warnings as errors, and every internal link of every built page resolves
(the file, and the anchor on it); the Markdown's own relative links (README.md, docs/, results/) resolve on disk,
as a reader of the repository follows them. Skips without mkdocs (the [docs] extra; `make setup` installs it)."""

from __future__ import annotations

import os
import re
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

ROOT = Path(__file__).resolve().parents[1]


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[str] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag, attrs):
        for k, v in attrs:
            if k == "id" and v:
                self.ids.add(v)
            if v and ((k == "href" and tag in ("a", "link")) or (k == "src" and tag in ("img", "script"))):
                self.links.append(v)


def _parse(path: Path) -> _Links:
    p = _Links()
    p.feed(path.read_text(encoding="utf-8", errors="replace"))
    return p


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    pytest.importorskip("mkdocstrings")
    from mkdocs.commands.build import build
    from mkdocs.config import load_config

    os.environ.setdefault("NO_MKDOCS_2_WARNING", "1")
    out = tmp_path_factory.mktemp("site")
    cfg = load_config(str(ROOT / "mkdocs.yml"), site_dir=str(out), strict=True)
    build(cfg)  # strict: any warning (a broken link among them) aborts the build
    return out


def _target(page: Path, link: str, site: Path) -> tuple[Path, str] | None:
    parts = urlsplit(link)
    if parts.scheme or parts.netloc or link.startswith(("mailto:", "data:", "javascript:")):
        return None
    path = unquote(parts.path)
    base = site.resolve() if path.startswith("/") else page.parent  # 404.html links from the site's root
    target = page if not path else (base / path.lstrip("/")).resolve()
    if path.endswith("/") or target.is_dir():
        target = target / "index.html"
    assert target.is_relative_to(site.resolve()), f"{page}: {link} leaves the site"
    return target, parts.fragment


def test_every_internal_link_of_the_site_resolves(site):
    pages = sorted(site.rglob("*.html"))
    assert len(pages) > 40  # docs, generated references, results
    for name in ("reference/cli", "reference/api", "reference/troubleshooting", "results", "methods/qk-wanda"):
        assert (site / name / "index.html").is_file(), name
    parsed = {p.resolve(): _parse(p) for p in pages}
    broken = []
    for page, links in parsed.items():
        for link in links.links:
            hit = _target(page, link, site)
            if hit is None:
                continue
            target, anchor = hit
            if not target.exists():
                broken.append(f"{page.relative_to(site.resolve())}: {link}")
            elif anchor and target.suffix == ".html":
                ids = parsed[target].ids if target in parsed else _parse(target).ids
                if anchor not in ids:
                    broken.append(f"{page.relative_to(site.resolve())}: {link} (no #{anchor})")
    assert not broken, "\n".join(broken[:50])


def test_generated_cli_reference_names_every_command(site):
    from secateur.cli import build_parser

    html = (site / "reference/cli/index.html").read_text(encoding="utf-8")
    for cmd in ("prune", "recover", "report", "demo", "eval ppl", "eval zeroshot", "eval captions", "export gguf",
                "export vllm"):
        assert f"secateur {cmd}" in html, cmd
    assert "--width-multiple" in html and "--towers" in html
    assert build_parser().prog == "secateur"


LINK = re.compile(r"\]\(([^()\s]+)\)")
GENERATED = {ROOT / "docs/reference/cli.md", ROOT / "docs/reference/troubleshooting.md"}  # made at build time


def _markdown_files():
    yield ROOT / "README.md"
    yield from sorted(p for p in (ROOT / "docs").rglob("*.md"))
    yield from sorted((ROOT / "results").rglob("*.md"))


def test_markdown_links_resolve_on_disk():
    """What a reader of the repository clicks: every relative link of README.md, docs/ and results/ names a file or
    folder that exists (anchors are checked by the site test)."""
    broken = []
    for md in _markdown_files():
        text = re.sub(r"```.*?```", "", md.read_text(encoding="utf-8"), flags=re.S)
        for link in LINK.findall(text):
            parts = urlsplit(link)
            if parts.scheme or parts.netloc or not parts.path or link.startswith("mailto:"):
                continue
            target = (md.parent / unquote(parts.path)).resolve()
            if not target.exists() and target not in GENERATED:
                broken.append(f"{md.relative_to(ROOT)}: {link}")
    assert not broken, "\n".join(broken)


def test_every_documented_secateur_name_exists():
    """Every dotted ``secateur.x.y`` name in a code span of README.md or docs/ is a module or an attribute that
    exists (the README once named ``secateur.export.hf.load_masks`` after it had moved to
    ``secateur.masks_file.load_masks``)."""
    import importlib

    missing = []
    for md in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for name in sorted(set(re.findall(r"`(secateur(?:\.[A-Za-z_]\w*)+)", md.read_text(encoding="utf-8")))):
            parts = name.split(".")
            for i in range(len(parts), 0, -1):
                try:
                    obj = importlib.import_module(".".join(parts[:i]))
                except ImportError:
                    continue
                try:
                    for attr in parts[i:]:
                        obj = getattr(obj, attr)
                except AttributeError:
                    missing.append(f"{md.relative_to(ROOT)}: {name}")
                break
            else:
                missing.append(f"{md.relative_to(ROOT)}: {name}")
    assert not missing, "\n".join(missing)
