"""Bridge to the LM Evaluation Harness (``pip install 'lm-eval>=0.4.9'``, extra ``secateur[lmeval]``).

* :func:`make_hflm` wraps an in-memory (possibly pruned) model as ``HFLM(pretrained=model, ...)``.
* :func:`write_local_tasks` serves the offline copies in ``../shared/data`` as harness tasks: the
  documents (rebuilt in the hub datasets' schema by :mod:`secateur.eval.zeroshot_tasks`) go to JSONL
  files, and one YAML per task ``include``-s the harness's own task config (so its prompts, process_docs
  and metrics apply unchanged) with ``dataset_path: json`` and ``data_files`` pointing at them.
  Nothing touches the hub.
* :func:`run_harness` runs any harness task (``local=False``: the harness's own configs, which need
  the hub) or the local ones (``local=True``) with the spec's settings (0-shot, seed 1234).
* :func:`agreement` runs our scorer and the harness on the same documents and compares them item by
  item: the request strings, every per-choice log-likelihood and the acc / acc_norm predictions.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import numpy as np
from torch import nn

from secateur.errors import SecateurError
from secateur.eval.zeroshot_tasks import SUITE7, build_item, load_docs, task_spec

LOCAL_PREFIX = "secateur_"
SEED = 1234


def _lm_eval():
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import lm_eval
    except ImportError as e:
        raise SecateurError("the lm-eval bridge needs the harness: pip install 'secateur[eval]'") from e
    return lm_eval


def harness_version() -> str:
    from importlib.metadata import version

    _lm_eval()
    return version("lm_eval")


def harness_tasks_dir() -> Path:
    lm_eval = _lm_eval()
    return Path(lm_eval.__file__).parent / "tasks"


def make_hflm(model: nn.Module, tokenizer, batch_size: int = 4, max_length: int | None = None, **kwargs):
    """``HFLM`` around an in-memory model (no extra BOS: ``add_bos_token`` left at the harness default)."""
    _lm_eval()
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, max_length=max_length, **kwargs)


def write_local_tasks(tasks, data_dir, out_dir, limit: int | None = None) -> dict[str, str]:
    """Write ``<task>.jsonl`` + ``secateur_<task>.yaml`` for each task into ``out_dir``.

    Returns ``{our task name: harness task name}``; pass ``out_dir`` as ``TaskManager(include_path=...)``.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tasks_dir = harness_tasks_dir()
    names = {}
    for t in tasks:
        spec = task_spec(t)
        base = tasks_dir / spec.harness_yaml
        if not base.exists():
            raise SecateurError(f"the installed lm-eval has no {spec.harness_yaml}")
        docs = load_docs(t, data_dir, limit)
        data = out / f"{t}.jsonl"
        with data.open("w", encoding="utf-8") as f:
            for d in docs:
                f.write(json.dumps(d, ensure_ascii=False) + "\n")
        split = spec.split
        cfg = {
            "include": str(base),
            "task": LOCAL_PREFIX + t,
            "tag": [],
            "dataset_path": "json",
            "dataset_name": None,
            "dataset_kwargs": {"data_files": {split: str(data)}, "cache_dir": str(out / "hf_cache")},
            "training_split": None,
            "validation_split": split if split == "validation" else None,
            "test_split": split if split == "test" else None,
            "fewshot_split": None,
        }
        # JSON is valid YAML, and it quotes every string safely
        (out / f"{LOCAL_PREFIX}{t}.yaml").write_text(json.dumps(cfg, indent=1))
        names[t] = LOCAL_PREFIX + t
    return names


def run_harness(model: nn.Module, tokenizer, tasks=None, *, limit: int | None = None, batch_size: int = 4,
                data_dir=None, local: bool = True, max_length: int | None = None, log_samples: bool = False,
                workdir: str | Path | None = None) -> dict:
    """Evaluate ``tasks`` with ``lm_eval.simple_evaluate`` on the in-memory model (0-shot, seed 1234).

    ``local=True`` serves our local documents (our task names, e.g. ``boolq``); ``local=False`` passes
    the names to the harness as they are (any harness task; needs its datasets, i.e. the hub).
    Returns ``{"tasks": {name: {metric: value}}, "samples": {name: [...]} (if log_samples),
    "version": ...}``.
    """
    _lm_eval()
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    if tasks is None:
        tasks = list(SUITE7)
    elif isinstance(tasks, str):
        tasks = [t.strip() for t in tasks.split(",") if t.strip()]
    lm = make_hflm(model, tokenizer, batch_size=batch_size, max_length=max_length)
    with tempfile.TemporaryDirectory(prefix="secateur-lmeval-", dir=workdir) as tmp:
        if local:
            from secateur.eval.zeroshot import zeroshot_data_dir

            mapping = write_local_tasks(tasks, zeroshot_data_dir(data_dir), tmp, limit)
            tm = TaskManager(include_path=tmp)
        else:
            mapping = {t: t for t in tasks}
            tm = TaskManager()
        res = simple_evaluate(model=lm, tasks=list(mapping.values()), num_fewshot=0, limit=limit,
                              batch_size=batch_size, log_samples=log_samples, task_manager=tm,
                              random_seed=SEED, numpy_random_seed=SEED, torch_random_seed=SEED,
                              fewshot_random_seed=SEED, bootstrap_iters=0)
    back = {v: k for k, v in mapping.items()}
    out = {"version": harness_version(), "tasks": {}, "settings": {"num_fewshot": 0, "limit": limit,
                                                                   "batch_size": batch_size, "seed": SEED,
                                                                   "local_data": local}}
    for name, metrics in res["results"].items():
        if name in back:
            out["tasks"][back[name]] = {k.split(",")[0]: v for k, v in metrics.items()
                                        if isinstance(v, (int, float)) and "stderr" not in k}
    if log_samples:
        out["samples"] = {back[n]: s for n, s in res["samples"].items() if n in back}
    return out


def compare_requests(tasks=None, data_dir=None, limit: int | None = None) -> dict:
    """Model-free check of the prompt strings on the whole data: the harness builds its requests from
    our documents (its YAML, templates and process_docs; 0-shot) and we compare them with ours.

    Returns ``{task: {"n": documents, "mismatch": count, "first_mismatch": (ours, harness) or None}}``.
    """
    _lm_eval()
    from lm_eval.tasks import TaskManager, get_task_dict

    from secateur.eval.zeroshot import zeroshot_data_dir

    names = list(SUITE7) if tasks is None else (
        [t.strip() for t in tasks.split(",") if t.strip()] if isinstance(tasks, str) else list(tasks))
    d = zeroshot_data_dir(data_dir)
    out = {}
    with tempfile.TemporaryDirectory(prefix="secateur-lmeval-") as tmp:
        mapping = write_local_tasks(names, d, tmp, limit)
        tm = TaskManager(include_path=tmp)
        hnames = list(mapping.values())
        # newer lm-eval: TaskManager.load() -> {"tasks": {...}, ...} (get_task_dict is deprecated there)
        loaded = tm.load(hnames) if hasattr(tm, "load") else None
        tdict = loaded["tasks"] if isinstance(loaded, dict) and "tasks" in loaded else get_task_dict(hnames, tm)
        for t, hname in mapping.items():
            task = tdict[hname]
            task.set_config(key="num_fewshot", value=0)
            task.build_all_requests(limit=limit, rank=0, world_size=1)
            by_doc: dict[int, list] = {}
            for inst in task.instances:
                by_doc.setdefault(inst.doc_id, []).append((inst.idx, tuple(inst.arguments[:2])))
            items = [build_item(t, doc, i) for i, doc in enumerate(load_docs(t, d, limit))]
            mism, first = 0, None
            for it in items:
                theirs = [a for _, a in sorted(by_doc.get(it.index, []))]
                if theirs != [tuple(r) for r in it.requests]:
                    mism += 1
                    first = first or (it.requests, theirs)
            out[t] = {"n": len(items), "harness_docs": len(by_doc), "mismatch": mism, "first_mismatch": first}
    return out


def agreement(model: nn.Module, tokenizer, tasks=None, *, limit: int = 20, batch_size: int = 4, data_dir=None,
              ll_atol: float = 1e-3, strategy: str = "packed") -> dict:
    """Compare our scorer with the harness item by item on the first ``limit`` documents per task.

    Per task: ``n``, ``request_mismatch`` (documents whose harness ``(context, continuation)`` strings
    differ from ours), ``max_abs_ll_diff`` over every choice, ``pred_mismatch`` / ``pred_norm_mismatch``
    (documents whose argmax differs), both accuracies, and ``ok`` (all equal, lls within ``ll_atol``).
    """
    from secateur.eval.zeroshot import item_metrics, loglikelihoods, zeroshot_data_dir

    names = list(SUITE7) if tasks is None else (
        [t.strip() for t in tasks.split(",") if t.strip()] if isinstance(tasks, str) else list(tasks))
    d = zeroshot_data_dir(data_dir)
    h = run_harness(model, tokenizer, names, limit=limit, batch_size=batch_size, data_dir=d, local=True,
                    log_samples=True)
    report = {"version": h["version"], "limit": limit, "tasks": {}}
    for t in names:
        docs = load_docs(t, d, limit)
        items = [build_item(t, doc, i) for i, doc in enumerate(docs)]
        ours = loglikelihoods(model, tokenizer, items, batch_size=batch_size, strategy=strategy)
        samples = sorted(h["samples"][t], key=lambda s: s["doc_id"])
        if len(samples) != len(items):
            raise SecateurError(f"{t}: harness scored {len(samples)} documents, we scored {len(items)}")
        req_mis = pm = pnm = 0
        max_diff = 0.0
        acc = [[], []]
        for it, res, s in zip(items, ours, samples):
            args = [tuple(a) for a in s["arguments"]]
            if [tuple(a[:2]) for a in args] != [tuple(r) for r in it.requests]:
                req_mis += 1
            h_ll = [float(r[0]) for r in s["filtered_resps"]]
            o_ll = [r[0] for r in res]
            max_diff = max(max_diff, float(np.max(np.abs(np.array(h_ll) - np.array(o_ll)))))
            mo, mh = item_metrics(o_ll, it.choices, it.gold), item_metrics(h_ll, it.choices, it.gold)
            pm += mo["pred"] != mh["pred"]
            pnm += mo["pred_norm"] != mh["pred_norm"]
            acc[0].append(mo[task_spec(t).metric])
            acc[1].append(mh[task_spec(t).metric])
        harness_score = h["tasks"][t].get(task_spec(t).metric)
        report["tasks"][t] = {
            "n": len(items), "request_mismatch": req_mis, "max_abs_ll_diff": max_diff, "pred_mismatch": pm,
            "pred_norm_mismatch": pnm, "metric": task_spec(t).metric, "ours": float(np.mean(acc[0])),
            "harness": harness_score, "harness_from_lls": float(np.mean(acc[1])),
            "ok": req_mis == 0 and pm == 0 and pnm == 0 and max_diff <= ll_atol,
        }
    report["ok"] = all(v["ok"] for v in report["tasks"].values())
    return report
