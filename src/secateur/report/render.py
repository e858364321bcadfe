"""The report document: blocks (headings, paragraphs, tables, images) rendered twice, as Markdown (plots as
files under ``plots/``) and as one self-contained HTML page (inline CSS, plots embedded as base64 PNG), and
the cell formatters (perplexity 3 decimals, percentages 2, seconds 2, MiB whole)."""

from __future__ import annotations

import base64
import html
import re
from dataclasses import dataclass, field
from typing import Any

from secateur.report.load import num


def fmt(x: Any, nd: int) -> str:
    x = num(x)
    return "-" if x is None else f"{x:.{nd}f}"


def pct(x: Any) -> str:
    x = num(x)
    return "-" if x is None else f"{100 * x:.2f}%"


def fmt_int(x: Any) -> str:
    return "-" if num(x) is None else f"{int(x):,}"



def drop_empty(headers: list[str], rows: list[list[str]], keep: int) -> tuple[list[str], list[list[str]]]:
    """Drop columns (after the first ``keep``) that are ``-`` in every row."""
    cols = [i for i in range(len(headers)) if i < keep or any(r[i] != "-" for r in rows)]
    return [headers[i] for i in cols], [[r[i] for i in cols] for r in rows]


# ------------------------------------------------------------------------------------- document


@dataclass
class Doc:
    """Blocks rendered twice: Markdown (plots as files) and HTML (plots embedded)."""

    blocks: list[tuple] = field(default_factory=list)
    plots: dict[str, bytes] = field(default_factory=dict)

    def h(self, level: int, text: str) -> None:
        self.blocks.append(("h", level, text))

    def p(self, text: str) -> None:
        self.blocks.append(("p", text))

    def ul(self, items: list[str]) -> None:
        if items:
            self.blocks.append(("ul", items))

    def table(self, headers: list[str], rows: list[list[str]], left: int = 2) -> None:
        """``left``: the first columns are text (left-aligned); the rest numbers (right-aligned)."""
        if rows:
            self.blocks.append(("table", headers, rows, left))

    def img(self, name: str, png: bytes, alt: str) -> None:
        self.plots[name] = png
        self.blocks.append(("img", f"plots/{name}", alt))

    def markdown(self) -> str:
        out: list[str] = []
        for b in self.blocks:
            if b[0] == "h":
                out += ["#" * b[1] + " " + b[2], ""]
            elif b[0] == "p":
                out += [b[1], ""]
            elif b[0] == "ul":
                out += [f"* {x}" for x in b[1]] + [""]
            elif b[0] == "table":
                _, headers, rows, left = b
                cell = lambda s: str(s).replace("|", "\\|")  # noqa: E731
                out.append("| " + " | ".join(cell(h) for h in headers) + " |")
                out.append("|" + "|".join("---" if i < left else "---:" for i in range(len(headers))) + "|")
                out += ["| " + " | ".join(cell(c) for c in r) + " |" for r in rows]
                out.append("")
            elif b[0] == "img":
                alt = b[2].replace("[", "(").replace("]", ")")  # brackets would end the alt text
                out += [f"![{alt}]({b[1]})", ""]
        return "\n".join(out)

    def html(self, title: str) -> str:
        def inline(s: str) -> str:  # escape, then `code` spans
            return re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(str(s)))

        body: list[str] = []
        for b in self.blocks:
            if b[0] == "h":
                body.append(f"<h{b[1]}>{inline(b[2])}</h{b[1]}>")
            elif b[0] == "p":
                body.append(f"<p>{inline(b[1])}</p>")
            elif b[0] == "ul":
                body.append("<ul>" + "".join(f"<li>{inline(x)}</li>" for x in b[1]) + "</ul>")
            elif b[0] == "table":
                _, headers, rows, left = b
                cls = ["" if i < left else ' class="num"' for i in range(len(headers))]
                head = "".join(f"<th{cls[i]}>{inline(h)}</th>" for i, h in enumerate(headers))
                trs = "".join("<tr>" + "".join(f"<td{cls[i]}>{inline(c)}</td>" for i, c in enumerate(r)) + "</tr>"
                              for r in rows)
                body.append(f"<table><thead><tr>{head}</tr></thead><tbody>{trs}</tbody></table>")
            elif b[0] == "img":
                data = base64.b64encode(self.plots[b[1].removeprefix("plots/")]).decode()
                body.append(f'<figure><img alt="{html.escape(b[2])}" src="data:image/png;base64,{data}">'
                            f"<figcaption>{inline(b[2])}</figcaption></figure>")
        return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{html.escape(title)}"
                f"</title>\n<style>{CSS}</style></head>\n<body>\n" + "\n".join(body) + "\n</body></html>\n")


CSS = ("body{font-family:system-ui,sans-serif;max-width:1200px;margin:2em auto;padding:0 1em;color:#222}"
       "table{border-collapse:collapse;margin:.5em 0 1.5em;font-size:.9em}"
       "th,td{border:1px solid #ccc;padding:.25em .6em;text-align:left}th{background:#f3f3f3}"
       ".num{text-align:right;font-variant-numeric:tabular-nums}code{font-size:.9em;background:#f6f6f6}"
       "figure{margin:1em 0}img{max-width:100%}figcaption{font-size:.85em;color:#555}"
       "h2{border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:1.6em}")

