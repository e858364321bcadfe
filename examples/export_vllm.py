"""Prune a language model, export the folder vLLM serves, and generate with vLLM (when vLLM is installed).

    python examples/export_vllm.py                          # SmolLM2-135M, Wanda-sp 20% with vLLM-servable widths
    python examples/export_vllm.py --method flap --sparsity 0.2

Structured runs with uniform widths keep the stock architecture; per-layer widths are written as NVIDIA's DeciLM
(served with ``trust_remote_code``), and ``deploy="vllm"`` (``secateur prune --deploy vllm``) makes the selection
one that format holds (the same query heads in every layer that keeps attention); masked runs become a dense
folder with the masks applied. Serve the folder with ``vllm serve FOLDER --trust-remote-code``; here vLLM's offline
``LLM`` generates a few tokens, skipped with a note when vLLM is not installed (``make vllm-env``: its own venv).
CLI: ``secateur export vllm RUN --out FOLDER``; docs/deploy-engines.md.
"""

from __future__ import annotations

import argparse
import importlib.util

from secateur import api
from secateur.cli import main as secateur


def run_vllm(folder: str, prompt: str, tokens: int) -> str | None:
    """Greedy continuation of ``prompt`` by vLLM, or None when vLLM is not installed."""
    if importlib.util.find_spec("vllm") is None:
        print(f"vLLM is not installed here (make vllm-env): serve the folder with vllm serve {folder} "
              "--trust-remote-code")
        return None
    import vllm

    llm = vllm.LLM(model=folder, dtype="float32", enforce_eager=True, trust_remote_code=True, seed=0)
    out = llm.generate([prompt], vllm.SamplingParams(max_tokens=tokens, temperature=0.0))
    return out[0].outputs[0].text


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--method", default="wanda-sp")
    ap.add_argument("--sparsity", type=float, default=0.2)
    ap.add_argument("--calib", default="c4")
    ap.add_argument("--nsamples", type=int, default=32)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--prompt", default="The capital of France is")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--out", default="out/examples/vllm")
    a = ap.parse_args(argv)

    api.prune(model=a.model, method=a.method, sparsity=a.sparsity, calib=a.calib, nsamples=a.nsamples,
              seqlen=a.seqlen, out=a.out, deploy="vllm", overwrite=True, quiet=True)
    served = f"{a.out}.served"
    if secateur(["export", "vllm", a.out, "--out", served, "--overwrite"]) != 0:
        raise SystemExit(2)  # the one-line reason is printed already
    text = run_vllm(served, a.prompt, a.tokens)
    if text is not None:
        print(f"vLLM: {a.prompt}{text}")
    return {"served": served, "vllm_text": text}


if __name__ == "__main__":
    main()
