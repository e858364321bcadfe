"""Prune a language model, then recover part of the loss with LoRA distillation from the dense model.

    python examples/prune_and_recover.py                       # SmolLM2-135M, Wanda-sp 30% (structured), 64k tokens
    python examples/prune_and_recover.py --method flap --sparsity 0.2 --tokens 262144

Recovery trains LoRA adapters on text disjoint from every evaluation split (``--data``: the calibration split of
c4/wikitext2/ptb, ``self`` or a .txt file), matching the dense teacher's top-k logits, then merges them into the
weights (masked runs keep their masks exactly). CLI: ``secateur recover RUN --out DIR``; docs/recovery.md.
"""

from __future__ import annotations

import argparse

from secateur import api


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--method", default="wanda-sp", help="(default: %(default)s: structured, a smaller dense model)")
    ap.add_argument("--sparsity", type=float, default=0.3)
    ap.add_argument("--calib", default="c4")
    ap.add_argument("--nsamples", type=int, default=32)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--data", default="c4", help="recovery text (default: %(default)s, its calibration split)")
    ap.add_argument("--tokens", type=int, default=65536, help="recovery training tokens (default: %(default)s)")
    ap.add_argument("--train-seqlen", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--dataset", default="wikitext2")
    ap.add_argument("--eval-seqlen", type=int, default=2048)
    ap.add_argument("--eval-windows", type=int, default=8)
    ap.add_argument("--out", default="out/examples/recovered")
    a = ap.parse_args(argv)

    pruned = f"{a.out}-pruned"
    api.prune(model=a.model, method=a.method, sparsity=a.sparsity, calib=a.calib, nsamples=a.nsamples,
              seqlen=a.seqlen, out=pruned, overwrite=True, quiet=True)
    rec = api.recover(pruned, a.out, data=a.data, tokens=a.tokens, seqlen=a.train_seqlen, batch=a.batch,
                      overwrite=True, quiet=True)
    ppl = {name: api.eval_ppl(model=m, dataset=a.dataset, seqlen=a.eval_seqlen, max_windows=a.eval_windows,
                              progress=False)["ppl"]
           for name, m in (("dense", a.model), ("pruned", pruned), ("recovered", a.out))}
    print(f"perplexity on {a.dataset}: " + ", ".join(f"{k} {v:.2f}" for k, v in ppl.items()))
    print(f"recovered run saved to {a.out} (the teacher: {rec.report['recovery']['teacher']['spec']})")
    return {"ppl": ppl, "pruned": pruned, "out": a.out, "report": rec.report}


if __name__ == "__main__":
    main()
