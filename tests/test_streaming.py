"""Block-streamed pruning and evaluation (``--stream``): a model built on the meta device, one decoder block loaded
from its safetensors at a time, pruned, written to the output's shards and freed.

* the streamed prune equals the in-memory prune bit for bit (weights, masks, config), for every unstructured
  method, a tied-embedding family with prefixed names (GPT-2) and bfloat16; the output is a standard sharded
  folder that one ``from_pretrained`` reloads;
* at most one block is ever materialized (counted from the engine's per-block seam);
* the memory plan refuses a run the machine cannot hold (exit 2, one line, nothing written);
* streamed perplexity equals the ordinary path's within a derived float32 bound;
* what ``--stream`` does not do is refused in one line.
"""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import random_calib_text, save_sharded_tiny
from safetensors import safe_open
from safetensors.torch import load_file

import secateur.export.shards as shards
from secateur import api
from secateur.calib import engine
from secateur.cli import main
from secateur.errors import SecateurError
from secateur.masks_file import load_masks
from secateur.models.streaming import PackedMasks
from secateur.testing import tiny_model, tiny_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")
LAYERS = 3
COMMON = dict(sparsity=0.5, nsamples=4, seqlen=32, chunk_size=2, quiet=True)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("stream")
    text = random_calib_text(root / "calib.txt")
    return {f: save_sharded_tiny(root / f, f, LAYERS) for f in ("llama", "gpt2")} | {"text": text}


@pytest.fixture
def small_shards(monkeypatch):
    monkeypatch.setattr(shards, "DEFAULT_MAX_SHARD_BYTES", 30_000)  # several output shards on a tiny model


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out |= load_file(f)
    return out


@pytest.mark.parametrize("family,method,dtype", [("llama", "magnitude", "float32"), ("llama", "wanda", "float32"),
                                                 ("llama", "sparsegpt", "float32"), ("gpt2", "wanda", "float32"),
                                                 ("llama", "wanda", "bfloat16")])
def test_streamed_prune_equals_the_in_memory_prune(folders, tmp_path, small_shards, opened, family, method, dtype):
    from transformers import AutoModelForCausalLM

    kw = dict(model=folders[family], method=method, calib=folders["text"], dtype=dtype, **COMMON)
    api.prune(out=str(tmp_path / "mem"), **kw)
    rep = api.prune(out=str(tmp_path / "str"), stream=True, **kw)
    mem, st = tmp_path / "mem", tmp_path / "str"
    a, b = _weights(mem), _weights(st)
    assert a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
    ma, mb = load_masks(mem / "secateur-masks.npz"), load_masks(st / "secateur-masks.npz")
    assert ma.keys() == mb.keys() and all(torch.equal(ma[k], mb[k]) for k in ma)
    assert json.loads((mem / "config.json").read_text()) == json.loads((st / "config.json").read_text())
    others = {p.name for p in mem.iterdir() if p.suffix != ".safetensors" and p.name != "secateur-report.json"}
    assert others <= {p.name for p in st.iterdir()}  # generation config, tokenizer files, masks: byte for byte
    differ = {"secateur-masks.npz", "README.md", "secateur-recipe.yaml"}  # the card and recipe say --stream
    assert all((mem / n).read_bytes() == (st / n).read_bytes() for n in others - differ)
    index = json.loads((st / shards.INDEX_NAME).read_text())
    assert len(set(index["weight_map"].values())) > 1 and set(index["weight_map"]) == set(b)
    reloaded = AutoModelForCausalLM.from_pretrained(st)  # one call, a standard sharded folder
    ref = AutoModelForCausalLM.from_pretrained(mem)
    sd, sr = reloaded.state_dict(), ref.state_dict()
    assert sd.keys() == sr.keys() and all(torch.equal(sd[k], sr[k]) for k in sd)
    assert rep["options"]["stream"] is True and "stream" not in json.loads((mem / "secateur-report.json").read_text())[
        "options"]
    assert rep["memory_plan"]["total_bytes"] > 0
    # the run's block source: every block released; the model carries no context of its own
    assert len(opened) == 1 and opened[0].model is rep.model and not opened[0].loaded
    assert opened[0].materialized_blocks() == [] and not hasattr(rep.model, "secateur_stream")


def test_one_block_materialized_at_a_time(folders, tmp_path, monkeypatch):
    """The engine's per-block seam sees exactly the block it visits off the meta device; afterwards none."""
    import secateur.models.streaming as streaming

    seen: list[tuple[int, list[int]]] = []
    holder: dict = {}
    orig_open = streaming.open_streamed

    def open_spy(*a, **k):
        holder["stream"] = orig_open(*a, **k)
        return holder["stream"]

    monkeypatch.setattr(streaming, "open_streamed", open_spy)
    heads: list[str] = []

    def after(i):
        seen.append((i, holder["stream"].materialized_blocks()))
        heads.append(holder["stream"].model.lm_head.weight.device.type)

    monkeypatch.setattr(engine, "_after_block", after)
    api.prune(model=folders["llama"], method="sparsegpt", calib=folders["text"], out=str(tmp_path / "o"),
              stream=True, **COMMON)
    assert seen == [(i, [i]) for i in range(LAYERS)]
    assert holder["stream"].materialized_blocks() == []
    # the tiny Llama's head is untied: never held by the prune (copied file to file; the output equals the
    # in-memory run's, test above), while the embeddings it is not tied to are
    assert heads == ["meta"] * LAYERS and holder["stream"].deferred == {"lm_head.weight"}
    assert holder["stream"].model.get_input_embeddings().weight.device.type == "cpu"


def test_memory_refusal_exit_2_nothing_written(folders, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SECATEUR_MEM_AVAILABLE_MB", "0.01")
    out = tmp_path / "o"
    rc = main(["prune", "--model", folders["llama"], "--method", "wanda", "--calib", folders["text"], "--nsamples",
               "4", "--seqlen", "32", "--out", str(out), "--stream", "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2
    lines = [ln for ln in err.splitlines() if ln.startswith("secateur: error:")]
    assert len(lines) == 1 and "not enough memory for the streamed prune" in lines[0]
    assert "10.2 KiB is available" in lines[0] and "--nsamples" in lines[0]
    assert "memory plan (streamed prune): this process holds" in err and "adds about" in err
    assert "N 4 x T 32 x (3 x d 32 + F 64)" in err
    assert not out.exists() and not list(tmp_path.glob(".o.*"))


def test_an_ordinary_prune_too_big_for_memory_names_stream(folders, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SECATEUR_MEM_AVAILABLE_MB", "0.05")
    out = tmp_path / "o"
    rc = main(["prune", "--model", folders["llama"], "--method", "magnitude", "--out", str(out), "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and "not enough memory for the prune" in err and "pass --stream" in err and not out.exists()
    monkeypatch.setenv("SECATEUR_MEM_AVAILABLE_MB", "1")  # the streamed plan fits where the whole model does not
    assert main(["prune", "--model", folders["llama"], "--method", "magnitude", "--out", str(out), "--quiet",
                 "--stream"]) == 0


def test_memory_plan_fits_its_formula(folders):
    """The plan's activation term is the formula it prints, and the totals add up."""
    from secateur.methods.registry import METHODS
    from secateur.models.adapters import get_adapter
    from secateur.models.memory import prune_plan, shape_of
    from secateur.models.streaming import open_streamed

    s = open_streamed(folders["llama"])
    shape = shape_of(s.model, get_adapter(s.model), s)
    from secateur.methods.unstructured import ROW_CHUNK_ELEMENTS, UnstructuredConfig

    plan = prune_plan(shape, METHODS["wanda"].memory(shape, UnstructuredConfig("wanda")), True, nsamples=8,
                      seqlen=512, chunk=8)
    assert plan.terms["activations"][0] == 8 * 512 * (3 * 32 + 64) * 4
    # the selection on the largest projection (d 32 x F 64 here): float64 scores + |W| (float32) + row chunks
    assert plan.terms["selection"][0] == (8 + 4) * 32 * 64 + 16 * ROW_CHUNK_ELEMENTS
    whole = METHODS["magnitude"].memory(shape, UnstructuredConfig("magnitude"))  # one pool: kthvalue over it all
    assert set(whole) == {"selection"} and whole["selection"][0] == (24 + 4) * 32 * 64
    assert set(METHODS["sparsegpt"].memory(shape, UnstructuredConfig("sparsegpt"))) == {"statistics"}
    assert plan.total == sum(b for b, _ in plan.terms.values())
    params = sum(p.numel() for n, p in s.model.named_parameters() if n.startswith("model.layers.0."))
    assert shape.block == params * 4 and shape.layers == LAYERS
    head = s.model.lm_head.weight.numel() * 4  # untied: counted by the evaluation's plan, not by the prune's
    assert shape.head == head and plan.terms["resident"][0] == shape.resident - head


@pytest.mark.parametrize("stride,max_windows", [(None, 6), (12, 6), (12, None)])  # the last: a shorter tail window
def test_streamed_ppl_equals_the_ordinary_path(folders, tmp_path, stride, max_windows):
    """Bound: both routes run the same float32 kernels on the same inputs (each window alone, same block kwargs);
    the only admissible difference is the order of float32 sums inside a kernel. A reordered sum of n terms moves by
    at most n u sum|terms| (u = 2^-24), so with L blocks and reductions of at most n = max(d, F, T) = 64 terms the
    logits move by at most about L n u max|z|, and the per-token cross-entropy by at most twice that
    (|d CE| <= 2 ||dz||_inf); log ppl is a mean of them: |log ppl_s - log ppl| <= 2 L n u max|z|."""
    text = folders["text"]
    if max_windows is None:  # 101 characters (tokens): windows at 0, 12, ..., 72, the last one 29 tokens long
        text = tmp_path / "short.txt"
        text.write_text(Path(folders["text"]).read_text()[:101])
    kw = dict(dataset=str(text), seqlen=32, stride=stride, max_windows=max_windows, progress=False)
    normal = api.eval_ppl(folders["llama"], **kw)
    streamed = api.eval_ppl(folders["llama"], stream=True, **kw)
    from secateur.models.loading import load_model

    dense, tok = load_model(folders["llama"])
    ids = torch.tensor([tok("abcdefgh ij" * 4)["input_ids"][:32]])
    with torch.no_grad():
        zmax = float(dense(ids).logits.abs().max())
    bound = 2 * LAYERS * 64 * 2.0**-24 * max(zmax, 1.0)
    if max_windows is None:
        assert (normal["corpus_tokens"] - 32) % 12 != 0  # the last window is shorter than the others
    assert streamed["streamed"] is True and streamed["windows"] == normal["windows"]
    assert streamed["scored_tokens"] == normal["scored_tokens"] and streamed["protocol"] == normal["protocol"]
    assert abs(math.log(streamed["ppl"]) - math.log(normal["ppl"])) <= bound  # measured here: 0 (bitwise equal)


def test_streamed_eval_of_a_streamed_prune(folders, tmp_path):
    out = tmp_path / "o"
    rc = main(["prune", "--model", folders["llama"], "--method", "wanda", "--calib", folders["text"], "--nsamples",
               "4", "--seqlen", "32", "--out", str(out), "--stream", "--quiet", "--eval-ppl", folders["text"],
               "--eval-windows", "2"])
    assert rc == 0
    a = api.eval_ppl(str(out), dataset=folders["text"], seqlen=32, max_windows=2, progress=False)
    b = api.eval_ppl(str(out), dataset=folders["text"], seqlen=32, max_windows=2, progress=False, stream=True)
    assert abs(math.log(a["ppl"]) - math.log(b["ppl"])) <= 2 * LAYERS * 64 * 2.0**-24 * 20


@pytest.mark.parametrize("kw,msg", [
    ({"method": "qk-wanda"}, "--method qk-wanda is not block-streamed yet"),
    ({"method": "corp-qk"}, "--method corp-qk is not block-streamed yet"),
    ({"method": "cocurve"}, "--method cocurve is not block-streamed: its ablation sweep"),
    ({"method": "wanda", "calib": "self"}, "cannot sample calibration text from the model"),
    ({"method": "wanda", "out": None}, "pass --out"),
    ({"method": "wanda", "resume": True}, "--resume does not apply to --stream"),
])
def test_what_stream_refuses(folders, tmp_path, kw, msg):
    args = dict(model=folders["llama"], calib=folders["text"], out=str(tmp_path / "o"), stream=True, **COMMON) | kw
    with pytest.raises(SecateurError, match=msg.replace("-", r"\-")):
        api.prune(**args)
    assert not (tmp_path / "o").exists()


def test_a_loaded_model_is_not_streamed(folders, tmp_path):
    from secateur.models.loading import load_model

    model, tok = load_model(folders["llama"])
    with pytest.raises(SecateurError, match="already in memory"):
        api.prune(model=model, tokenizer=tok, method="wanda", calib=folders["text"], out=str(tmp_path / "o"),
                  stream=True, **COMMON)
    with pytest.raises(SecateurError, match="already in memory"):
        api.eval_ppl(model, dataset=folders["text"], tokenizer=tok, seqlen=32, stream=True)


def test_shard_writer_plans_writes_and_checks(tmp_path):
    specs = [shards.Spec("a", torch.float32, (3, 4)), shards.Spec("b", torch.bfloat16, (5,)),
             shards.Spec("c", torch.int64, (2, 2)), shards.Spec("d", torch.float16, ())]
    w = shards.ShardWriter(tmp_path, specs, max_shard_bytes=50)
    assert [s.file for s in w.shards] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    vals = {"a": torch.randn(3, 4), "b": torch.randn(5).bfloat16(), "c": torch.arange(4).view(2, 2),
            "d": torch.tensor(1.5, dtype=torch.float16)}
    for k in ("d", "b", "a"):  # any order
        w.write(k, vals[k])
    with pytest.raises(SecateurError, match="never written"):
        w.close()
    with pytest.raises(SecateurError, match="the export plan says"):
        w.write("c", vals["c"].float())
    w.write("c", vals["c"])
    with pytest.raises(SecateurError, match="written twice"):
        w.write("c", vals["c"])
    w.close()
    got = {}
    for f in sorted(tmp_path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as g:
            got |= {k: g.get_tensor(k) for k in g.keys()}
    assert got.keys() == vals.keys() and all(torch.equal(got[k], vals[k]) for k in vals)
    index = json.loads((tmp_path / shards.INDEX_NAME).read_text())
    assert index["metadata"]["total_size"] == sum(s.nbytes for s in specs)


def test_packed_masks_round_trip():
    m = PackedMasks()
    x = torch.rand(7, 13) < 0.5
    m["x"] = x
    assert torch.equal(m["x"], x) and list(m) == ["x"] and dict(m)["x"].dtype == torch.bool and m.nbytes == 12


def test_make_7b_generator_at_a_tiny_size(tmp_path):
    """bench/tools/make_7b.py with tiny overrides: a sharded bf16 folder + tokenizer that loads and evaluates "
    "streamed."""
    from transformers import AutoModelForCausalLM

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "m"
    subprocess.run([sys.executable, str(root / "bench" / "tools" / "make_7b.py"), "--out", str(out), "--layers", "2",
                    "--hidden", "64", "--heads", "4", "--ffn", "128", "--vocab", "300", "--max-shard-mb", "0.05"],
                   check=True, capture_output=True, env={"PYTHONPATH": str(root / "src"), "PATH": "/usr/bin:/bin"})
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16 and model.config.num_hidden_layers == 2
    assert len(list(out.glob("*.safetensors"))) > 1 and (out / shards.INDEX_NAME).exists()
    text = tmp_path / "t.txt"
    text.write_text("hello world, " * 200)
    res = api.eval_ppl(str(out), dataset=str(text), seqlen=32, max_windows=2, progress=False, stream=True)
    assert math.isfinite(res["ppl"])


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_streamed_ppl_follows_the_bos_rule_and_layer_types(tmp_path, family):
    """A tokenizer that prepends BOS gets the same windows (``+bos-first``) streamed as in memory, and Gemma-3's
    sliding and global layers get their own masks and RoPE tables block by block (windows longer than its
    sliding window); same bound argument as above, measured equal."""
    path = tmp_path / family
    tiny_model(family, vocab=100, layers=LAYERS).save_pretrained(path, max_shard_size="20KB")
    tiny_tokenizer(bos=True).save_pretrained(path)
    text = tmp_path / "eval.txt"
    random.seed(1)
    text.write_text(" ".join("".join(random.choice("abcdefghij ,.") for _ in range(8)) for _ in range(40)))
    kw = dict(dataset=str(text), seqlen=32, max_windows=4, progress=False)
    normal = api.eval_ppl(str(path), **kw)
    streamed = api.eval_ppl(str(path), stream=True, **kw)
    assert normal["bos"] == streamed["bos"] == "first" and streamed["protocol"] == "nonoverlap-32+bos-first"
    assert streamed["scored_tokens"] == normal["scored_tokens"]
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        zmax = float(AutoModelForCausalLM.from_pretrained(path)(torch.arange(1, 33)[None]).logits.abs().max())
    assert abs(math.log(streamed["ppl"]) - math.log(normal["ppl"])) <= 2 * LAYERS * 64 * 2.0**-24 * max(zmax, 1.0)
