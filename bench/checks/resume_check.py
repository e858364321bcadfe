"""Kill-and-resume check of ``secateur prune --resume`` on SmolLM2-135M (results/reliability/reliability.md).

    python bench/checks/resume_check.py [--kill-block 10] [--json results/reliability/resume-check.json]

Three real processes of ``secateur prune --method wanda --calib c4 --nsamples 2 --seqlen 128``:

1. an uninterrupted run to ``A``;
2. a run to ``B`` killed with SIGKILL as soon as the checkpoint of block ``--kill-block`` appears
   (``.B.secateur-ckpt/engine0-block<k>.pt``; the hidden states may or may not be written yet -- either is a
   state a real kill can leave);
3. the same command as 2 with ``--resume``.

Prints and writes the sha256 of every tensor of A and B (and of their masks) plus one digest over all of
them; the check passes when the two agree bit for bit.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: bench.* imports
from bench.common import stamped

ROOT = Path(__file__).resolve().parents[2]


def _cmd(out: Path, data_dir: str | None, *extra: str) -> list[str]:
    cmd = [sys.executable, "-m", "secateur.cli", "prune", "--model", "smollm2-135m", "--method", "wanda",
           "--calib", "c4", "--nsamples", "2", "--seqlen", "128", "--quiet", "--out", str(out), *extra]
    return cmd + (["--data-dir", data_dir] if data_dir else [])


def digests(out: Path) -> dict[str, str]:
    """sha256 of every tensor in the saved safetensors and of every array of the masks file."""
    import torch
    from safetensors.torch import load_file

    d: dict[str, str] = {}
    for f in sorted(out.glob("*.safetensors")):
        for k, t in sorted(load_file(f).items()):
            d[k] = hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
    masks = out / "secateur-masks.npz"
    if masks.exists():
        z = np.load(masks)
        d |= {f"mask:{k}": hashlib.sha256(z[k].tobytes()).hexdigest() for k in sorted(z.files)}
    return d


def _total(d: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()


def kill_and_resume(work: Path, kill_block: int = 10, data_dir: str | None = None) -> dict:
    """Run the three processes in ``work``; return the digests and what happened."""
    from secateur.calib.resume import checkpoint_dir

    work = Path(work)
    a, b = work / "A", work / "B"
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    t0 = time.perf_counter()
    subprocess.run(_cmd(a, data_dir), env=env, check=True, capture_output=True)
    t_clean = time.perf_counter() - t0
    marker = checkpoint_dir(b) / f"engine0-block{kill_block}.pt"
    proc = subprocess.Popen(_cmd(b, data_dir), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while proc.poll() is None and not marker.exists():
        time.sleep(0.01)
    killed = proc.poll() is None
    if killed:
        proc.send_signal(signal.SIGKILL)
    proc.wait()
    out_after_kill = b.exists()
    left = sorted(p.name for p in checkpoint_dir(b).iterdir()) if checkpoint_dir(b).exists() else []
    t0 = time.perf_counter()
    res = subprocess.run(_cmd(b, data_dir, "--resume"), env=env, capture_output=True, text=True)
    t_resume = time.perf_counter() - t0
    da, db = digests(a), digests(b) if b.exists() else {}
    return {"model": "smollm2-135m", "command": " ".join(_cmd(Path("OUT"), None)[1:]), "kill_block": kill_block,
            "killed_at_block_file": killed, "checkpoint_files_after_kill": left,
            "output_existed_after_kill": out_after_kill, "resumed_rc": res.returncode,
            "resume_stderr": res.stderr.strip().splitlines()[-3:], "checkpoint_removed": not checkpoint_dir(b).exists(),
            "seconds": {"uninterrupted": round(t_clean, 1), "resumed": round(t_resume, 1)},
            "tensors": len(da), "identical": bool(da) and da == db,
            "uninterrupted": _total(da), "resumed": _total(db),
            "differing": sorted(k for k in set(da) | set(db) if da.get(k) != db.get(k)), "per_tensor": da}


def main() -> int:
    import tempfile

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kill-block", type=int, default=10)
    p.add_argument("--data-dir", default=None)
    p.add_argument("--json", default=str(ROOT / "results" / "reliability" / "resume-check.json"))
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="resume-check-") as tmp:
        res = kill_and_resume(Path(tmp), args.kill_block, args.data_dir)
    summary = {k: v for k, v in res.items() if k != "per_tensor"}
    print(json.dumps(summary, indent=1))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(stamped(res), indent=1) + "\n")
    return 0 if res["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
