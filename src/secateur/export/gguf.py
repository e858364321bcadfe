"""``secateur export gguf RUN --out model.gguf``: a pruned run folder as one GGUF file for llama.cpp.

The run folder is read as it is on disk (``config.json``, its safetensors, one file or sharded, and its tokenizer);
no model is built. Tensors are streamed: each is read, converted and written before the next, so memory stays
near one tensor. Names and layouts are the ones llama.cpp's ``convert_hf_to_gguf.py`` writes:
``token_embd``, ``blk.N.attn_{norm,q,k,v,output}``, ``blk.N.ffn_{norm,gate,up,down}``, ``output_norm``,
``output``; weights keep the ``[out, in]`` row order of the Hugging Face tensors; 1-D tensors and norms stay f32.

Architectures (the *route*, also written under ``secateur.export.route``):

* the family's own (``llama`` for Llama, Mistral and SmolLM2; ``qwen2``) when every layer has the same widths
  and the architecture's tensors can hold every tensor of the run. ``llama`` q/k rows are permuted the way the
  converter does it (llama.cpp applies RoPE to adjacent pairs, transformers to the two halves of a head):
  within each head, row ``2j`` of the GGUF is row ``j`` and row ``2j+1`` is row ``j + head_dim/2``
  (q with the query heads, k with the KV heads; q/k biases likewise). ``qwen2`` is written unpermuted
  (its llama.cpp RoPE is the half-split one).
* ``deci`` (llama.cpp's per-layer Llama, Nemotron-NAS) otherwise: ``attention.head_count``,
  ``attention.head_count_kv`` and ``feed_forward_length`` are per-layer arrays, ``attention.key_length`` /
  ``value_length`` give the head size; q/k permuted as for ``llama`` (also for a Qwen2 run). A layer whose
  attention was removed has head counts 0 and no attention tensors (llama.cpp's "attention-free" layer: no norm,
  no residual add, exactly an identity), with two exceptions written as one zero head (q, k, v, o zero: scores
  0, values 0, output exactly 0): layer 0, because llama.cpp reads the head size and RoPE width only when
  ``n_head(0) > 0`` (with 0 it takes head size 0 and refuses every other layer's q: "tensor 'blk.1.attn_q.weight'
  has wrong shape"), and a removed attention that kept its o_proj bias (FLAP's compensation), which the zero head
  then adds. llama.cpp's ``n_ff = 0`` ("FFN-free") layer skips the whole rest of the layer, the attention output
  and its residual included, so ``n_ff = 0`` is written only for a layer that lost both its attention and its
  MLP, kept no o / down bias, and is not the last layer. A layer that keeps its attention but lost its MLP gets
  an MLP of width 1 with zero weights (output exactly 0, plus its down-projection bias if it has one). Both
  stand-ins are named in the returned notes. These rules were checked by running llama.cpp
  (``tests/test_llamacpp.py``: logits equal to the HF model's within float32 rounding).

What llama.cpp cannot read is refused in one line naming the tensor, before anything is written: any tensor
without a GGUF name. ``qwen2`` reads q (weight and bias) with the hidden size's rows and no o_proj / down_proj
bias (FLAP's compensation biases): a Qwen2 run with pruned heads or such a bias goes to ``deci``, whose loader
reads the q bias with the layer's ``n_head * head_dim`` rows (as ``llama``'s does) and both biases.

Tokenizer (``tokenizer.ggml.*``): copied from the GGUF the run was pruned from when its report names one that
is still there (``model_source``: same sha256), else built from the folder's ``tokenizer.json`` as the
converter's ``_set_vocab_gpt2`` does (byte-level BPE: ``gpt2`` model, tokens padded to the embedding rows
with ``[PADn]``, token types, merges, special ids, whether BOS/EOS are added, chat template). The
pre-tokenizer name comes from ``--tokenizer-pre`` or is recognised from ``tokenizer.json`` (``gpt-2``,
``llama-bpe``, ``qwen2``, ``smollm``); other tokenizers are refused in one line.

``--type``: ``f32`` (exact), ``f16``, ``bf16``, ``q8_0`` (``gguf.quants``); 1-D tensors and norms stay f32. A
matrix whose rows are not a multiple of 32 falls back to f16 under q8_0 (as the converter does), one beyond
float16's range to f32; the returned ``fallbacks`` name each. llama.cpp's own ``llama-quantize`` k-quants (Q4_K,
Q5_K, Q6_K ...) need rows of a multiple of 256 values (``ggml``'s ``QK_K``) and fall back to another type for the
others: a note names those matrices (:func:`kquant_note`; a structured prune with ``--width-multiple 256`` keeps
the MLP widths, the ``ffn_down`` rows, multiples of 256; attention widths and the hidden size are not rounded).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from secateur.errors import SecateurError
from secateur.export.folder import REPORT_NAME, atomic_file

# families this exporter writes -> their llama.cpp architecture (the converter writes Mistral as llama)
FAMILY_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}
TYPES = ("f32", "f16", "bf16", "q8_0")
ROUTE_KEY = "secateur.export.route"
SOURCE_KEY = "secateur.export.source"
F16_MAX = 65504.0
# tokenizer.json pre-tokenizer regexes -> llama.cpp's tokenizer.ggml.pre
_LLAMA3_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_RE = _LLAMA3_RE.replace(r"\p{N}{1,3}", r"\p{N}")
_SPLIT_PRE = {_LLAMA3_RE: "llama-bpe", _QWEN2_RE: "qwen2"}
_ATTN = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output"}
_MLP = {"gate": "ffn_gate", "up": "ffn_up", "down": "ffn_down"}


def _gguf():
    import gguf

    return gguf


# --- the run folder -------------------------------------------------------------------------------------


class RunFolder:
    """A run folder's config and tensors, read lazily from its safetensors (one file or a sharded index)."""

    def __init__(self, path: str | Path, stack: contextlib.ExitStack) -> None:
        from secateur.schemas.report import RunReport
        from secateur.schemas.run_folder import ConfigFamily, RunConfig, ShardIndex

        self.path = Path(path)
        if not self.path.is_dir():
            raise SecateurError(f"run {self.path} is not a folder; give a secateur prune --out folder")
        cfg = self.path / "config.json"
        if not cfg.is_file():
            raise SecateurError(f"run {self.path} has no config.json; give a secateur prune --out folder")
        # every file read back is checked where it enters: one line naming the file and the field
        self.config = _read_checked(cfg, ConfigFamily)
        if family_of_config(self.config) in FAMILY_ARCH:  # another family is refused by name (export_gguf)
            _read_checked(cfg, RunConfig)
        if (self.path / REPORT_NAME).is_file():  # read later for the tokenizer's source GGUF
            _read_checked(self.path / REPORT_NAME, RunReport)
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            files = sorted(set(_read_checked(index, ShardIndex)["weight_map"].values()))
        elif (self.path / "model.safetensors").is_file():
            files = ["model.safetensors"]
        else:
            raise SecateurError(f"run {self.path} has no safetensors weights (model.safetensors or an index); give "
                                "a secateur prune --out folder")
        self._where: dict[str, object] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for f in files:
            h = _open_safetensors(self.path / f, index if index.is_file() else None, stack)
            for name in h.keys():
                self._where[name] = h
                self.shapes[name] = tuple(h.get_slice(name).get_shape())
        if family_of_config(self.config) in FAMILY_ARCH:  # the weights against config.json, from the headers
            from secateur.models.folder_check import check_folder

            check_folder(str(self.path), self.path, self.config)

    def tensor(self, name: str) -> np.ndarray:
        return self._where[name].get_tensor(name).float().numpy()


RUN_FIX = "re-export the run (secateur prune --out), or restore the file"


def _read_checked(path: Path, schema) -> dict:
    """A JSON file of the run folder, checked against ``schema`` (:mod:`secateur.schemas`)."""
    from secateur.schemas.report import parse_at

    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise SecateurError(f"{path}: invalid JSON (line {e.lineno}: {e.msg}); {RUN_FIX}") from None
    except (UnicodeDecodeError, RecursionError) as e:
        what = "not UTF-8 text" if isinstance(e, UnicodeDecodeError) else "invalid JSON (nested too deeply)"
        raise SecateurError(f"{path}: {what}; {RUN_FIX}") from None
    except OSError as e:
        raise SecateurError(f"{path}: cannot be read ({e.strerror or e}); check the file's permissions") from None
    if not isinstance(data, dict):
        raise SecateurError(f"{path}: a JSON {'array' if isinstance(data, list) else 'value'} "
                            f"({str(data)[:20]!r}), not an object; {RUN_FIX}")
    parse_at(schema, data, str(path), RUN_FIX)
    return data


def _open_safetensors(path: Path, index: Path | None, stack: contextlib.ExitStack):
    """An open safetensors file of the run folder; a missing, truncated or corrupt one is one line (the message of
    :func:`secateur.models.loading.check_safetensors`)."""
    from safetensors import safe_open

    from secateur.models.files import check_safetensors

    if not path.is_file():
        raise SecateurError(f"model file {path} is missing" + (f" (named by {index.name})" if index else "")
                            + f"; {RUN_FIX}")
    check_safetensors(path)
    try:
        h = stack.enter_context(safe_open(str(path), framework="pt"))
        for name in h.keys():
            h.get_slice(name).get_shape()
    except Exception as e:  # noqa: BLE001 - safetensors' own errors (SafetensorError, ...) for a damaged header
        raise SecateurError(f"model file {path} is truncated or corrupt ({e.__class__.__name__}: {_first_line(e)}); "
                            "re-download or re-export it") from None
    return h


def _first_line(e: Exception) -> str:
    """The start of an exception's message, safe inside a one-line error."""
    from secateur.schemas.report import printable

    lines = str(e).splitlines()
    return printable(lines[0][:80]) if lines else ""


@dataclass(frozen=True)
class LayerShape:
    n_heads: int
    n_kv: int
    ff: int
    biases: frozenset  # roles with a bias: q k v o gate up down


@dataclass
class Entry:
    """One GGUF tensor: its name, numpy shape, where its data comes from, and its storage type."""

    name: str
    shape: tuple[int, ...]
    source: str | None  # the HF tensor, or None: zeros
    permute_heads: int = 0  # > 0: llama.cpp's q/k row order over this many heads
    qtype: str = "f32"


def _permute_rows(a: np.ndarray, n_heads: int) -> np.ndarray:
    """Within each of ``n_heads`` heads, put rows ``j`` and ``j + d/2`` next to each other (d = head size)."""
    d = a.shape[0] // n_heads
    return a.reshape(n_heads, 2, d // 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)


def unpermute_rows(a: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of the q/k row permutation (for readers and tests)."""
    d = a.shape[0] // n_heads
    return a.reshape(n_heads, d // 2, 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)


# --- geometry and route --------------------------------------------------------------------------------


def family_of_config(cfg: dict) -> str:
    from secateur.models.hetero import base_model_type

    return base_model_type(str(cfg.get("model_type", "")))


def _rope_theta(cfg: dict) -> float:
    rp = cfg.get("rope_parameters") or {}
    rs = cfg.get("rope_scaling") or {}
    kind = rp.get("rope_type") or rs.get("rope_type") or rs.get("type") or "default"
    if kind != "default":
        raise SecateurError(f"RoPE scaling {kind!r} is not exported to GGUF yet, only plain RoPE is; convert the run "
                            "folder with llama.cpp's convert_hf_to_gguf.py instead")
    theta = rp.get("rope_theta", cfg.get("rope_theta"))
    if theta is None:
        raise SecateurError(f"config.json: rope_theta: missing (neither rope_parameters.rope_theta nor rope_theta); "
                            f"{RUN_FIX}")
    return float(theta)


def layer_shapes(run: RunFolder, head_dim: int) -> list[LayerShape]:
    """Each layer's widths and biases, read from the tensor shapes (the same for masked, stock and hetero runs)."""
    out = []
    for i in range(int(run.config["num_hidden_layers"])):
        p = f"model.layers.{i}."
        sh = run.shapes
        try:
            n_heads = sh[p + "self_attn.o_proj.weight"][1] // head_dim
            n_kv = sh[p + "self_attn.k_proj.weight"][0] // head_dim
            ff = sh[p + "mlp.down_proj.weight"][1]
        except KeyError as e:
            raise SecateurError(f"run {run.path} has no tensor {e.args[0]}, which config.json implies; {RUN_FIX}") \
                from None
        roles = {**{r: f"self_attn.{r}_proj" for r in _ATTN}, **{r: f"mlp.{r}_proj" for r in _MLP}}
        biases = frozenset(r for r, m in roles.items() if p + m + ".bias" in sh)
        out.append(LayerShape(n_heads, n_kv, ff, biases))
    return out


def _hf(i: int, role: str, kind: str = "weight") -> str:
    return f"model.layers.{i}." + (f"self_attn.{role}_proj" if role in _ATTN else f"mlp.{role}_proj") + "." + kind


def _blockers(arch: str, layers: list[LayerShape], hidden: int, head_dim: int, shapes: dict) -> list[str]:
    """What ``arch`` (as llama.cpp loads it) cannot hold, one message per tensor; empty when it holds all."""
    why = []
    for i, ly in enumerate(layers):
        if arch == "qwen2":
            if ly.n_heads * head_dim != hidden and ly.n_heads > 0:
                why.append(f"tensor {_hf(i, 'q')} has {ly.n_heads * head_dim} rows but llama.cpp's qwen2 reads "
                           f"blk.{i}.attn_q.weight with the hidden size {hidden}")
            for r in ("o", "gate", "up", "down"):
                if r in ly.biases:
                    why.append(f"llama.cpp's qwen2 reads no {_ATTN.get(r, _MLP.get(r))}.bias "
                               f"(tensor {_hf(i, r, 'bias')})")
            for r in ("q", "k", "v"):
                if r not in ly.biases:
                    why.append(f"llama.cpp's qwen2 needs blk.{i}.{_ATTN[r]}.bias and the run has none")
    return why


def choose_route(family: str, layers: list[LayerShape], hidden: int, head_dim: int, shapes: dict
                 ) -> tuple[str, list[str]]:
    """``(architecture, notes)``: the family's own when it holds the run, else ``deci``; refuses otherwise."""
    arch = FAMILY_ARCH[family]
    first = layers[0]
    uniform = all((ly.n_heads, ly.n_kv, ly.ff) == (first.n_heads, first.n_kv, first.ff) for ly in layers) \
        and first.n_heads > 0 and first.ff > 0
    own = _blockers(arch, layers, hidden, head_dim, shapes)
    if uniform and not own:
        return arch, []
    deci = _blockers("deci", layers, hidden, head_dim, shapes)
    if deci:
        raise SecateurError(f"cannot export to GGUF: {deci[0]}; keep the run as a Hugging Face folder")
    notes = [f"written as deci, not {arch}: " + (own[0] if uniform else "the layers have different widths")]
    return "deci", notes


# --- the tensor plan ---------------------------------------------------------------------------------


def _attention_entries(arch: str, ly: LayerShape, i: int, sh: dict, hidden: int, head_dim: int,
                       notes: list[str]) -> list[Entry]:
    """Layer ``i``'s attention tensors in writing order (none for a removed attention outside ``deci``'s stand-in);
    appends a note when a zero head stands in for a removed attention."""
    p, blk, entries = f"model.layers.{i}.", f"blk.{i}.", []
    permute = arch in ("llama", "deci")
    if arch == "deci" and _standin_attention(ly, i):
        # one zero head: scores 0, V 0, output exactly 0 (+ the o bias the removed attention kept)
        norm = p + "input_layernorm.weight"
        entries += [Entry(blk + "attn_norm.weight", (hidden,), norm if norm in sh else None),
                    Entry(blk + "attn_q.weight", (head_dim, hidden), None),
                    Entry(blk + "attn_k.weight", (head_dim, hidden), None),
                    Entry(blk + "attn_v.weight", (head_dim, hidden), None),
                    Entry(blk + "attn_output.weight", (hidden, head_dim), None)]
        if "o" in ly.biases:
            entries.append(Entry(blk + "attn_output.bias", sh[_hf(i, "o", "bias")], _hf(i, "o", "bias")))
        notes.append(f"layer {i} has no attention: written as one zero head ("
                     + ("llama.cpp reads the head size from layer 0's head count)" if i == 0 else
                        "it carries the o_proj bias the removed attention kept)"))
    elif ly.n_heads > 0:
        entries.append(Entry(blk + "attn_norm.weight", sh[p + "input_layernorm.weight"],
                             p + "input_layernorm.weight"))
        for r, g in _ATTN.items():
            heads = {"q": ly.n_heads, "k": ly.n_kv}.get(r, 0) if permute else 0
            entries.append(Entry(blk + g + ".weight", sh[_hf(i, r)], _hf(i, r), heads))
            if r in ly.biases:
                entries.append(Entry(blk + g + ".bias", sh[_hf(i, r, "bias")], _hf(i, r, "bias"), heads))
    return entries


def plan_tensors(run: RunFolder, arch: str, layers: list[LayerShape], head_dim: int
                 ) -> tuple[list[Entry], list[str]]:
    """Every GGUF tensor in writing order (and notes on zero-width stand-ins); refuses a run tensor left over."""
    cfg, sh = run.config, run.shapes
    hidden = int(cfg["hidden_size"])
    entries = [Entry("token_embd.weight", sh["model.embed_tokens.weight"], "model.embed_tokens.weight")]
    notes: list[str] = []
    unused: set[str] = set()
    last = len(layers) - 1
    for i, ly in enumerate(layers):
        p = f"model.layers.{i}."
        blk = f"blk.{i}."
        entries += _attention_entries(arch, ly, i, sh, hidden, head_dim, notes)
        drop_mlp = arch == "deci" and _ff_of(ly, i, last) == 0
        if not drop_mlp:
            entries.append(Entry(blk + "ffn_norm.weight", sh[p + "post_attention_layernorm.weight"],
                                 p + "post_attention_layernorm.weight"))
        if ly.ff > 0:
            for r, g in _MLP.items():
                entries.append(Entry(blk + g + ".weight", sh[_hf(i, r)], _hf(i, r)))
                if r in ly.biases:
                    entries.append(Entry(blk + g + ".bias", sh[_hf(i, r, "bias")], _hf(i, r, "bias")))
        elif not drop_mlp:  # llama.cpp's n_ff = 0 would drop this layer's attention too: a zero MLP of width 1
            entries += [Entry(blk + "ffn_gate.weight", (1, hidden), None),
                        Entry(blk + "ffn_up.weight", (1, hidden), None),
                        Entry(blk + "ffn_down.weight", (hidden, 1), None)]
            if "down" in ly.biases:
                entries.append(Entry(blk + "ffn_down.bias", sh[_hf(i, "down", "bias")], _hf(i, "down", "bias")))
            notes.append(f"layer {i} has no MLP: written as a zero MLP of width 1 (llama.cpp's n_ff = 0 would also "
                         "drop the layer's attention)")
        # norms of removed sublayers are unused by the run's own forward too
        unused |= {p + "input_layernorm.weight"} if ly.n_heads == 0 else set()
        unused |= {p + "post_attention_layernorm.weight"} if drop_mlp else set()
    entries.append(Entry("output_norm.weight", sh["model.norm.weight"], "model.norm.weight"))
    if "lm_head.weight" in sh:
        entries.append(Entry("output.weight", sh["lm_head.weight"], "lm_head.weight"))
    used = {e.source for e in entries} | unused
    spare = [n for n in sh if n not in used and not n.endswith("rotary_emb.inv_freq")
             and not (n.startswith("model.layers.") and 0 in sh[n])]
    if spare:
        raise SecateurError(f"cannot export to GGUF: tensor {spare[0]} has no place in a llama.cpp {arch!r} model; "
                            f"{RUN_FIX}")
    return entries, notes


def _ff_of(ly: LayerShape, i: int, last: int) -> int:
    """The deci ``feed_forward_length`` of a layer: its width, 0 only for a layer that lost its attention and its
    MLP and kept no o / down bias (not the last layer), else 1 (the zero stand-in MLP)."""
    if ly.ff > 0:
        return ly.ff
    dropped = ly.n_heads == 0 and not {"o", "down"} & ly.biases and i != last
    return 0 if dropped else 1


def _standin_attention(ly: LayerShape, i: int) -> bool:
    """A removed attention written as one zero head (deci): in layer 0, whose head count llama.cpp reads the
    head size from (``n_head(0) = 0`` gives head size 0 and refuses every other layer's q), or one that kept its
    o_proj bias (the attention-free layer reads none)."""
    return ly.n_heads == 0 and (i == 0 or "o" in ly.biases)


def _heads_of(ly: LayerShape, i: int) -> tuple[int, int]:
    """The deci ``head_count`` / ``head_count_kv`` of a layer."""
    return (1, 1) if _standin_attention(ly, i) else (ly.n_heads, ly.n_kv)


# --- storage types -------------------------------------------------------------------------------------


def _storage(entries: list[Entry], run: RunFolder, want: str) -> list[tuple[str, str, str]]:
    """Set each entry's qtype; returns the fallbacks ``(tensor, type, why)``. Values are checked against the
    target range only for f16 and q8_0 (one read of each matrix)."""
    fallbacks = []
    for e in entries:
        if len(e.shape) == 1 or e.name.endswith("_norm.weight") or want == "f32":
            e.qtype = "f32"
            continue
        e.qtype = want
        if want == "q8_0" and e.shape[-1] % 32:
            e.qtype = "f16"
            fallbacks.append((e.name, "f16", f"its rows hold {e.shape[-1]} values, not a multiple of 32"))
        if e.qtype in ("f16", "q8_0") and e.source is not None:
            amax = float(np.abs(run.tensor(e.source)).max(initial=0.0))
            limit = F16_MAX if e.qtype == "f16" else F16_MAX * 127
            if not amax <= limit:
                fallbacks.append((e.name, "f32", f"|values| up to {amax:.3g}, beyond {e.qtype}'s range"))
                e.qtype = "f32"
    return fallbacks


QK_K = 256  # llama.cpp's k-quant super-block: a row of a Q*_K matrix holds a multiple of it


def kquant_note(entries: list[Entry], limit: int = 3) -> str | None:
    """A note naming the matrices whose rows ``llama-quantize`` cannot store as k-quants (rows not a multiple of
    256 values: it falls back to another type for them), by row length (``limit`` names each), or None when every
    matrix fits."""
    mats = [e for e in entries if len(e.shape) == 2 and not e.name.endswith("_norm.weight")]
    odd: dict[int, list[str]] = {}
    for e in mats:
        if e.shape[-1] % QK_K:
            odd.setdefault(e.shape[-1], []).append(e.name)
    if not odd:
        return None
    groups = "; ".join(f"rows of {n}: {', '.join(names[:limit])}"
                       f"{f' and {len(names) - limit} more' if len(names) > limit else ''}"
                       for n, names in sorted(odd.items()))
    hint = ("; prune with --width-multiple 256 to keep the MLP widths (ffn_down rows) multiples of 256"
            if any(name.endswith("ffn_down.weight") for names in odd.values() for name in names) else "")
    return (f"llama-quantize's k-quants (Q4_K ...) need rows of a multiple of {QK_K} values and fall back to another "
            f"type for {sum(map(len, odd.values()))} of {len(mats)} matrices ({groups}){hint}")


def _qtype(name: str):
    g = _gguf()
    return {"f32": g.GGMLQuantizationType.F32, "f16": g.GGMLQuantizationType.F16,
            "bf16": g.GGMLQuantizationType.BF16, "q8_0": g.GGMLQuantizationType.Q8_0}[name]


def _encode(a: np.ndarray, qtype: str) -> np.ndarray:
    if qtype == "f32":
        return np.ascontiguousarray(a, dtype=np.float32)
    if qtype == "f16":
        return np.ascontiguousarray(a.astype(np.float16))
    return _gguf().quants.quantize(np.ascontiguousarray(a, dtype=np.float32), _qtype(qtype))


def _info(e: Entry) -> tuple[tuple[int, ...], np.dtype, int, object]:
    """(shape as add_tensor_info takes it, numpy dtype, bytes, raw type or None)."""
    n = int(np.prod(e.shape))
    if e.qtype == "f32":
        return e.shape, np.dtype(np.float32), 4 * n, None
    if e.qtype == "f16":
        return e.shape, np.dtype(np.float16), 2 * n, None
    g = _gguf()
    byte_shape = tuple(g.quants.quant_shape_to_byte_shape(e.shape, _qtype(e.qtype)))
    return byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), _qtype(e.qtype)


# --- tokenizer -------------------------------------------------------------------------------------------


def _source_gguf(run_path: Path) -> Path | None:
    """The GGUF a run was pruned from, when its report names one that is still there with the same content."""
    rep = run_path / REPORT_NAME
    if not rep.is_file():
        return None
    with contextlib.suppress(ValueError, OSError):
        src = (json.loads(rep.read_text()).get("model_source") or {})
        p = Path(src.get("gguf") or "")
        from secateur.models.gguf_cache import file_sha256, known_file

        if src.get("gguf") and p.is_file() and file_sha256(p) == src.get("sha256"):
            return p
        if isinstance(src.get("sha256"), str):  # a report names the file portably: found by its digest here
            return known_file(src["sha256"])
    return None


def _copy_gguf_tokenizer(w, path: Path, vocab: int) -> str:
    """Copy every ``tokenizer.*`` key of the source GGUF (as its converter wrote them)."""
    g = _gguf()
    reader = g.GGUFReader(str(path))
    n_tokens = None
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == g.GGUFValueType.ARRAY and len(field.types) > 1 else None
        value = field.contents()
        if key == "tokenizer.ggml.tokens":
            n_tokens = len(value)
        w.add_key_value(key, value, vtype, sub_type=sub)
    if n_tokens != vocab:
        raise SecateurError(f"the tokenizer of {path} has {n_tokens} tokens but the model {vocab} embedding rows; "
                            "pass --tokenizer-pre NAME to build the vocabulary from the run's tokenizer.json instead")
    return f"copied from {path.name}"


def _pre_of(tok: dict) -> str | None:
    """llama.cpp's pre-tokenizer name for a byte-level BPE ``tokenizer.json``, when it is one secateur knows."""
    pre = tok.get("pre_tokenizer") or {}
    kind = pre.get("type")
    if kind == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"  # llama.cpp's name (its converter writes it; "gpt2" is refused as unknown)
    if kind != "Sequence":
        return None
    parts = pre.get("pretokenizers", [])
    kinds = [p.get("type") for p in parts]
    if kinds == ["Split", "ByteLevel"] and not parts[1].get("use_regex", True):
        return _SPLIT_PRE.get((parts[0].get("pattern") or {}).get("Regex"))
    if kinds == ["Digits", "ByteLevel"] and parts[0].get("individual_digits") and parts[1].get("use_regex", True):
        return "smollm"
    return None


def _byte_level(tok: dict) -> bool:
    def has(node) -> bool:
        node = node or {}
        return node.get("type") == "ByteLevel" or any(has(p) for p in node.get("pretokenizers", []))
    return has(tok.get("pre_tokenizer")) or (tok.get("decoder") or {}).get("type") == "ByteLevel"


def _hf_tokenizer(w, run_path: Path, vocab: int, pre: str | None) -> str:
    """``tokenizer.ggml.*`` from the folder's byte-level BPE ``tokenizer.json`` (the converter's gpt2 vocab)."""
    g = _gguf()
    f = run_path / "tokenizer.json"
    if not f.is_file():
        raise SecateurError(f"run {run_path} has no tokenizer.json; llama.cpp needs the tokenizer in the GGUF")
    from secateur.schemas.run_folder import TokenizerFile

    tok = _read_checked(f, TokenizerFile)
    model = tok.get("model") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback") or not _byte_level(tok):
        raise SecateurError(f"the tokenizer of {run_path} is not a byte-level BPE ({model.get('type')}"
                            f"{', byte fallback' if model.get('byte_fallback') else ''}); secateur exports "
                            "byte-level BPE tokenizers (GPT-2, Llama-3, Qwen2, SmolLM) to GGUF")
    pre = pre or _pre_of(tok)
    if pre is None:
        raise SecateurError(f"secateur does not recognise the pre-tokenizer of {f}; pass --tokenizer-pre NAME "
                            "(llama.cpp's tokenizer.ggml.pre, e.g. gpt-2, llama-bpe, qwen2, smollm)")
    ids = dict(model.get("vocab", {}))
    added = {a["id"]: a for a in tok.get("added_tokens", [])}
    for i, a in added.items():
        ids[a["content"]] = i
    by_id = {i: t for t, i in ids.items()}
    if max(by_id, default=-1) >= vocab:
        raise SecateurError(f"the tokenizer of {run_path} has token ids up to {max(by_id)} but the model only "
                            f"{vocab} embedding rows; {RUN_FIX}")
    tokens, types = [], []
    for i in range(vocab):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(g.TokenType.UNUSED)
        else:
            tokens.append(by_id[i])
            a = added.get(i)
            types.append(g.TokenType.NORMAL if a is None else
                         g.TokenType.CONTROL if a.get("special") else g.TokenType.USER_DEFINED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    _special_tokens(w, run_path, ids)
    return f"built from tokenizer.json (gpt2 BPE, pre {pre})"


def _special_tokens(w, run_path: Path, ids: dict[str, int]) -> None:
    """BOS/EOS/UNK/PAD ids, whether BOS/EOS are added, the chat template (as transformers' tokenizer has them)."""
    from transformers import AutoTokenizer

    try:
        t = AutoTokenizer.from_pretrained(str(run_path))
        with_special = t("a")["input_ids"]
        plain = t("a", add_special_tokens=False)["input_ids"]
    except Exception as e:  # noqa: BLE001 - transformers' errors for damaged tokenizer files vary by file
        raise SecateurError(f"run {run_path}: transformers cannot load its tokenizer (tokenizer files, config.json) "
                            f"({e.__class__.__name__}: {_first_line(e)}); {RUN_FIX}") from None
    for kind, add in (("bos", w.add_bos_token_id), ("eos", w.add_eos_token_id), ("unk", w.add_unk_token_id),
                      ("pad", w.add_pad_token_id)):
        token = getattr(t, f"{kind}_token", None)
        if isinstance(token, str) and token in ids:
            add(ids[token])
    bos, eos = getattr(t, "bos_token_id", None), getattr(t, "eos_token_id", None)
    w.add_add_bos_token(bool(bos is not None and len(with_special) > len(plain) and with_special[0] == bos))
    w.add_add_eos_token(bool(eos is not None and len(with_special) > len(plain) and with_special[-1] == eos))
    template = getattr(t, "chat_template", None)
    if isinstance(template, str) and template:
        w.add_chat_template(template)


# --- the writer ----------------------------------------------------------------------------------------


def is_secateur_gguf(path: str | Path) -> bool:
    """The file is a GGUF that secateur's exporter wrote (its header holds ``secateur.export.route``)."""
    from secateur.models.gguf_cache import _read_header

    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            meta, _ = _read_header(Path(path), buf)
    except Exception:  # noqa: BLE001 - anything unreadable is not ours
        return False
    return ROUTE_KEY in meta


def _metadata(w, run: RunFolder, arch: str, layers: list[LayerShape], head_dim: int, want: str) -> None:
    g = _gguf()
    cfg = run.config
    last = len(layers) - 1
    w.add_name(run.path.name)
    w.add_file_type({"f32": g.LlamaFileType.ALL_F32, "f16": g.LlamaFileType.MOSTLY_F16,
                     "bf16": g.LlamaFileType.MOSTLY_BF16, "q8_0": g.LlamaFileType.MOSTLY_Q8_0}[want])
    if want in ("bf16", "q8_0"):
        w.add_quantization_version(g.GGML_QUANT_VERSION)
    w.add_block_count(len(layers))
    w.add_context_length(int(cfg["max_position_embeddings"]))
    w.add_embedding_length(int(cfg["hidden_size"]))
    if arch == "deci":
        w.add_feed_forward_length([_ff_of(ly, i, last) for i, ly in enumerate(layers)])
        w.add_head_count([_heads_of(ly, i)[0] for i, ly in enumerate(layers)])
        w.add_head_count_kv([_heads_of(ly, i)[1] for i, ly in enumerate(layers)])
    else:
        w.add_feed_forward_length(layers[0].ff)
        w.add_head_count(layers[0].n_heads)
        w.add_head_count_kv(layers[0].n_kv)
    w.add_rope_freq_base(_rope_theta(cfg))
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(int(run.shapes["model.embed_tokens.weight"][0]))
    w.add_string(ROUTE_KEY, arch)
    w.add_string(SOURCE_KEY, str(run.path.name))


def export_gguf(run_dir: str | Path, out: str | Path, qtype: str = "f16", overwrite: bool = False,
                tokenizer_pre: str | None = None, progress: Callable[[str], None] | None = None) -> dict:
    """Write the run folder ``run_dir`` as the GGUF file ``out`` (atomically; see the module doc). Returns
    ``{"path", "arch", "type", "tensors", "fallbacks", "notes", "tokenizer", "bytes"}``."""
    if qtype not in TYPES:
        raise SecateurError(f"--type {qtype!r} is not one of {', '.join(TYPES)}; choose one of those")
    if Path(out).resolve() == Path(run_dir).resolve() or Path(run_dir).resolve() in Path(out).resolve().parents:
        raise SecateurError(f"output {out} is inside the run folder {run_dir}; write the GGUF elsewhere")
    with contextlib.ExitStack() as stack:
        run = RunFolder(run_dir, stack)
        cfg = run.config
        family = family_of_config(cfg)
        if family not in FAMILY_ARCH:
            raise SecateurError(f"secateur exports the {', '.join(FAMILY_ARCH)} families to GGUF; run {run.path} "
                                f"is a {family or 'unknown'!r} model; keep it as a Hugging Face folder, or convert it "
                                "with llama.cpp's convert_hf_to_gguf.py")
        hidden = int(cfg["hidden_size"])
        head_dim = int(cfg.get("head_dim") or hidden // int(cfg["num_attention_heads"]))
        _rope_theta(cfg)
        layers = layer_shapes(run, head_dim)
        arch, notes = choose_route(family, layers, hidden, head_dim, run.shapes)
        entries, more = plan_tensors(run, arch, layers, head_dim)
        notes += more
        vocab = int(run.shapes["model.embed_tokens.weight"][0])
        fallbacks = _storage(entries, run, qtype)
        if (kq := kquant_note(entries)) is not None:
            notes.append(kq)
        need = sum(_info(e)[2] for e in entries) + (64 << 20)
        with atomic_file(out, overwrite, is_secateur_gguf, need=need, kind="GGUF file") as tmp:
            w = _gguf().GGUFWriter(str(tmp), arch)
            _metadata(w, run, arch, layers, head_dim, qtype)
            src = _source_gguf(run.path)
            tok = _copy_gguf_tokenizer(w, src, vocab) if src is not None and tokenizer_pre is None \
                else _hf_tokenizer(w, run.path, vocab, tokenizer_pre)
            for e in entries:
                shape, dtype, nbytes, raw = _info(e)
                w.add_tensor_info(e.name, shape, dtype, nbytes, raw_dtype=raw)
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_ti_data_to_file()
            for e in _tensors(run, entries):
                w.write_tensor_data(e)
            w.close()
        size = Path(out).stat().st_size
    return {"path": str(out), "arch": arch, "type": qtype, "tensors": len(entries), "fallbacks": fallbacks,
            "notes": notes, "tokenizer": tok, "bytes": size}


def _tensors(run: RunFolder, entries: list[Entry]) -> Iterator[np.ndarray]:
    for e in entries:
        a = np.zeros(e.shape, np.float32) if e.source is None else run.tensor(e.source)
        if e.permute_heads:
            a = _permute_rows(a, e.permute_heads)
        yield _encode(a, e.qtype)


# --- CLI -------------------------------------------------------------------------------------------------


def register_cli(export_subparsers) -> argparse.ArgumentParser:
    """Add ``secateur export gguf``."""
    p = export_subparsers.add_parser(
        "gguf", help="write a run folder as one GGUF file for llama.cpp",
        description="Write a secateur prune --out folder as a GGUF file (llama.cpp). Uniform widths keep the "
                    "family's architecture (llama, qwen2); per-layer widths become llama.cpp's deci "
                    "architecture (per-layer head counts and FFN widths). Masked runs are written dense.")
    p.add_argument("run", metavar="RUN_DIR", help="a secateur prune --out folder")
    p.add_argument("--out", required=True, help="the .gguf file to write (atomically)")
    p.add_argument("--type", dest="qtype", default="f16", choices=TYPES,
                   help="storage of the matrices; 1-D tensors and norms stay f32 (default: %(default)s)")
    p.add_argument("--tokenizer-pre", default=None, metavar="NAME",
                   help="llama.cpp pre-tokenizer name (tokenizer.ggml.pre) when secateur does not recognise it")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it is a GGUF secateur wrote")
    p.set_defaults(func=_cmd_gguf)
    return p


def _cmd_gguf(args) -> int:
    r = export_gguf(args.run, args.out, args.qtype, args.overwrite, args.tokenizer_pre)
    print(f"wrote {r['path']}: {r['arch']}, {r['type']}, {r['tensors']} tensors, {r['bytes'] / 1e6:.1f} MB; "
          f"tokenizer {r['tokenizer']}")
    for name, t, why in r["fallbacks"]:
        print(f"  {name}: {t} ({why})")
    for note in r["notes"]:
        print(f"  note: {note}")
    return 0
