"""Replay a run from its recipe and check that it wrote the same model, bit for bit.

    python examples/replay_recipe.py                                  # prunes SmolLM2-135M first, then replays it
    python examples/replay_recipe.py --recipe out/wanda50/secateur-recipe.yaml --out out/replayed

Every ``secateur prune --out`` folder holds ``secateur-recipe.yaml``: every option that determines its weights and
masks, with the sha256 of the model and of the calibration tokens (a replay on other inputs is refused in one
line). Flags given with ``--recipe`` override its values (``--out`` at least). CLI: ``secateur prune --recipe
FILE --out DIR``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from secateur import api
from secateur.cli import main as secateur
from secateur.testing import folder_digest


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default=None, help="a secateur-recipe.yaml (default: prune --model first)")
    ap.add_argument("--model", default="smollm2-135m", help="the model pruned first when no --recipe is given")
    ap.add_argument("--method", default="wanda")
    ap.add_argument("--sparsity", type=float, default=0.5)
    ap.add_argument("--calib", default="c4")
    ap.add_argument("--nsamples", type=int, default=32)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--out", default="out/examples/replayed")
    a = ap.parse_args(argv)

    recipe = a.recipe
    if recipe is None:
        first = f"{a.out}-original"
        api.prune(model=a.model, method=a.method, sparsity=a.sparsity, calib=a.calib, nsamples=a.nsamples,
                  seqlen=a.seqlen, out=first, overwrite=True, quiet=True)
        recipe = str(Path(first) / "secateur-recipe.yaml")
    print(Path(recipe).read_text())
    if secateur(["prune", "--recipe", recipe, "--out", a.out, "--overwrite", "--quiet"]) != 0:
        raise SystemExit(2)  # the one-line reason is printed already
    original, replayed = folder_digest(Path(recipe).parent), folder_digest(a.out)
    print(f"weights and masks: {original[:16]} (original) {replayed[:16]} (replayed): "
          + ("identical" if original == replayed else "DIFFERENT"))
    return {"recipe": recipe, "out": a.out, "identical": original == replayed}


if __name__ == "__main__":
    main()
