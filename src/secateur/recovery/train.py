"""The recovery's training loop: AdamW on the LoRA tensors, cosine schedule with linear warmup, a deterministic
order, and checkpoints a killed run continues from with bit-identical adapters (``--resume``).

Schedule, per optimizer step s = 0 .. S-1 with W = round(warmup x S) warmup steps::

    lr(s) = lr x (s + 1) / (W + 1)                                    s < W
    lr(s) = lr x 0.5 (1 + cos(pi (s - W) / max(1, S - W)))            s >= W

Order: epoch e visits the training windows in ``torch.randperm`` order from a generator seeded with
``seed x 1000003 + e``, in batches of ``--batch`` (the last one may be smaller): the batch of step s is a function of
(seed, s) alone, so a resumed run sees the same batches. With dropout > 0 the global torch RNG draws the masks; its
state is saved with each checkpoint.

Checkpoint (every ``--checkpoint-every`` steps, in the prune's convention: the hidden sibling
``.<out>.secateur-ckpt`` of ``--out``, :mod:`secateur.calib.resume`): one file ``recover-train.pt`` with the step,
the adapter tensors, the optimizer's and scheduler's states, the RNG state and the losses so far, written atomically.
Its manifest holds the fingerprint of the run (options but out/overwrite/quiet/resume/--save-adapter/
--checkpoint-every, the run folder's and teacher's files, the training tokens' sha256, the versions); a checkpoint of
another run is refused with ``--resume``.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import torch

from secateur.recovery.lora import adapter_params, set_train_mode
from secateur.recovery.loss import batch_loss

CKPT_FILE = "recover-train.pt"


def _after_step(step: int) -> None:
    """Called after each optimizer step (tests replace it to interrupt a run at a chosen step)."""


def schedule(total: int, warmup: float):
    w = int(round(warmup * total))

    def factor(s: int) -> float:
        if s < w:
            return (s + 1) / (w + 1)
        return 0.5 * (1.0 + math.cos(math.pi * (s - w) / max(1, total - w)))

    return factor, w


def batches(n: int, batch: int, epochs: int, seed: int) -> list[torch.Tensor]:
    """The window indices of every step, in order."""
    out = []
    for e in range(epochs):
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1000003 + e))
        out += list(perm.split(batch))
    return out


def _file_stats(path: Path) -> list:
    if not path.exists():
        return []
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    return [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]


def fingerprint(opts, run_dir: str, teacher: str | None, token_sha: str) -> dict:
    """Everything that determines the adapters of a recovery (see the module docstring)."""
    import json

    from secateur.recovery.options import NEUTRAL
    from secateur.runinfo import versions

    options = {k: v for k, v in sorted(opts.to_dict().items()) if k not in NEUTRAL}
    fp = {"options": options, "run_files": _file_stats(Path(run_dir)),
          "teacher_files": _file_stats(Path(teacher)) if teacher and Path(teacher).exists() else teacher,
          "tokens_sha256": token_sha, "versions": versions()}
    return json.loads(json.dumps(fp, default=str))


def _save(ckpt, step: int, pm, opt, sched, losses: list[float], curve: list[list]) -> None:
    """The training state after ``step`` steps, everything a resumed run needs to continue bit for bit."""
    ckpt.save(CKPT_FILE, {"step": step, "adapter": {n: p.detach().clone() for n, p in adapter_params(pm).items()},
                          "optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "rng": torch.get_rng_state(),
                          "losses": torch.tensor(losses, dtype=torch.float64), "curve": curve})


def _restore(ckpt, pm, opt, sched) -> tuple[int, list[float], list[list]]:
    """``(step, losses, curve)`` of the checkpoint, its adapters, optimizer, schedule and RNG state restored."""
    state = ckpt.load(CKPT_FILE)
    with torch.no_grad():
        for name, p in adapter_params(pm).items():
            p.copy_(state["adapter"][name])
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"])
    return int(state["step"]), [float(x) for x in state["losses"]], [list(p) for p in state.get("curve", [])]


def train(pm, train_ids: torch.Tensor, opts, teacher=None, ckpt=None, log=None, probe=None) -> dict:
    """Train the adapters of ``pm`` in place; returns ``{"losses", "steps", "resumed_from", "wall_s", "curve"}``.

    ``probe(model) -> float`` (held-out perplexity), when given with ``opts.heldout_every = N``, is measured
    before the first step and after every N-th and the last; ``curve`` lists ``[step, tokens seen, value]``
    (tokens = windows x seqlen of the steps so far). Probing reads no RNG, so it leaves the adapters unchanged."""
    from tqdm.auto import tqdm

    log = log or (lambda msg: print(f"secateur: {msg}", file=sys.stderr))
    params = list(adapter_params(pm).values())
    opt = torch.optim.AdamW(params, lr=opts.lr, weight_decay=opts.weight_decay)
    order = batches(train_ids.shape[0], opts.batch, opts.epochs, opts.seed)
    total = len(order)
    factor, _ = schedule(total, opts.warmup)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    losses: list[float] = []
    curve: list[list] = []
    start = 0
    every = getattr(opts, "heldout_every", 0) if probe is not None else 0
    seen = [0]  # training tokens after each step
    for idx in order:
        seen.append(seen[-1] + len(idx) * train_ids.shape[1])

    def point(step: int) -> None:
        curve.append([step, seen[step], float(probe(pm))])

    if ckpt is not None and ckpt.has(CKPT_FILE):
        start, losses, curve = _restore(ckpt, pm, opt, sched)
        log(f"resuming the recovery at step {start} of {total}")
    t0 = time.perf_counter()
    if every and start == 0:
        point(0)
    bar = tqdm(total=total, initial=start, desc="recover", disable=opts.quiet, unit="step")
    try:
        for s in range(start, total):
            set_train_mode(pm)
            loss = batch_loss(pm, train_ids[order[s]], opts.loss, teacher, opts.topk)
            loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach().item())
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.4f}")
            if every and ((s + 1) % every == 0 or s + 1 == total):
                point(s + 1)
            if ckpt is not None and (s + 1) % opts.checkpoint_every == 0 and s + 1 < total:
                _save(ckpt, s + 1, pm, opt, sched, losses, curve)
            _after_step(s + 1)
    finally:
        bar.close()
    pm.eval()
    return {"losses": losses, "steps": total, "resumed_from": start or None, "wall_s": time.perf_counter() - t0,
            "curve": curve}
