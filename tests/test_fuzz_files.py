"""Files secateur reads back, mutated by a generator and run through the CLI: every case keeps the promise of
``tests/contract.py`` (exit 0 with the output asked for, or exit 2 with one ``secateur: error: ...; fix`` line and
nothing new on disk; never a traceback, never a user file changed).

The valid files come from real runs, made once for the module: a tiny Llama pruned with wanda (its
``secateur-recipe.yaml``, ``secateur-report.json``, ``config.json``, ``tokenizer.json``, safetensors header and the
``ppl.json`` / ``zeroshot.json`` written beside it by ``secateur eval``), the checkpoint a prune interrupted after
its first block leaves, the zero-shot task files in the layout of ``../shared/data`` (their first lines, or the
same formats written here when the data is absent) and rows of the repository's own bench results files. A case
takes one of them and changes it the way a disk, an editor or a hand does: a value replaced by one of another
type, a key deleted or added, the file truncated, invalid UTF-8 or invalid syntax inserted, a scalar instead of a
mapping. Classes (``SECATEUR_FUZZ_LOG`` counts them): recipe, run-report, checkpoint-manifest, task-file,
report-json.

The commands chosen fail fast where they can (a recipe is checked before any model is loaded); a mutation that
leaves a file valid runs the command to its end, on tiny inputs. The ``ci`` profile runs a fixed set of cases;
``HYPOTHESIS_PROFILE=long`` (bench/checks/reliability_fuzz.py) runs more.
"""

from __future__ import annotations

import bz2
import json
import shutil
import tempfile
from pathlib import Path

import pytest
import yaml
from conftest import DATA_DIR
from contract import check, problem, record, run_cli, tree
from hypothesis import given
from hypothesis import strategies as st

from secateur.calib import engine
from secateur.calib.resume import checkpoint_dir
from secateur.testing import save_tiny, tiny_bpe_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

REPO = Path(__file__).resolve().parents[1]
PRUNE = ["--calib", "self", "--nsamples", "2", "--seqlen", "16", "--quiet"]
TEXT = "the quick brown fox jumps over the lazy dog. " * 40

# --- values and mutations ------------------------------------------------------------------------------------

INTS = st.sampled_from([-1, 0, 1, 2, 7, 2**40, int("1" * 64)])  # the last: a digest YAML read as a number
FLOATS = st.sampled_from([0.0, 0.5, 2.0, -1.5, 1e300, float("nan"), float("inf")])
WORDS = st.sampled_from(["", "abc", "0.5", "2", "true", "q,k", "null", "2:4", "é", "a" * 70]) | \
    st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=6)
SCALARS = st.one_of(st.none(), st.booleans(), INTS, FLOATS, WORDS)
VALUES = st.one_of(SCALARS, st.lists(st.one_of(INTS, WORDS), max_size=3),
                   st.dictionaries(WORDS, st.one_of(INTS, WORDS), max_size=2))
NEW_KEYS = st.sampled_from(["extra", "sparsty", "schema_version", "protocol", "ppl", "tasks", "gold"]) | WORDS


def _kind(v) -> str:
    return "bool" if isinstance(v, bool) else type(v).__name__


def _paths(node, prefix=()) -> list[tuple]:
    """Every key (mapping) and index (list) under ``node``, as paths from the top."""
    out = []
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for k, v in items:
        out.append(prefix + (k,))
        out += _paths(v, prefix + (k,))
    return out


def _parent(doc, path):
    for k in path[:-1]:
        doc = doc[k]
    return doc


def mutate_doc(data, doc, keep: tuple = ()) -> tuple[str, object]:
    """One change to a copy of ``doc`` (a mapping): ``(what was done, the new document)``. Keys in ``keep`` (top
    level) are never deleted."""
    doc = json.loads(json.dumps(doc))
    paths = _paths(doc)
    op = data.draw(st.sampled_from(["replace", "delete", "add"]))
    if op == "add":
        dicts = [()] + [p for p in paths if isinstance(_parent(doc, p + (None,)), dict)]
        where = data.draw(st.sampled_from(dicts))
        node = _parent(doc, where + (None,))
        key = data.draw(NEW_KEYS)
        node[key] = data.draw(VALUES)
        return f"add {where + (key,)}", doc
    path = data.draw(st.sampled_from(paths))
    parent = _parent(doc, path)
    if op == "delete" and not (len(path) == 1 and path[0] in keep):
        del parent[path[-1]]
        return f"delete {path}", doc
    old = parent[path[-1]]
    parent[path[-1]] = data.draw(VALUES.filter(lambda v: _kind(v) != _kind(old)))
    return f"replace {path} -> {parent[path[-1]]!r:.40}", doc


def mutate_bytes(data, raw: bytes) -> tuple[str, bytes]:
    """A file-level change: truncated, invalid UTF-8 or syntax inserted, or a scalar instead of a mapping."""
    op = data.draw(st.sampled_from(["truncate", "utf8", "syntax", "scalar"]))
    at = data.draw(st.integers(0, max(0, len(raw) - 1)))
    if op == "truncate":
        return f"truncate at {at}", raw[:at]
    if op == "utf8":
        return f"invalid UTF-8 at {at}", raw[:at] + b"\xff\xfe\xc3" + raw[at:]
    if op == "syntax":
        junk = data.draw(st.sampled_from([b"{", b"]", b":", b'"', b"\t- ", b"[[", b"\x00"]))
        return f"syntax {junk!r} at {at}", raw[:at] + junk + raw[at:]
    scalar = data.draw(st.sampled_from([b"5", b"[1, 2]", b"null", b'"text"', b"", b"   \n"]))
    return f"scalar {scalar!r}", scalar


def mutated(data, doc, dump, keep: tuple = ()) -> tuple[str, bytes]:
    """A document changed as a whole file (one time in four) or in one of its values."""
    if data.draw(st.integers(0, 3)) == 0:
        return mutate_bytes(data, dump(doc))
    what, new = mutate_doc(data, doc, keep)
    return what, dump(new)


def dump_json(doc) -> bytes:
    return json.dumps(doc, indent=1).encode()


def dump_yaml(doc) -> bytes:
    return yaml.safe_dump(doc, sort_keys=False, allow_unicode=True).encode()


# --- the valid inputs, made once ---------------------------------------------------------------------------

JSONL_TASKS = {  # task -> its JSONL file under the data folder (and the format README.txt describes)
    "boolq": "zeroshot/boolq.jsonl", "winogrande": "zeroshot/winogrande.jsonl", "arc_easy": "zeroshot/arc_easy.jsonl",
    "arc_challenge": "zeroshot/arc_challenge.jsonl", "openbookqa": "zeroshot/openbook_qa.jsonl",
    "piqa": "piqa-official/valid.jsonl",
}
SAMPLE_LINES = {  # the formats of ../shared/data, for a machine without it
    "zeroshot/boolq.jsonl": {"query": "Passage: Water boils at 100 degrees at sea level.\nQuestion: does water boil "
                                      "at 100 degrees?", "choices": ["no", "yes"], "gold": 1},
    "zeroshot/winogrande.jsonl": {"context_options": ["Sarah was a better surgeon than Maria so Sarah",
                                                      "Sarah was a better surgeon than Maria so Maria"],
                                  "continuation": "always got the harder cases.", "gold": 0},
    "zeroshot/arc_easy.jsonl": {"query": "Question: Which gas do plants take in?", "choices": ["oxygen",
                                "carbon dioxide", "helium", "neon"], "gold": 1},
    "zeroshot/arc_challenge.jsonl": {"query": "Question: What makes a planet's day shorter?", "choices": [
        "faster rotation", "slower rotation", "a larger moon"], "gold": 0},
    "zeroshot/openbook_qa.jsonl": {"query": "Predators eat", "choices": ["lions", "humans", "bunnies", "grass"],
                                   "gold": 2},
    "piqa-official/valid.jsonl": {"goal": "dresser", "sol1": "replace drawer with bobby pin",
                                  "sol2": "finish, woodgrain with bobby pin"},
}
N_LINES = 3


def _task_data(root: Path) -> Path:
    """A data folder in the layout of ../shared/data: the first lines of each JSONL task file (and piqa's labels),
    from the real data when it is here."""
    d = root / "tasks"
    for rel in JSONL_TASKS.values():
        src = DATA_DIR / rel
        if src.is_file():
            with src.open(encoding="utf-8") as f:
                lines = [next(f).rstrip("\n") for _ in range(N_LINES)]
        else:
            lines = [json.dumps(SAMPLE_LINES[rel])] * N_LINES
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_text("\n".join(lines) + "\n", encoding="utf-8")
    (d / "piqa-official" / "valid-labels.lst").write_text("0\n1\n1\n")
    return d


def _bench_rows() -> list[dict]:
    """Result rows of the repository's bench files in their layouts (a preset by name and by its parameters,
    zero-shot scores per task, kept widths, a Q/K allocation, a QK-error row), trimmed to a few layers."""
    rows = []
    for name in ("unstructured-smollm2.jsonl", "qk-wanda-smollm2.jsonl", "structured-smollm2.jsonl"):
        path = REPO / "results" / "text" / name
        if not path.is_file():
            continue
        taken = {"row": 0, "qk-error": 0}
        for line in path.read_text().splitlines():
            row = json.loads(line)
            kind = row.get("kind", "row")
            if kind not in taken or taken[kind] >= (2 if kind == "row" else 1):
                continue
            if isinstance(row.get("per_layer"), list):
                row["per_layer"] = row["per_layer"][:4]
            if isinstance(row.get("allocation"), dict) and isinstance(row["allocation"].get("per_block"), list):
                row["allocation"]["per_block"] = row["allocation"]["per_block"][:3]
            taken[kind] += 1
            rows.append(row)
    if not rows:  # the layouts, written here
        rows = [{"row": "dense", "preset": "p", "wikitext2": {"ppl": 20.0, "protocol": "nonoverlap-64",
                                                               "windows": 2, "windows_total": 5}},
                {"row": "wanda-50", "preset": {"name": "p", "nsamples": 4}, "sparsity": 0.5,
                 "zeroshot": {"limit": 10, "mean": 45.0, "se": 1.0, "tasks": {"boolq": 0.6, "rte": 0.3}},
                 "per_layer": [{"layer": 0, "group": "mlp", "kept": 12, "width": 16}],
                 "allocation": {"per_block": [{"block": 0, "rho_q": 0.5, "rho_k": 0.4}], "mean_rho_q": 0.5}},
                {"kind": "qk-error", "row": "wanda-50", "preset": "p", "e_qk": 12.5, "per_block": [10.0, 15.0]}]
    return rows


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """The valid inputs (see the module docstring), under one folder; the cache is a folder of its own."""
    root = tmp_path_factory.mktemp("fuzz-files")
    mp = pytest.MonkeyPatch()
    mp.setenv("SECATEUR_CACHE", str(root / "cache"))
    model = root / "model"
    save_tiny("llama", model)
    tiny_bpe_tokenizer(128).save_pretrained(model)  # byte-level BPE: what export gguf can write
    run = root / "run"
    assert run_cli(["prune", "--model", str(model), *PRUNE, "--out", str(run)])[0] == 0
    text = root / "eval.txt"
    text.write_text(TEXT)
    tasks = _task_data(root)
    for argv in (["eval", "ppl", "--model", str(run), "--dataset", str(text), "--seqlen", "32", "--max-windows", "2",
                  "--quiet", "--json", str(run / "ppl.json")],
                 ["eval", "zeroshot", "--model", str(run), "--tasks", "arc_easy", "--limit", "2", "--data-dir",
                  str(tasks), "--quiet", "--json", str(run / "zeroshot.json")]):
        code, _, err = run_cli(argv)
        assert code == 0, err
    # a prune interrupted after its first block leaves its checkpoint beside --out
    out = root / "ck" / "out"
    out.parent.mkdir()

    def stop(i: int) -> None:
        if i == 0:
            raise KeyboardInterrupt

    with pytest.MonkeyPatch.context() as m:
        m.setattr(engine, "_after_block", stop)
        code, _, err = run_cli(["prune", "--model", str(model), *PRUNE, "--out", str(out)])
    ckpt = checkpoint_dir(out)
    assert code == 130 and ckpt.is_dir(), err
    bench = root / "bench.jsonl"
    bench.write_text("\n".join(json.dumps(r) for r in _bench_rows()) + "\n")
    yield {"root": root, "model": model, "run": run, "tasks": tasks, "ckpt": ckpt, "bench": bench}
    mp.undo()


@pytest.fixture
def case(base):
    """A fresh scratch folder per generated case (removed after it, so a long run stays small)."""
    made: list[Path] = []

    def new() -> Path:
        made.append(Path(tempfile.mkdtemp(dir=base["root"], prefix="case-")))
        return made[-1]

    yield new
    for p in made:
        shutil.rmtree(p, ignore_errors=True)


def _log(what: str):
    """Names the mutation in a failing case's report (hypothesis prints notes)."""
    from hypothesis import note

    note(what)


# --- recipes -----------------------------------------------------------------------------------------------------


@given(data=st.data())
def test_recipe(base, case, data):
    recipe = yaml.safe_load((base["run"] / "secateur-recipe.yaml").read_text())
    # the default model (no `model:`) is the real SmolLM2, a download or 500 MB to hash: never deleted here
    what, raw = mutated(data, recipe, dump_yaml, keep=("model",))
    _log(what)
    d = case()
    path = d / "recipe.yaml"
    path.write_bytes(raw)
    out = d / "out"
    code, _, err = check("recipe", ["prune", "--recipe", str(path), "--out", str(out), "--quiet"],
                         [base["model"], d], allowed_new=[out])
    assert code == 2 or (out / "model.safetensors").is_file()


@pytest.mark.parametrize("value, words", [
    ("sparsity: abc", r"sparsity: input should be a valid number \(got 'abc'\); write the fraction"),
    ("nsamples: '2'", r"nsamples: input should be a valid integer \(got '2'\); write a whole number"),
    ("targets: [q, k]", r"targets: input should be a valid string .*; write a comma-separated string"),
    ("calib: 5", r"calib: input should be a valid string \(got 5\)"),
    ("seed: 1.5", r"seed: input should be a valid integer"),
    ("structured: 'true'", r"structured: input should be a valid boolean"),
    ("segment_len: '64'", r"segment_len: input should be a valid integer"),
    ("pattern: 2:4", r"pattern: input should be a valid string \(got 124\); write N:M in quotes"),
])
def test_recipe_value_of_the_wrong_type_is_named(base, tmp_path, value, words):
    import re

    key = value.split(":")[0]
    lines = [line for line in (base["run"] / "secateur-recipe.yaml").read_text().splitlines()
             if not line.startswith(key + ":")]
    path = tmp_path / "recipe.yaml"
    path.write_text("\n".join(lines) + f"\n{value}\n")
    code, _, err = check("recipe", ["prune", "--recipe", str(path), "--out", str(tmp_path / "out")], [tmp_path])
    assert code == 2 and str(path) in err and re.search(words, err), err


def test_recipe_decimal_digest_is_refused_not_ignored(base, tmp_path):
    text = (base["run"] / "secateur-recipe.yaml").read_text()
    digest = yaml.safe_load(text)["check"]["calibration_sha256"]
    path = tmp_path / "recipe.yaml"
    path.write_text(text.replace(digest, "1" * 64))  # unquoted: YAML reads an integer
    code, _, err = check("recipe", ["prune", "--recipe", str(path), "--out", str(tmp_path / "out")], [tmp_path])
    assert code == 2 and "check.calibration_sha256: a number, not a digest" in err and "quote it" in err, err


def test_recipe_exponent_number_is_a_number(base, tmp_path):
    """``sparsity: 5e-1`` unquoted is a string to PyYAML (YAML 1.1), a number to the user: read as 0.5."""
    from secateur.options import options_from_recipe

    text = (base["run"] / "secateur-recipe.yaml").read_text().replace("sparsity: 0.5", "sparsity: 5e-1")
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    assert options_from_recipe(str(path)).sparsity == 0.5


# --- run folders: export gguf and report ---------------------------------------------------------------------

RUN_FILES = ("secateur-report.json", "config.json", "tokenizer.json", "ppl.json", "zeroshot.json",
             "model.safetensors")


def _mutate_safetensors(data, raw: bytes) -> tuple[str, bytes]:
    """The safetensors header changed as a JSON document (its length prefix kept right), or the file truncated."""
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    if data.draw(st.booleans()):
        at = data.draw(st.integers(0, len(raw) - 1))
        return f"truncate at {at}", raw[:at]
    what, new = mutate_doc(data, header)
    text = json.dumps(new).encode()
    return "header " + what, len(text).to_bytes(8, "little") + text + raw[8 + n:]


def _run_copy(data, base, d: Path, files=RUN_FILES) -> Path:
    run = d / "run"
    shutil.copytree(base["run"], run)
    name = data.draw(st.sampled_from(files))
    f = run / name
    if name.endswith(".safetensors"):
        what, raw = _mutate_safetensors(data, f.read_bytes())
    else:
        what, raw = mutated(data, json.loads(f.read_text()), dump_json)
    _log(f"{name}: {what}")
    f.write_bytes(raw)
    return run


def _resize_config(data, run: Path) -> None:
    """A size in config.json changed to another whole number: the config disagrees with the weights."""
    f = run / "config.json"
    cfg = json.loads(f.read_text())
    key = data.draw(st.sampled_from(sorted(k for k, v in cfg.items() if _kind(v) == "int")))
    cfg[key] = data.draw(st.sampled_from([-5, 0, 1, 3, 64, 2**31]).filter(lambda v: v != cfg[key]))
    _log(f"config.json: {key} -> {cfg[key]}")
    f.write_text(json.dumps(cfg, indent=1))


@given(data=st.data())
def test_export_gguf_run_folder(base, case, data):
    d = case()
    if data.draw(st.integers(0, 4)) == 0:
        run = d / "run"
        shutil.copytree(base["run"], run)
        _resize_config(data, run)
    else:
        run = _run_copy(data, base, d, ("secateur-report.json", "config.json", "tokenizer.json", "model.safetensors"))
    out = d / "model.gguf"
    code, _, err = check("run-report", ["export", "gguf", str(run), "--out", str(out), "--type", "f32"], [d],
                         allowed_new=[out])
    assert code == 2 or out.is_file()


@given(data=st.data())
def test_report_run_folder(base, case, data):
    d = case()
    run = _run_copy(data, base, d, ("secateur-report.json", "ppl.json", "zeroshot.json"))
    out = d / "rep"
    code, _, err = check("run-report", ["report", str(run), "--out", str(out)], [d], allowed_new=[out])
    assert code == 2 or (out / "report.md").is_file()


@given(data=st.data())
def test_report_bench_rows(base, case, data):
    rows = [json.loads(line) for line in base["bench"].read_text().splitlines()]
    d = case()
    path = d / "results.jsonl"
    i = data.draw(st.integers(0, len(rows) - 1))
    if data.draw(st.integers(0, 4)) == 0:
        what, raw = mutate_bytes(data, base["bench"].read_bytes())
    else:
        what, new = mutate_doc(data, rows[i])
        rows[i] = new
        raw = ("\n".join(json.dumps(r) for r in rows) + "\n").encode()
    _log(f"row {i}: {what}")
    path.write_bytes(raw)
    out = d / "rep"
    code, _, err = check("report-json", ["report", str(path), "--out", str(out)], [d], allowed_new=[out])
    assert code == 2 or (out / "report.md").is_file()


def test_every_bench_results_file_of_the_repository_makes_a_report():
    """The repository's own results files (a preset written as its parameters, zero-shot scores per task) are read
    and tabulated (plots aside: they are the same code for every input)."""
    from secateur.errors import SecateurError
    from secateur.report.build import build
    from secateur.report.load import load_inputs

    files = sorted((REPO / "results").glob("*/*.jsonl"))
    read = 0
    for f in files:
        try:
            runs = load_inputs([str(f)])
        except SecateurError as e:
            assert "no result rows" in str(e), e  # files of other records (efficiency, the error table)
            continue
        build(runs, "t", with_plots=False)
        read += 1
    assert read >= min(len(files), 5)


# --- the checkpoint manifest -----------------------------------------------------------------------------------


@given(data=st.data())
def test_checkpoint_manifest(base, case, data):
    d = case()
    out = d / "out"
    ckpt = checkpoint_dir(out)
    shutil.copytree(base["ckpt"], ckpt)
    manifest = ckpt / "manifest.json"
    what, raw = mutated(data, json.loads(manifest.read_text()), dump_json)
    _log(what)
    manifest.write_bytes(raw)
    roots = [base["model"], d]
    before = tree(*roots)
    code, _, err = run_cli(["prune", "--model", str(base["model"]), *PRUNE, "--out", str(out), "--resume"])
    if code == 0:  # resumed (or replaced it): the checkpoint is spent, the output is written
        before = {k: v for k, v in before.items() if not k.startswith(str(ckpt))}
        assert not ckpt.exists() and (out / "model.safetensors").is_file()
    verdict = problem(code, err, before, tree(*roots), [out])
    record("checkpoint-manifest", code, verdict)
    assert verdict is None, f"checkpoint-manifest: {what}: {verdict}"
    if code == 2:
        assert "drop --resume" in err or "delete it" in err or "move it away" in err, err


# --- zero-shot task files --------------------------------------------------------------------------------------


def _zeroshot(model: Path, task: str, data_dir: Path) -> list[str]:
    return ["eval", "zeroshot", "--model", str(model), "--tasks", task, "--data-dir", str(data_dir), "--limit", "2",
            "--quiet"]


@given(data=st.data())
def test_task_file(base, case, data):
    d = case()
    tasks = d / "data"
    shutil.copytree(base["tasks"], tasks)
    task = data.draw(st.sampled_from(sorted(JSONL_TASKS)))
    f = tasks / JSONL_TASKS[task]
    lines = f.read_text(encoding="utf-8").splitlines()
    op = data.draw(st.integers(0, 5))
    if op == 0:
        what, raw = mutate_bytes(data, f.read_bytes())
    elif op == 1 and task == "piqa":
        labels = f.parent / "valid-labels.lst"
        what, raw = mutate_bytes(data, labels.read_bytes())
        f = labels
    else:
        i = data.draw(st.integers(0, len(lines) - 1))
        what, new = mutate_doc(data, json.loads(lines[i]))
        lines[i] = json.dumps(new)
        what = f"line {i + 1}: {what}"
        raw = ("\n".join(lines) + "\n").encode()
    _log(f"{f.name}: {what}")
    f.write_bytes(raw)
    code, out, err = check("task-file", _zeroshot(base["model"], task, tasks), [d, base["model"]])
    if code == 2:
        assert f.name in err, err
    else:
        assert "nan" not in out.lower(), out


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_empty_task_file_is_refused_not_nan(base, tmp_path, content):
    tasks = tmp_path / "data"
    shutil.copytree(base["tasks"], tasks)
    (tasks / "zeroshot" / "arc_easy.jsonl").write_text(content)
    code, _, err = check("task-file", _zeroshot(base["model"], "arc_easy", tasks), [tmp_path])
    assert code == 2 and "arc_easy.jsonl: no documents in the zero-shot task arc_easy" in err, err


def test_task_line_names_file_line_and_key(base, tmp_path):
    tasks = tmp_path / "data"
    shutil.copytree(base["tasks"], tasks)
    f = tasks / "zeroshot" / "winogrande.jsonl"
    lines = f.read_text().splitlines()
    row = json.loads(lines[1])
    del row["continuation"]
    lines[1] = json.dumps(row)
    f.write_text("\n".join(lines) + "\n")
    code, _, err = check("task-file", _zeroshot(base["model"], "winogrande", tasks), [tmp_path])
    assert code == 2 and f"{f}:2: continuation: missing;" in err, err


def test_hellaswag_and_rte_damaged(base, tmp_path):
    """The two task files that are not JSONL: a bz2 text of 6 lines per item, a TSV / parquet table."""
    tasks = tmp_path / "data"
    (tasks / "hellaswag").mkdir(parents=True)
    item = ["Sports: A man stands on a field.", "7", "he runs.", "he sits.", "he waves.", "he jumps."]
    (tasks / "hellaswag" / "hellaswag_val_full.txt.bz2").write_bytes(bz2.compress("\n".join(item).encode()))
    code, _, err = check("task-file", _zeroshot(base["model"], "hellaswag", tasks), [tmp_path])
    assert code == 2 and "hellaswag_val_full.txt.bz2:2: label: '7' is not 0, 1, 2 or 3" in err, err
    (tasks / "hellaswag" / "hellaswag_val_full.txt.bz2").write_bytes(b"BZh91AY&SY-truncated")
    code, _, err = check("task-file", _zeroshot(base["model"], "hellaswag", tasks), [tmp_path])
    assert code == 2 and "not a complete bz2 file" in err, err
    (tasks / "rte-glue").mkdir()
    (tasks / "rte-glue" / "dev.tsv").write_text("sentence1\tsentence2\tlabel\tidx\nA cat.\tAn animal.\tyes\t0\n")
    code, _, err = check("task-file", _zeroshot(base["model"], "rte", tasks), [tmp_path])
    assert code == 2 and "dev.tsv: row 1: label: input should be a valid integer (got 'yes')" in err, err
