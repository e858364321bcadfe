"""Zero-shot scorer: harness tokenization, packed scoring vs a brute-force reference, metrics, loaders, CLI."""

from __future__ import annotations

import argparse
import bz2
import csv
import json
import math
import os
from pathlib import Path

import pytest
import torch

from secateur.errors import SecateurError
from secateur.eval import zeroshot as zs
from secateur.eval.zeroshot_tasks import (
    SUITE7,
    TASKS,
    Item,
    build_item,
    hellaswag_preprocess,
    load_docs,
    load_items,
    split_hellaswag_ctx,
)
from secateur.testing import tiny_model

DATA_DIR = Path(os.environ.get("SECATEUR_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
HAS_ZS_DATA = (DATA_DIR / "zeroshot" / "boolq.jsonl").exists() and (DATA_DIR / "hellaswag").is_dir()
requires_zs_data = pytest.mark.skipif(not HAS_ZS_DATA, reason=f"no zero-shot data at {DATA_DIR}")

TRAIN_TEXT = [
    "The cat sat on the mat. Question: is the cat on the mat?\nAnswer: yes no True False",
    "A man is sitting on a roof. He starts pulling up roofing on a roof. the lady walks to a barbell.",
    "Question: Which statement best explains why photosynthesis is the foundation of most food webs?",
    "Sarah was a much better surgeon than Maria so Maria always got the harder cases.",
    "Predators eat bunnies and grass. Planetary days will become shorter. café naïve",
]


def tiny_tokenizer():
    """A byte-level BPE (GPT-2 style whitespace handling) trained offline on a few strings."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>"], show_progress=False)
    tk.train_from_iterator(TRAIN_TEXT * 3, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>", bos_token="<|endoftext|>")


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def write_fake_data(root: Path) -> Path:
    """A data folder in the ../shared/data layout with two or three documents per task."""
    zs_dir = root / "zeroshot"
    zs_dir.mkdir(parents=True)

    def jl(name, rows):
        (zs_dir / name).write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")

    jl("boolq.jsonl", [
        {"query": "Passage: The cat sat on the mat.\nQuestion: is the cat on the mat?", "choices": ["no", "yes"],
         "gold": 1},
        {"query": "Passage: Dogs bark.\nQuestion: A quote\nQuestion: inside\nQuestion: do cats bark?",
         "choices": ["no", "yes"], "gold": 0},
    ])
    jl("winogrande.jsonl", [
        {"context_options": ["Sarah was a much better surgeon than Maria so Sarah",
                             "Sarah was a much better surgeon than Maria so Maria"],
         "continuation": "always got the harder cases.", "gold": 0},
        {"context_options": ["Sam", "Sarah"], "continuation": "won the cat.", "gold": 1},
    ])
    mc = [{"query": "Question: Which statement best explains why photosynthesis matters?",
           "choices": ["Sunlight is energy.", "Most are on land.", "Carbon is more available.", "Plants."], "gold": 0},
          {"query": "Question: Predators eat", "choices": ["lions", "humans", "bunnies", "grass"], "gold": 2}]
    jl("arc_easy.jsonl", mc)
    jl("arc_challenge.jsonl", mc[::-1])
    jl("openbook_qa.jsonl", [{"query": "Predators eat", "choices": ["lions", "humans", "bunnies", "grass"],
                              "gold": 2}])
    hs = ["Roof shingle removal: A man is sitting on a roof. he", "3", "is using wrap to wrap a pair of skis.",
          "is ripping level tiles off.", "is holding a rubik's cube.", "starts pulling up roofing on a roof.",
          "Health: How to cope. Put off any plans. Promise yourself to wait.", "0", "Even when you do, rest.",
          "You're doing something.", "Eat [bracketed] food.", "Sleep."]
    (root / "hellaswag").mkdir()
    (root / "hellaswag" / "hellaswag_val_full.txt.bz2").write_bytes(bz2.compress(("\n".join(hs) + "\n").encode()))
    (root / "rte-glue").mkdir()
    with (root / "rte-glue" / "dev.tsv").open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f, delimiter="\t")
        w.writerow(["sentence1", "sentence2", "label", "idx"])
        w.writerow(["Dana Reeve died of lung cancer.", "Christopher Reeve had an accident.", 1, 0])
        w.writerow(["Bacteria are mutating fast.", "Bacteria is winning the war.", 0, 1])
    (root / "piqa-official").mkdir()
    (root / "piqa-official" / "valid.jsonl").write_text(
        json.dumps({"goal": "How do I dry a cat?", "sol1": "Use a towel ", "sol2": "Use an oven"}) + "\n")
    (root / "piqa-official" / "valid-labels.lst").write_text("0\n")
    return root


@pytest.fixture(scope="module")
def fake_data(tmp_path_factory):
    return write_fake_data(tmp_path_factory.mktemp("zsdata"))


# ---------------------------------------------------------------- tokenization


def test_encode_pair_follows_the_harness_rule(tok):
    ctx, cont = zs.encode_pair(tok, "Question: is it?\nAnswer:", " yes")
    whole = tok.encode("Question: is it?\nAnswer: yes")
    assert ctx == tok.encode("Question: is it?\nAnswer:")
    assert ctx + cont == whole and cont == whole[len(ctx):]
    # trailing spaces of the context move into the continuation (a space-led token is scored)
    ctx2, cont2 = zs.encode_pair(tok, "Question: is it?\nAnswer: ", "yes")
    assert (ctx2, cont2) == (ctx, cont)
    with pytest.raises(SecateurError):
        zs.encode_pair(tok, "", " yes")


# ---------------------------------------------------------------- scoring vs brute force


def brute_force(model, tok, item: Item, max_length: int) -> list[float]:
    """One full forward per (context, continuation), harness truncation, float64 log-softmax."""
    out = []
    for c, x in item.requests:
        ctx, cont = zs.encode_pair(tok, c, x)
        full = (ctx + cont)[-(max_length + 1):]
        with torch.no_grad():
            logits = model(torch.tensor([full[:-1]])).logits[0].double()
        lp = torch.log_softmax(logits, -1)
        n = len(full) - len(cont)
        out.append(sum(float(lp[n - 1 + j, t]) for j, t in enumerate(cont)))
    return out


def synthetic_items() -> list[Item]:
    ctx = "The cat sat on the mat.\nQuestion: is the cat on the mat?\nAnswer:"
    return [
        Item("t", 0, [(ctx, " no"), (ctx, " yes")], ["no", "yes"], 1),
        Item("t", 1, [("Question: Predators eat", " " + c) for c in ("lions", "bunnies", "grass grows", "café")],
             ["lions", "bunnies", "grass grows", "café"], 1),
        # partial scoring: contexts differ, the continuation is shared (winogrande)
        Item("t", 2, [("Sarah was better than Maria so Sarah", " always got the harder cases."),
                      ("Sarah was better than Maria so Maria", " always got the harder cases.")], ["a", "b"], 0),
        Item("t", 3, [("Sam", " won."), ("Sarah", " won.")], ["Sam", "Sarah"], 1),  # no shared prefix
        Item("t", 4, [("A man is sitting on a roof. He", " starts pulling up roofing on a roof."),
                      ("A man is sitting on a roof. He", " is holding a rubik's cube.")], ["x", "y"], 0),
        Item("t", 5, [("Predators", " eat")], ["eat"], 0),  # single request
    ]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral", "opt", "gpt2"])
def test_packed_and_plain_scores_equal_brute_force(family, tok):
    model = tiny_model(family, vocab=len(tok))
    items = synthetic_items()
    ref = [brute_force(model, tok, it, zs.resolve_max_length(model)) for it in items]
    for strategy, bs in (("packed", 1), ("packed", 4), ("plain", 3)):
        got = zs.loglikelihoods(model, tok, items, batch_size=bs, strategy=strategy)
        for r, g in zip(ref, got):
            assert [x[0] for x in g] == pytest.approx(r, abs=2e-4, rel=1e-5), (strategy, bs)


def test_left_truncation_matches_the_harness(tok):
    model = tiny_model("llama", vocab=len(tok))
    items = synthetic_items()
    pairs = [zs.encode_pair(tok, c, x) for it in items for c, x in it.requests]
    max_length = max(len(x) for _, x in pairs) + 1  # the input keeps the last max_length tokens
    assert sum(len(c) + len(x) > max_length + 1 for c, x in pairs) >= 4  # several requests get truncated
    ref = [brute_force(model, tok, it, max_length) for it in items]
    got = zs.loglikelihoods(model, tok, items, batch_size=3, max_length=max_length)
    for r, g in zip(ref, got):
        assert [x[0] for x in g] == pytest.approx(r, abs=2e-4, rel=1e-5)


def test_packing_shares_the_context(tok):
    pairs = [zs.encode_pair(tok, "Question: Predators eat", " " + c) for c in ("lions", "bunnies", "grass")]
    (g,) = zs.build_group(pairs, max_length=100)
    ctx_len = len(pairs[0][0])
    assert g.tokens[:ctx_len] == pairs[0][0]
    assert g.segments[:ctx_len] == [0] * ctx_len
    # each branch holds its continuation minus the last token (nothing is predicted from it)
    assert len(g.tokens) == ctx_len + sum(len(c) - 1 for _, c in pairs)
    assert g.n_request_tokens == sum(len(a) + len(b) for a, b in pairs)
    for rows, (_, cont) in zip(g.score_rows, pairs):
        assert rows[0] == ctx_len - 1 and len(rows) == len(cont)
    plain = zs.build_group(pairs, max_length=100, share=False)
    assert len(plain) == 3 and all(len(p.score_rows) == 1 for p in plain)


def test_tree_mask_blocks_other_branches():
    seg = torch.tensor([[0, 0, 1, 1, 2, -1]])
    allowed = zs._tree_mask(seg, torch.float32)[0, 0] == 0
    assert allowed[3].tolist() == [True, True, True, True, False, False]
    assert allowed[4].tolist() == [True, True, False, False, True, False]
    assert allowed[5].tolist() == [False, False, False, False, False, True]  # padding sees only itself
    assert not allowed[0, 1]  # causal


def test_is_greedy_flag(tok):
    model = tiny_model("llama", vocab=len(tok))
    ctx = "The cat sat on the mat."
    ids = tok.encode(ctx)
    with torch.no_grad():
        nxt = int(model(torch.tensor([ids])).logits[0, -1].argmax())
    other = (nxt + 1) % len(tok)
    item = Item("t", 0, [(ctx, tok.decode([nxt])), (ctx, tok.decode([other]))], ["a", "b"], 0)
    pairs = [zs.encode_pair(tok, c, x) for c, x in item.requests]
    if [len(c) for _, c in pairs] != [1, 1] or pairs[0][1] != [nxt]:
        pytest.skip("decoded token does not re-encode to itself")
    (res,) = zs.loglikelihoods(model, tok, [item])
    assert res[0][1] is True and res[1][1] is False


# ---------------------------------------------------------------- metrics


def test_item_metrics_acc_norm_divides_by_characters():
    # raw argmax picks the short choice; per-character normalization picks the long one
    m = zs.item_metrics([-2.0, -3.0], ["ab", "abcdef"], gold=1)
    assert (m["pred"], m["pred_norm"], m["acc"], m["acc_norm"]) == (0, 1, 0.0, 1.0)
    # characters, not bytes: "éé" is 2 characters but 4 bytes
    m = zs.item_metrics([-2.1, -2.0], ["éé", "ab"], gold=0)
    assert m["pred_norm"] == 1  # -2.1/2 < -2.0/2
    assert zs.item_metrics([-2.1, -2.0], ["éé", "ab"], gold=0)["acc_bytes"] == 1.0  # -2.1/4 > -2.0/2
    # ties go to the lowest index (np.argmax)
    assert zs.item_metrics([-1.0, -1.0], ["a", "b"], gold=0)["acc"] == 1.0


def test_suite_summary_mean_and_stratified_se():
    per = {"boolq": {"score": 0.6, "n": 100}, "rte": {"score": 0.55555, "n": 9}, "hellaswag": {"score": 0.3, "n": 50}}
    s = zs.suite_summary(per)
    assert s["mean"] == pytest.approx(100 * (0.6 + 0.55555 + 0.3) / 3, abs=1e-12)
    se = 100 / 3 * math.sqrt(0.6 * 0.4 / 100 + 0.55555 * 0.44445 / 9 + 0.3 * 0.7 / 50)
    assert s["se"] == pytest.approx(se, rel=1e-12)
    assert not s["is_suite7"]
    assert zs.suite_summary({t: {"score": 0.5, "n": 10} for t in SUITE7})["is_suite7"]


# ---------------------------------------------------------------- loaders -> harness strings


def test_harness_strings_from_fake_data(fake_data):
    it = load_items("boolq", fake_data)
    assert it[0].requests == [("The cat sat on the mat.\nQuestion: is the cat on the mat?\nAnswer:", " no"),
                              ("The cat sat on the mat.\nQuestion: is the cat on the mat?\nAnswer:", " yes")]
    assert it[1].requests[0][0] == "Dogs bark.\nQuestion: A quote\nQuestion: inside\nQuestion: do cats bark?\nAnswer:"
    rte = load_items("rte", fake_data)
    assert rte[0].requests == [("Dana Reeve died of lung cancer.\nQuestion: Christopher Reeve had an accident. True or "
                                "False?\nAnswer:", c) for c in (" True", " False")]
    assert rte[0].gold == 1
    hs = load_items("hellaswag", fake_data)
    assert hs[0].requests[0] == ("Roof shingle removal: A man is sitting on a roof. He", " is using wrap to wrap a "
                                 "pair of skis.")
    assert hs[0].gold == 3 and hs[1].gold == 0
    assert hs[1].requests[0][0] == "Health: How to cope. Put off any plans. Promise yourself to wait."
    assert hs[1].requests[2][1] == " Eat food." and hs[1].choices[2] == "Eat food."
    wg = load_items("winogrande", fake_data)
    assert wg[0].requests == [("Sarah was a much better surgeon than Maria so Sarah", " always got the harder cases."),
                              ("Sarah was a much better surgeon than Maria so Maria", " always got the harder cases.")]
    assert wg[1].requests == [("Sam", " won the cat."), ("Sarah", " won the cat.")] and wg[1].gold == 1
    arc = load_items("arc_easy", fake_data)
    assert arc[0].requests[0] == ("Question: Which statement best explains why photosynthesis matters?\nAnswer:",
                                  " Sunlight is energy.")
    assert load_items("arc_challenge", fake_data)[0].gold == 2
    ob = load_items("openbookqa", fake_data)
    assert ob[0].requests[2] == ("Predators eat", " bunnies") and ob[0].gold == 2
    pq = load_items("piqa", fake_data)
    assert pq[0].requests == [("Question: How do I dry a cat?\nAnswer:", " Use a towel "),
                              ("Question: How do I dry a cat?\nAnswer:", " Use an oven")]
    assert [len(load_docs(t, fake_data, limit=1)) for t in TASKS] == [1] * len(TASKS)


def test_hellaswag_ctx_split():
    assert split_hellaswag_ctx("A man is sitting on a roof. he") == ("A man is sitting on a roof.", "he")
    assert split_hellaswag_ctx('Screen reads "how to". a talking man') == ('Screen reads "how to".', "a talking man")
    assert split_hellaswag_ctx(". a colorful intro") == (".", "a colorful intro")
    assert split_hellaswag_ctx("How to cope. Put off any plans.") == ("How to cope. Put off any plans.", "")
    # the harness strips before removing tags, so a leading tag leaves its space behind
    assert hellaswag_preprocess(" [header] How to x [title] Do y. [step] Go  on ") == " How to x. Do y. Go on"


@requires_zs_data
def test_real_data_counts_and_first_items():
    sizes = {t: len(load_docs(t, DATA_DIR)) for t in TASKS}
    assert sizes == {t: s.size for t, s in TASKS.items()}
    first = {t: build_item(t, load_docs(t, DATA_DIR, limit=1)[0]) for t in TASKS}
    b = first["boolq"].requests[0][0]
    assert b.startswith("All biomass goes through") and b.endswith(
        "\nQuestion: does ethanol take more energy make that produces?\nAnswer:")
    assert first["boolq"].gold == 0
    assert first["rte"].requests[0][0].endswith(
        "\nQuestion: Christopher Reeve had an accident. True or False?\nAnswer:")
    assert first["rte"].gold == 1
    assert first["hellaswag"].requests[3] == ("Roof shingle removal: A man is sitting on a roof. He",
                                              " starts pulling up roofing on a roof.")
    assert first["hellaswag"].gold == 3
    assert first["winogrande"].requests[1] == ("Sarah was a much better surgeon than Maria so Maria",
                                               " always got the easier cases.")
    assert first["winogrande"].gold == 1
    assert first["arc_easy"].requests[0][0] == ("Question: Which statement best explains why photosynthesis is the "
                                                "foundation of most food webs?\nAnswer:")
    assert first["openbookqa"].requests[1][1] == " quit eating lunch out" and first["openbookqa"].gold == 1
    assert first["piqa"].requests[0][0] == "Question: How do I ready a guinea pig cage for it's new occupants?\nAnswer:"


@requires_zs_data
def test_real_hellaswag_context_split_is_consistent():
    docs = load_docs("hellaswag", DATA_DIR)
    activitynet = [d for d in docs if d["ctx_b"]]
    wikihow = [d for d in docs if not d["ctx_b"]]
    assert len(activitynet) + len(wikihow) == 10042 and len(activitynet) > 3000 and len(wikihow) > 6000
    # ctx_b is the lower-case trailing noun phrase; capitalization is the harness's job
    assert all(d["ctx_b"][0].islower() or not d["ctx_b"][0].isalpha() for d in activitynet)
    assert all(d["ctx_a"] + " " + d["ctx_b"] == d["ctx"] for d in activitynet)


# ---------------------------------------------------------------- evaluate + CLI


def test_evaluate_zeroshot_end_to_end(fake_data, tok):
    model = tiny_model("llama", vocab=len(tok))
    res = zs.evaluate_zeroshot(model, tok, list(SUITE7) + ["piqa"], limit=2, batch_size=3, data_dir=fake_data,
                               return_items=True)
    assert set(res["tasks"]) == set(SUITE7) | {"piqa"}
    for t, m in res["tasks"].items():
        items = load_items(t, fake_data, 2)
        assert m["n"] == len(items) and m["metric"] == TASKS[t].metric
        recs = res["items"][t]
        for it, rec in zip(items, recs):
            assert rec["lls"] == pytest.approx(brute_force(model, tok, it, 256), abs=2e-4)
        assert m["score"] == sum(r[m["metric"]] for r in recs) / len(recs)
    s = res["summary"]
    assert s["mean"] == pytest.approx(100 * sum(m["score"] for m in res["tasks"].values()) / 8)
    assert res["speed"]["request_tokens"] > res["speed"]["forward_tokens"] > 0
    assert set(res["data"]["sha256"]) >= {"zeroshot/boolq.jsonl", "hellaswag/hellaswag_val_full.txt.bz2"}


def test_bad_inputs_raise(fake_data, tok):
    model = tiny_model("llama", vocab=len(tok))
    with pytest.raises(SecateurError, match="unknown zero-shot task"):
        zs.evaluate_zeroshot(model, tok, "boolq,mmlu", data_dir=fake_data)
    with pytest.raises(SecateurError, match="does not exist"):
        zs.evaluate_zeroshot(model, tok, "boolq", data_dir=fake_data / "nope")
    with pytest.raises(SecateurError, match="missing zero-shot data"):
        zs.evaluate_zeroshot(model, tok, "boolq", data_dir=fake_data / "hellaswag")
    with pytest.raises(SecateurError, match="strategy"):
        zs.loglikelihoods(model, tok, synthetic_items(), strategy="fast")


def test_cli_zeroshot(fake_data, tok, tmp_path, capsys):
    model = tiny_model("llama", vocab=len(tok))
    folder = tmp_path / "m"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    parser = argparse.ArgumentParser()
    zs.register_cli(parser.add_subparsers(dest="what"))
    out = tmp_path / "r.json"
    args = parser.parse_args(["zeroshot", "--model", str(folder), "--tasks", "boolq,winogrande", "--limit", "2",
                              "--data-dir", str(fake_data), "--json", str(out), "--quiet", "--batch-size", "2"])
    assert args.func(args) == 0
    res = json.loads(out.read_text())
    assert list(res["tasks"]) == ["boolq", "winogrande"] and res["tasks"]["boolq"]["n"] == 2
    assert res["model"]["dtype"] == "float32" and res["protocol"] == zs.PROTOCOL
    assert "2-task mean" in capsys.readouterr().out
    bad = parser.parse_args(["zeroshot", "--model", str(folder), "--tasks", "nope", "--data-dir", str(fake_data)])
    with pytest.raises(SecateurError):
        bad.func(bad)


def test_half_precision_and_full_logits_path(tok, monkeypatch):
    model = tiny_model("llama", vocab=len(tok))
    items = synthetic_items()[:3]
    ref = zs.loglikelihoods(model, tok, items)
    # the model(...).logits path (taken for soft-capped / scaled heads) gives the same numbers
    monkeypatch.setattr(zs, "_needs_full_logits", lambda m: True)
    full = zs.loglikelihoods(model, tok, items, batch_size=2)
    for r, f in zip(ref, full):
        assert [x[0] for x in f] == pytest.approx([x[0] for x in r], abs=2e-4)
    monkeypatch.undo()
    half = zs.loglikelihoods(model.to(torch.bfloat16), tok, items)  # the mask follows the model dtype
    for r, h in zip(ref, half):
        assert [x[0] for x in h] == pytest.approx([x[0] for x in r], abs=0.5)


# ---------------------------------------------------------------- several processes


ZS_TASKS = "boolq,winogrande,hellaswag,arc_easy,openbookqa"


def _zs_folder(tok, root: Path) -> Path:
    folder = root / "m"
    if not folder.exists():
        tiny_model("llama", vocab=len(tok)).save_pretrained(folder)
        tok.save_pretrained(folder)
    return folder


def _zs_worker(rank: int, world: int, root: str, data: str) -> None:
    from secateur.models.loading import load_model

    ran = []
    real = zs._run_batch

    def counting(model, groups, packed, device):
        ran.append(len(groups))
        return real(model, groups, packed, device)

    zs._run_batch = counting
    model, tok = load_model(str(Path(root) / "m"))
    res = zs.evaluate_zeroshot(model, tok, ZS_TASKS, batch_size=2, data_dir=data, return_items=True)
    torch.save({"res": res, "ran": ran}, Path(root) / f"zs-{world}-{rank}.pt")


def _zs_numbers(res: dict) -> str:
    """The result's numbers as exact text (``repr`` of every float; a one-document task's NaN stderr compares)."""
    return json.dumps({"tasks": res["tasks"], "summary": res["summary"], "items": res["items"],
                       "tokens": [res["speed"][k] for k in ("requests", "request_tokens", "forward_tokens")]},
                      sort_keys=True)


@pytest.mark.slow
def test_two_processes_score_the_batches_of_one(fake_data, tok, tmp_path):
    """Batch b on rank b % 2, every log-likelihood gathered: the single process's numbers on every rank."""
    from secateur.calib.dist import spawn_gloo
    from secateur.models.loading import load_model

    n = torch.get_num_threads()
    torch.set_num_threads(1)  # the spawned ranks' kernels (1 thread each)
    try:
        model, tk = load_model(str(_zs_folder(tok, tmp_path)))
        one = zs.evaluate_zeroshot(model, tk, ZS_TASKS, batch_size=2, data_dir=fake_data, return_items=True)
    finally:
        torch.set_num_threads(n)
    spawn_gloo(_zs_worker, 2, (str(tmp_path), str(fake_data)), threads=1)
    ranks = [torch.load(tmp_path / f"zs-2-{r}.pt", weights_only=False) for r in (0, 1)]
    for r in ranks:
        assert _zs_numbers(r["res"]) == _zs_numbers(one)
    # the work was split: rows in batches of 2 per task (one packed row per document), batch b of the run (counted
    # over the tasks) on rank b % 2
    batches = sum(math.ceil(one["tasks"][t]["n"] / 2) for t in ZS_TASKS.split(","))
    assert batches >= 3 and [len(r["ran"]) for r in ranks] == [len(range(k, batches, 2)) for k in (0, 1)]


@pytest.mark.slow
def test_cli_zeroshot_procs_prints_once_writes_once(fake_data, tok, tmp_path):
    import subprocess
    import sys

    folder = _zs_folder(tok, tmp_path)
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env |= {"PYTHONPATH": src + os.pathsep + env.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1",
            "SECATEUR_DIST_TIMEOUT": "60"}
    out = tmp_path / "r.json"
    p = subprocess.run([sys.executable, "-m", "secateur", "eval", "zeroshot", "--model", str(folder), "--tasks",
                        "boolq,winogrande,hellaswag", "--data-dir", str(fake_data), "--json", str(out), "--quiet",
                        "--batch-size", "1", "--items", "--procs", "2"],
                       env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("3-task mean") == 1 and p.stdout.count("wrote") == 1, p.stdout
    res = json.loads(out.read_text())
    assert res["processes"] == 2
    from secateur.models.loading import load_model

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, tk = load_model(str(folder))
        one = zs.evaluate_zeroshot(model, tk, "boolq,winogrande,hellaswag", batch_size=1, data_dir=fake_data,
                                   return_items=True)
    finally:
        torch.set_num_threads(n)
    assert _zs_numbers(res) == _zs_numbers(one)
