"""Where a COEC call spends its time on one layer of a real model (issue 29 section 1, COEC half).

    python bench/speed/coec_layer_profile.py --model qwen2.5-0.5b --layers 12 --tag now
    python bench/speed/coec_layer_profile.py --render

Problem: the model's dense input statistics of ``o_proj`` and ``down_proj`` in the layers asked for (C4 calibration,
``--nsamples`` x ``--seqlen``, seed 0, the same token ids every bench uses: ``bench.common.calib_tokens``), captured
once by forward hooks and cached under bench/_work/. Kept columns: RCPU's 30% selection
(:func:`bench.speed.coec_speed.kept_columns`: the top 70% channels of ``down_proj`` by ``||W_j||^2 C_jj``, the
best KV groups of ``o_proj``). Each call is timed the way the structured pipeline makes it: ``coec(..., alpha=0.9)``
(tempering inside), paper defaults, one torch thread, under cProfile; the page lists the call's own stage timings
(tempering, setup, init, rounds) and the functions that own the time. Rows: results/speed/coec-profile.jsonl.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: bench.* imports
from bench.common import WORK, append_row, calib_tokens, model_path, read_rows, results_dir

OUT_JSON = results_dir("speed") / "coec-profile.jsonl"
OUT_MD = results_dir("speed") / "coec-profile.md"
ROLES = {"attn_out": "o", "mlp_out": "down"}


class _Done(Exception):
    """Raised by a hook after the last layer asked for: the rest of the forward is not needed."""


def _stop(*_) -> None:
    raise _Done


def capture(model_name: str, layers: list[int], nsamples: int, seqlen: int) -> dict:
    """Float64 input Grams of o_proj / down_proj in ``layers`` (dense model, one forward of the calibration set)."""
    from secateur.calib.stats import Gram
    from secateur.models.adapters import get_adapter
    from secateur.models.loading import load_model

    path = WORK / f"coec-profile-stats-{model_name}-{nsamples}x{seqlen}-L{'_'.join(map(str, layers))}.pt"
    if path.exists():
        return torch.load(path, weights_only=False)
    model, tok = load_model(model_path(model_name))
    ad = get_adapter(model)
    ids, _ = calib_tokens(tok, "c4", nsamples, seqlen)
    grams: dict = {}
    hooks = []
    for li in layers:
        refs = ad.role_refs(ad.layers[li])
        for group, role in ROLES.items():
            g = grams.setdefault(li, {})[group] = Gram(refs[role].weight.shape[1])
            hooks.append(refs[role].module.register_forward_pre_hook(lambda _m, a, g=g: g.update(a[0].detach())))
    last = max(layers)
    with torch.no_grad():
        for i in range(ids.shape[0]):
            h = ad.layers[last].register_forward_hook(_stop)
            try:
                model(ids[i : i + 1])
            except _Done:
                pass
            finally:
                h.remove()
    for h in hooks:
        h.remove()
    blob = {"grams": grams, "weights": {li: {group: ad.role_refs(ad.layers[li])[role].weight.detach().double().clone()
                                             for group, role in ROLES.items()} | {
        "v": ad.role_refs(ad.layers[li])["v"].weight.detach().double().clone()} for li in layers},
            "heads": (model.config.num_attention_heads, model.config.num_key_value_heads)}
    WORK.mkdir(parents=True, exist_ok=True)
    torch.save(blob, path)
    return blob


def profile(args) -> None:
    from bench.speed.coec_speed import kept_columns
    from secateur.compensate import InputStats, ValueProjection
    from secateur.compensate.coec import coec

    torch.set_num_threads(1)
    blob = capture(args.model, args.layers, args.nsamples, args.seqlen)
    n_heads, n_kv = blob["heads"]
    for li in args.layers:
        for group in args.groups:
            w0 = blob["weights"][li][group]
            st = InputStats.from_gram(blob["grams"][li][group])
            kept = kept_columns(group, w0, st.second_moment, n_heads, n_kv, 0.7)
            value = ValueProjection(blob["weights"][li]["v"], n_heads, n_kv) if group == "attn_out" else None
            pr = cProfile.Profile()
            t = time.perf_counter()
            pr.enable()
            out = coec(w0, st, kept, value=value, max_rounds=args.rounds)
            pr.disable()
            wall = time.perf_counter() - t
            s = io.StringIO()
            ps = pstats.Stats(pr, stream=s)
            top = sorted(((v[2], f"{Path(k[0]).name}:{k[2]}") for k, v in ps.stats.items()), reverse=True)[:12]
            d = out.diagnostics
            tm = d["timings"]
            row = {"key": f"{args.tag}/{args.model}/L{li}/{group}", "tag": args.tag, "model": args.model,
                   "layer": li, "group": group, "shape": list(w0.shape), "kept": int(len(kept)),
                   "calib": f"c4 {args.nsamples}x{args.seqlen}", "wall_s": round(wall, 2),
                   "tempering_s": round(tm["tempering_s"], 2), "setup_s": round(tm["setup_s"], 2),
                   "init_s": round(tm["init_s"], 2), "rounds": d["rounds"],
                   "rounds_s": round(sum(tm["rounds_s"]), 2), "right_s": round(sum(tm["right_s"]), 2),
                   "right_iters": d.get("right_iters"), "objective_before": d["objective_before"],
                   "objective_after": d["objective_after"], "recon_before": d["recon_before"],
                   "recon_after": d["recon_after"], "top_self_s": [[round(a, 2), b] for a, b in top],
                   "weight_sha": _sha(out.weight)}
            append_row(OUT_JSON, row)
            print(json.dumps({k: v for k, v in row.items() if k != "right_iters"}), flush=True)


def _sha(w: torch.Tensor) -> str:
    import hashlib

    return hashlib.sha256(w.contiguous().numpy().tobytes()).hexdigest()[:16]


def render() -> None:
    rows = read_rows(OUT_JSON)
    L = ["# COEC on one layer of a real model: where the time goes (issue 29)", "",
         "Made by `python bench/speed/coec_layer_profile.py` (protocol in its docstring; rows in "
         "`coec-profile.jsonl`). One torch thread, under cProfile; `load` is the 1-minute load average when the "
         "row was written.", "",
         "| tag | model | layer | group | shape / kept | wall s | tempering s | setup s | init s | rounds | rounds s "
         "| right solve s | L before -> after | recon (untempered) | load | commit |",
         "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|---|---|"]
    for r in rows:
        L.append(f"| {r['tag']} | {r['model']} | {r['layer']} | {r['group']} | {r['shape'][0]}x{r['shape'][1]} / "
                 f"{r['kept']} | {r['wall_s']} | {r['tempering_s']} | {r['setup_s']} | {r['init_s']} | {r['rounds']} "
                 f"| {r['rounds_s']} | {r['right_s']} | {r['objective_before']:.5g} -> {r['objective_after']:.5g} | "
                 f"{r['recon_before']:.4g} -> {r['recon_after']:.4g} | {r['load_avg_1_5_15'][0]} | `{r['commit']}` |")
    L += ["", "Functions that own the time (self seconds under cProfile), per row:", ""]
    for r in rows:
        L.append(f"- {r['tag']} L{r['layer']} {r['group']}: "
                 + ", ".join(f"{b} {a}" for a, b in r["top_self_s"][:8]))
    OUT_MD.write_text("\n".join(L) + "\n")
    print(f"wrote {OUT_MD}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--layers", type=lambda s: [int(x) for x in s.split(",")], default=[12])
    ap.add_argument("--groups", type=lambda s: s.split(","), default=["mlp_out", "attn_out"])
    ap.add_argument("--nsamples", type=int, default=8)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--tag", default="now")
    ap.add_argument("--render", action="store_true")
    args = ap.parse_args()
    if not args.render:
        profile(args)
    render()


if __name__ == "__main__":
    main()
