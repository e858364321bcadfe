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

from secateur.errors import SecateurError

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


def _jsonl(path: Path) -> list[dict]:
    if not path.exists():
        raise SecateurError(f"missing zero-shot data file {path}")
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _boolq_docs(d: Path) -> list[dict]:
    out = []
    for i, r in enumerate(_jsonl(d / "zeroshot" / "boolq.jsonl")):
        q = r["query"]
        if not q.startswith("Passage: ") or "\nQuestion: " not in q or not q.endswith("?"):
            raise SecateurError(f"boolq row {i}: unexpected query format")
        passage, question = q[len("Passage: "):].rsplit("\nQuestion: ", 1)  # a passage quotes "\nQuestion: " once
        out.append({"passage": passage, "question": question[:-1], "label": int(r["gold"]), "idx": i})
    return out


def _rte_docs(d: Path) -> list[dict]:
    pq_path = d / "rte-glue" / "validation.parquet"
    tsv = d / "rte-glue" / "dev.tsv"
    if pq_path.exists():
        import pyarrow.parquet as pq

        rows = pq.read_table(pq_path).to_pylist()
    elif tsv.exists():
        with tsv.open(encoding="utf-8", newline="") as f:
            rows = list(csv.DictReader(f, delimiter="\t"))
    else:
        raise SecateurError(f"missing RTE data: neither {pq_path} nor {tsv}")
    return [{"sentence1": r["sentence1"], "sentence2": r["sentence2"], "label": int(r["label"]),
             "idx": int(r["idx"])} for r in rows]


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
    path = d / "hellaswag" / "hellaswag_val_full.txt.bz2"
    if not path.exists():
        raise SecateurError(f"missing zero-shot data file {path}")
    lines = bz2.decompress(path.read_bytes()).decode("utf-8").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if len(lines) % 6:
        raise SecateurError(f"{path}: {len(lines)} lines is not 6 per item")
    out = []
    for i in range(len(lines) // 6):
        head, label, *endings = lines[6 * i: 6 * i + 6]
        activity, ctx = head.split(": ", 1)
        ctx_a, ctx_b = split_hellaswag_ctx(ctx)
        out.append({"ind": i, "activity_label": activity, "ctx_a": ctx_a, "ctx_b": ctx_b,
                    "ctx": f"{ctx_a} {ctx_b}" if ctx_b else ctx_a, "endings": endings, "label": label,
                    "split": "val"})
    return out


def _winogrande_docs(d: Path) -> list[dict]:
    out = []
    for r in _jsonl(d / "zeroshot" / "winogrande.jsonl"):
        c1, c2 = r["context_options"]
        n = 0
        while n < min(len(c1), len(c2)) and c1[n] == c2[n]:
            n += 1
        # back off to a word boundary so the options are whole words (any common prefix is exact)
        while n > 0 and not c1[n - 1].isspace():
            n -= 1
        prefix = c1[:n]
        out.append({"sentence": f"{prefix}_ {r['continuation']}", "option1": c1[n:], "option2": c2[n:],
                    "answer": str(int(r["gold"]) + 1)})
    return out


def _mc_docs(path: Path, question_key: str, strip_prefix: str) -> list[dict]:
    out = []
    for i, r in enumerate(_jsonl(path)):
        q = r["query"]
        if strip_prefix:
            if not q.startswith(strip_prefix):
                raise SecateurError(f"{path.name} row {i}: query does not start with {strip_prefix!r}")
            q = q[len(strip_prefix):]
        labels = [chr(ord("A") + k) for k in range(len(r["choices"]))]
        out.append({"id": str(i), question_key: q, "choices": {"text": list(r["choices"]), "label": labels},
                    "answerKey": labels[int(r["gold"])]})
    return out


def _piqa_docs(d: Path) -> list[dict]:
    base = d / "piqa-official"
    rows = _jsonl(base / "valid.jsonl")
    lab_path = base / "valid-labels.lst"
    if not lab_path.exists():
        raise SecateurError(f"missing zero-shot data file {lab_path}")
    labels = [int(x) for x in lab_path.read_text().split()]
    if len(labels) != len(rows):
        raise SecateurError(f"piqa: {len(rows)} items but {len(labels)} labels")
    return [{"goal": r["goal"], "sol1": r["sol1"], "sol2": r["sol2"], "label": lab} for r, lab in zip(rows, labels)]


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
        raise SecateurError(f"data directory {d} does not exist")
    docs = spec.loader(d)
    return docs if limit is None else docs[:limit]


def build_item(task: str, doc: dict, index: int = 0) -> Item:
    requests, choices, gold = task_spec(task).builder(doc)
    if not 0 <= gold < len(choices):
        raise SecateurError(f"{task} item {index}: gold index {gold} out of range")
    return Item(task, index, requests, choices, gold, doc)


def load_items(task: str, data_dir: str | Path, limit: int | None = None) -> list[Item]:
    return [build_item(task, doc, i) for i, doc in enumerate(load_docs(task, data_dir, limit))]
