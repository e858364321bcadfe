"""Every command and Python snippet of README.md and docs/*.md, found and made small enough to run in the suite.

The convention (docs/development.md, "Documentation snippets"):

* A fenced block tagged ``bash`` / ``sh`` or ``python`` runs; any other block (``text``, none) is an example
  output, a formula or a diagram and does not.
* ``<!-- test: skip (reason) -->`` on the line just above a fence leaves that block out; the reason is required
  (a GPU, a second environment, another program, an hour of training).
* A ``bash`` block holds ``secateur ...`` commands only (``\\`` continues a line, ``#`` starts a comment); each
  runs in-process through :func:`secateur.cli.main` and must exit 0.
* The blocks of one page run in order in one empty working folder, so ``out/wanda50`` written by a page's
  ``prune`` is the folder its later ``eval`` reads: every page starts from nothing.
* Substitutions make them small: a model that is not a folder of the page (``--model``, ``--dense``,
  ``--reference``, ``--teacher``, ``model="..."``) becomes a tiny random model of the family :data:`MODELS`
  names (an unknown name fails, asking for an entry); the text corpora ``c4`` / ``wikitext2`` / ``ptb`` become a
  short local text file; sizes are capped by :data:`CAPS`. Commands that read the shared data (Fashion-MNIST,
  zero-shot tasks, C4's held-out QK-error windows) skip when it is absent. CoCurve's guards (the first and last
  two layers protected, at most 1.5 rho of a layer removed) need depth: its commands get a 16-layer tiny model,
  ``--heldout 2``, ``--positions 2`` and ``--ffn-groups 8``. Commands that default to a whole corpus or task suite
  get a few windows, items or tokens (:data:`ADDED`, :data:`PY_ADDED`); ``--procs N`` runs as one process.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").rglob("*.md") if "hooks" not in p.parts)]
RUN_LANGS = {"bash", "sh", "python"}

# model names in the docs -> the tiny family that stands in for them (secateur.testing.save_tiny)
MODELS = {
    "smollm2-135m": "llama",
    "HuggingFaceTB/SmolLM2-135M-Instruct": "llama",
    "path/to/model": "llama",
    "path/to/llama-7b": "llama",
    "path/to/7b": "llama",
    "meta-llama/Llama-2-7b-hf": "llama",
    "Qwen/Qwen2.5-0.5B": "qwen2",
    "facebook/opt-125m": "opt",
    "model.gguf": "gguf-llama",
    "~/.cache/secateur/vision/fmnist-vit": "vit",
    "path/to/vit": "vit",
    "path/to/dinov2": "dinov2-headless",
    "path/to/llava": "llava",
    "path/to/qwen2.5-vl": "qwen2_5_vl",
}
TEXT_CORPORA = {"c4", "wikitext2", "ptb"}
TEXT_FLAGS = {"--calib", "--dataset", "--data"}
MODEL_FLAGS = {"--model", "--dense", "--reference", "--teacher"}
# flag (and the same name as a Python keyword, dashes as underscores) -> the largest value a snippet runs with
CAPS = {"--nsamples": 4, "--seqlen": 32, "--segment-len": 8, "--max-windows": 2, "--eval-windows": 2, "--limit": 2,
        "--tokens": 256, "--max-images": 16, "--probe-train": 32, "--repeats": 1, "--warmup": 1, "--n": 2,
        "--prompt-len": 16, "--new-tokens": 4, "--heldout-windows": 2, "--coec-rounds": 2, "--heldout": 2,
        "--batch": 4, "--throughput-batch": 2, "--chunk-size": 2, "--stride": 16,
        "--procs": 1}  # one process: tests/test_distributed.py runs the splits
# flags a command gets when it gives none (the measurement's defaults are sized for real models)
ADDED = {("eval", "efficiency"): ["--prompt-len", "16", "--new-tokens", "4", "--warmup", "0", "--repeats", "1",
                                  "--throughput-batch", "2"],
         ("eval", "zeroshot"): ["--limit", "2", "--tasks", "arc_easy"], ("eval", "ppl"): ["--max-windows", "4"],
         ("recover", "-"): ["--tokens", "256"], ("eval", "accuracy"): ["--max-images", "16"],
         ("eval", "features"): ["--max-images", "16", "--probe-train", "32"],
         ("eval", "captions"): ["--max-images", "8"],
         ("eval", "qk-error"): ["--n", "2"]}
PY_ADDED = {"eval_efficiency": {"prompt_len": 16, "new_tokens": 4, "warmup": 0, "repeats": 1},
            "eval_zeroshot": {"limit": 2, "tasks": '["arc_easy"]'}, "eval_ppl": {"max_windows": 4}}
WINDOWED = {("prune",), ("recover",), ("eval", "ppl"), ("eval", "qk-error")}  # get --seqlen 32 when none is given
DATA_WORDS = ("fashion-mnist", "zeroshot", "qk-error", "accuracy", "features", "captions")


@dataclass
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    skip: str | None = None  # the reason, when marked

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


@dataclass
class Command:
    argv: list[str]
    line: int
    extra: dict = field(default_factory=dict)


SKIP = re.compile(r"<!--\s*test:\s*skip\s*\((?P<why>.*)\)\s*-->")


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of a Markdown page, with the skip mark on the line just above each."""
    out, lines = [], page.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^(\s*)(```+)\s*([\w+-]*)", lines[i])
        if not m:
            i += 1
            continue
        fence, lang, start = m.group(2), m.group(3).lower(), i
        body = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i][len(m.group(1)):] if lines[i].startswith(m.group(1)) else lines[i])
            i += 1
        above = lines[start - 1].strip() if start > 0 else ""
        skip = SKIP.search(above)
        if above.startswith("<!-- test") and not skip:
            raise ValueError(f"{page.relative_to(ROOT)}:{start}: unknown test mark {above!r}; use "
                             "<!-- test: skip (reason) -->")
        if skip and not skip.group("why").strip():
            raise ValueError(f"{page.relative_to(ROOT)}:{start}: a skip mark needs its reason")
        out.append(Block(page, start + 1, lang, "\n".join(body), skip.group("why").strip() if skip else None))
        i += 1
    return out


def commands(block: Block) -> list[Command]:
    """The ``secateur`` command lines of a bash block (continuations joined, comments dropped)."""
    out, pending, first = [], "", 0
    for n, raw in enumerate(block.text.splitlines(), start=block.line + 1):
        if not pending:
            first = n
        if raw.rstrip().endswith("\\"):
            pending += raw.rstrip()[:-1] + " "
            continue
        words = shlex.split(pending + raw, comments=True)
        pending = ""
        if not words:
            continue
        if words[0] == "secateur":
            out.append(Command(words[1:], first))
        elif words[:3] == ["python", "-m", "secateur"]:
            out.append(Command(words[3:], first))
        else:
            raise ValueError(f"{block.page.relative_to(ROOT)}:{first}: {words[0]!r} is not a secateur command; "
                             "a block with other programs needs <!-- test: skip (reason) --> above it")
    return out


def needs_data(argv: list[str]) -> bool:
    return any(w in DATA_WORDS for w in argv) or any(w.startswith("fashion-mnist") for w in argv)


PY_DATA_WORDS = ("fashion-mnist", "eval_zeroshot", "qk_error", "eval_accuracy", "eval_features", "eval_captions")


def python_needs_data(src: str) -> bool:
    return any(w in src for w in PY_DATA_WORDS)


def shrink(argv: list[str], model_for, text_file: str, where: str) -> list[str]:
    """``argv`` with tiny models, the local text file and capped sizes in place of the documented ones."""
    out = list(argv)
    cocurve = any(a == "--method" and b.startswith("cocurve") for a, b in zip(out, out[1:]))
    for i, w in enumerate(out[:-1]):
        v = out[i + 1]
        if w in MODEL_FLAGS:
            out[i + 1] = model_for(v, where, deep=cocurve)
        elif w in TEXT_FLAGS and v in TEXT_CORPORA:
            out[i + 1] = text_file
        elif w in CAPS and re.fullmatch(r"\d+", v):
            out[i + 1] = str(min(int(v), CAPS[w]))
    sub = out[0] if out else ""
    if sub in ("prune",) and "--model" not in out and "--recipe" not in out:
        raise ValueError(f"{where}: give --model explicitly (the default is the real SmolLM2-135M)")
    if sub == "prune" and "--quiet" not in out:
        out.append("--quiet")
    if (tuple(out[:1]) in WINDOWED or tuple(out[:2]) in WINDOWED) and "--seqlen" not in out and "--recipe" not in out:
        out += ["--seqlen", "32"]
    added = ADDED.get(tuple(out[:2]), ADDED.get((out[0], "-"), [])) if out else []
    for flag, value in zip(added[::2], added[1::2]):
        if flag not in out:
            out += [flag, value]
    if cocurve:  # held-out windows within the capped --nsamples; a shorter sweep
        for flag, value in (("--heldout", "2"), ("--positions", "2"), ("--ffn-groups", "8")):
            if flag not in out:
                out += [flag, value]
    return out


def shrink_python(src: str, model_for, text_file: str, where: str) -> str:
    """The same substitutions in Python source: string literals naming models or corpora, capped keywords."""
    def model_literal(m):
        name = m.group(2)
        return repr(model_for(name, where, deep=False)) if name in MODELS else m.group(0)

    src = re.sub(r"""(["'])([^"'\n]+)\1""", model_literal, src)
    src = re.sub(r"""\b(calib|dataset|data)=(["'])(c4|wikitext2|ptb)\2""", lambda m: f"{m.group(1)}={text_file!r}",
                 src)
    for fn, kwargs in PY_ADDED.items():
        def add(m, kwargs=kwargs):
            given = set(re.findall(r"(\w+)=", m.group(2)))
            return m.group(1) + "".join(f"{k}={v}, " for k, v in kwargs.items() if k not in given) + m.group(2)
        src = re.sub(rf"(\b{fn}\()([^\n]*)", add, src)
    for flag, cap in CAPS.items():
        name = flag[2:].replace("-", "_")
        src = re.sub(rf"\b{name}=(\d+)\b", lambda m, n=name, c=cap: f"{n}={min(int(m.group(1)), c)}", src)
    return src
