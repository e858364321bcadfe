"""Per-tower pruning of the assembled VLM (issue 47 §4, first slice): ``results/vlm/cocurve-vlm.md`` (+ ``.jsonl``).

The VLM of ``bench/tools/train_vlm.py`` (SigLIP-shaped vision tower + SmolLM2-135M + trained projector) pruned one
tower at a time with ``secateur prune --towers``: the language tower calibrated on image-caption pairs
(``--calib fashion-mnist-captions``, train split, seed 0), the vision tower on Fashion-MNIST train images; every
output scored by ``secateur eval captions`` on the same test images (seed-0 draw). Methods whose allocation is
uniform across layers (Wanda-sp, magnitude-sp, random; unstructured Wanda) save as a stock LLaVA; per-layer
allocations (FLAP, CORP, CoCurve) cannot be expressed in a stock VLM config yet and are refused in one line (named
in the page).

Joint rows (``secateur prune --towers joint``, :mod:`secateur.vlm_joint`): CoCurve, CoCurve-diag, Wanda-sp, FLAP and
magnitude-sp at 20% and 30% with ONE budget over both towers' units (CoCurve: one teacher-KL graph over both towers,
caption tokens only, the last 16 of the 64 + 16 pairs choose lambda), each followed by its language-only control at
matched parameters (``--towers joint:language`` at :func:`secateur.vlm_joint.matched_ratio` of the joint row: the
same count of parameters removed, within one unit); each row records where the budget went (fraction of each tower)
and the caption-token teacher KL on 16 held-out test pairs beside the caption scores. One sweep serves every CoCurve
row (the first keeps its joint graph beside the VLM, ``fmnist-llava-joint-graph.npz``; the others reuse it, the
language-only rows its language block). They run when the assembled VLM exists and are skipped with a message
otherwise.

    python bench/quality/vlm_towers.py              # every row not yet recorded (resumable row by row)
    python bench/quality/vlm_towers.py --render     # the page from the recorded rows
    python bench/quality/vlm_towers.py --tiny       # the joint path end to end on a tiny random VLM (no files)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "src"))

from bench.common import append_row, read_rows, results_dir, stamped  # noqa: E402

OUT = results_dir("vlm") / "cocurve-vlm.jsonl"
PAGE = results_dir("vlm") / "cocurve-vlm.md"
#: key -> (tower, method, sparsity); the language rows calibrate on caption pairs, the vision rows on images
ROWS = {f"{t}-{m}-{int(100 * s)}": (t, m, s) for s in (0.2, 0.3, 0.5) for t, m in (
    ("language", "wanda-sp"), ("language", "magnitude-sp"), ("vision", "wanda-sp"), ("language", "wanda"))}
# both towers in one run (vision first), unstructured so every ratio saves: against language-only rows above
ROWS |= {"both-wanda-30": ("vision=0.3,language=0.3", "wanda", 0.3),
         "both-wanda-50": ("vision=0.5,language=0.5", "wanda", 0.5)}
REFUSED = {"language-flap-30": ("language", "flap", 0.3), "vision-corp-30": ("vision", "corp", 0.3)}
#: one budget over both towers (key -> method, sparsity); each is followed by its language-only row at matched params
JOINT_METHODS = ("cocurve", "cocurve-diag", "wanda-sp", "flap", "magnitude-sp")
JOINT = {f"joint-{m}-{int(100 * s)}": (m, s) for s in (0.2, 0.3) for m in JOINT_METHODS}
HELDOUT_PAIRS = 16  # caption pairs of the test split for the teacher KL (seed 0)


def cache() -> Path:
    return Path(os.environ.get("SECATEUR_CACHE", Path.home() / ".cache" / "secateur")) / "vision" / "fmnist-llava"


def _load() -> list[float]:
    return [round(v, 2) for v in os.getloadavg()]


def prune_row(key: str, tower: str, method: str, s: float, nsamples: int, images: int) -> dict:
    from secateur import api
    from secateur.errors import SecateurError
    from secateur.eval.captions import eval_captions

    calib = "fashion-mnist" if tower == "vision" else "fashion-mnist-captions"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out"
        t = time.perf_counter()
        try:
            res = api.prune(model=str(cache()), towers=tower, method=method, sparsity=s, calib=calib,
                            nsamples=nsamples, out=str(out), quiet=True)
        except SecateurError as e:
            return stamped({"key": key, "tower": tower, "method": method, "sparsity": s, "refused": str(e),
                            "load_avg_1_5_15": _load()})
        wall = time.perf_counter() - t
        params = sum(p.numel() for p in res.model.parameters())
        ev = eval_captions(str(out), max_images=images)
    return stamped({"key": key, "tower": tower, "method": method, "sparsity": s, "calib": calib,
                    "nsamples": nsamples, "params": params, "prune_s": round(wall, 1),
                    "eval": {k: v for k, v in ev.items() if k != "images_manifest"}, "load_avg_1_5_15": _load(),
                    "threads": __import__("torch").get_num_threads()})


def heldout_teacher(model: str | Path, n: int = HELDOUT_PAIRS):
    """The dense VLM's caption-token teacher on ``n`` test-split pairs (:class:`secateur.vlm_joint.CaptionKL`)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from secateur.data.captions import caption_pairs, caption_target
    from secateur.vlm_joint import CaptionData, CaptionKL

    dense = AutoModelForImageTextToText.from_pretrained(model).eval()
    proc = AutoProcessor.from_pretrained(model)
    ids, px, _ = caption_pairs(dense, proc, n, 0, split="test")
    return CaptionKL(dense, CaptionData(ids, px, caption_target(proc.tokenizer, dense.config, ids)))


def joint_row(key: str, model: str | Path, spec: str, method: str, s: float, nsamples: int, images: int, teacher,
              keep_graph: Path | None = None, **knobs) -> dict:
    """One ``--towers joint`` (or ``joint:language``) row: prune, save, reload, score captions and held-out KL;
    ``keep_graph``: where to keep a CoCurve run's joint graph for the next CoCurve rows."""
    from transformers import AutoModelForImageTextToText

    from secateur import api
    from secateur.errors import SecateurError
    from secateur.eval.captions import eval_captions

    base = {"key": key, "joint": True, "towers": spec, "method": method, "sparsity": s}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out"
        t = time.perf_counter()
        try:
            res = api.prune(model=str(model), towers=spec, method=method, sparsity=s,
                            calib="fashion-mnist-captions", nsamples=nsamples, out=str(out), quiet=True, **knobs)
        except SecateurError as e:
            return stamped(base | {"refused": str(e), "load_avg_1_5_15": _load()})
        wall = time.perf_counter() - t
        rep = res.report
        if keep_graph is not None and (out / "cocurve_graph.npz").exists():
            import shutil

            keep_graph.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(out / "cocurve_graph.npz", keep_graph)
        ev = eval_captions(str(out), max_images=images)
        kl = teacher.evaluate(AutoModelForImageTextToText.from_pretrained(out).eval())
    d = rep["details"]
    return stamped(base | {"calib": "fashion-mnist-captions", "nsamples": nsamples, "knobs": knobs,
                           "params": rep["vlm"]["params_after"], "budget": rep["vlm"]["budget"],
                           "routes": rep["vlm"]["routes"], "lambda": d.get("lambda"),
                           "cross_tower_edges": d.get("cross_tower_edges"), "prune_s": round(wall, 1),
                           "heldout_kl": kl["kl"], "heldout_kl_se": kl["se"], "heldout_pairs": len(kl["per_sequence"]),
                           "eval": {k: v for k, v in ev.items() if k != "images_manifest"},
                           "load_avg_1_5_15": _load(), "threads": __import__("torch").get_num_threads()})


def joint_rows(model: str | Path, done: set[str], nsamples: int, images: int, teacher, keys: dict | None = None,
               graph: Path | None = None, **cocurve_knobs):
    """Each joint row not in ``done``, then its language-only row at matched parameters (yields the rows);
    ``cocurve_knobs`` go to the CoCurve runs only. ``graph``: the first CoCurve run's joint graph is kept there and
    every later CoCurve run (CoCurve-diag, the other budget, the language-only rows: its language block) reuses it
    (``cocurve_graph``; H does not depend on the budget): one sweep for all of them."""
    from secateur.vlm_joint import matched_ratio

    def knobs_of(method: str) -> tuple[dict, Path | None]:
        if not method.startswith("cocurve"):
            return {}, None
        if graph is not None and graph.exists():
            return cocurve_knobs | {"cocurve_graph": str(graph)}, None
        return cocurve_knobs, graph

    for key, (method, s) in (keys or JOINT).items():
        row = None
        if key not in done:
            knobs, keep = knobs_of(method)
            row = joint_row(key, model, "joint", method, s, nsamples, images, teacher, keep, **knobs)
            yield row
        lang = key.replace("joint-", "language-only-")
        if lang not in done:
            if row is None:
                row = next((r for r in read_rows(OUT) if r["key"] == key), None)
            if row is None or "budget" not in row:
                continue
            r = matched_ratio(row["budget"])
            knobs, keep = knobs_of(method)
            out = joint_row(lang, model, "joint:language", method, r, nsamples, images, teacher, **knobs)
            yield out | {"matched_to": key, "matched_removed_params": row["budget"]["removed_params"]}


def dense_row(images: int) -> dict:
    from transformers import AutoModelForImageTextToText

    from secateur.eval.captions import eval_captions

    ev = eval_captions(str(cache()), max_images=images)
    params = sum(p.numel() for p in AutoModelForImageTextToText.from_pretrained(cache()).parameters())
    return stamped({"key": "dense", "tower": "-", "method": "dense", "sparsity": 0.0, "params": params,
                    "eval": {k: v for k, v in ev.items() if k != "images_manifest"}, "load_avg_1_5_15": _load()})


def render(rows: list[dict]) -> str:
    out = ["# Pruning the assembled VLM: one tower at a time, and one budget over both towers (issue 47)", "",
           "The VLM of [vision-models.md](../vision/vision-models.md) "
           "(SigLIP-shaped tower + SmolLM2-135M + trained projector), "
           "pruned with `secateur prune --towers language|vision` (language: calibrated on Fashion-MNIST "
           "image-caption pairs merged by the VLM itself; vision: on Fashion-MNIST images), scored with `secateur "
           "eval captions` on the same seed-0 draw of test images. Command: `python bench/quality/vlm_towers.py` "
           "(rows in `cocurve-vlm.jsonl`, each with its commit and load). One tower at a time, a per-layer "
           "allocation (FLAP, CORP, CoCurve) cannot be saved in the stock LLaVA config and is refused; the joint runs "
           "of the second table (one budget over both towers, `--towers joint`) save per-layer widths as "
           "`secateur_<family>` sub-configs.", "",
           "How to reproduce: build the VLM (`python bench/tools/train_vision.py --arch siglip` then "
           "`python bench/tools/train_vlm.py`, about 1.5-2 CPU-hours on 2 cores, into "
           "`~/.cache/secateur/vision/fmnist-llava`), then "
           "`python bench/quality/vlm_towers.py` (resumable row by row; without the VLM it says so and only renders "
           "this page); `python bench/quality/vlm_towers.py --tiny` runs the joint rows end to end on a tiny random "
           "VLM in a few minutes (printed, nothing written).", "",
           "| tower | method | sparsity | params | caption accuracy | multiple choice | caption ppl | prune (s) "
           "| load |",
           "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in sorted((r for r in rows if "eval" in r and not r.get("joint")),
                    key=lambda r: (r["tower"] != "-", r["tower"], r["sparsity"], r["method"])):
        e = r["eval"]
        out.append(f"| {r['tower']} | {r['method']} | {r['sparsity']:.0%} | {r['params']:,} | "
                   f"{e['caption_accuracy']:.4f} | {e['multiple_choice_accuracy']:.4f} | {e['caption_ppl']:.3f} | "
                   f"{r.get('prune_s', '-')} | {r['load_avg_1_5_15'][0]} |")
    if not any("eval" in r and r["method"] != "dense" for r in rows):
        out += ["", "No pruned row yet: the command above records them one by one (about 6 minutes a row on 2 shared "
                "cores: a prune on 64 caption pairs, then 100 test images scored), resumable."]
    out += render_joint(rows)
    ref = [r for r in rows if "refused" in r and not r.get("joint")]
    if ref:
        out += ["", "Refused (one line, exit 2, nothing written), as a user would see them:", ""]
        out += [f"* `{r['tower']}` `{r['method']}` {r['sparsity']:.0%}: {r['refused']}" for r in ref]
    return "\n".join(out) + "\n"


def render_joint(rows: list[dict]) -> list[str]:
    """The joint table: one budget over both towers against the language tower alone at matched parameters."""
    joint = [r for r in rows if r.get("joint")]
    out = ["", "## One budget over both towers (`--towers joint`) against the language tower alone at matched "
           "parameters", "",
           "Each joint row prunes the units of both towers under one budget (CoCurve: one teacher-KL graph over both "
           "towers from single-unit ablations through the whole VLM, caption tokens only; the baselines: raw "
           "per-parameter scores ranked across both towers); the row under it prunes the language tower alone "
           "(`--towers joint:language`) at the ratio that removes the same number of parameters. `vision` / "
           "`language`: the fraction of each tower's removable parameters removed (where the budget went). Held-out "
           f"KL: caption-token teacher KL on {HELDOUT_PAIRS} test-split pairs.", "",
           "| run | method | target | removed params | vision | language | params | caption accuracy | multiple choice "
           "| caption ppl | held-out KL | lambda |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    if (PAGE.parent / BUDGET_PNG).exists() and any("eval" in r for r in joint):
        out[3:3] = [f"![where the budget went]({BUDGET_PNG})", ""]
    if not any("eval" in r for r in joint):
        return out[:3] + ["Not run yet: the assembled VLM (`bench/tools/train_vlm.py`) is needed; the command "
                          "above records these rows after the per-tower ones. The path is verified end to end on a "
                          "tiny random VLM by `python bench/quality/vlm_towers.py --tiny` and tests/test_vlm_joint.py."]
    order = {k: i for i, k in enumerate(JOINT)}
    for r in sorted((r for r in joint if "eval" in r),
                    key=lambda r: (order.get(r.get("matched_to", r["key"]), 99), "matched_to" in r)):
        b, e = r["budget"], r["eval"]
        by = b["by_tower"]
        frac = {t: f"{by[t]['fraction']:.1%}" if t in by else "-" for t in ("vision", "language")}
        lam = "-" if r.get("lambda") is None else f"{r['lambda']:.3g}"
        run = "both towers" if r["towers"] == "joint" else "language only (matched)"
        out.append(f"| {run} | {r['method']} | {r['sparsity']:.3f} | {b['removed_params']:,} | {frac['vision']} | "
                   f"{frac['language']} | {r['params']:,} | {e['caption_accuracy']:.4f} | "
                   f"{e['multiple_choice_accuracy']:.4f} | {e['caption_ppl']:.3f} | {r['heldout_kl']:.4f} | {lam} |")
    ref = [r for r in joint if "refused" in r]
    out += [""] + [f"* refused: `{r['towers']}` `{r['method']}` {r['sparsity']:.0%}: {r['refused']}" for r in ref]
    return out


BUDGET_PNG = "cocurve-vlm-budget.png"


def budget_plot(rows: list[dict], path: Path, sparsity: float = 0.3) -> bool:
    """Where the joint budget went at ``sparsity`` (:func:`secateur.plots.plot_tower_budget`), one line per joint
    method; False when no such row is recorded."""
    from secateur.plots import plot_tower_budget

    series = {r["method"]: r["budget"]["per_layer"] for r in rows
              if r.get("joint") and r["towers"] == "joint" and r["sparsity"] == sparsity and "per_layer" in
              r.get("budget", {})}
    if not series:
        return False
    plot_tower_budget(series, path, f"one budget of {sparsity:.0%} over both towers: where it went")
    return True


def tiny(images: int) -> int:
    """The joint rows end to end on a tiny random VLM (14 layers per tower: CoCurve's guard is feasible at 20%),
    20% only, four caption pairs (two hold out lambda): rows printed, nothing written under results/."""
    import torch

    from secateur.testing import save_tiny_vlm

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        model = save_tiny_vlm("llava", Path(tmp) / "tiny", layers=14)
        teacher = heldout_teacher(model, 4)
        keys = {k: v for k, v in JOINT.items() if v[1] == 0.2}
        rows: list[dict] = []
        for row in joint_rows(model, set(), 4, images, teacher, keys, Path(tmp) / "graph.npz", heldout=2, top_r=32):
            rows.append(row)
            b = row.get("budget", {})
            print(row["key"], row.get("refused") or {t: round(d["fraction"], 4) for t, d in b["by_tower"].items()},
                  row.get("eval", {}).get("caption_ppl"), row.get("heldout_kl"), flush=True)
        print("\n".join(render_joint(rows)))
        png = Path(tmp) / BUDGET_PNG
        print(f"budget plot: {budget_plot(rows, png, 0.2) and png.stat().st_size} bytes")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--render", action="store_true")
    ap.add_argument("--nsamples", type=int, default=64)
    ap.add_argument("--images", type=int, default=100, help="test images scored per row (seed-0 draw)")
    ap.add_argument("--tiny", action="store_true", help="the joint rows on a tiny random VLM, printed (a check of "
                                                         "the path, no results written)")
    a = ap.parse_args(argv)
    if a.tiny:
        return tiny(min(a.images, 8))
    if not a.render:
        if not (cache() / "train.json").exists():
            print(f"skipped: {cache()} holds no assembled VLM (the per-tower and joint rows need it); build it with "
                  "python bench/tools/train_vlm.py (after the vision model it needs), then rerun", file=sys.stderr)
            PAGE.write_text(render(read_rows(OUT)))
            return 0
        done = {r["key"] for r in read_rows(OUT)}
        if "dense" not in done:
            append_row(OUT, dense_row(a.images), unique_key=True)
        for key, (tower, method, s) in {**REFUSED, **ROWS}.items():
            if key not in done:
                row = prune_row(key, tower, method, s, a.nsamples, a.images)
                append_row(OUT, row, unique_key=True)
                print(key, row.get("eval", row.get("refused")), flush=True)
                PAGE.write_text(render(read_rows(OUT)))
        teacher = heldout_teacher(cache())
        # CoCurve: 8 pairs per forward of each ablation (the same H up to summation order; tests/test_vlm_joint.py)
        graph = cache().parent / "fmnist-llava-joint-graph.npz"  # one sweep for every CoCurve row
        for row in joint_rows(cache(), done, a.nsamples + 16, a.images, teacher, None, graph, seqs_per_block=8):
            append_row(OUT, row, unique_key=True)
            print(row["key"], row.get("budget", {}).get("by_tower"), row.get("eval", row.get("refused")), flush=True)
            PAGE.write_text(render(read_rows(OUT)))
        if budget_plot(read_rows(OUT), PAGE.parent / BUDGET_PNG):  # add it to results/README.md's vlm files
            print(f"wrote {PAGE.parent / BUDGET_PNG}")
    PAGE.write_text(render(read_rows(OUT)))
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
