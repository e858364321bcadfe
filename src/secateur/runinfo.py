"""Provenance for every report: versions, machine, peak memory, timings."""

from __future__ import annotations

import os
import platform
import resource
import sys
import time
from contextlib import contextmanager

import torch

# The version of the JSON that secateur writes: the prune report (secateur-report.json), evaluation JSON
# (`secateur eval ppl --json`) and the `secateur report` index. Raise it when a field changes meaning or goes
# away (adding a field does not); readers treat a file without it as version 0 (written before it existed).
SCHEMA_VERSION = 1


def versions() -> dict[str, str]:
    import transformers

    import secateur

    return {"secateur": secateur.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": sys.version.split()[0]}


def portable(value):
    """What a published file (report, card) says for a path: an absolute path becomes its last component, so an
    output pushed to a hub does not carry this machine's folders; ids, aliases and relative paths are kept."""
    if isinstance(value, str) and os.path.isabs(value):
        return os.path.basename(value.rstrip("/")) or value
    return value


def portable_source(src: dict | None) -> dict | None:
    """A GGUF input's ``model_source`` for publishing: the file by name and digest, the cache folder by its name
    under ``$SECATEUR_CACHE`` (the run's own machine finds it again by the digest)."""
    if not src:
        return src
    out = dict(src)
    if out.get("gguf"):
        out["gguf"] = portable(out["gguf"])
    if out.get("cache"):
        out["cache"] = "$SECATEUR_CACHE/" + portable(out["cache"])
    return out


def machine() -> dict[str, object]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "platform": platform.platform()}


def peak_rss_mb() -> float:
    """Peak resident set size of this process, in MiB: Linux's ``VmHWM`` (the high-water mark of this process's own
    memory, reset when it starts a program), else ``ru_maxrss``. Not ``ru_maxrss`` on Linux: it is inherited across
    fork and kept across exec, so a command started by a large parent (a benchmark that hashed a 7B folder) would
    report the parent's peak as its own."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux, the only other reader


class Timer:
    """Named phase timings: ``with timer("calibrate"): ...``; ``timer.phases`` in seconds."""

    def __init__(self) -> None:
        self.phases: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        t = time.perf_counter()
        try:
            yield
        finally:
            self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - t
