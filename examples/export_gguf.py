"""Prune a language model, export it to one GGUF file and run it in llama.cpp (when llama-cpp-python is installed).

    python examples/export_gguf.py                         # SmolLM2-135M, Wanda-sp 20% (a smaller dense model), f16
    python examples/export_gguf.py --method wanda --sparsity 0.5 --type q8_0

Uniform structured widths keep the family's architecture (llama, qwen2); per-layer widths become llama.cpp's
``deci`` architecture; masked (unstructured) runs are written dense. llama.cpp runs the file as any other:
``llama-cli -m FILE.gguf -p "..."``; here through its Python binding (``pip install 'secateur[deploy]'``), skipped
with a note when it is absent. CLI: ``secateur export gguf RUN --out FILE.gguf --type f16``.
"""

from __future__ import annotations

import argparse
import importlib.util

from secateur import api
from secateur.cli import main as secateur


def run_llama_cpp(gguf: str, prompt: str, tokens: int) -> str | None:
    """Greedy continuation of ``prompt`` by llama.cpp, or None when llama-cpp-python is not installed."""
    if importlib.util.find_spec("llama_cpp") is None:
        print(f"llama-cpp-python is not installed (pip install 'secateur[deploy]'): run the file with "
              f"llama-cli -m {gguf} -p '{prompt}'")
        return None
    import llama_cpp

    llm = llama_cpp.Llama(model_path=gguf, n_ctx=256, seed=0, verbose=False)
    return llm(prompt, max_tokens=tokens, temperature=0.0)["choices"][0]["text"]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--method", default="wanda-sp")
    ap.add_argument("--sparsity", type=float, default=0.2)
    ap.add_argument("--calib", default="c4")
    ap.add_argument("--nsamples", type=int, default=32)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--type", default="f16", choices=["f32", "f16", "bf16", "q8_0"], help="GGUF matrix storage")
    ap.add_argument("--prompt", default="The capital of France is")
    ap.add_argument("--tokens", type=int, default=16, help="tokens llama.cpp generates (default: %(default)s)")
    ap.add_argument("--out", default="out/examples/gguf")
    a = ap.parse_args(argv)

    api.prune(model=a.model, method=a.method, sparsity=a.sparsity, calib=a.calib, nsamples=a.nsamples,
              seqlen=a.seqlen, out=a.out, overwrite=True, quiet=True)
    gguf = f"{a.out}.gguf"
    if secateur(["export", "gguf", a.out, "--out", gguf, "--type", a.type, "--overwrite"]) != 0:
        raise SystemExit(2)  # the one-line reason is printed already
    text = run_llama_cpp(gguf, a.prompt, a.tokens)
    if text is not None:
        print(f"llama.cpp: {a.prompt}{text}")
    return {"gguf": gguf, "llama_cpp_text": text}


if __name__ == "__main__":
    main()
