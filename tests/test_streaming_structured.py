"""``prune --stream`` for the structured methods (issue 16 §3): two block-streamed passes (statistics and scores;
then compensate, slice and write), the output folder equal to the in-memory run's.

* the streamed output equals the in-memory output: every tensor bit for bit, ``config.json`` (stock for uniform
  widths; per-layer config and ``secateur_hetero.py`` for uneven ones), the selection and the report's fields, for
  Llama, Qwen2 and Gemma-3, uniform and global (FLAP AL-AM) allocation, with and without compensation (COEC, LS,
  FLAP's bias, RCPU, CORP), for every streamed selection (ShortGPT's removed blocks included);
* at most one block is materialized at a time, in both passes;
* the memory plan states its terms and refuses a run that does not fit (exit 2, nothing written);
* CoCurve is refused with its reason.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import random_calib_text, save_sharded_tiny
from safetensors.torch import load_file

import secateur.export.shards as shards
from secateur import api
from secateur.calib import engine
from secateur.cli import main
from secateur.errors import SecateurError

pytestmark = pytest.mark.usefixtures("one_thread")
LAYERS = 3
COMMON = dict(sparsity=0.3, nsamples=4, seqlen=32, chunk_size=2, quiet=True)
# report fields that differ by design (timings, memory, the run's own options)
VOLATILE = ("timings", "peak_rss_mb", "options", "memory_plan", "machine", "details", "versions")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("stream-sp")
    text = random_calib_text(root / "calib.txt")
    out = {f: save_sharded_tiny(root / f, f, LAYERS) for f in ("llama", "qwen2", "gemma3_text", "gpt2", "opt")}
    return out | {"text": text}


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out |= load_file(f)
    return out


def _same_details(a: dict, b: dict) -> None:
    """The method's report details agree but for times and the measured timings."""
    def strip(d):
        if isinstance(d, dict):
            return {k: strip(v) for k, v in d.items() if "second" not in k and not k.endswith("_s")}
        if isinstance(d, list):
            return [strip(v) for v in d]
        return d
    assert strip(a) == strip(b)


def _compare(mem: Path, st: Path, rep: dict, opened: list) -> None:
    a, b = _weights(mem), _weights(st)
    assert a.keys() == b.keys()
    bad = [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
    assert not bad, bad[:3]
    assert json.loads((mem / "config.json").read_text()) == json.loads((st / "config.json").read_text())
    names = {p.name for p in mem.iterdir() if p.suffix != ".safetensors" and p.name != "secateur-report.json"}
    assert names == {p.name for p in st.iterdir() if p.suffix != ".safetensors" and
                     p.name not in ("secateur-report.json", shards.INDEX_NAME)}
    same = names - {"README.md", "secateur-recipe.yaml"}  # the card and recipe say --stream
    assert all((mem / n).read_bytes() == (st / n).read_bytes() for n in same), \
        [n for n in same if (mem / n).read_bytes() != (st / n).read_bytes()]
    ra, rb = (json.loads((f / "secateur-report.json").read_text()) for f in (mem, st))
    assert {k: v for k, v in ra.items() if k not in VOLATILE} == {k: v for k, v in rb.items() if k not in VOLATILE}
    _same_details(ra["details"], rb["details"])
    assert rb["options"]["stream"] is True and rep["memory_plan"]["total_bytes"] > 0
    assert len(opened) == 1 and opened[0].model is rep.model and opened[0].materialized_blocks() == []
    assert not hasattr(rep.model, "secateur_stream")  # the block source travels as an argument, not on the model


CASES = {  # id: (family, method, knobs)
    "llama-wanda-sp": ("llama", "wanda-sp", {}),
    "llama-wanda-sp-coec": ("llama", "wanda-sp", {"compensation": "coec", "coec_rounds": 2}),
    "qwen2-rcpu": ("qwen2", "rcpu", {}),
    "qwen2-flap-global-ls": ("qwen2", "flap", {"allocation": "flap-global", "compensation": "ls", "sparsity": 0.4}),
    "llama-flap-global-coec": ("llama", "flap", {"allocation": "flap-global", "compensation": "coec",
                                                 "coec_rounds": 2}),
    "gemma3-flap-global-bias": ("gemma3_text", "flap", {"allocation": "flap-global"}),
    "gemma3-wanda-sp-coec": ("gemma3_text", "wanda-sp", {"compensation": "coec", "coec_rounds": 2}),
    "llama-magnitude-sp": ("llama", "magnitude-sp", {}),
    "llama-wanda-sp-head-slot-coec": ("llama", "wanda-sp", {"units": "head_slot,channel", "compensation": "coec",
                                                            "coec_rounds": 2, "sparsity": 0.5}),
    "qwen2-random-head-slot": ("qwen2", "random", {"units": "head_slot,channel", "sparsity": 0.5}),
    "gemma3-flap-global-head-slot": ("gemma3_text", "flap", {"allocation": "flap-global",
                                                             "units": "head_slot,channel"}),
    "llama-random-ls": ("llama", "random", {"compensation": "ls"}),
    "qwen2-corp": ("qwen2", "corp", {}),
    "llama-shortgpt": ("llama", "shortgpt", {"sparsity": 0.34}),
    "gemma3-shortgpt": ("gemma3_text", "shortgpt", {"sparsity": 0.34}),
    "gpt2-wanda-sp-bias": ("gpt2", "wanda-sp", {"compensation": "bias"}),
    "opt-magnitude-sp-heads": ("opt", "magnitude-sp", {"units": "head,channel"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_streamed_structured_prune_equals_the_in_memory_prune(folders, tmp_path, monkeypatch, opened, case):
    family, method, knobs = CASES[case]
    monkeypatch.setattr(shards, "DEFAULT_MAX_SHARD_BYTES", 30_000)  # several output shards
    kw = dict(model=folders[family], method=method, calib=folders["text"]) | COMMON | knobs
    api.prune(out=str(tmp_path / "mem"), **kw)
    rep = api.prune(out=str(tmp_path / "str"), stream=True, **kw)
    _compare(tmp_path / "mem", tmp_path / "str", rep, opened)
    index = json.loads((tmp_path / "str" / shards.INDEX_NAME).read_text())
    assert len(set(index["weight_map"].values())) > 1
    if "head-slot" in case and family != "gemma3_text":  # slots removed (Gemma-3 is MQA: head units)
        assert rep["details"]["by_kind"]["head_slot"]["removed_units"] > 0
    if "global" in case:  # uneven widths: the per-layer config and its classes
        assert len(set(rep["details"]["per_layer_realized"].values())) > 1
        assert rep["export_route"] == "hetero" and (tmp_path / "str" / "secateur_hetero.py").exists()
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(tmp_path / "str")  # one call reloads it
    assert m.config.num_hidden_layers == LAYERS - len(rep["details"]["removed_blocks"])
    assert bool(rep["details"]["removed_blocks"]) == (method == "shortgpt")


def test_one_block_materialized_at_a_time(folders, tmp_path, monkeypatch):
    """Both passes: the engine's per-block seam sees exactly its block off the meta device; the blocks written
    without a forward (after the last compensated one) are loaded alone too."""
    import secateur.models.streaming as streaming

    seen: list[tuple[int, list[int]]] = []
    holder: dict = {}
    orig_open, orig_load = streaming.open_streamed, streaming.BlockStream.load

    def open_spy(*a, **k):
        holder["stream"] = orig_open(*a, **k)
        return holder["stream"]

    def load_spy(self, index):
        orig_load(self, index)
        seen.append((-1, self.materialized_blocks()))

    monkeypatch.setattr(streaming, "open_streamed", open_spy)
    monkeypatch.setattr(streaming.BlockStream, "load", load_spy)
    monkeypatch.setattr(engine, "_after_block", lambda i: seen.append((i, holder["stream"].materialized_blocks())))
    api.prune(model=folders["llama"], method="wanda-sp", calib=folders["text"], out=str(tmp_path / "o"),
              stream=True, compensation="ls", **COMMON)
    engine_seen = [s for s in seen if s[0] >= 0]
    assert engine_seen == [(i, [i]) for i in range(LAYERS)] * 2  # statistics pass, then the Gram pass
    assert all(len(m) == 1 for _, m in seen)
    assert holder["stream"].materialized_blocks() == []


def test_memory_plan_and_refusal(folders, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SECATEUR_MEM_AVAILABLE_MB", "0.01")
    out = tmp_path / "o"
    rc = main(["prune", "--model", folders["llama"], "--method", "wanda-sp", "--compensation", "coec", "--calib",
               folders["text"], "--nsamples", "4", "--seqlen", "32", "--out", str(out), "--stream", "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2
    lines = [ln for ln in err.splitlines() if ln.startswith("secateur: error:")]
    assert len(lines) == 1 and "not enough memory for the streamed structured prune" in lines[0]
    assert "memory plan (streamed structured prune): this process holds" in err and "adds about" in err
    assert "8 (d_att^2 32^2 + F^2 64^2)" in err and "6 x 8 max(d_att, F)^2 (coec)" in err
    assert not out.exists() and not list(tmp_path.glob(".o.*"))


def test_memory_plan_terms(folders):
    from secateur.compensate import solver_matrices
    from secateur.models.adapters import get_adapter
    from secateur.models.memory import shape_of, structured_prune_plan
    from secateur.models.streaming import open_streamed

    s = open_streamed(folders["llama"])
    shape = shape_of(s.model, get_adapter(s.model), s)
    d, f, a = shape.hidden, shape.ffn, shape.attn
    # coec: 4 solver matrices + the eigh workspace (about 2 n^2), k = 6
    plan = structured_prune_plan(shape, 8, 64, 4, score_stats=True, solver=("coec", solver_matrices("coec")))
    assert plan.terms["grams"][0] == 8 * (a * a + f * f) + 8 * d * (a + f) + 6 * 8 * max(a, f) ** 2
    assert plan.terms["activations"][0] == 8 * 64 * (3 * d + f) * 4
    assert plan.total == sum(b for b, _ in plan.terms.values())
    none = structured_prune_plan(shape, 0, 64, 4, score_stats=False, solver=None)
    assert "grams" not in none.terms and "activations" not in none.terms


@pytest.mark.parametrize("method", ["cocurve", "cocurve-diag"])
def test_cocurve_is_refused_with_its_reason(folders, tmp_path, method):
    with pytest.raises(SecateurError, match="held-out lambda choice read the whole model"):
        api.prune(model=folders["llama"], method=method, calib=folders["text"], out=str(tmp_path / "o"), stream=True,
                  **COMMON)
    assert not (tmp_path / "o").exists()


def test_optional_tensors_of_the_shard_plan(tmp_path):
    """A bias a compensator may add: written or not, the shard stays a valid safetensors file."""
    from safetensors import safe_open

    specs = [shards.Spec("a", torch.float32, (3, 4)), shards.Spec("b", torch.float32, (4,), optional=True),
             shards.Spec("c", torch.float32, (2,), optional=True), shards.Spec("d", torch.float32, (5,))]
    for present in ((), ("b",), ("c",), ("b", "c")):
        folder = tmp_path / ("x" + "".join(present))
        folder.mkdir()
        w = shards.ShardWriter(folder, specs)
        vals = {s.name: torch.randn(s.shape) for s in specs}
        for k in ("d", *present, "a"):
            w.write(k, vals[k])
        w.close()
        with safe_open(str(folder / "model.safetensors"), framework="pt") as g:
            got = {k: g.get_tensor(k) for k in g.keys()}
        assert set(got) == {"a", "d", *present} and all(torch.equal(got[k], vals[k]) for k in got)


def test_a_bias_the_guard_drops_is_left_out_of_the_shards(folders, tmp_path, monkeypatch, opened):
    """FLAP's bias on a bias-free family, the slice-only fallback forced on layer 1: its projections stay
    bias-free, the other layers get one (a per-layer config); the optional tensors absent from the shard plan."""
    from secateur.methods import compensation

    orig = compensation._guarded

    def forced(cfg, comp, rec, *a):
        if rec["layer"] == 1:
            comp.diagnostics["recon_after"] = float("inf")
        return orig(cfg, comp, rec, *a)

    monkeypatch.setattr(compensation, "_guarded", forced)
    kw = dict(model=folders["llama"], method="flap", calib=folders["text"]) | COMMON
    api.prune(out=str(tmp_path / "mem"), **kw)
    rep = api.prune(out=str(tmp_path / "str"), stream=True, **kw)
    _compare(tmp_path / "mem", tmp_path / "str", rep, opened)
    names = set(_weights(tmp_path / "str"))
    assert "model.layers.0.mlp.down_proj.bias" in names and "model.layers.1.mlp.down_proj.bias" not in names
    assert rep["export_route"] == "hetero"
