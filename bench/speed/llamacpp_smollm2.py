"""SmolLM2-135M pruned by secateur, exported to GGUF and run by llama.cpp (issue 17 section 2).

    make deploy                                                      # llama-cpp-python, built once ([deploy] extra)
    nice -n 5 python bench/speed/llamacpp_smollm2.py --prepare             # prune + export GGUF for every row
    python bench/speed/llamacpp_smollm2.py --measure --repeats 3           # ppl + speed, each model in its own process
    python bench/speed/llamacpp_smollm2.py --render                        # results/deploy/llamacpp-smollm2.md
    python bench/speed/llamacpp_smollm2.py --measure --rows cocurve-30 --types f16   # one row, dense beside it

On an AMX Xeon where llama.cpp's AMX int8 matmul crashes (ggml-org/llama.cpp#20824), measure q8_0 with
``SECATEUR_LLAMACPP_NO_EXTRA_BUFTS=1`` (weights in plain CPU buffers; recorded in each row as ``extra_bufts``).

Rows: dense, Wanda-sp 30% (uniform widths: the family's own ``llama`` architecture), FLAP 20% with global
allocation (uneven widths: ``deci``), CoCurve 30% (uneven: ``deci``), each exported as f16 and q8_0 by
``secateur export gguf``. Calibration C4 8 x 512, seed 0 (CoCurve: its quick preset, 4 graph + 4 held-out
windows of 256, 32 positions, top-r 256).

Perplexity: WikiText-2 test, the very windows of ``secateur eval ppl --seqlen 512 --max-windows 8`` (the same
token ids from secateur's tokenizer and window plan, BOS rule included), scored from llama.cpp's logits
(``logits_all``) in float64 on this side; the HF number is ``secateur eval ppl`` on the run folder, beside it.
Speed: prefill of 512 tokens (one ``eval`` call, n_batch 512, only the last position's logits) and decode of 64
tokens one at a time (greedy argmax fed back), tokens/s at 2 threads, flash attention on (llama.cpp's tools
default); every (model, type) is measured in its own fresh process, the rows are alternated in rounds (round r
measures every model once, in a rotated order), and the ratio to dense is taken within each round, then the
median over rounds is reported. Perplexity is computed in the first round only (deterministic).
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

JSONL = results_dir("deploy") / "llamacpp-smollm2.jsonl"
MD = results_dir("deploy") / "llamacpp-smollm2.md"
OUT = WORK / "llamacpp"
CALIB = ["--calib", "c4", "--nsamples", "8", "--seqlen", "512", "--seed", "0"]
ROWS: dict[str, list[str]] = {
    "dense": [],
    "wanda-sp-30": ["--method", "wanda-sp", "--sparsity", "0.3"],
    "flap-20-global": ["--method", "flap", "--sparsity", "0.2", "--allocation", "flap-global"],
    # kept FFN widths multiples of 32: q8_0 quantizes every matrix and llama.cpp's kernels see aligned rows
    "wanda-sp-30-w32": ["--method", "wanda-sp", "--sparsity", "0.3", "--width-multiple", "32"],
    # CoCurve's quick preset (bench/quality/cocurve_smollm2.py): 4 graph + 4 held-out windows of 256; overrides CALIB
    "cocurve-30": ["--method", "cocurve", "--sparsity", "0.3", "--nsamples", "8", "--heldout", "4",
                   "--seqlen", "256", "--positions", "32", "--top-r", "256"],
}
# the dense row is the dequantized cache folder of the GGUF alias: transformers converted its tokenizer with a
# plain ByteLevel pre-tokenizer (gpt-2), SmolLM2's own is llama.cpp's smollm (digits one by one), which the pruned
# rows copy from the source GGUF their report names
EXPORT_EXTRA = {"dense": ["--tokenizer-pre", "smollm"]}
TYPES = ("f16", "q8_0")
SEQLEN, WINDOWS, PREFILL, DECODE, THREADS = 512, 8, 512, 64, 2
# llama.cpp's own tools default to flash attention "auto" (on for the CPU backend); llama-cpp-python's default is
# off, which also pads a deci model's V cache to its widest layer
FLASH_ATTN = True
SECATEUR = [sys.executable, "-m", "secateur.cli"]


def run_dir(row: str) -> Path:
    return OUT / row


def gguf_path(row: str, typ: str) -> Path:
    return OUT / f"{row}.{typ}.gguf"


def _call(cmd: list[str]) -> None:
    print("$ " + " ".join(cmd), flush=True)
    subprocess.check_call(cmd, env=os.environ | {"TOKENIZERS_PARALLELISM": "false"})


def prepare(only: list[str] | None = None) -> None:
    """Prune each row (dense: the model folder itself), export f16 and q8_0, and measure the HF perplexity;
    ``only``: these rows."""
    from secateur.models.loading import resolve

    OUT.mkdir(parents=True, exist_ok=True)
    for row, args in ROWS.items():
        if only is not None and row not in only:
            continue
        src = run_dir(row)
        if row == "dense":
            src = Path(resolve("smollm2-135m", "float32")[0])
        elif not (src / "secateur-report.json").exists():
            _call([*SECATEUR, "prune", "--model", "smollm2-135m", *CALIB, *args, "--out", str(src), "--overwrite",
                   "--quiet"])
        for typ in TYPES:
            if not gguf_path(row, typ).exists():
                _call([*SECATEUR, "export", "gguf", str(src), "--out", str(gguf_path(row, typ)), "--type", typ,
                       *EXPORT_EXTRA.get(row, [])])
        hf = OUT / f"{row}.hf-ppl.json"
        if not hf.exists():
            _call([*SECATEUR, "eval", "ppl", "--model", str(src), "--dataset", "wikitext2", "--seqlen", str(SEQLEN),
                   "--max-windows", str(WINDOWS), "--json", str(hf), "--quiet"])


def windows() -> tuple[list[list[int]], list[int], str]:
    return smollm2_wikitext_windows(SEQLEN, WINDOWS)


def _no_extra_bufts() -> None:
    """Load models with ``use_extra_bufts = False`` (llama-cpp-python has no keyword for it): the weights stay in
    plain CPU buffers, so llama.cpp's AMX int8 matmul, which crashes on some Xeons (ggml-org/llama.cpp#20824), is
    never used."""
    import llama_cpp.llama_cpp as lc

    default = lc.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = False
        return p

    lc.llama_model_default_params = params


def measure_one(path: Path, wins: list[list[int]], scored: list[int], with_ppl: bool = True) -> dict:
    """In this (fresh) process: llama.cpp's perplexity on the windows (``logits_all``), then prefill and decode
    tokens/s on a second context without ``logits_all`` (only the last position's logits, as a server computes
    them: copying 512 x 49152 logits out would be timed otherwise)."""
    import llama_cpp
    import numpy as np

    if os.environ.get("SECATEUR_LLAMACPP_NO_EXTRA_BUFTS") == "1":  # no AMX / repacked weight buffers (#20824)
        _no_extra_bufts()
    common = dict(model_path=str(path), n_threads=THREADS, n_threads_batch=THREADS, verbose=False)
    out = {}
    if with_ppl:
        out = ppl_one(common, wins, scored)
    llm = llama_cpp.Llama(n_ctx=PREFILL + DECODE, n_batch=PREFILL, n_ubatch=PREFILL, logits_all=False,
                          flash_attn=FLASH_ATTN, **common)
    vocab = llm.n_vocab()

    def last() -> int:
        return int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(vocab,))))

    prompt = wins[0][:PREFILL]
    llm.eval(prompt[:8])  # warm-up (first-call allocations), then timed from an empty cache
    llm.reset()
    t = time.perf_counter()
    llm.eval(prompt)
    prefill = len(prompt) / (time.perf_counter() - t)
    tok = last()
    t = time.perf_counter()
    for _ in range(DECODE):
        llm.eval([tok])
        tok = last()
    decode = DECODE / (time.perf_counter() - t)
    llm.close()
    return out | {"prefill_tok_s": prefill, "decode_tok_s": decode}


def ppl_one(common: dict, wins: list[list[int]], scored: list[int]) -> dict:
    """llama.cpp's perplexity on the windows, from its logits at every position (``logits_all``)."""
    import llama_cpp
    import numpy as np

    llm = llama_cpp.Llama(n_ctx=SEQLEN, n_batch=SEQLEN, n_ubatch=SEQLEN, logits_all=True, **common)
    nll, n = 0.0, 0
    for w, k in zip(wins, scored):
        llm.reset()
        llm.eval(w)
        logits = np.asarray(llm.scores[:len(w)], dtype=np.float64)
        lp = logits - logits.max(-1, keepdims=True)
        lp = lp - np.log(np.exp(lp).sum(-1, keepdims=True))
        T = len(w)
        rows = np.arange(T - 1 - k, T - 1)  # the positions predicting the window's last k tokens
        nll -= float(lp[rows, np.asarray(w)[rows + 1]].sum())
        n += k
    llm.close()
    return {"ppl": math.exp(nll / n), "scored_tokens": n}


def arch_of(path: Path) -> str:
    import gguf

    return gguf.GGUFReader(str(path)).fields["general.architecture"].contents()


def f16_matrices(path: Path) -> int:
    """Matrices the exporter stored as f16 in a q8_0 file (rows not a multiple of 32: pruned FFN widths)."""
    import gguf

    return sum(1 for t in gguf.GGUFReader(str(path)).tensors
               if len(t.shape) == 2 and t.tensor_type == gguf.GGMLQuantizationType.F16)


def measure(repeats: int, only: list[str] | None = None, types: tuple[str, ...] = TYPES) -> None:
    """``only``: measure these rows (dense is measured beside them in every round for the ratios, and its JSONL
    row is kept unless it is named); a row that finished later is measured without redoing the others."""
    import llama_cpp

    from secateur.runinfo import machine


    wins, scored, protocol = windows()
    rows = [r for r in ROWS if only is None or r in only or r == "dense"]
    todo = [(r, t) for r in rows for t in types if gguf_path(r, t).exists()]
    blob = WORK / "llamacpp-windows.json"
    blob.write_text(json.dumps({"wins": wins, "scored": scored}))
    rounds: list[dict] = []
    for rep in range(repeats):
        order = todo[rep % len(todo):] + todo[:rep % len(todo)]  # rotated: no model always runs first
        res = {}
        for row, typ in order:
            out = subprocess.run([sys.executable, __file__, "--child", str(gguf_path(row, typ)), str(blob),
                                  str(int(rep == 0))],
                                 capture_output=True, text=True, check=True)
            res[f"{row}|{typ}"] = json.loads(out.stdout.strip().splitlines()[-1])
        rounds.append(res)
    for row, typ in todo:
        if only is not None and row not in only:
            continue
        key = f"{row}|{typ}"
        per = [r[key] for r in rounds]
        dense = [r[f"dense|{typ}"] for r in rounds]
        hf = json.loads((OUT / f"{row}.hf-ppl.json").read_text())
        append_row(JSONL, {
            "key": key, "row": row, "type": typ, "args": ROWS[row], "file_bytes": gguf_path(row, typ).stat().st_size,
            "ppl_llamacpp": per[0]["ppl"], "ppl_hf": hf["ppl"], "protocol": protocol, "windows": len(wins),
            "prefill_tok_s": statistics.median(p["prefill_tok_s"] for p in per),
            "decode_tok_s": statistics.median(p["decode_tok_s"] for p in per),
            "prefill_vs_dense": statistics.median(p["prefill_tok_s"] / d["prefill_tok_s"] for p, d in zip(per, dense)),
            "decode_vs_dense": statistics.median(p["decode_tok_s"] / d["decode_tok_s"] for p, d in zip(per, dense)),
            "repeats": repeats, "threads": THREADS, "flash_attn": FLASH_ATTN, "arch": arch_of(gguf_path(row, typ)),
            "f16_matrices": f16_matrices(gguf_path(row, typ)) if typ != "f16" else None,
            "llama_cpp_python": llama_cpp.__version__,
            "loadavg_1m": os.getloadavg()[0], "cpu": machine()["cpu"],
            "extra_bufts": os.environ.get("SECATEUR_LLAMACPP_NO_EXTRA_BUFTS") != "1",
        }, unique_key=True)


def render() -> None:
    rows = read_rows(JSONL)
    L = ["# SmolLM2-135M pruned by secateur, run by llama.cpp", "",
         "Produced by `bench/speed/llamacpp_smollm2.py` (protocol in its docstring). Perplexity: WikiText-2 test, "
         f"`{rows[0]['protocol'] if rows else '-'}`, first {WINDOWS} windows, llama.cpp's logits beside "
         "`secateur eval ppl` on the HF folder. Speed: prefill 512 tokens and decode 64 tokens at 2 threads, each "
         "model in its own process, rounds alternated, median over rounds; ratio to dense within each round.", "",
         "| row | arch | type | file MB | ppl llama.cpp | ppl HF (f32) | prefill tok/s | x dense | decode tok/s "
         "| x dense |",
         "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        typ = r["type"] + (f" ({r['f16_matrices']} f16)" if r.get("f16_matrices") else "")
        L.append(f"| {r['row']} | {r.get('arch', '-')} | {typ} | {r['file_bytes'] / 1e6:.1f} | "
                 f"{fmt(r['ppl_llamacpp'])} | "
                 f"{fmt(r['ppl_hf'])} | {fmt(r['prefill_tok_s'], 0)} | {fmt(r['prefill_vs_dense'])} | "
                 f"{fmt(r['decode_tok_s'], 1)} | {fmt(r['decode_vs_dense'])} |")
    if rows:
        L += ["", f"llama-cpp-python {rows[0]['llama_cpp_python']}, {rows[0]['repeats']} rounds, flash attention "
              f"{'on' if rows[0].get('flash_attn') else 'off'} for the speed runs; machine: 2 cores shared with other "
              f"work, 1-minute load average {min(r['loadavg_1m'] for r in rows):.1f}-"
              f"{max(r['loadavg_1m'] for r in rows):.1f} during the runs"
              + (": the speed columns are dominated by that contention and should be re-measured on an idle machine"
                 if max(r["loadavg_1m"] for r in rows) > 3.0 else
                 " (the measurement's own 2 threads: every other job was paused)")
              + "; the perplexity columns are deterministic. "
              "`q8_0 (n f16)`: n matrices stay f16 because their rows "
              "(pruned FFN widths) are not a multiple of q8_0's block of 32."]
        cpus = {r.get("cpu") or "AMD EPYC (2 cores)" for r in rows}
        if len(cpus) > 1:  # rows measured on other machines: their ratios come from a dense run on the same machine
            L += ["", "Machines: " + "; ".join(
                f"{', '.join(r['row'] + ' ' + r['type'] for r in rows if (r.get('cpu') or 'AMD EPYC (2 cores)') == c)}"
                f" on {c}" for c in sorted(cpus)) + ". Tokens/s compare only within a machine; each `x dense` is "
                "against dense measured in the same rounds on that machine. llama-cpp-python built on that Xeon "
                "(AVX-512, AMX) dies with SIGSEGV on any q8_0 file, dense included (llama.cpp's AMX int8 matmul: "
                "ggml-org/llama.cpp#20824, open, machine-dependent); its q8_0 rows (dense beside them) were measured "
                "with the model's `use_extra_bufts` off (`SECATEUR_LLAMACPP_NO_EXTRA_BUFTS=1`: weights in plain CPU "
                "buffers, no AMX)."]
    MD.write_text("\n".join(L) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prepare", action="store_true")
    ap.add_argument("--measure", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    # llama-cpp-python 0.3.36 built on an AMX Xeon (Sapphire Rapids) dies with SIGSEGV loading any q8_0 file here
    ap.add_argument("--types", default=",".join(TYPES), help="comma-separated GGUF types to measure")
    ap.add_argument("--rows", default=None, help="comma-separated rows to prepare or measure (default: all)")
    ap.add_argument("--render", action="store_true")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        blob = json.loads(Path(a.child[1]).read_text())
        print(json.dumps(measure_one(Path(a.child[0]), blob["wins"], blob["scored"], a.child[2] == "1")))
        return
    if a.prepare:
        prepare(a.rows.split(",") if a.rows else None)
    if a.measure:
        measure(a.repeats, a.rows.split(",") if a.rows else None, tuple(a.types.split(",")))
    render()


if __name__ == "__main__":
    main()
