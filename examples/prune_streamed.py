"""Prune a model larger than memory: one decoder block in memory at a time (``--stream``), under a memory plan.

    python examples/prune_streamed.py                          # SmolLM2-135M (any local safetensors folder works)
    python examples/prune_streamed.py --model /models/llama-7b --method sparsegpt

Before loading anything secateur prints the run's memory plan (what each part of the peak costs, by formula) and
refuses, in one line, a run that would not fit; the report keeps the plan. Streamed runs read a local folder (or
the alias's cached one), load each block from its safetensors, prune it, write it to ``--out`` and free it. The
perplexity is streamed the same way. CLI: ``secateur prune ... --stream`` and ``secateur eval ppl ... --stream``.
"""

from __future__ import annotations

import argparse

from secateur import api


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", help="a local model folder or alias (default: %(default)s)")
    ap.add_argument("--method", default="wanda", help="magnitude, wanda, sparsegpt or a structured method")
    ap.add_argument("--sparsity", type=float, default=0.5)
    ap.add_argument("--calib", default="c4", help="c4, wikitext2, ptb or a .txt file (not self: the model is "
                    "never whole in memory to sample from)")
    ap.add_argument("--nsamples", type=int, default=32)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--dataset", default="wikitext2")
    ap.add_argument("--eval-seqlen", type=int, default=2048)
    ap.add_argument("--eval-windows", type=int, default=4)
    ap.add_argument("--out", default="out/examples/streamed")
    a = ap.parse_args(argv)

    result = api.prune(model=a.model, method=a.method, sparsity=a.sparsity, calib=a.calib, nsamples=a.nsamples,
                       seqlen=a.seqlen, out=a.out, stream=True, overwrite=True, quiet=True)
    plan = result["memory_plan"]
    ppl = api.eval_ppl(model=a.out, dataset=a.dataset, seqlen=a.eval_seqlen, max_windows=a.eval_windows,
                       stream=True, progress=False)["ppl"]
    print(f"memory plan: about {plan['total_bytes'] / 2**20:.1f} MiB at the peak (terms: {', '.join(plan['terms'])})")
    print(f"streamed {a.method} {a.sparsity:.0%}: perplexity {ppl:.2f} on {a.dataset}; saved to {a.out}")
    return {"memory_plan": plan, "ppl": ppl, "out": a.out}


if __name__ == "__main__":
    main()
