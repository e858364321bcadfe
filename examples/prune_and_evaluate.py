"""Prune a language model and compare its perplexity with the dense model's.

    python examples/prune_and_evaluate.py                                  # SmolLM2-135M, Wanda 50%, C4 -> WikiText-2
    python examples/prune_and_evaluate.py --method sparsegpt --pattern 2:4
    python examples/prune_and_evaluate.py --model Qwen/Qwen2.5-0.5B --calib self   # offline calibration text

The same job on the command line: ``secateur prune --model M --method wanda --sparsity 0.5 --calib c4 --out DIR``,
then ``secateur eval ppl --model DIR --dataset wikitext2``. Data: ``--data-dir`` or ``$SECATEUR_DATA`` (a folder
laid out like ../shared/data); ``--calib self`` needs none.
"""

from __future__ import annotations

import argparse

from secateur import api


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m",
                    help="HF id or folder, .gguf file, or alias (default: %(default)s)")
    ap.add_argument("--method", default="wanda", help="any of `secateur prune --help` (default: %(default)s)")
    ap.add_argument("--sparsity", type=float, default=0.5)
    ap.add_argument("--pattern", default=None, help="N:M semi-structured pattern, e.g. 2:4")
    ap.add_argument("--calib", default="c4", help="c4, wikitext2, ptb, self or a .txt file (default: %(default)s)")
    ap.add_argument("--nsamples", type=int, default=32)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--dataset", default="wikitext2", help="perplexity corpus or a .txt file (default: %(default)s)")
    ap.add_argument("--eval-seqlen", type=int, default=2048)
    ap.add_argument("--eval-windows", type=int, default=8, help="perplexity windows (default: %(default)s)")
    ap.add_argument("--out", default="out/examples/pruned")
    a = ap.parse_args(argv)

    result = api.prune(model=a.model, method=a.method, sparsity=a.sparsity, pattern=a.pattern, calib=a.calib,
                       nsamples=a.nsamples, seqlen=a.seqlen, out=a.out, overwrite=True, quiet=True)
    ppl = {}
    for name, model in (("dense", a.model), ("pruned", a.out)):
        ppl[name] = api.eval_ppl(model=model, dataset=a.dataset, seqlen=a.eval_seqlen, max_windows=a.eval_windows,
                                 progress=False)["ppl"]
    sparsity = result["realized_sparsity"]["targeted"]
    print(f"{a.method} {sparsity:.0%} of the targeted weights; perplexity on {a.dataset} "
          f"({a.eval_windows} windows of {a.eval_seqlen}): dense {ppl['dense']:.2f}, pruned {ppl['pruned']:.2f}")
    print(f"saved to {a.out} (a Hugging Face folder with its masks, report, recipe and model card)")
    return {"sparsity": sparsity, "ppl": ppl, "out": a.out}


if __name__ == "__main__":
    main()
