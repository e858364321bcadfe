"""Per-tower pruning of the assembled VLM (issue 47 §4, first slice): ``results/vlm/cocurve-vlm.md`` (+ ``.jsonl``).

The VLM of ``bench/tools/train_vlm.py`` (SigLIP-shaped vision tower + SmolLM2-135M + trained projector) pruned one
tower at a time with ``secateur prune --towers``: the language tower calibrated on image-caption pairs
(``--calib fashion-mnist-captions``, train split, seed 0), the vision tower on Fashion-MNIST train images; every
output scored by ``secateur eval captions`` on the same test images (seed-0 draw). Methods whose allocation is
uniform across layers (Wanda-sp, magnitude-sp, random; unstructured Wanda) save as a stock LLaVA; per-layer
allocations (FLAP, CORP, CoCurve) cannot be expressed in a stock VLM config yet and are refused in one line (named
in the page). The joint inventory over both towers (one budget, CoCurve's one graph) is not built yet: this page
has no CoCurve row and says so.

    python bench/quality/vlm_towers.py              # every row not yet recorded (resumable row by row)
    python bench/quality/vlm_towers.py --render     # the page from the recorded rows
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


def dense_row(images: int) -> dict:
    from transformers import AutoModelForImageTextToText

    from secateur.eval.captions import eval_captions

    ev = eval_captions(str(cache()), max_images=images)
    params = sum(p.numel() for p in AutoModelForImageTextToText.from_pretrained(cache()).parameters())
    return stamped({"key": "dense", "tower": "-", "method": "dense", "sparsity": 0.0, "params": params,
                    "eval": {k: v for k, v in ev.items() if k != "images_manifest"}, "load_avg_1_5_15": _load()})


def render(rows: list[dict]) -> str:
    out = ["# Pruning the assembled VLM one tower at a time (issue 47, first slice)", "",
           "The VLM of [vision-models.md](../vision/vision-models.md) "
           "(SigLIP-shaped tower + SmolLM2-135M + trained projector), "
           "pruned with `secateur prune --towers language|vision` (language: calibrated on Fashion-MNIST "
           "image-caption pairs merged by the VLM itself; vision: on Fashion-MNIST images), scored with `secateur "
           "eval captions` on the same seed-0 draw of test images. Command: `python bench/quality/vlm_towers.py` "
           "(rows in `cocurve-vlm.jsonl`, each with its commit and load). **Not yet here**: CoCurve's one graph over "
           "both towers (the joint inventory and budget), its diagonal control, and the joint-vs-language-only "
           "comparison at matched parameters; per-layer allocations (FLAP, CORP, CoCurve) in a stock VLM config.", "",
           "| tower | method | sparsity | params | caption accuracy | multiple choice | caption ppl | prune (s) "
           "| load |",
           "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in sorted((r for r in rows if "eval" in r), key=lambda r: (r["tower"] != "-", r["tower"], r["sparsity"],
                                                                    r["method"])):
        e = r["eval"]
        out.append(f"| {r['tower']} | {r['method']} | {r['sparsity']:.0%} | {r['params']:,} | "
                   f"{e['caption_accuracy']:.4f} | {e['multiple_choice_accuracy']:.4f} | {e['caption_ppl']:.3f} | "
                   f"{r.get('prune_s', '-')} | {r['load_avg_1_5_15'][0]} |")
    if not any("eval" in r and r["method"] != "dense" for r in rows):
        out += ["", "No pruned row yet: the command above records them one by one (about 6 minutes a row on 2 shared "
                "cores: a prune on 64 caption pairs, then 100 test images scored), resumable."]
    ref = [r for r in rows if "refused" in r]
    if ref:
        out += ["", "Refused (one line, exit 2, nothing written), as a user would see them:", ""]
        out += [f"* `{r['tower']}` `{r['method']}` {r['sparsity']:.0%}: {r['refused']}" for r in ref]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--render", action="store_true")
    ap.add_argument("--nsamples", type=int, default=64)
    ap.add_argument("--images", type=int, default=100, help="test images scored per row (seed-0 draw)")
    a = ap.parse_args(argv)
    if not a.render:
        if not (cache() / "train.json").exists():
            raise SystemExit(f"{cache()}: no VLM; train it first: python bench/tools/train_vlm.py")
        done = {r["key"] for r in read_rows(OUT)}
        if "dense" not in done:
            append_row(OUT, dense_row(a.images), unique_key=True)
        for key, (tower, method, s) in {**REFUSED, **ROWS}.items():
            if key not in done:
                row = prune_row(key, tower, method, s, a.nsamples, a.images)
                append_row(OUT, row, unique_key=True)
                print(key, row.get("eval", row.get("refused")), flush=True)
                PAGE.write_text(render(read_rows(OUT)))
    PAGE.write_text(render(read_rows(OUT)))
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
