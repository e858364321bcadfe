"""``secateur recover RUN_DIR --out DIR``: the command line of :func:`secateur.recovery.recover`."""

from __future__ import annotations

import argparse

from secateur.recovery.options import LOSSES, RecoverOptions

_D = RecoverOptions(run_dir="")


_SUMMARY = "recover a pruned run with LoRA distillation from its dense model"
_DESCRIPTION = ("Train LoRA adapters on a pruned run (a `secateur prune --out` folder) to match its dense teacher on "
                "text disjoint from every evaluation split, merge them into the weights (masked runs: the masks "
                "re-applied exactly) and save a run folder like any other. See docs/recovery.md.")


def register_cli(sub) -> argparse.ArgumentParser:
    """Add ``secateur recover``: its arguments mirror :class:`RecoverOptions` (defaults read from it)."""
    p = sub.add_parser("recover", help=_SUMMARY, description=_DESCRIPTION)
    p.add_argument("run_dir", metavar="RUN_DIR", help="the pruned run's folder (written by secateur prune --out)")
    p.add_argument("--out", required=True, help="output folder (written atomically)")
    p.add_argument("--teacher", default=None, metavar="SPEC",
                   help="the dense model (default: the run's base model, found by its sha256 or its name)")
    g = p.add_argument_group("adapters")
    g.add_argument("--rank", type=int, default=_D.rank, help="LoRA rank r (default: %(default)s)")
    g.add_argument("--alpha", type=float, default=_D.alpha, help="LoRA alpha (scale alpha / r) (default: %(default)s)")
    g.add_argument("--dropout", type=float, default=_D.dropout, help="LoRA dropout (default: %(default)s)")
    g = p.add_argument_group("loss and data")
    g.add_argument("--loss", default=_D.loss, choices=list(LOSSES),
                   help="kl: top-k distillation KL(teacher || student); ce: next-token cross-entropy "
                        "(default: %(default)s)")
    g.add_argument("--topk", type=int, default=_D.topk, help="teacher logits kept per token for kl "
                                                              "(default: %(default)s)")
    g.add_argument("--data", default=_D.data,
                   help="training text: c4, wikitext2, ptb (their calibration splits, never an evaluation split), "
                        "self (sampled from the teacher) or a .txt file (default: %(default)s)")
    g.add_argument("--data-dir", default=None, help="local data folder (default: $SECATEUR_DATA or ../shared/data)")
    g.add_argument("--tokens", type=int, default=_D.tokens, help="training tokens (default: %(default)s)")
    g.add_argument("--seqlen", type=int, default=_D.seqlen, help="tokens per window (default: %(default)s)")
    g.add_argument("--batch", type=int, default=_D.batch, help="windows per step (default: %(default)s)")
    g.add_argument("--epochs", type=int, default=_D.epochs, help="passes over the windows (default: %(default)s)")
    g.add_argument("--heldout-windows", type=int, default=_D.heldout_windows,
                   help="held-out windows for the before/after loss in the report, 0: none (default: %(default)s)")
    g.add_argument("--heldout-every", type=int, default=_D.heldout_every, metavar="N",
                   help="held-out perplexity every N steps, recorded as the report's recovery curve (default: "
                        "%(default)s, none)")
    g = p.add_argument_group("optimizer")
    g.add_argument("--lr", type=float, default=_D.lr, help="AdamW learning rate (default: %(default)s)")
    g.add_argument("--warmup", type=float, default=_D.warmup,
                   help="share of the steps with linear warmup before the cosine decay (default: %(default)s)")
    g.add_argument("--weight-decay", type=float, default=_D.weight_decay, help="AdamW weight decay "
                                                                               "(default: %(default)s)")
    g.add_argument("--seed", type=int, default=_D.seed, help="adapter init, window and order seed "
                                                             "(default: %(default)s)")
    g = p.add_argument_group("run")
    g.add_argument("--checkpoint-every", type=int, default=_D.checkpoint_every,
                   help="steps between checkpoints in .<out>.secateur-ckpt beside --out (default: %(default)s)")
    g.add_argument("--resume", action="store_true", help="continue a killed run of the same command from its "
                                                         "checkpoint (identical adapters)")
    g.add_argument("--overwrite", action="store_true", help="replace --out (and --save-adapter) if it exists")
    g.add_argument("--save-adapter", default=None, metavar="DIR",
                   help="also save the peft adapter folder (PeftModel.from_pretrained loads it on the pruned run)")
    g.add_argument("--dtype", default=_D.dtype, help="float32 | bfloat16 | float16 (default: %(default)s)")
    g.add_argument("--device", default=_D.device, help="torch device (default: %(default)s)")
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_recover)
    return p


def cmd_recover(args) -> int:
    from secateur.recovery import recover

    kw = {k: v for k, v in vars(args).items() if k not in ("func", "command", "argv", "run_dir", "out")}
    res = recover(args.run_dir, args.out, **kw)
    rec = res.report["recovery"]
    loss = rec["loss"]
    line = f"recovered {args.run_dir}: {rec['steps']} steps, loss {loss['first']:.4f} -> {loss['last']:.4f}"
    if rec.get("heldout"):
        h = rec["heldout"]
        line += f"; held-out {h['metric']} {h['pruned']:.4f} -> {h['output']:.4f}"
    print(line)
    print(f"saved to {args.out}")
    return 0
