"""Zero-shot task loaders: local data files -> lm-eval-harness documents -> scoring items.

Two layers, kept apart so the lm-eval bridge can feed the *same documents* to the harness:

1. ``load_docs(task, data_dir)`` reads the offline copies in ``../shared/data`` (see its README) and
   rebuilds each row in the schema of the Hugging Face dataset the harness task reads
   (``aps/super_glue`` boolq, ``nyu-mll/glue`` rte, ``Rowan/hellaswag``, ``allenai/winogrande``,
   ``allenai/ai2_arc``, ``allenai/openbookqa``, ``baber/piqa``).
2. ``build_item(task, doc)`` turns one document into the harness's log-likelihood requests
   ``(context, continuation)`` exactly as the task YAML of lm-eval 0.4.9-0.4.13 does
   (``lm_eval/tasks/<task>/*.yaml`` + utils): 0-shot, no description, ``target_delimiter=" "``, so
   ``continuation = " " + choice``.

Prompt strings (checked against the installed lm-eval 0.4.13 task files):
  boolq       "{passage}\\nQuestion: {question}?\\nAnswer:"          choices " no" / " yes"        acc
  rte         "{sentence1}\\nQuestion: {sentence2} True or False?\\nAnswer:"  " True" (label 0,
              entailment) / " False" (label 1)                                                 acc
  hellaswag   preprocess(activity_label + ": " + ctx_a + " " + ctx_b.capitalize()), endings
              preprocessed (utils.preprocess)                                                   acc_norm
  winogrande  partial scoring: context_i = sentence[:blank] + option_i (one per option), one shared
              continuation " " + sentence[blank+1:].strip()                                     acc
  arc_easy / arc_challenge  "Question: {question}\\nAnswer:", " " + choice text                 acc_norm
  openbookqa  "{question_stem}", " " + choice text                                              acc_norm
  piqa        "Question: {goal}\\nAnswer:", " " + sol1 / sol2                                   acc_norm

Fidelity of the local copies (what cannot be recovered offline, stated once here):
  * boolq (llm-foundry copy): SuperGLUE passages start with the Wikipedia title, "Ethanol fuel -- All
    biomass ..."; the local copy dropped the title ("All biomass ...") and it cannot be rebuilt, so
    every BoolQ context lacks the "<title> -- " prefix the harness on the hub data would see. The
    question text and label order are SuperGLUE's (validation, 3270 items, same order).
  * hellaswag (llama.cpp text copy): lines hold ``preprocess(activity_label) + ": " + preprocess(ctx)``
    with ``ctx = ctx_a + " " + ctx_b``. We split ``ctx_b`` back off: ActivityNet items (the context
    ends without a period: ctx_b is the trailing lower-case noun phrase after the last sentence
    end), WikiHow items (context ends with ".") have ``ctx_b == ""``; the harness then capitalizes
    ctx_b. Residual risk: endings that began with a removed "[step]"/"[title]" tag lost a leading
    space the harness would keep (not detectable from the copy).
  * winogrande (llm-foundry copy) stores the two contexts and the continuation; ``sentence`` is
    rebuilt as ``prefix + "_ " + continuation`` with the longest common word-boundary prefix, which
    reproduces the harness's contexts and continuation exactly.
  * arc / openbookqa: llm-foundry query "Question: X" / stem, choices and gold index; answer labels
    are re-lettered A, B, C, ... (the harness only uses the gold index).
  * piqa: the official release (``piqa-official``), not the llm-foundry copy (which strips choices).
"""

from __future__ import annotations

import bz2
import csv
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from secateur.errors import SecateurError
from secateur.schemas.tasks import BoolQLine, PiqaLine, QueryLine, WinograndeLine

M = TypeVar("M")

SUITE7 = ("boolq", "rte", "hellaswag", "winogrande", "arc_easy", "arc_challenge", "openbookqa")
TARGET_DELIMITER = " "


@dataclass
class Item:
    """One document as log-likelihood requests. ``choices`` are the strings whose character length
    normalizes acc_norm (the harness's ``doc_to_choice``: for winogrande the contexts)."""

    task: str
    index: int
    requests: list[tuple[str, str]]
    choices: list[str]
    gold: int
    doc: dict = field(repr=False, default_factory=dict)


@dataclass(frozen=True)
class TaskSpec:
    name: str
    metric: str  # the suite metric: "acc" or "acc_norm"
    split: str  # the harness split these documents stand for ("validation" or "test")
    size: int  # documents in the full split
    files: tuple[str, ...]  # data files relative to the data dir (recorded with their hashes)
    harness_yaml: str  # the harness task config, relative to lm_eval/tasks
    loader: Callable[[Path], list[dict]]
    builder: Callable[[dict], tuple[list[tuple[str, str]], list[str], int]]


# ---------------------------------------------------------------- readers -> harness schema


DATA_FIX = ("restore the file from its source (the README beside it says which), or pass --data-dir to a folder laid "
            "out like ../shared/data")


_JSON_TYPES = {list: "array", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}


def _data_file(path: Path) -> Path:
    """``path``, a regular file, or one line saying what is missing."""
    if not path.is_file():
        detail = " (it is not a regular file)" if path.exists() else ""
        raise SecateurError(f"missing zero-shot data file {path}{detail}; {DATA_FIX}")
    return path


def _lines(path: Path) -> list[tuple[int, str]]:
    """``(line number, text)`` of every non-blank line of a UTF-8 text file."""
    data = _data_file(path).read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise SecateurError(f"{path}:{line}: not UTF-8 text (byte 0x{data[e.start]:02x}); {DATA_FIX}") from None
    return [(n, line) for n, line in enumerate(text.split("\n"), 1) if line.strip()]


def _jsonl(path: Path, schema: type[M]) -> list[tuple[int, M]]:
    """Every line of a JSONL task file as ``(line number, validated row)``: a line that is not a JSON object of
    the task's format is one error naming the file, the line and the key."""
    from secateur.schemas import parse

    out = []
    for n, line in _lines(path):
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, RecursionError) as e:
            what = f"not valid JSON ({e.msg}, column {e.colno})" if isinstance(e, json.JSONDecodeError) \
                else "not valid JSON"
            raise SecateurError(f"{path}:{n}: {what}; {DATA_FIX}") from None
        if not isinstance(row, dict):
            raise SecateurError(f"{path}:{n}: a JSON {_JSON_TYPES.get(type(row), 'value')}, not an object of the "
                                f"task's keys; {DATA_FIX}")
        out.append((n, parse(schema, row, f"{path}:{n}", DATA_FIX)))
    return out


def _gold(path: Path, n: int, gold: int, choices: list) -> int:
    if gold >= len(choices):
        raise SecateurError(f"{path}:{n}: gold: {gold} is not the index of one of the {len(choices)} choices; "
                            f"{DATA_FIX}")
    return gold


def _boolq_docs(d: Path) -> list[dict]:
    out = []
    path = d / "zeroshot" / "boolq.jsonl"
    for i, (n, r) in enumerate(_jsonl(path, BoolQLine)):
        q = r.query
        if not q.startswith("Passage: ") or "\nQuestion: " not in q or not q.endswith("?"):
            raise SecateurError(f"{path}:{n}: query: not 'Passage: ...\\nQuestion: ...?'; {DATA_FIX}")
        passage, question = q[len("Passage: "):].rsplit("\nQuestion: ", 1)  # a passage quotes "\nQuestion: " once
        out.append({"passage": passage, "question": question[:-1], "label": r.gold, "idx": i})
    return out


def _rte_docs(d: Path) -> list[dict]:
    from secateur.schemas import parse
    from secateur.schemas.tasks import RteRow

    pq_path = d / "rte-glue" / "validation.parquet"
    tsv = d / "rte-glue" / "dev.tsv"
    if pq_path.exists():
        import pyarrow
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(_data_file(pq_path)).to_pylist()
        except (pyarrow.ArrowException, OSError) as e:
            from secateur.schemas.report import printable

            first = (str(e).splitlines() or [""])[0]
            raise SecateurError(f"{pq_path}: not a readable parquet file ({printable(first[:80])}); {DATA_FIX}") \
                from None
        where = [f"{pq_path}: row {i + 1}" for i in range(len(rows))]
    elif tsv.exists():
        text = "\n".join(line for _, line in _lines(tsv))
        rows = [{k: _int_text(v) if k in ("label", "idx") else v for k, v in r.items() if k in RteRow.model_fields}
                for r in csv.DictReader(text.splitlines(), delimiter="\t")]
        where = [f"{tsv}: row {i + 1}" for i in range(len(rows))]
    else:
        raise SecateurError(f"missing RTE data: neither {pq_path} nor {tsv}; {DATA_FIX}")
    docs = []
    for r, at in zip(rows, where):
        row = parse(RteRow, r, at, DATA_FIX)
        docs.append({"sentence1": row.sentence1, "sentence2": row.sentence2, "label": row.label, "idx": row.idx})
    return docs


def _int_text(v):
    """A TSV cell that holds a whole number, as that number (anything else as it is, refused by the schema)."""
    return int(v) if isinstance(v, str) and v.strip().isdigit() else v


_SENT_END = re.compile(r"[.!?][\"')\]]*\s+")


def split_hellaswag_ctx(ctx: str) -> tuple[str, str]:
    """Split a llama.cpp-format context back into ``(ctx_a, ctx_b)``.

    WikiHow contexts end with "." and have an empty ctx_b; ActivityNet contexts end inside the
    incomplete noun phrase ctx_b, which follows the last sentence end.
    """
    if not ctx or ctx.endswith("."):
        return ctx, ""
    ends = list(_SENT_END.finditer(ctx))
    if not ends:
        return "", ctx
    cut = ends[-1].end()
    return ctx[:cut].rstrip(), ctx[cut:]


def _hellaswag_docs(d: Path) -> list[dict]:
    path = _data_file(d / "hellaswag" / "hellaswag_val_full.txt.bz2")
    try:
        lines = bz2.decompress(path.read_bytes()).decode("utf-8").split("\n")
    except (OSError, ValueError, EOFError) as e:  # a damaged bz2 stream, or not UTF-8 inside
        why = "not UTF-8 text" if isinstance(e, UnicodeDecodeError) else f"not a complete bz2 file ({e})"
        raise SecateurError(f"{path}: {why}; {DATA_FIX}") from None
    if lines and lines[-1] == "":
        lines.pop()
    if len(lines) % 6:
        raise SecateurError(f"{path}: {len(lines)} lines is not 6 per item (context, label, 4 endings); {DATA_FIX}")
    out = []
    for i in range(len(lines) // 6):
        head, label, *endings = lines[6 * i: 6 * i + 6]
        if ": " not in head:
            raise SecateurError(f"{path}:{6 * i + 1}: context: no 'activity: context'; {DATA_FIX}")
        if label.strip() not in ("0", "1", "2", "3"):
            raise SecateurError(f"{path}:{6 * i + 2}: label: {label[:20]!r} is not 0, 1, 2 or 3; {DATA_FIX}")
        activity, ctx = head.split(": ", 1)
        ctx_a, ctx_b = split_hellaswag_ctx(ctx)
        out.append({"ind": i, "activity_label": activity, "ctx_a": ctx_a, "ctx_b": ctx_b,
                    "ctx": f"{ctx_a} {ctx_b}" if ctx_b else ctx_a, "endings": endings, "label": label,
                    "split": "val"})
    return out


def _winogrande_docs(d: Path) -> list[dict]:
    out = []
    for _, r in _jsonl(d / "zeroshot" / "winogrande.jsonl", WinograndeLine):
        c1, c2 = r.context_options
        n = 0
        while n < min(len(c1), len(c2)) and c1[n] == c2[n]:
            n += 1
        # back off to a word boundary so the options are whole words (any common prefix is exact)
        while n > 0 and not c1[n - 1].isspace():
            n -= 1
        prefix = c1[:n]
        out.append({"sentence": f"{prefix}_ {r.continuation}", "option1": c1[n:], "option2": c2[n:],
                    "answer": str(r.gold + 1)})
    return out


def _mc_docs(path: Path, question_key: str, strip_prefix: str) -> list[dict]:
    out = []
    for i, (n, r) in enumerate(_jsonl(path, QueryLine)):
        q = r.query
        if strip_prefix:
            if not q.startswith(strip_prefix):
                raise SecateurError(f"{path}:{n}: query: does not start with {strip_prefix!r}; {DATA_FIX}")
            q = q[len(strip_prefix):]
        labels = [chr(ord("A") + k) for k in range(len(r.choices))]
        out.append({"id": str(i), question_key: q, "choices": {"text": list(r.choices), "label": labels},
                    "answerKey": labels[_gold(path, n, r.gold, r.choices)]})
    return out


def _piqa_docs(d: Path) -> list[dict]:
    base = d / "piqa-official"
    rows = _jsonl(base / "valid.jsonl", PiqaLine)
    lab_path = base / "valid-labels.lst"
    labels = []
    for n, line in _lines(lab_path):
        if line.strip() not in ("0", "1"):
            raise SecateurError(f"{lab_path}:{n}: {line.strip()[:20]!r} is not a label (0 or 1); {DATA_FIX}")
        labels.append(int(line))
    if len(labels) != len(rows):
        raise SecateurError(f"{lab_path}: {len(labels)} labels for the {len(rows)} items of {base / 'valid.jsonl'}; "
                            f"{DATA_FIX}")
    return [{"goal": r.goal, "sol1": r.sol1, "sol2": r.sol2, "label": lab} for (_, r), lab in zip(rows, labels)]


# ---------------------------------------------------------------- documents -> requests (harness YAML)


def hellaswag_preprocess(text: str) -> str:
    """lm_eval/tasks/hellaswag/utils.py ``preprocess`` (order matters: strip first)."""
    text = text.strip()
    text = text.replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    text = text.replace("  ", " ")
    return text


def _mc(context: str, choices: list[str], gold: int):
    return [(context, TARGET_DELIMITER + c) for c in choices], list(choices), gold


def _boolq_item(doc):
    return _mc(f"{doc['passage']}\nQuestion: {doc['question']}?\nAnswer:", ["no", "yes"], int(doc["label"]))


def _rte_item(doc):
    return _mc(f"{doc['sentence1']}\nQuestion: {doc['sentence2']} True or False?\nAnswer:", ["True", "False"],
               int(doc["label"]))


def _hellaswag_item(doc):
    ctx = doc["ctx_a"] + " " + doc["ctx_b"].capitalize()
    query = hellaswag_preprocess(doc["activity_label"] + ": " + ctx)
    return _mc(query, [hellaswag_preprocess(e) for e in doc["endings"]], int(doc["label"]))


def _winogrande_item(doc):
    s = doc["sentence"]
    idx = s.index("_")
    contexts = [s[:idx] + doc["option1"], s[:idx] + doc["option2"]]
    target = s[idx + 1:].strip()
    return [(c, TARGET_DELIMITER + target) for c in contexts], contexts, {"1": 0, "2": 1}[doc["answer"]]


def _arc_item(doc):
    ch = doc["choices"]
    return _mc(f"Question: {doc['question']}\nAnswer:", list(ch["text"]), ch["label"].index(doc["answerKey"]))


def _obqa_item(doc):
    ch = doc["choices"]
    return _mc(doc["question_stem"], list(ch["text"]), ch["label"].index(doc["answerKey"].lstrip()))


def _piqa_item(doc):
    return _mc(f"Question: {doc['goal']}\nAnswer:", [doc["sol1"], doc["sol2"]], int(doc["label"]))


TASKS: dict[str, TaskSpec] = {t.name: t for t in (
    TaskSpec("boolq", "acc", "validation", 3270, ("zeroshot/boolq.jsonl",), "super_glue/boolq/default.yaml",
             _boolq_docs, _boolq_item),
    TaskSpec("rte", "acc", "validation", 277, ("rte-glue/validation.parquet",), "glue/rte/default.yaml",
             _rte_docs, _rte_item),
    TaskSpec("hellaswag", "acc_norm", "validation", 10042, ("hellaswag/hellaswag_val_full.txt.bz2",),
             "hellaswag/hellaswag.yaml", _hellaswag_docs, _hellaswag_item),
    TaskSpec("winogrande", "acc", "validation", 1267, ("zeroshot/winogrande.jsonl",), "winogrande/default.yaml",
             _winogrande_docs, _winogrande_item),
    TaskSpec("arc_easy", "acc_norm", "test", 2376, ("zeroshot/arc_easy.jsonl",), "arc/arc_easy.yaml",
             lambda d: _mc_docs(d / "zeroshot" / "arc_easy.jsonl", "question", "Question: "), _arc_item),
    TaskSpec("arc_challenge", "acc_norm", "test", 1172, ("zeroshot/arc_challenge.jsonl",),
             "arc/arc_challenge.yaml",
             lambda d: _mc_docs(d / "zeroshot" / "arc_challenge.jsonl", "question", "Question: "), _arc_item),
    TaskSpec("openbookqa", "acc_norm", "test", 500, ("zeroshot/openbook_qa.jsonl",), "openbookqa/openbookqa.yaml",
             lambda d: _mc_docs(d / "zeroshot" / "openbook_qa.jsonl", "question_stem", ""), _obqa_item),
    TaskSpec("piqa", "acc_norm", "validation", 1838, ("piqa-official/valid.jsonl", "piqa-official/valid-labels.lst"),
             "piqa/piqa.yaml", _piqa_docs, _piqa_item),
)}


def task_spec(name: str) -> TaskSpec:
    if name not in TASKS:
        raise SecateurError(f"unknown zero-shot task {name!r}; choose from {', '.join(TASKS)}")
    return TASKS[name]


def load_docs(task: str, data_dir: str | Path, limit: int | None = None) -> list[dict]:
    """The task's documents in harness schema, in file order; ``limit`` keeps the first N."""
    spec = task_spec(task)
    d = Path(data_dir)
    if not d.is_dir():
        raise SecateurError(f"data directory {d} does not exist; pass --data-dir a folder holding the zero-shot tasks")
    docs = spec.loader(d)
    if not docs:  # an empty file would score nan and exit 0
        raise SecateurError(f"{d / spec.files[0]}: no documents in the zero-shot task {task}; {DATA_FIX}, or leave "
                            f"{task} out of --tasks")
    return docs if limit is None else docs[:limit]


def build_item(task: str, doc: dict, index: int = 0) -> Item:
    requests, choices, gold = task_spec(task).builder(doc)
    if not 0 <= gold < len(choices):
        raise SecateurError(f"{task} item {index}: gold index {gold} out of range; {DATA_FIX}")
    return Item(task, index, requests, choices, gold, doc)


def load_items(task: str, data_dir: str | Path, limit: int | None = None) -> list[Item]:
    return [build_item(task, doc, i) for i, doc in enumerate(load_docs(task, data_dir, limit))]
