"""CoCurve bench, ``--dry-run``: a preset's plan and its cost in dense forward-tokens, from a forward timed here."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from bench.common import (
    read_rows,
    results_dir,
)
from bench.quality.cocurve import base as run
from bench.quality.cocurve.base import COMP_CALIB, PRESETS, config, corpora_ids, load
from bench.quality.cocurve.rows import _wants_full_ppl


def _eligible_units(cfg) -> tuple[int, int]:
    """(units, ablated units) of the run's model under the CoCurve inventory and guard, from a meta-device copy
    (no weights read)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from secateur.methods.cocurve import cocurve_inventory
    from secateur.models.adapters import get_adapter
    from secateur.models.loading import resolve

    path, extra = resolve(run.MODEL)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path, **extra))
    inv = cocurve_inventory(get_adapter(model), cfg.n_ffn_groups)
    prot = cfg.guard(0.0).protected(inv.n_layers)
    return len(inv), sum(int(li) not in prot for li in inv.layer_of.tolist())


def _measure_dense(T: int, ppl_len: int) -> dict:
    """Seconds per token of one dense forward on this machine now, 1 thread (what each stage's process uses),
    at the sweep's length ``T`` and the perplexity window ``ppl_len``; with the load average it ran under."""
    torch.set_num_threads(1)
    model, _ = load()
    vocab = model.config.vocab_size
    out = {"threads": 1, "load_before": round(os.getloadavg()[0], 2)}
    with torch.no_grad():
        for n in (T, ppl_len):
            ids = torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(0))
            model(ids[:, :64])  # warm-up
            ts = []
            for _ in range(2):
                t = time.perf_counter()
                model(ids)
                ts.append(time.perf_counter() - t)
            out[f"s_per_token_at_{n}"] = min(ts) / n
    out["load_after"] = round(os.getloadavg()[0], 2)
    return out


def dry_run(preset: str, rhos: list[float], methods: list[str], coec_methods: list[str], ranks: int = 2) -> dict:
    """The plan of a preset's run and its cost in dense forward-tokens (one token through the whole dense model),
    without running it: token counts, ablations, and a wall-time estimate from a dense forward measured here
    at the start (1 thread per process, the load named; the sweep split over ``ranks`` processes)."""
    p = PRESETS[preset]
    cfg = config(p)
    T, ng, nh, nt = p["seqlen"], p["n_graph"], p["n_heldout"], p.get("n_test", 0)
    n_units, n_abl_units = _eligible_units(cfg)
    cost = json.loads((results_dir("speed") / "cocurve-sweep-cost.json").read_text())
    ratio = cost["median"]["new"]["ratio"]  # one ablation / one dense forward of the same tokens (0.415)
    pl, ps, total_w, first_w, full_c = _ppl_windows(p)
    ppl_row = sum(first_w.values()) * pl
    ppl_full = sum(total_w[c] for c in full_c) * pl
    n_abl = n_abl_units * ng  # one block per sequence (seqs_per_block 1)
    rows = [("dense", 0.0)] + [(m, r) for r in rhos for m in methods]
    sweep, parts, ppl_parts = _token_costs(p, rhos, methods, coec_methods, rows, n_abl * ratio, ppl_row, ppl_full)
    zs_rows = [x for x in p.get("zs", [])]
    total = sum(sweep.values()) + sum(parts.values()) + sum(ppl_parts.values())
    rate = _measure_dense(T, pl)
    s_T, s_L = rate[f"s_per_token_at_{T}"], rate[f"s_per_token_at_{pl}"]
    wall, zs_cell_s, coec_solve_s = _wall_estimate(sweep, parts, ppl_parts, s_T, s_L, ranks, len(zs_rows),
                                                   len(rhos) * len(coec_methods))
    hours = sum(wall.values()) / 3600
    # the rows stage split over two processes (one per rho, --no-dense on the second), the sweep as above
    hours_2 = (wall["sweep_s"] + (sum(wall.values()) - wall["sweep_s"]) / 2) / 3600
    plan = {"preset": preset, "params": p, "rhos": rhos, "methods": methods, "coec_methods": coec_methods,
            "tokens": {"graph": f"{ng} x {T} = {ng * T}", "heldout_lambda": f"{nh} x {T} = {nh * T}",
                       "test": f"{nt} x {T} = {nt * T}",
                       "coec_grams": f"{COMP_CALIB['nsamples']} x {COMP_CALIB['seqlen']}" if coec_methods else None},
            "positions": {"per_sequence": p["positions"] or T, "total": ng * min(p["positions"] or T, T),
                          "stride": T // (p["positions"] or T)},
            "top_r": p["top_r"], "units": n_units, "ablated_units": n_abl_units,
            "ablations": f"{n_abl_units} x {ng} sequences = {n_abl}",
            "ablation_over_dense_forward": ratio,
            "perplexity_windows": {"first": first_w, "every_window": total_w, "context": pl, "stride": ps,
                                   "every_window_rows": [f"{m}@{r:g}" for m, r in rows
                                                         if _wants_full_ppl(p, m, r)],
                                   "every_window_corpora": full_c},
            "zeroshot_rows": zs_rows,
            "rows": len(rows) + (len(rhos) * len(coec_methods)),
            "cost_dense_forward_tokens": {k: round(v) for k, v in (sweep | parts | ppl_parts).items()}
            | {"total": round(total)},
            "cost_dense_forwards_of_T": round(total / T, 1),
            "measured_dense_forward": rate | {"cpu": _cpu_name()},
            "estimate_wall_s": {k: round(v) for k, v in wall.items()},
            "estimate_hours": round(hours, 2), "estimate_hours_rows_in_2_processes": round(hours_2, 2),
            "estimate_basis": f"dense forward measured now, 1 thread: {s_T * 1e3:.2f} ms/token at {T}, "
                              f"{s_L * 1e3:.2f} ms/token at {pl} (load {rate['load_before']} before); the sweep "
                              f"split over {ranks} processes (one per core), every other stage one process of 1 "
                              f"thread; zero-shot {zs_cell_s:.0f} s and a COEC solve {coec_solve_s:.0f} s per row "
                              "(the committed quick rows' medians)"}
    _report_plan(plan, preset, n_abl, ratio, T, len(rows), total, hours, hours_2, s_T, rate)
    return plan


def _ppl_windows(p: dict) -> tuple[int, int, dict, dict, list]:
    """(context, stride, every window per corpus, the rows' first windows per corpus, the corpora measured on
    every window) at the preset's perplexity protocol."""
    from secateur.eval.ppl import window_plan

    pl, ps = p.get("ppl_seqlen", 2048), p.get("ppl_stride", 512)
    if run.INPUTS:
        sizes = {k: int(v.numel()) for k, v in torch.load(run.INPUTS)["corpora"].items()}
    else:
        _, tok = load("cpu")
        sizes = {k: int(v.numel()) for k, v in corpora_ids(tok).items()}
    total_w = {c: len(window_plan(n, pl, ps)) for c, n in sizes.items()}
    first_w = {c: total_w[c] if p["ppl_windows"] is None else min(p["ppl_windows"], total_w[c]) for c in sizes}
    full_c = p.get("full_ppl_corpora") or list(sizes)
    return pl, ps, total_w, first_w, full_c


def _token_costs(p: dict, rhos, methods, coec_methods, rows, abl_forwards: float, ppl_row: int, ppl_full: int):
    """Dense forward-tokens by part: (sweep, rows and KL, perplexity); ``abl_forwards``: the ablations in dense
    forwards (ablations x their cost over a dense forward)."""
    from secateur.budgets.greedy import DEFAULT_LAMBDAS

    T, ng, nh, nt = p["seqlen"], p["n_graph"], p["n_heldout"], p.get("n_test", 0)
    sweep = {"sweep_dense": ng * T, "sweep_ablations": abl_forwards * T}
    parts: dict[str, float] = {"teachers": (nh + nt) * T}
    # at most one held-out pass per distinct mask: the grid's lambdas, or the breakpoint family's cap
    n_lam = len(DEFAULT_LAMBDAS) if p.get("family", "grid") == "grid" else p.get("max_candidates", 32)
    sel = ev = ppl = 0.0
    for m, r in rows:
        if m in ("cocurve", "cocurve-fixed"):
            sel += n_lam * nh * T  # at most one held-out pass per lambda (distinct masks only)
        elif m != "dense":
            sel += nh * T
        ev += nt * T
        ppl += ppl_row + (ppl_full if _wants_full_ppl(p, m, r) else 0)
    if {"wanda_sp", "flap"} & set(methods):
        parts["baseline_statistics"] = ng * T
    parts |= {"selection_heldout_kl": sel, "test_kl": ev}
    ppl_parts = {"perplexity": ppl}
    if coec_methods:
        c = COMP_CALIB
        n_coec = len(rhos) * len(coec_methods)
        parts["coec_grams"] = c["nsamples"] * c["seqlen"] + ng * T
        parts["coec_rows_eval"] = n_coec * (nh + nt) * T
        ppl_parts["coec_rows_perplexity"] = n_coec * ppl_row
    return sweep, parts, ppl_parts


def _wall_estimate(sweep, parts, ppl_parts, s_T: float, s_L: float, ranks: int, n_zs: int, n_coec: int):
    """Wall seconds by part from the measured dense rate, zero-shot cells and COEC solves at the committed
    quick rows' medians: (wall, zero-shot cell s, COEC solve s)."""
    quick_zs = [r["zeroshot"]["seconds"] for r in read_rows(run.OUT_JSON) if r.get("zeroshot")]
    zs_cell_s = sorted(quick_zs)[len(quick_zs) // 2] if quick_zs else 100.0
    quick_coec = [r["compensation_s"] for r in read_rows(run.OUT_JSON) if "coec_rounds" in r and "compensation_s" in r]
    coec_solve_s = sorted(quick_coec)[len(quick_coec) // 2] if quick_coec else 0.0
    wall = {"sweep_s": sum(sweep.values()) * s_T / max(ranks, 1), "rows_and_kl_s": sum(parts.values()) * s_T,
            "perplexity_s": sum(ppl_parts.values()) * s_L, "zeroshot_s": n_zs * zs_cell_s,
            "coec_solves_s": n_coec * coec_solve_s}
    return wall, zs_cell_s, coec_solve_s


def _report_plan(plan: dict, preset: str, n_abl: int, ratio: float, T: int, n_rows: int, total: float,
                 hours: float, hours_2: float, s_T: float, rate: dict) -> None:
    """Print the plan and its one-line summary; write results/text/cocurve-smollm2-{preset}-plan.json."""
    print(json.dumps(plan, indent=1), flush=True)
    (run.RESULTS_DIR / f"cocurve-smollm2-{preset}-plan.json").write_text(json.dumps(plan, indent=1) + "\n")
    print(f"{preset}: {n_abl} ablations x {ratio:.3f} = {n_abl * ratio:.0f} dense forwards of {T} tokens for the "
          f"sweep; {n_rows} rows + {plan['rows'] - n_rows} COEC rows; total {total / 1e6:.2f} M dense "
          f"forward-tokens = {total / T:.0f} forwards of {T} tokens; about {hours:.1f} h here, {hours_2:.1f} h with "
          f"the rows in 2 processes "
          f"({s_T * 1e3:.2f} ms/token at {T} measured now on 1 thread, load {rate['load_before']})", flush=True)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"
