"""Structured pruning on SmolLM2-135M (issue 5): every selection score without compensation, FLAP with its
bias, at 10/20/30/40%; WikiText-2 perplexity, parameter count, measured efficiency of the sliced model.

    nice -n 5 python bench/quality/structured_smollm2.py            # every row (resumes: rows already done are kept)
    python bench/quality/structured_smollm2.py --render              # rebuild results/text/structured-smollm2.md

Protocol (preset below, the same for every row): calibration = WikiText-2 *validation* text (COEC and
FLAP calibrate on WikiText-2; the local data has no train split), 32 random windows of 2048 tokens, seed 0;
one dense engine pass collects the o_proj / down_proj input statistics (``sumsq``, ``meanvar`` and the
Gram) and ShortGPT's block influence; they are cached in ``bench/_work`` and reused by every row and
sparsity (a structured selection from a dense pass does not depend on the sparsity). Units: whole KV
groups (SmolLM2: 3 per layer, 3 query heads each) and MLP channels (1536 per layer), uniform ratio per
layer, ``ceil((1 - rho) n)`` kept (COEC). Perplexity: non-overlapping 2048-token windows, the first
``windows`` of WikiText-2 test (and C4 validation where a row asks for it).

The machinery here (stats cache, row cache, row runner) is shared with ``bench/quality/compensation_smollm2.py``.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: bench.* imports
from bench.common import (
    WORK,
    append_row,
    find_dense_ppl,
    find_dense_zeroshot,
    fmt,
    fmt_zs,
    read_rows,
    results_dir,
    row_sink,
    zeroshot_cell,
)

# Named protocols; STRUCT_PRESET picks one (the sweep tables use the quick one, the main rows the full one).
QUICK = "quick-wt2v16-w2"
PRESETS = {
    QUICK: {"name": QUICK, "calib": "wikitext2", "nsamples": 16, "seqlen": 2048, "seed": 0, "eval_seqlen": 2048,
            "windows": 2},
    # COEC's protocol: 128 x 2048 WikiText-2 calibration (validation text here), every test window
    "full": {"name": "full", "calib": "wikitext2", "nsamples": 128, "seqlen": 2048, "seed": 0, "eval_seqlen": 2048,
             "windows": None},
}
PRESET = PRESETS[os.environ.get("STRUCT_PRESET", QUICK)]
SPARSITIES = (0.1, 0.2, 0.3, 0.4)
# one row cache file per writing script (two scripts may run at once); every script reads all of them
ROW_CACHE = WORK / f"structured-rows-{PRESET['name']}-structured.jsonl"
STATS_PATH = WORK / (f"structured-stats-{PRESET['calib']}-{PRESET['nsamples']}x{PRESET['seqlen']}-"
                     f"seed{PRESET['seed']}.pt")
OUT_JSON = results_dir("text") / "structured-smollm2.jsonl"
OUT_MD = results_dir("text") / "structured-smollm2.md"
SELECTIONS_5 = ("wanda-sp", "flap", "rcpu", "magnitude-sp", "random", "shortgpt")
FULL_ROWS = (("wanda-sp", "none", 0.3),)  # the main row at the full protocol (COEC's headline sparsity)
FULL_DATASETS = ("wikitext2", "c4")  # COEC Table 1 columns, for the main rows of both benches


# --- shared machinery -----------------------------------------------------------------------------------

class Bench:
    """Dense model, calibration ids, cached statistics and evaluation ids, loaded once per process."""

    def __init__(self) -> None:
        from secateur.models.adapters import get_adapter
        from secateur.models.loading import load_model

        torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))  # 1 when two benches share 2 cores
        self.model, self.tok = load_model("smollm2-135m")
        self.model.eval()
        self.adapter = get_adapter(self.model)
        self.dense_state = {k: v.clone() for k, v in self.model.state_dict().items()}
        self.ids, self.manifest = calib_ids(self.tok)
        self._stats = None
        self._eval: dict[str, torch.Tensor] = {}

    @property
    def stats(self):
        if self._stats is None:
            self._stats = load_or_collect_stats(self)
        return self._stats

    def eval_ids(self, dataset: str) -> torch.Tensor:
        if dataset not in self._eval:
            from secateur.data.sources import eval_text
            from secateur.data.windows import eval_ids

            self._eval[dataset] = eval_ids(eval_text(dataset), self.tok)
        return self._eval[dataset]

    def fresh(self):
        """A dense copy of the model (the cached dense weights, so no reload)."""
        from secateur.models.adapters import get_adapter

        m = copy.deepcopy(self.model)
        m.load_state_dict(self.dense_state)
        return m, get_adapter(m)


def calib_ids(tok):
    from secateur.data.windows import calibration_set

    WORK.mkdir(parents=True, exist_ok=True)
    p = PRESET
    path = WORK / f"calib-{p['calib']}-{p['nsamples']}x{p['seqlen']}-seed{p['seed']}.pt"
    if path.exists():
        blob = torch.load(path)
        return blob["ids"], blob["manifest"]
    ids, man = calibration_set(p["calib"], tok, p["nsamples"], p["seqlen"], p["seed"])
    torch.save({"ids": ids, "manifest": man.to_dict()}, path)
    return ids, man.to_dict()


def load_or_collect_stats(b: Bench):
    """Dense statistics for every row (cached on disk: ~0.7 GB for SmolLM2's Grams)."""
    from secateur.calib.collect import collect_stats
    from secateur.methods.structured import add_block_influence

    if STATS_PATH.exists():
        blob = torch.load(STATS_PATH, weights_only=False)
        if blob["calib_sha256"] == b.manifest["sha256"]:
            return blob["stats"]
    print("collecting dense statistics (one engine pass + block influence)...", flush=True)
    # ShortGPT's block influence (one more dense forward) only for the sweep preset: the full one runs no ShortGPT row
    st = collect_stats(b.model, b.adapter, b.ids, ("sumsq", "meanvar", "gram"), chunk_size=4, progress=True)
    if PRESET["name"] == QUICK:
        add_block_influence(st, b.model, b.adapter, b.ids, chunk_size=4)
    torch.save({"calib_sha256": b.manifest["sha256"], "stats": st}, STATS_PATH)
    return st


def dense_forward_seconds(b: Bench, n: int = 4) -> float:
    """One dense forward of the calibration set through the decoder (blocks + final norm, no lm_head),
    timed on the first ``n`` sequences and scaled linearly to all of them (the machine is shared and slow)."""
    with torch.no_grad():
        t = time.perf_counter()
        b.model.base_model(input_ids=b.ids[:n], use_cache=False)
    return (time.perf_counter() - t) * b.ids.shape[0] / n


CACHE_FILE = [ROW_CACHE]  # compensation_smollm2.py points this at its own file


def row_key(method: str, comp: str, rho: float, extra: dict | None = None, preset: str | None = None) -> str:
    """Row identity; rows of a preset other than the quick one carry its name (they share the results files)."""
    tail = ",".join(f"{k}={v}" for k, v in sorted((extra or {}).items()))
    preset = preset or PRESET["name"]
    suffix = "" if preset == QUICK else f"|preset={preset}"
    return f"{method}|{comp}|{rho:.2f}" + (f"|{tail}" if tail else "") + suffix


def ppl(b: Bench, model, dataset: str) -> dict:
    from secateur.eval.ppl import perplexity

    r = perplexity(model, b.eval_ids(dataset), seqlen=PRESET["eval_seqlen"], max_windows=PRESET["windows"],
                   progress=False)
    return {k: r[k] for k in ("ppl", "protocol", "windows", "windows_total", "scored_tokens", "seconds")}


def cached_rows() -> dict[str, dict]:
    out: dict[str, dict] = {}
    for f in sorted(WORK.glob(f"structured-rows-{PRESET['name']}-*.jsonl")):
        for r in read_rows(f):
            old = out.get(r["key"])
            if old is None or len(r["ppl"]) + bool(r.get("zeroshot")) >= len(old["ppl"]) + bool(
                    old.get("zeroshot")):
                out[r["key"]] = r
    return out


def run_row(b: Bench, method: str, comp: str, rho: float, datasets: tuple[str, ...] = ("wikitext2",),
            extra: dict | None = None, key_extra: dict | None = None,
            cfg_extra: dict | None = None, zeroshot: bool = False) -> dict:
    """Prune a fresh dense copy with the structured pipeline, evaluate, cache the row (by key).

    ``extra``: StructuredConfig fields that also name the row; ``key_extra`` / ``cfg_extra`` separate the
    two (e.g. a COEC ablation stage names the row, its COECOptions configure it)."""
    key_extra = key_extra if key_extra is not None else extra
    cfg_kw = cfg_extra if cfg_extra is not None else (extra or {})
    from secateur.data.windows import token_sha256
    from secateur.eval.efficiency import count_params
    from secateur.methods.structured import SELECTIONS, StructuredConfig, prune_structured
    from secateur.runinfo import machine, versions

    key = row_key(method, comp, rho, key_extra)
    have = cached_rows().get(key)
    if have and all(d in have["ppl"] for d in datasets) and (not zeroshot or have.get("zeroshot")):
        return have
    rec = have or {"key": key, "method": method, "compensation": comp, "sparsity": rho, "extra": key_extra or {},
                   "preset": PRESET, "calibration": b.manifest, "ppl": {}}
    model, adapter = b.fresh()
    if method == "dense":
        rec.update(params=count_params(model), realized=0.0, params_removed_fraction=0.0)
    else:
        cfg = StructuredConfig(score=SELECTIONS[method], sparsity=rho, compensation=comp, **cfg_kw)
        t = time.perf_counter()
        res = prune_structured(model, adapter, b.ids, cfg, stats=b.stats)
        if not have:  # a cached row only lacking a dataset is rebuilt (deterministically) but not re-timed
            rec["prune_s"] = time.perf_counter() - t
            d = res.details
            rec.update(params=d["params_after"], realized=d["realized"], by_kind={
                k: {"removed_units": v["removed_units"], "units": v["units"], "realized": v["realized"]}
                for k, v in (d["by_kind"] or {}).items()}, removed_blocks=d["removed_blocks"],
                params_removed_fraction=d["params_removed_fraction"], compensation_s=d["compensation_seconds"],
                compensation_summary=d["compensation_summary"], timings=res.timings,
                per_layer=[{k: r.get(k) for k in ("layer", "group", "kept", "width", "recon_before",
                                                   "recon_after", "gcv_lambda_rel", "rounds", "seconds", "guard",
                                                   "fallback")} for r in d["per_layer"]])
    for d in datasets:
        if d not in rec["ppl"]:
            sha = token_sha256(b.eval_ids(d))
            reused = find_dense_ppl(d, f"nonoverlap-{PRESET['eval_seqlen']}", PRESET["windows"], sha) if (
                method == "dense") else None
            rec["ppl"][d] = reused or (ppl(b, model, d) | {"tokens_sha256": sha})
    if zeroshot and not rec.get("zeroshot"):  # the seven-task mean on the first ZS_LIMIT documents per task
        rec["zeroshot"] = (find_dense_zeroshot() if method == "dense" else None) or zeroshot_cell(model, b.tok)
    rec["versions"], rec["machine"] = versions(), machine()
    append_row(CACHE_FILE[0], rec)
    del model
    return rec


def dense_row(b: Bench, datasets=("wikitext2",), zeroshot=False) -> dict:
    rec = run_row(b, "dense", "none", 0.0, datasets, zeroshot=zeroshot)
    if "dense_forward_s" not in rec:
        rec["dense_forward_s"] = dense_forward_seconds(b)
        rec["stats_timings"] = b.stats.timings
        append_row(CACHE_FILE[0], rec)
    return rec


def preset_line(rows: list[dict]) -> str:
    p = PRESETS[QUICK]
    rows = [r for r in rows if r["preset"]["name"] == QUICK]
    sha = rows[0]["calibration"]["sha256"][:16] if rows else "?"
    ev = rows[0]["ppl"].get("wikitext2", {}) if rows else {}
    return (f"Preset `{p['name']}`: calibration WikiText-2 validation, {p['nsamples']} x {p['seqlen']} tokens, "
            f"seed {p['seed']} (token sha256 {sha}...); perplexity {ev.get('protocol', 'nonoverlap-2048')}, the "
            f"first {p['windows']} windows ({ev.get('scored_tokens', '?')} scored tokens) of WikiText-2 test"
            f" (and of C4 validation where shown). Every row below uses this preset.")


def full_section(rows: list[dict], datasets: tuple[str, ...]) -> list[str]:
    """The rows made at the full protocol (STRUCT_PRESET=full), as their own table."""
    full = [r for r in rows if r["preset"]["name"] == "full"]
    if not full:
        return []
    p = PRESETS["full"]
    ev = {d: next((r["ppl"][d] for r in full if d in r["ppl"]), {}) for d in datasets}
    calib = next((r["calibration"] for r in full), {})
    out = ["", "## Main rows at the full protocol", "",
           f"Preset `full` (`STRUCT_PRESET=full`): calibration WikiText-2 validation, {p['nsamples']} x "
           f"{p['seqlen']} tokens, seed {p['seed']} (token sha256 {calib.get('sha256', '?')[:16]}...); perplexity "
           f"{ev['wikitext2'].get('protocol', 'nonoverlap-2048')} over every window of each corpus ("
           + ", ".join(f"{d}: {e.get('windows_total', '?')} windows, {e.get('scored_tokens', '?')} scored tokens"
                       for d, e in ev.items()) + "). "
           "Dense evaluations are reused from another bench when protocol, windows and corpus token hash match "
           "(the source is named in the JSONL, `reused_from`).", "",
           "| sparsity | selection | compensation | realized | params (M) | " + " | ".join(
               {"wikitext2": "WikiText-2", "c4": "C4"}[d] for d in datasets) + " | zero-shot mean (first "
           "100 docs/task) | prune + comp. s |",
           "|---:|---|---|---:|---:|" + "---:|" * len(datasets) + "---:|---:|"]
    for r in sorted(full, key=lambda r: (r["sparsity"], r["method"] != "dense", r["method"], r["compensation"])):
        cells = " | ".join(fmt(r["ppl"][d]["ppl"], 2) if d in r["ppl"] else "-" for d in datasets)
        out.append(f"| {r['sparsity']:.0%} | {r['method']} | {r['compensation']} | {r.get('realized', 0):.1%} | "
                   f"{r['params'] / 1e6:.2f} | {cells} | {fmt_zs(r.get('zeroshot'))} | {fmt(r.get('prune_s'), 1)} |")
    return out


def machine_line(rows: list[dict]) -> str:
    v = rows[0]["versions"] if rows else {}
    m = rows[0]["machine"] if rows else {}
    return (f"Versions: {json.dumps(v)}. Machine: {m.get('cpu')}, {m.get('cores')} cores shared with other jobs "
            "(load average 10-15 during the runs: this job got a small fraction of a core), "
            f"{m.get('torch_threads')} torch threads, no GPU; times are "
            "indicative.")


# --- issue 5 -----------------------------------------------------------------------------------------------

def rows_5() -> list[tuple[str, str, float]]:
    out = []
    for rho in SPARSITIES:
        for m in SELECTIONS_5:
            out.append((m, "none", rho))
        out.append(("flap", "bias", rho))
    return out


def render() -> None:
    rows = read_rows(OUT_JSON)
    by = {r["key"]: r for r in rows}
    dense = by.get(row_key("dense", "none", 0.0, preset=QUICK))
    lines = ["# Structured pruning on SmolLM2-135M: selection scores without compensation", "",
             "Made by `nice -n 5 python bench/quality/structured_smollm2.py` (rows in `structured-smollm2.jsonl`).", "",
             preset_line(rows), "",
             "Pipeline: `secateur.methods.structured` (= `secateur prune --structured --method M --compensation "
             "none|bias`): one dense calibration pass -> unit scores -> uniform allocation (keep "
             "`ceil((1 - rho) n)` KV groups and MLP channels in every layer) -> physical slicing. ShortGPT "
             "removes `round(rho * 30)` whole blocks of lowest block influence instead. Sparsity = fraction of "
             "the removable projection parameters (KV groups with their query heads + MLP channels).", "",
             "**SmolLM2 has only 3 KV groups per layer**: at 10%, 20% and 30% `ceil(0.9 * 3) = ceil(0.8 * 3) = "
             "ceil(0.7 * 3) = 3` groups are kept (no attention pruned; only MLP channels go, so the realized "
             "fraction of the removable parameters is below the target, e.g. 22.5% at 30%), at 40% 2 of 3 groups "
             "are kept (realized 38.3%). The realized column shows what was removed.",
             "", "| sparsity | selection | compensation | WikiText-2 ppl | params (M) | params removed | "
             "realized (of removable) | KV groups removed | MLP channels removed | prune s |",
             "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    if dense:
        lines.append(f"| 0% | dense | - | {fmt(dense['ppl']['wikitext2']['ppl'], 2)} | "
                     f"{dense['params'] / 1e6:.2f} | 0 | 0 | 0 | 0 | - |")
    for rho in SPARSITIES:
        for m, c, _rho in [r for r in rows_5() if r[2] == rho]:
            r = by.get(row_key(m, c, rho, preset=QUICK))
            if r is None:
                lines.append(f"| {rho:.0%} | {m} | {c} | (not run) | | | | | | |")
                continue
            bk = r.get("by_kind") or {}
            kv = bk.get("kv_group", {})
            ch = bk.get("channel", {})
            blk = f" ({len(r['removed_blocks'])} blocks)" if r.get("removed_blocks") else ""
            lines.append(
                f"| {rho:.0%} | {m}{blk} | {c} | {fmt(r['ppl']['wikitext2']['ppl'], 2)} | {r['params'] / 1e6:.2f} | "
                f"{r['params_removed_fraction']:.1%} | {r['realized']:.1%} | "
                f"{kv.get('removed_units', '-')}/{kv.get('units', '-')} | "
                f"{ch.get('removed_units', '-')}/{ch.get('units', '-')} | {fmt(r.get('prune_s'), 1)} |")
    from bench.speed.efficiency_table import table as efficiency_table  # measured in fresh processes, quiet machine

    lines += efficiency_table()
    lines += full_section(rows, FULL_DATASETS)
    lines += ["", "Notes: all scores are computed from the same dense statistics; `random` uses seed 0; FLAP uses "
              "its WIFV score with the uniform (COEC) allocation here (FLAP's own global AL-AM allocation is "
              "`--allocation flap-global`); `flap | bias` adds FLAP's mean-replacement bias `W[:, P] mu_P` to "
              "o_proj / down_proj. Reproduce one row: `secateur prune --model smollm2-135m --structured --method "
              "wanda-sp --sparsity 0.3 --calib wikitext2 --nsamples 16 --seqlen 2048 --out out/wsp30` then "
              "`secateur eval ppl --model out/wsp30 --max-windows 2` and `secateur eval efficiency --model "
              "out/wsp30 --dense smollm2-135m`.", "", machine_line(rows), ""]
    OUT_MD.write_text("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--render", action="store_true")
    ap.add_argument("--stats-only", action="store_true")
    a = ap.parse_args()
    if a.render:
        return render()
    b = Bench()
    _ = b.stats
    if a.stats_only:
        return
    emit = row_sink(OUT_JSON, render, lambda rec: f"{rec['key']}: wt2 {rec['ppl']['wikitext2']['ppl']:.2f}")

    if PRESET["name"] == "full":  # the main row (and dense) at the paper's protocol
        emit(dense_row(b, FULL_DATASETS, zeroshot=True))
        for m, c, rho in FULL_ROWS:
            emit(run_row(b, m, c, rho, FULL_DATASETS, zeroshot=True))
        return
    emit(dense_row(b))
    # rows unique to this table first; wanda-sp/none and flap/bias are shared with compensation_smollm2.py
    shared = {("wanda-sp", "none"), ("flap", "bias")}
    order = sorted(rows_5(), key=lambda r: ((r[0], r[1]) in shared, [0.3, 0.4, 0.2, 0.1].index(r[2])))
    for m, c, rho in order:
        rec = run_row(b, m, c, rho)
        if not math.isfinite(rec["ppl"]["wikitext2"]["ppl"]):
            print(f"{rec['key']}: non-finite ppl", flush=True)
        emit(rec)


if __name__ == "__main__":
    main()
