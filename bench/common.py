"""Shared helpers for benchmark scripts: presets, cached calibration tokens, row files, tables."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "bench" / "_work"  # cached token files and scratch (git-ignored)
RESULTS = ROOT / "results"

# Named protocol presets. full = the papers' protocol; quick = fewer tokens, same everything else.
PRESETS = {
    "full": {"nsamples": 128, "seqlen": 2048, "max_windows": None},
    "quick": {"nsamples": 32, "seqlen": 2048, "max_windows": 32},
    "smoke": {"nsamples": 2, "seqlen": 256, "max_windows": 2},
}


def calib_tokens(tokenizer, source: str, nsamples: int, seqlen: int, seed: int = 0):
    """Calibration ids cached on disk so every row (and llm-compressor) sees the same tokens."""
    from secateur.data.windows import calibration_set

    WORK.mkdir(parents=True, exist_ok=True)
    path = WORK / f"calib-{source}-{nsamples}x{seqlen}-seed{seed}.pt"
    if path.exists():
        blob = torch.load(path)
        return blob["ids"], blob["manifest"]
    ids, man = calibration_set(source, tokenizer, nsamples, seqlen, seed)
    torch.save({"ids": ids, "manifest": man.to_dict()}, path)
    return ids, man.to_dict()


def run_child(script: Path, args: list[str], log: Path) -> int:
    """Run one row in a fresh process (independent peak RSS), logging to ``log``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        return subprocess.call([sys.executable, str(script), *args], stdout=f, stderr=subprocess.STDOUT,
                               env=os.environ | {"TOKENIZERS_PARALLELISM": "false"})


def read_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def append_row(path: Path, row: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(row, default=str) + "\n")


def fmt(x, nd=2) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)
