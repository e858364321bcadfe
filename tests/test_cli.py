"""CLI: bad input gives one line, exit code 2 and no output; a tiny end-to-end prune + eval."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from secateur.cli import main
from secateur.testing import save_tiny


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny("llama", tmp_path_factory.mktemp("m") / "tiny")


@pytest.fixture
def calib_txt(tmp_path):
    p = tmp_path / "calib.txt"
    p.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    return str(p)


def _prune(tiny_dir, out, *extra):
    return main(["prune", "--model", tiny_dir, "--calib", "self", "--nsamples", "2", "--seqlen", "16", "--quiet",
                 "--out", str(out), *extra])


@pytest.mark.parametrize("extra,msg", [
    (["--method", "nope"], "unknown method"),
    (["--sparsity", "1.0"], "sparsity must be in [0, 1)"),
    (["--sparsity", "-0.1"], "sparsity must be in [0, 1)"),
    (["--pattern", "3:7"], "does not divide"),
    (["--pattern", "4:2"], "0 < N < M"),
    (["--data-dir", "/nonexistent/data"], "does not exist"),
    (["--targets", "q,zz"], "unknown projection roles"),
    (["--calib", "/nonexistent/file.txt"], "missing data file"),
    (["--heldout", "4"], "only applies to --method cocurve"),
    (["--method", "cocurve", "--units", "channel"], "selects its own units"),
])
def test_bad_input_exits_2_and_writes_nothing(tiny_dir, tmp_path, capsys, extra, msg):
    out = tmp_path / "out"
    assert _prune(tiny_dir, out, *extra) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("secateur:")]
    assert len(err) == 1 and msg in err[0]
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_model_folder_without_weights(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text("{}")
    assert main(["prune", "--model", str(tmp_path / "empty"), "--out", str(tmp_path / "o")]) == 2
    assert "has no weights" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_nan_activations_exit_2(tmp_path, capsys):
    path = save_tiny("llama", tmp_path / "nan")
    m = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        m.model.layers[0].input_layernorm.weight.fill_(float("nan"))
    m.save_pretrained(path)
    assert main(["prune", "--model", path, "--calib", str(_write(tmp_path)), "--nsamples", "2", "--seqlen", "16",
                 "--quiet", "--out", str(tmp_path / "o")]) == 2
    assert "non-finite" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def _write(tmp_path):
    p = tmp_path / "c.txt"
    p.write_text("abc def ghi " * 50)
    return p


def test_unknown_family(tmp_path, capsys):
    from transformers import GPTNeoXConfig

    cfg = GPTNeoXConfig(vocab_size=128, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                        intermediate_size=64)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "neox")
    from secateur.testing import tiny_tokenizer

    tiny_tokenizer().save_pretrained(tmp_path / "neox")
    assert main(["prune", "--model", str(tmp_path / "neox"), "--method", "magnitude", "--out",
                 str(tmp_path / "o")]) == 2
    assert "unsupported model family 'gpt_neox'; supported: gemma3_text, gpt2, llama" in capsys.readouterr().err


@pytest.mark.parametrize("method", ["magnitude", "wanda", "sparsegpt"])
def test_prune_then_eval_end_to_end(tiny_dir, tmp_path, calib_txt, method, capsys):
    out = tmp_path / method
    assert main(["prune", "--model", tiny_dir, "--method", method, "--calib", calib_txt, "--nsamples", "2",
                 "--seqlen", "32", "--quiet", "--out", str(out)]) == 0
    rep = json.loads((out / "secateur-report.json").read_text())
    assert rep["method"] == method and abs(rep["realized_sparsity"]["targeted"] - 0.5) < 0.01
    if method != "magnitude":
        assert len(rep["calibration"]["sha256"]) == 64
    assert {"versions", "timings", "peak_rss_mb"} <= rep.keys()
    assert main(["eval", "ppl", "--model", str(out), "--dataset", calib_txt, "--seqlen", "64", "--quiet",
                 "--json", str(tmp_path / "p.json")]) == 0
    assert json.loads((tmp_path / "p.json").read_text())["protocol"] == "nonoverlap-64"


def test_self_generated_calibration_is_seeded(tiny_dir, tmp_path):
    a = _prune(tiny_dir, tmp_path / "a")
    b = _prune(tiny_dir, tmp_path / "b")
    assert a == b == 0
    ra = json.loads((tmp_path / "a" / "secateur-report.json").read_text())["calibration"]
    rb = json.loads((tmp_path / "b" / "secateur-report.json").read_text())["calibration"]
    assert ra["sha256"] == rb["sha256"] and ra["source"] == "self"


@pytest.mark.parametrize("value", ["wan\nda", "wanda\x1e2", "w\x00x", "\u2028"])
@pytest.mark.parametrize("argv", [["prune", "--method"], ["prune", "--sparsity"], ["eval", "ppl", "--seqlen"],
                                  ["prune"], ["eval", "ppl", "--quiet", "x"]])  # the last two: unrecognized arguments
def test_parser_errors_are_one_line_whatever_the_value(argv, value, capsys):
    """argparse echoes a bad value into its message; control characters (a newline, a record separator) must not
    split the CLI's single error line."""
    try:
        code = main([*argv, value])  # refused by the options' schema
    except SystemExit as e:  # refused by argparse (a type or choice)
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("secateur: error: ") and len(err.splitlines()) == 1, err



def test_the_error_line_ends_with_the_page_that_explains_its_input(tmp_path, capfd, monkeypatch):
    """Issue 48: each one-line error names its docs page, chosen by the module that raised it (secateur.errors.
    TOPICS), and that page exists; the exception the API raises keeps the message alone."""
    from pathlib import Path

    from secateur.calib.dist import rendezvous
    from secateur.errors import TOPICS, SecateurError, docs_page

    docs = Path(__file__).resolve().parents[1] / "docs"
    assert all((docs / page).is_file() for _, _, page in TOPICS)
    for k, v in {"MASTER_ADDR": "nowhere.invalid", "MASTER_PORT": "1", "WORLD_SIZE": "2", "RANK": "0"}.items():
        monkeypatch.setenv(k, v)
    assert main(["eval", "ppl", "--model", str(tmp_path), "--dataset", "wikitext2"]) == 2
    line = capfd.readouterr().err.strip()
    assert "\n" not in line and line.endswith("(docs/distributed.md)") and "MASTER_ADDR" in line, line
    with pytest.raises(SecateurError) as e:
        rendezvous()
    assert "docs/" not in str(e.value) and docs_page(e.value) == "distributed.md"
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert main(["prune", "--model", str(tmp_path), "--method", "wanda", "--sparsity", "1.5"]) == 2
    assert capfd.readouterr().err.strip().endswith("(docs/errors.md)")  # raised in secateur/errors.py
