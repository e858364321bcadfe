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
import mmap
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from secateur.errors import SecateurError
from secateur.export.gguf_run import (
    FAMILY_ARCH,
    RUN_FIX,
    RunFolder,
    family_of_config,
    gguf_module,
)
from secateur.export.gguf_tokenizer import (
    copy_gguf_tokenizer,
    hf_tokenizer,
    source_gguf,
)
from secateur.safe_write import atomic_file, output_lock
from secateur.schemas.api import checked_call

TYPES = ("f32", "f16", "bf16", "q8_0")
ROUTE_KEY = "secateur.export.route"
SOURCE_KEY = "secateur.export.source"
F16_MAX = 65504.0
_ATTN = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output"}
_MLP = {"gate": "ffn_gate", "up": "ffn_up", "down": "ffn_down"}


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
    g = gguf_module()
    return {"f32": g.GGMLQuantizationType.F32, "f16": g.GGMLQuantizationType.F16,
            "bf16": g.GGMLQuantizationType.BF16, "q8_0": g.GGMLQuantizationType.Q8_0}[name]


def _encode(a: np.ndarray, qtype: str) -> np.ndarray:
    if qtype == "f32":
        return np.ascontiguousarray(a, dtype=np.float32)
    if qtype == "f16":
        return np.ascontiguousarray(a.astype(np.float16))
    return gguf_module().quants.quantize(np.ascontiguousarray(a, dtype=np.float32), _qtype(qtype))


def _info(e: Entry) -> tuple[tuple[int, ...], np.dtype, int, object]:
    """(shape as add_tensor_info takes it, numpy dtype, bytes, raw type or None)."""
    n = int(np.prod(e.shape))
    if e.qtype == "f32":
        return e.shape, np.dtype(np.float32), 4 * n, None
    if e.qtype == "f16":
        return e.shape, np.dtype(np.float16), 2 * n, None
    g = gguf_module()
    byte_shape = tuple(g.quants.quant_shape_to_byte_shape(e.shape, _qtype(e.qtype)))
    return byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), _qtype(e.qtype)


# --- the writer ----------------------------------------------------------------------------------------


def is_secateur_gguf(path: str | Path) -> bool:
    """The file is a GGUF that secateur's exporter wrote (its header holds ``secateur.export.route``)."""
    from secateur.models.gguf_reader import read_header

    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            meta, _ = read_header(Path(path), buf)
    except Exception:  # noqa: BLE001 - anything unreadable is not ours
        return False
    return ROUTE_KEY in meta


def _metadata(w, run: RunFolder, arch: str, layers: list[LayerShape], head_dim: int, want: str) -> None:
    g = gguf_module()
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


@checked_call
def export_gguf(run_dir: str | os.PathLike, out: str | os.PathLike, qtype: str = "f16", overwrite: bool = False,
                tokenizer_pre: str | None = None, progress: Callable[[str], None] | None = None) -> dict:
    """Write the run folder ``run_dir`` as the GGUF file ``out`` (atomically; see the module doc). Returns
    ``{"path", "arch", "type", "tensors", "fallbacks", "notes", "tokenizer", "bytes"}``."""
    if qtype not in TYPES:
        raise SecateurError(f"--type {qtype!r} is not one of {', '.join(TYPES)}; choose one of those")
    if Path(out).resolve() == Path(run_dir).resolve() or Path(run_dir).resolve() in Path(out).resolve().parents:
        raise SecateurError(f"output {out} is inside the run folder {run_dir}; write the GGUF elsewhere")
    with contextlib.ExitStack() as stack:
        stack.enter_context(output_lock(out))  # one output, one writer: from the checks to the rename
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
            w = gguf_module().GGUFWriter(str(tmp), arch)
            _metadata(w, run, arch, layers, head_dim, qtype)
            src = source_gguf(run.path)
            tok = copy_gguf_tokenizer(w, src, vocab) if src is not None and tokenizer_pre is None \
                else hf_tokenizer(w, run.path, vocab, tokenizer_pre)
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
