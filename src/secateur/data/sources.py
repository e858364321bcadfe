"""Text sources for calibration and evaluation.

Sources, in the order users reach for them:
  * a data directory (``--data-dir`` or ``SECATEUR_DATA``) laid out like ``../shared/data``:
    ``wikitext2-raw/``, ``c4-validation-2k/``, ``ptb-mikolov/``;
  * the ``datasets`` hub loaders, when online and no data directory is given;
  * a plain text file (any path ending in .txt);
  * ``self``: text sampled from the dense model itself (works offline with no data at all).

Splits of the local C4 file (2000 validation documents): documents [0, 1500) are the calibration
pool, documents [1500, 2000) the held-out perplexity set, so the two never overlap.
"""

from __future__ import annotations

import os
from pathlib import Path

from secateur.errors import SecateurError
from secateur.files import read_regular_bytes, regular_file  # noqa: F401  (their old home)

C4_CALIB_DOCS = (0, 1500)
C4_EVAL_DOCS = (1500, 2000)
DATASETS = ("wikitext2", "c4", "ptb")


def default_data_dir() -> Path | None:
    """``SECATEUR_DATA`` if set, else ``../shared/data`` next to the checkout or the working directory."""
    env = os.environ.get("SECATEUR_DATA")
    if env:
        return Path(env)
    for base in (Path.cwd(), Path(__file__).resolve().parents[3]):
        cand = base.parent / "shared" / "data"
        if cand.is_dir():
            return cand
    return None


def resolve_data_dir(data_dir: str | Path | None) -> Path | None:
    if data_dir is None:
        return default_data_dir()
    p = Path(data_dir)
    if not p.is_dir():
        raise SecateurError(f"data directory {data_dir} does not exist; "
                            "pass --data-dir a folder laid out like ../shared/data")
    return p


def _need(path: Path) -> Path:
    if not path.exists():
        raise SecateurError(f"missing data file {path}; check --data-dir / SECATEUR_DATA (laid out like "
                            "shared/data: wikitext2-raw/, c4-validation-2k/, ptb-mikolov/)")
    return regular_file(path, "data file", "the data directory must hold the corpus files themselves")


def read_text_file(path: str | Path) -> str:
    """A user's ``.txt`` corpus: a UTF-8 text file with something in it, or a one-line error naming it (a FIFO,
    a device or a socket is refused before it is opened: never a hang)."""
    p = Path(path)
    if p.is_dir():
        raise SecateurError(f"text file {p} is a directory; pass a UTF-8 .txt file")
    if not os.path.lexists(p):
        raise SecateurError(f"missing data file {p}; check the path of the .txt file")
    raw = read_regular_bytes(p, "text file", "pass a UTF-8 .txt file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SecateurError(f"text file {p} is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}); "
                            "convert it to UTF-8 (e.g. iconv -t UTF-8)") from None
    if "\x00" in text:
        raise SecateurError(f"text file {p} is binary (it contains NUL bytes); pass a UTF-8 .txt file")
    if not text.strip():
        raise SecateurError(f"text file {p} is empty; pass a .txt file with text in it")
    return text


def wikitext2_test(data_dir: Path) -> str:
    """WikiText-2 raw test, HF rows joined with "\\n\\n" (the Wanda/SparseGPT convention)."""
    p = _need(data_dir / "wikitext2-raw" / "wiki.test.raw")
    lines = p.read_text(encoding="utf-8").split("\n")[:-1]
    rows = [ln + "\n" if ln.strip() else "" for ln in lines]
    return "\n\n".join(rows)


def wikitext2_valid(data_dir: Path) -> str:
    """WikiText-2 validation (tokenized release, with <unk>): the local stand-in for calibration text."""
    p = _need(data_dir / "wikitext2-raw" / "wiki.valid.tokens")
    return " ".join(ln.strip() for ln in p.read_text(encoding="utf-8").split("\n") if ln.strip())


def c4_documents(data_dir: Path, start: int, stop: int) -> list[str]:
    import pyarrow.parquet as pq

    p = _need(data_dir / "c4-validation-2k" / "c4_validation_2k.parquet")
    return pq.read_table(p).column("text").to_pylist()[start:stop]


def ptb_text(data_dir: Path, split: str = "test") -> str:
    """PTB (Mikolov), stripped rows joined with " " (the GPTQ / HF ptb_text_only convention)."""
    p = _need(data_dir / "ptb-mikolov" / f"ptb.{split}.txt")
    return " ".join(ln.strip() for ln in p.read_text(encoding="utf-8").split("\n"))


def _hub_eval_text(name: str) -> str:
    try:
        from datasets import load_dataset
    except ImportError as e:
        raise SecateurError(f"no data directory found and `datasets` is not installed to fetch {name}; "
                            "pass --data-dir or set SECATEUR_DATA") from e
    try:
        if name == "wikitext2":
            rows = load_dataset("wikitext", "wikitext-2-raw-v1", split="test")["text"]
            return "\n\n".join(rows)
        if name == "ptb":
            rows = load_dataset("ptb_text_only", "penn_treebank", split="test")["sentence"]
            return " ".join(rows)
        if name == "c4":
            ds = load_dataset("allenai/c4", data_files={"validation": "en/c4-validation.00000-of-00008.json.gz"},
                              split="validation")
            return " ".join(ds[:1100]["text"])
    except Exception as e:  # network errors come in many types
        raise SecateurError(f"could not fetch {name} from the hub ({type(e).__name__}); "
                            "pass --data-dir or set SECATEUR_DATA") from e
    raise SecateurError(f"unknown dataset {name!r}; choose from {', '.join(DATASETS)}")


def eval_text(name: str, data_dir: str | Path | None = None) -> str:
    """Evaluation text of a named corpus (test splits; C4: the held-out document slice)."""
    if name not in DATASETS:
        if Path(name).suffix == ".txt":
            return read_text_file(name)
        raise SecateurError(f"unknown dataset {name!r}; choose from {', '.join(DATASETS)} or a .txt file")
    d = resolve_data_dir(data_dir)
    if d is None:
        return _hub_eval_text(name)
    if name == "wikitext2":
        return wikitext2_test(d)
    if name == "ptb":
        return ptb_text(d, "test")
    return " ".join(c4_documents(d, *C4_EVAL_DOCS))


def calib_documents(name: str, data_dir: str | Path | None = None) -> list[str]:
    """Calibration pool as a list of documents (one string for single-stream corpora)."""
    if Path(name).suffix == ".txt":
        return [read_text_file(name)]
    if name not in DATASETS:
        raise SecateurError(f"unknown calibration set {name!r}; choose from self, {', '.join(DATASETS)} "
                            "or a .txt file")
    d = resolve_data_dir(data_dir)
    if d is None:
        try:
            from datasets import load_dataset

            if name == "c4":
                ds = load_dataset("allenai/c4", data_files={"train": "en/c4-train.00000-of-01024.json.gz"},
                                  split="train")
                return list(ds["text"])
            if name == "wikitext2":
                return [" ".join(load_dataset("wikitext", "wikitext-2-raw-v1", split="train")["text"])]
            return [" ".join(load_dataset("ptb_text_only", "penn_treebank", split="train")["sentence"])]
        except Exception as e:
            raise SecateurError(f"no data directory and the hub is unreachable for {name} "
                                f"({type(e).__name__}); pass --data-dir or set SECATEUR_DATA") from e
    if name == "c4":
        return c4_documents(d, *C4_CALIB_DOCS)
    if name == "wikitext2":
        return [wikitext2_valid(d)]
    return [ptb_text(d, "valid")]
