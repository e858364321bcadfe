"""The options of ``secateur recover`` / :func:`secateur.recovery.recover`, checked before anything is loaded."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from secateur.errors import SecateurError

LOSSES = ("kl", "ce")
CORPORA = ("c4", "wikitext2", "ptb", "self")
#: options that do not change the adapters (left out of the checkpoint's fingerprint)
NEUTRAL = ("out", "overwrite", "quiet", "resume", "save_adapter", "checkpoint_every", "heldout_every")


@dataclass
class RecoverOptions:
    """Every setting of a recovery run (the CLI flags, the API keywords). Defaults: LoRA r 16, alpha 32, dropout 0
    on every attention and MLP projection; top-64 distillation KL from the run's base model; 65,536 tokens of C4
    calibration documents in windows of 512, one window per step (128 steps); AdamW lr 1e-3, cosine schedule, 10%
    warmup. Chosen by measurement (results/text/recovery-smollm2.md): on SmolLM2 Wanda-sp 30% the earlier batch 4 / lr
    2e-4 (32 steps) took the held-out KL only 0.99 -> 0.85; batch 1 / lr 1e-3 reaches 0.73 in the same tokens and
    a third of the peak memory."""

    run_dir: str
    out: str | None = None
    teacher: str | None = None
    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    loss: str = "kl"
    topk: int = 64
    data: str = "c4"
    data_dir: str | None = None
    tokens: int = 65536
    seqlen: int = 512
    batch: int = 1
    epochs: int = 1
    lr: float = 1e-3
    warmup: float = 0.1
    weight_decay: float = 0.0
    seed: int = 0
    heldout_windows: int = 4
    heldout_every: int = 0  # held-out perplexity every N steps (0: none): the report's recovery curve
    checkpoint_every: int = 50
    resume: bool = False
    overwrite: bool = False
    save_adapter: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    quiet: bool = False

    @classmethod
    def from_kwargs(cls, run_dir, **kw) -> RecoverOptions:
        known = {f.name for f in fields(cls)}
        bad = sorted(set(kw) - known)
        if bad:
            raise SecateurError(f"recover: unknown option {bad[0]!r}; see 'secateur recover --help' for the options")
        return cls(run_dir=run_dir, **kw)

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def windows(self) -> int:
        """Training windows: ``ceil(tokens / seqlen)``."""
        return math.ceil(self.tokens / self.seqlen)

    @property
    def steps(self) -> int:
        """Optimizer steps: ``epochs x ceil(windows / batch)``."""
        return self.epochs * math.ceil(self.windows / self.batch)

    def validate(self) -> RecoverOptions:
        """Types, ranges and choices: one line naming the option and what to pass (nothing read from disk but the
        existence of a ``.txt`` corpus)."""
        from secateur.schemas.api import path_or_none

        run_dir = path_or_none(self.run_dir, "recover: run_dir", "pass the run folder that secateur prune --out wrote")
        if run_dir is None or not run_dir.strip():
            raise SecateurError("recover needs the run folder that secateur prune --out wrote; pass it as RUN_DIR")
        self.run_dir = run_dir
        out = path_or_none(self.out, "recover: out (--out)", "pass the output folder")
        if out is None or not out.strip():
            raise SecateurError("recover needs an output folder; pass --out DIR")
        self.out = out
        for name in ("resume", "overwrite", "quiet"):
            if not isinstance(getattr(self, name), bool):
                raise SecateurError(f"--{_flag(name)} must be True or False, got {getattr(self, name)!r}; pass a bool")
        for name in ("dtype", "device", "loss"):
            if not isinstance(getattr(self, name), str):
                raise SecateurError(f"--{_flag(name)} must be a string, got {getattr(self, name)!r}; see "
                                    "'secateur recover --help' for the values")
        if not isinstance(self.data, str):
            self.data = path_or_none(self.data, "recover: data (--data)", f"pass one of {', '.join(CORPORA)} or the "
                                     "path of a .txt file")
        for name, low in (("rank", 1), ("topk", 1), ("tokens", 1), ("seqlen", 2), ("batch", 1), ("epochs", 1),
                          ("checkpoint_every", 1), ("heldout_windows", 0), ("heldout_every", 0), ("seed", 0)):
            _int(name, getattr(self, name), low)
        for name, lo, hi, closed_hi in (("dropout", 0.0, 1.0, False), ("warmup", 0.0, 1.0, False),
                                        ("weight_decay", 0.0, math.inf, False)):
            _number(name, getattr(self, name), lo, hi, closed_hi)
        for name in ("alpha", "lr"):
            v = _number(name, getattr(self, name), 0.0, math.inf, False)
            if v <= 0:
                raise SecateurError(f"--{_flag(name)} must be > 0, got {v!r}; pass a positive number, e.g. "
                                    f"{'32' if name == 'alpha' else '1e-3'}")
        if self.loss not in LOSSES:
            raise SecateurError(f"--loss {self.loss!r} is not a loss; choose kl (distillation from the teacher) or "
                                "ce (next-token cross-entropy)")
        if not isinstance(self.data, str) or not (self.data in CORPORA or Path(self.data).suffix == ".txt"):
            raise SecateurError(f"--data {self.data!r} is not a training corpus; choose one of "
                                f"{', '.join(CORPORA)} or a .txt file")
        if Path(self.data).suffix == ".txt" and not Path(self.data).is_file():
            raise SecateurError(f"--data {self.data}: no such file; check the path of the .txt file")
        for name in ("teacher", "save_adapter", "data_dir"):
            v = path_or_none(getattr(self, name), f"recover: {name} (--{_flag(name)})", "pass a path, or None")
            if v is not None and not v.strip():
                raise SecateurError(f"--{_flag(name)} is empty; pass a path, or leave it out")
            setattr(self, name, v)
        if self.heldout_every and not self.heldout_windows:
            raise SecateurError("--heldout-every needs held-out windows; pass --heldout-windows N (N >= 1)")
        if self.save_adapter is not None and Path(self.save_adapter).absolute() == Path(self.out).absolute():
            raise SecateurError("--save-adapter names the same folder as --out; choose another folder")
        return self


def _flag(name: str) -> str:
    return name.replace("_", "-")


def _int(name: str, v, low: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise SecateurError(f"--{_flag(name)} must be an integer, got {v!r}; pass a whole number >= {low}")
    if v < low:
        raise SecateurError(f"--{_flag(name)} must be >= {low}, got {v}; pass a whole number >= {low}")
    return v


def _number(name: str, v, lo: float, hi: float, closed_hi: bool) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
        raise SecateurError(f"--{_flag(name)} must be a number, got {v!r}; pass a number in [{lo}, {hi})")
    if v < lo or (v > hi if closed_hi else v >= hi):
        raise SecateurError(f"--{_flag(name)} must be in [{lo}, {hi}{']' if closed_hi else ')'}, got {v!r}; "
                            "pass a number in that range")
    return float(v)


def command_line(opts: RecoverOptions) -> str:
    """The ``secateur recover`` command of ``opts`` (options at their default left out; paths portable: an absolute
    path by its last component, as every published file names them)."""
    import shlex

    from secateur.runinfo import portable

    default = RecoverOptions(run_dir="")
    parts = ["secateur", "recover", shlex.quote(str(portable(opts.run_dir)))]
    for f in fields(RecoverOptions):
        v = getattr(opts, f.name)
        if f.name == "run_dir" or v == getattr(default, f.name):
            continue
        flag = f"--{_flag(f.name)}"
        if isinstance(v, bool):
            parts.append(flag)
        else:
            parts += [flag, shlex.quote(str(portable(v) if isinstance(v, str) else v))]
    return " ".join(parts)
