"""mkdocs hooks of the secateur site (mkdocs.yml ``hooks:``), run at build time:

* ``reference/cli.md``: every command's flags, generated from the argparse parser itself
  (:func:`secateur.cli.build_parser`), so the page cannot drift from the CLI;
* ``reference/troubleshooting.md``: every ``SecateurError`` message in the source (read with ``ast``, f-string
  fields shown as ``{...}``), grouped by the input it is about, each group naming the page that explains it;
* ``results/``: the results tree (its index ``results/README.md``, every study page and the files they link) joins
  the site under ``results/``;
* Sphinx roles in docstrings (``:func:``, ``:class:``, ...) dropped in front of their code span;
* links to repository files outside ``docs/`` (written relative to the page on disk, so they also work when the
  Markdown is read on a forge): a file under ``results/`` becomes its page in the site; any other existing file
  becomes its repository path as text; a link to a file that does not exist is left alone, so ``mkdocs build
  --strict`` fails on it.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
from pathlib import Path

from mkdocs.structure.files import File, Files

from secateur.errors import TOPICS, topic

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "results"
SRC = ROOT / "src" / "secateur"
RESULT_SUFFIXES = {".md", ".png", ".json", ".jsonl", ".txt", ".svg", ".csv", ".html"}



# ---------------------------------------------------------------------------------------------- CLI reference
def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _subparsers(parser: argparse.ArgumentParser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            yield from action.choices.items()


def _walk(parser: argparse.ArgumentParser, path: list[str]):
    subs = list(_subparsers(parser))
    if not subs or path:
        yield path, parser
    for name, sub in subs:
        yield from _walk(sub, [*path, name])


def _flags(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.metavar or action.dest}`"
    meta = ""
    if action.nargs != 0:
        meta = " " + (action.metavar if isinstance(action.metavar, str) else action.dest.upper())
    return ", ".join(f"`{o}{meta}`" for o in action.option_strings)


def cli_reference() -> str:
    os.environ.setdefault("COLUMNS", "100")
    from secateur.cli import build_parser

    top = build_parser()
    fmt = argparse.HelpFormatter("secateur")
    out = ["# CLI reference", "",
           "Generated from the argparse definitions (`secateur.cli.build_parser`) when the site is built; "
           "`secateur COMMAND --help` prints the same. Every command ends a problem it can name with one line "
           "and exit code 2 ([errors](../errors.md)).", ""]
    commands = [(p, parser) for p, parser in _walk(top, []) if p]
    out += ["| command | what it does |", "|---|---|"]
    help_of = {}
    for name, action in ((n, a) for a in top._actions if isinstance(a, argparse._SubParsersAction)
                         for n, a in [(c.dest, c) for c in a._choices_actions]):
        help_of[name] = action.help
    for name, sub in _subparsers(top):
        for cname, caction in ((c.dest, c) for a in sub._actions if isinstance(a, argparse._SubParsersAction)
                               for c in a._choices_actions):
            help_of[f"{name} {cname}"] = caction.help
    for path, _ in commands:
        key = " ".join(path)
        text = (help_of.get(key) or "").replace("%%", "%")  # subcommand help is %-formatted only by argparse itself
        out.append(f"| [`secateur {key}`](#{'-'.join(['secateur', *path])}) | {_cell(text)} |")
    out.append("")
    for path, parser in commands:
        anchor = "-".join(["secateur", *path])
        out += [f"## secateur {' '.join(path)} {{#{anchor}}}", ""]
        if parser.description:
            out += [_cell(parser.description), ""]
        out += ["```text", parser.format_usage().strip(), "```", ""]
        for group in parser._action_groups:
            actions = [a for a in group._group_actions
                       if a.help != argparse.SUPPRESS and not isinstance(a, (argparse._HelpAction,
                                                                             argparse._SubParsersAction))]
            if not actions:
                continue
            title = group.title or "options"
            out += [f"**{_cell(title)}**", ""]
            if group.description:
                out += [_cell(group.description), ""]
            out += ["| flag | default | what it does |", "|---|---|---|"]
            for a in actions:
                default = "" if a.default in (None, argparse.SUPPRESS, False) or a.nargs == 0 else f"`{a.default}`"
                if a.required:
                    default = "required"
                text = fmt._expand_help(a) if a.help else ""
                if a.choices and not isinstance(a.choices, dict):
                    text += f" (choices: {', '.join(map(str, a.choices))})"
                out.append(f"| {_flags(a)} | {default} | {_cell(text)} |")
            out.append("")
        if parser.epilog:
            out += ["```text", parser.epilog.strip(), "```", ""]
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------------------------------ troubleshooting
def _message(node: ast.AST) -> str | None:
    """The text of a message expression: string constants, f-strings (fields as ``{...}``) and ``+``."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        parts = []
        for v in node.values:
            if isinstance(v, ast.Constant):
                parts.append(str(v.value))
            else:
                parts.append("{" + ast.unparse(v.value) + "}")
        return "".join(parts)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _message(node.left), _message(node.right)
        if left is not None or right is not None:
            return (left or "{...}") + (right or "{...}")
    return None


def error_messages() -> list[tuple[str, int, str]]:
    """``(module path, line, message)`` of every ``SecateurError(...)`` built from a literal message."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not (isinstance(node, ast.Call) and node.args):
                continue
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            if name != "SecateurError":
                continue
            text = _message(node.args[0])
            if text and len(text.strip()) > 8:
                found.append((rel, node.lineno, " ".join(text.split())))
    return found


def _topic(rel: str) -> tuple[str, str]:
    return topic(rel)


def troubleshooting() -> str:
    groups: dict[tuple[str, str], list[tuple[str, int, str]]] = {}
    msgs = error_messages()
    for rel, line, text in msgs:
        groups.setdefault(_topic(rel), []).append((rel, line, text))
    out = ["# Troubleshooting", "",
           "Every problem secateur can name ends the command with one line on stderr, `secateur: error: <which input "
           "and what is wrong>; <what to do>`, exit code 2 and nothing written ([errors](../errors.md)). This page "
           f"lists the {len(msgs)} messages in the source (generated from every `SecateurError(...)` when the site "
           "is built; `{...}` stands for the value filled in), grouped by the input they are about, each group "
           "with the page that explains that input. Search this page (or the site) for the words of your line. "
           "Every row of the tested table of fixable inputs, run through a real process: "
           "[reliability table](../results/reliability/reliability-table.md).", ""]
    order = {title: i for i, (_, title, _) in enumerate(TOPICS)}
    for (title, page), items in sorted(groups.items(), key=lambda kv: order[kv[0][0]]):
        out += [f"## {title}", "", f"Explained in [{page}](../{page}).", ""]
        seen = set()
        for rel, line, text in items:
            if text in seen:
                continue
            seen.add(text)
            out.append(f"- `{text.replace('`', chr(39))}` <small>(`secateur/{rel}:{line}`)</small>")
        out.append("")
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------------------------------------ the hooks
def on_files(files: Files, config) -> Files:
    files.append(File.generated(config, "reference/cli.md", content=cli_reference()))
    files.append(File.generated(config, "reference/troubleshooting.md", content=troubleshooting()))
    if RESULTS.is_dir():
        for path in sorted(RESULTS.rglob("*")):
            if path.is_file() and path.suffix in RESULT_SUFFIXES:
                uri = path.relative_to(ROOT).as_posix()
                if files.get_file_from_path(uri) is None:
                    files.append(File(uri, src_dir=str(ROOT), dest_dir=config["site_dir"],
                                      use_directory_urls=config["use_directory_urls"]))
    return files


LINK = re.compile(r"(!?\[[^\]\n]*\])\(([^()\s]+)\)")


def _real_dir(page) -> Path:
    """Where the page's Markdown lives on disk (the links in it are relative to that)."""
    if page.file.abs_src_path:
        return Path(page.file.abs_src_path).parent
    return Path(page.file.src_dir or ROOT / "docs", page.file.src_uri).parent


def on_page_markdown(markdown: str, page, config, files) -> str:
    docs = Path(config["docs_dir"]).resolve()
    here = _real_dir(page).resolve()
    site_dir = Path(page.file.src_uri).parent

    def fix(m: re.Match) -> str:
        text, target = m.group(1), m.group(2)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith(("#", "/")):
            return m.group(0)
        path, _, anchor = target.partition("#")
        real = (here / path).resolve()
        if not real.is_relative_to(ROOT):
            return m.group(0)
        if real.is_relative_to(docs):  # a docs page, from a docs page (unchanged) or from a results page
            new = os.path.relpath(real.relative_to(docs).as_posix(), site_dir.as_posix() or ".")
            return f"{text}({new}{'#' + anchor if anchor else ''})"
        rel = real.relative_to(ROOT).as_posix()
        if real.is_relative_to(RESULTS) and files.get_file_from_path(rel) is not None:
            new = os.path.relpath(rel, site_dir.as_posix() or ".") + (f"#{anchor}" if anchor else "")
            return f"{text}({new})"
        if real.exists():  # a source file or folder: named, not linked (the site holds docs/ and results/ only)
            label = text[1:-1].strip()
            return f"{label} (`{rel}`)" if label and label.strip("`") != rel else f"`{rel}`"
        return m.group(0)  # a broken link: left for mkdocs to report

    return LINK.sub(fix, markdown)


SPHINX_ROLE = re.compile(r":(?:py:)?(?:func|class|mod|meth|data|attr|exc|obj):(?=<code>)")


def on_page_content(html: str, page, config, files) -> str:
    """Docstrings use Sphinx roles (``:func:`name```); mkdocstrings renders them as Markdown, which leaves the role
    in front of the code span: drop it."""
    return SPHINX_ROLE.sub("", html)
