"""Item-by-item agreement of our zero-shot scorer with the LM Evaluation Harness (skipped without lm-eval)."""

from __future__ import annotations

import importlib.util
import json

import pytest
from test_zeroshot import tiny_tokenizer, write_fake_data

from secateur.eval.zeroshot_tasks import SUITE7, TASKS, load_items
from secateur.testing import tiny_model

pytestmark = pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None, reason="lm-eval not installed")

ALL = list(SUITE7) + ["piqa"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tok = tiny_tokenizer()
    model = tiny_model("llama", vocab=len(tok))
    data = write_fake_data(tmp_path_factory.mktemp("zsdata"))
    return model, tok, data


@pytest.fixture(scope="module")
def report(setup):
    from secateur.eval.lmeval_bridge import agreement

    model, tok, data = setup
    return agreement(model, tok, ALL, limit=2, batch_size=3, data_dir=data)


def test_agreement_item_by_item(report, setup):
    _, _, data = setup
    assert set(report["tasks"]) == set(ALL)
    for t, r in report["tasks"].items():
        assert r["n"] == len(load_items(t, data, 2)) > 0
        assert r["request_mismatch"] == 0, t  # the harness built the same (context, continuation) strings
        assert r["max_abs_ll_diff"] < 1e-4, t
        assert r["pred_mismatch"] == 0 and r["pred_norm_mismatch"] == 0, t
        assert r["ours"] == r["harness"] == r["harness_from_lls"], t
    assert report["ok"]


def test_local_task_files(setup, tmp_path):
    from secateur.eval.lmeval_bridge import write_local_tasks

    _, _, data = setup
    names = write_local_tasks(["boolq", "arc_easy"], data, tmp_path)
    assert names == {"boolq": "secateur_boolq", "arc_easy": "secateur_arc_easy"}
    cfg = json.loads((tmp_path / "secateur_arc_easy.yaml").read_text())
    assert cfg["test_split"] == "test" and cfg["validation_split"] is None
    assert cfg["include"].endswith("arc/arc_easy.yaml") and cfg["dataset_path"] == "json"
    assert len((tmp_path / "boolq.jsonl").read_text().splitlines()) == 2
    for t in TASKS:  # every task maps to a config of the installed harness
        from secateur.eval.lmeval_bridge import harness_tasks_dir

        assert (harness_tasks_dir() / TASKS[t].harness_yaml).exists(), t


def test_hellaswag_preprocess_is_the_harness_function():
    from lm_eval.tasks.hellaswag.utils import preprocess

    from secateur.eval.zeroshot_tasks import hellaswag_preprocess

    for s in (" [header] How to x [title] Do y. [step] Go  on ", "[title] A [substeps] b   c.", "Eat [x] food.",
              "a [ b ] c [title]. d"):
        assert hellaswag_preprocess(s) == preprocess(s)


def test_compare_requests_on_every_document(setup, monkeypatch):
    import dataclasses

    from secateur.eval.lmeval_bridge import compare_requests

    _, _, data = setup
    # the check can fail: a boolq prompt without the "?" is caught on every document
    spec = TASKS["boolq"]

    def bad(doc):
        reqs, choices, gold = spec.builder(doc)
        return [(c.replace("?\nAnswer:", "\nAnswer:"), x) for c, x in reqs], choices, gold

    monkeypatch.setitem(TASKS, "boolq", dataclasses.replace(spec, builder=bad))
    res = compare_requests(["boolq", "hellaswag", "winogrande"], data)
    assert res["boolq"]["mismatch"] == res["boolq"]["n"] == 2
    assert res["hellaswag"] == {"n": 2, "harness_docs": 2, "mismatch": 0, "first_mismatch": None}
    assert res["winogrande"]["mismatch"] == 0 and res["winogrande"]["n"] == 2
