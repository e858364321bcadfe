"""Prune with several processes on one machine: each takes its share of the calibration windows, same result.

    python examples/prune_multiprocess.py                     # SmolLM2-135M, Wanda 50%, 2 processes
    python examples/prune_multiprocess.py --procs 4 --method sparsegpt --compare

``--procs N`` starts N ranks (gloo on CPU, NCCL with ``--device cuda``) and watches them: a failing rank ends them
all with one line. The result equals one process's bit for bit (``--compare`` checks it here). Across machines,
``torchrun --nproc-per-node N -m secateur prune ...`` does the same. CLI: ``secateur prune ... --procs N``;
docs/distributed.md.
"""

from __future__ import annotations

import argparse

from secateur.cli import main as secateur
from secateur.testing import folder_digest


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--method", default="wanda")
    ap.add_argument("--sparsity", type=float, default=0.5)
    ap.add_argument("--calib", default="c4")
    ap.add_argument("--nsamples", type=int, default=32)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--compare", action="store_true", help="also prune in one process and compare the digests")
    ap.add_argument("--out", default="out/examples/multiprocess")
    a = ap.parse_args(argv)

    common = ["prune", "--model", a.model, "--method", a.method, "--sparsity", str(a.sparsity), "--calib", a.calib,
              "--nsamples", str(a.nsamples), "--seqlen", str(a.seqlen), "--overwrite", "--quiet"]
    if secateur([*common, "--procs", str(a.procs), "--out", a.out]) != 0:
        raise SystemExit(2)  # the one-line reason is printed already
    digest = folder_digest(a.out)
    print(f"{a.procs} processes: weights and masks {digest[:16]}; saved to {a.out}")
    same = None
    if a.compare:
        if secateur([*common, "--out", f"{a.out}-1proc"]) != 0:
            raise SystemExit(2)
        same = folder_digest(f"{a.out}-1proc") == digest
        print("one process: " + ("the same bits" if same else "DIFFERENT bits"))
    return {"out": a.out, "digest": digest, "same_as_one_process": same}


if __name__ == "__main__":
    main()
