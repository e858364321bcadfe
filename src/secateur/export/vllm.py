"""``secateur export vllm RUN --out DIR``: a run folder as the folder vLLM serves best for it.

The run folder is read as it is on disk (``config.json``, safetensors, one file or sharded, tokenizer; the same
reader and checks as ``export gguf``: :class:`secateur.export.gguf_run.RunFolder`). Routes (``secateur-export.json``
records the route and the engines whose loaders accept the folder):

* ``dense``: a masked run (unstructured, N:M, QK-Wanda; ``secateur-masks.npz`` present) or an unpruned folder: the
  stock config and every tensor as it is, with the masks applied once more (``W[mask] = 0``, so the served weights
  keep them even if the weights were edited after pruning). vLLM no longer accelerates unstructured or 2:4
  sparsity: the folder is smaller only once compressed, not faster.
* ``stock``: a structured run whose layers all keep the same widths (secateur saved it with the family's stock
  config): copied as it is; vLLM's own Llama / Mistral / Qwen2 classes serve it.
* ``decilm``: a per-layer run (``model_type = secateur_<family>``, Llama, Mistral or Qwen2): NVIDIA's Nemotron-NAS
  format, ``DeciLMForCausalLM`` with ``block_configs`` (format: :mod:`secateur.export.configuration_decilm`,
  copied into the folder as ``configuration_decilm.py`` and named by ``auto_map``; serve with
  ``trust_remote_code=True``; nothing is fetched). Read from vLLM 0.32.0's
  ``vllm/model_executor/models/nemotron_nas.py`` (``DeciLMDecoderLayer.__init__``): one global query-head count
  (``num_attention_heads``, explicit ``head_dim``), per layer ``n_heads_in_group`` (KV heads =
  ``num_attention_heads // n_heads_in_group``), an explicit ``ffn.intermediate_size`` when no ``ffn_mult``
  attribute exists, ``no_op`` attention / MLP (the layer's norm goes with it), and biases as global flags
  (``qkv_bias`` for q/k/v, ``attention_bias`` for o_proj, ``mlp_bias`` for gate/up/down).

DeciLM rules, each applied before anything is written:

* every layer that keeps attention keeps the same number of query heads; otherwise refused, naming the layers and
  ``secateur prune --deploy vllm`` (which selects that way) or ``--allocation uniform``;
* a layer's KV heads divide its query heads (always true of secateur's GQA slicing; checked);
* biases: a layer without a bias its flag implies gets zeros (exact). One flag for all four attention biases (q,
  k, v, o: SGLang's ``LlamaAttention`` uses one ``bias`` for qkv_proj and o_proj, so the folder reads the same in
  both). The output bias of a removed attention or MLP (FLAP's compensation keeps it) has no module to live in:
  it is a constant added to the residual stream where nothing removed reads it, so it is folded into the output
  bias of the nearest kept sublayer before it (o_proj or down_proj), or into every row of the embedding when
  none is (the lm_head is then written untied). Exact in real arithmetic; in float32 one addition of two biases
  is rounded once instead of twice;
* ``--engine sglang`` / ``tensorrt-llm``: the folder must also be read by that engine's DeciLM loader (rules from
  their source, :data:`ENGINE_RULES`): MLP widths multiples of 256 (``ffn_mult`` only; prune with
  ``--width-multiple 256``), and no biases the engine's modules lack (SGLang: MLP biases; TensorRT-LLM: any bias,
  so a Qwen2 run's q/k/v biases are refused);
* the written config is checked against the written tensors (each layer's shapes as vLLM builds them from
  ``block_configs``) before the folder is renamed into place: widths that disagree with the weights are refused.

Every refusal is one :class:`~secateur.errors.SecateurError` line (exit 2) and leaves no folder
(:func:`secateur.safe_write.atomic_dir`). Memory: the run's tensors once (they are assembled, then saved).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from secateur.errors import SecateurError
from secateur.export.gguf import LayerShape, layer_shapes
from secateur.export.gguf_run import RUN_FIX, RunFolder, family_of_config
from secateur.safe_write import (
    EXPORT_MARKER,
    MASKS_NAME,
    METHOD_NAMES,
    REPORT_NAME,
    atomic_dir,
    output_lock,
)
from secateur.schemas.api import checked_call

ROUTES = ("dense", "stock", "decilm")
ENGINES = ("vllm", "sglang", "tensorrt-llm")
DECILM_FAMILIES = ("llama", "mistral", "qwen2")
CONFIG_MODULE = "configuration_decilm.py"
DEPLOY_HINT = "prune with --deploy vllm (the same query heads in every layer that keeps attention)"
_ATTN = ("q", "k", "v", "o")
_MLP = ("gate", "up", "down")
# files of a run folder that stay behind: the run's own weights/config are rewritten, its per-layer classes and
# secateur's bookkeeping do not apply to the served folder
_SKIP = {"config.json", "model.safetensors.index.json", "secateur_hetero.py", REPORT_NAME, MASKS_NAME,
         EXPORT_MARKER, CONFIG_MODULE}

#: what each engine's DeciLM loader reads, from its source (docs/deploy-engines.md has the table and citations):
#: ``ffn_mult_only``: the MLP width comes from ``ffn_mult`` alone (a multiple of 256); ``biases``: the bias
#: flags its modules honour (the others are never created, so such weights would be dropped or refused)
ENGINE_RULES: dict[str, dict] = {
    "vllm": {"ffn_mult_only": False, "biases": {"attention", "mlp"},
             "source": "vllm 0.32.0 vllm/model_executor/models/nemotron_nas.py: DeciLMDecoderLayer.__init__"},
    "sglang": {"ffn_mult_only": True, "biases": {"attention"},
               "source": "sglang python/sglang/srt/models/nemotron_nas.py: DeciLMDecodeLayer.__init__ "
                         "(LlamaMLP of models/llama.py has no bias)"},
    "tensorrt-llm": {"ffn_mult_only": True, "biases": set(),
                     "source": "TensorRT-LLM tensorrt_llm/_torch/models/modeling_nemotron_nas.py: "
                               "NemotronNASDecoderLayer.__init__, NemotronNASAttention (bias=False)"},
}


@dataclass(frozen=True)
class Block:
    """One DeciLM layer as written: query/KV heads (0/0: no-op attention), MLP width (0: no-op MLP)."""

    n_heads: int
    n_kv: int
    width: int


# --- widths <-> block_configs ---------------------------------------------------------------------------


def find_multiple(n: int, k: int) -> int:
    """DeciLM's ``_find_multiple``: ``n`` rounded up to a multiple of ``k``."""
    return n if n % k == 0 else n + k - n % k


def ffn_mult_width(ffn_mult: float, hidden: int) -> int:
    """The MLP width DeciLM loaders derive from ``ffn_mult`` (``_ffn_mult_to_intermediate_size``)."""
    return find_multiple(int(2 * ffn_mult * hidden / 3), 256)


def ffn_mult_for(width: int, hidden: int) -> float | None:
    """An ``ffn_mult`` that gives ``width`` back exactly under :func:`ffn_mult_width`, or None (width not a multiple
    of 256, or float rounding would miss it)."""
    if width <= 0 or width % 256:
        return None
    m = 3 * width / (2 * hidden)
    return m if ffn_mult_width(m, hidden) == width else None


def block_configs(blocks: list[Block], n_heads: int, hidden: int) -> list[dict]:
    """The ``block_configs`` of ``blocks`` (format: :mod:`secateur.export.configuration_decilm`)."""
    out = []
    for b in blocks:
        attn = {"no_op": b.n_heads == 0, "replace_with_linear": False,
                "n_heads_in_group": n_heads // b.n_kv if b.n_heads else None}
        ffn: dict = {"no_op": b.width == 0, "replace_with_linear": False,
                     "intermediate_size": b.width or None}
        if (m := ffn_mult_for(b.width, hidden)) is not None:
            ffn["ffn_mult"] = m
        out.append({"attention": attn, "ffn": ffn})
    return out


def blocks_of_config(cfg: dict) -> list[Block]:
    """Each layer's widths as vLLM's DeciLM builds them from ``cfg`` (``config.json`` as a dict): ``ffn_mult`` wins
    over ``intermediate_size`` when present (``hasattr(block_config.ffn, "ffn_mult")``)."""
    heads, hidden = int(cfg["num_attention_heads"]), int(cfg["hidden_size"])
    out = []
    for b in cfg["block_configs"]:
        a, f = b["attention"], b["ffn"]
        nh = 0 if a["no_op"] else heads
        kv = 0 if a["no_op"] else heads // int(a["n_heads_in_group"])
        w = 0 if f["no_op"] else (ffn_mult_width(f["ffn_mult"], hidden) if "ffn_mult" in f
                                  else int(f["intermediate_size"]))
        out.append(Block(nh, kv, w))
    return out


def engines_accepting(cfg: dict) -> dict[str, str]:
    """For each engine of :data:`ENGINE_RULES`, ``"yes"`` or why its DeciLM loader would not read ``cfg``."""
    out = {}
    kept_ffn = [i for i, b in enumerate(cfg["block_configs"]) if not b["ffn"]["no_op"]]
    flags = {"attention": bool(cfg.get("attention_bias") or cfg.get("qkv_bias")), "mlp": bool(cfg.get("mlp_bias"))}
    for engine, rule in ENGINE_RULES.items():
        why = None
        if rule["ffn_mult_only"]:
            odd = [i for i in kept_ffn if "ffn_mult" not in cfg["block_configs"][i]["ffn"]]
            if odd:
                w = cfg["block_configs"][odd[0]]["ffn"]["intermediate_size"]
                why = (f"its DeciLM loader reads MLP widths only as ffn_mult (multiples of 256); layer {odd[0]} is "
                       f"{w} wide: prune with --width-multiple 256")
        for kind, on in flags.items():
            if on and kind not in rule["biases"] and why is None:
                why = f"its DeciLM {'attention' if kind == 'attention' else 'MLP'} has no bias and the run has " \
                      f"{'attention (q/k/v/o)' if kind == 'attention' else 'MLP'} biases"
        out[engine] = why or "yes"
    return out


# --- the run -> a plan of tensors ----------------------------------------------------------------------


def _hf(i: int, role: str, kind: str = "weight") -> str:
    return f"model.layers.{i}." + (f"self_attn.{role}_proj" if role in _ATTN else f"mlp.{role}_proj") + f".{kind}"


def _fold_target(layers, i: int, sub: str) -> tuple[int, str] | None:
    """Where a constant added at the output of layer ``i``'s sublayer ``sub`` ('attn' or 'mlp', removed) can live:
    the nearest kept sublayer before it, as ``(layer, 'o' | 'down')``, or None (only removed sublayers before it:
    the embedding)."""
    order = [(j, s) for j in range(len(layers)) for s in ("attn", "mlp")]
    k = order.index((i, sub))
    for j, s in reversed(order[:k]):
        if s == "attn" and layers[j].n_heads > 0:
            return j, "o"
        if s == "mlp" and layers[j].ff > 0:
            return j, "down"
    return None


def plan_decilm(run: RunFolder, head_dim: int) -> tuple[dict, dict[str, torch.Tensor], list[str]]:
    """``(config.json as a dict, {tensor name: tensor}, notes)`` of the DeciLM folder of ``run`` (module
    docstring); refuses what the format cannot hold."""
    cfg = run.config
    fam = family_of_config(cfg)
    if fam not in DECILM_FAMILIES:
        raise SecateurError(f"run {run.path} is a per-layer {fam!r} model; vLLM's DeciLM format holds Llama-shaped "
                            f"layers ({', '.join(DECILM_FAMILIES)}): serve the run folder with "
                            "trust_remote_code=True and model_impl='transformers' instead")
    if any(s.get("qk_dim") for s in cfg.get("secateur_layers") or []):
        raise SecateurError(f"run {run.path} has query/key heads narrower than its value heads (CORP Q/K); vLLM's "
                            "DeciLM has one head size: keep the run as a Hugging Face folder")
    if fam == "mistral" and cfg.get("sliding_window"):
        raise SecateurError(f"run {run.path} uses a sliding window of {cfg['sliding_window']} tokens, which vLLM's "
                            "DeciLM does not apply; keep the run as a Hugging Face folder")
    layers = layer_shapes(run, head_dim)
    hidden = int(cfg["hidden_size"])
    kept = {ly.n_heads for ly in layers if ly.n_heads > 0}
    if len(kept) > 1:
        by = {}
        for i, ly in enumerate(layers):
            if ly.n_heads:
                by.setdefault(ly.n_heads, i)
        shown = ", ".join(f"layer {i} keeps {n}" for n, i in sorted(by.items(), key=lambda t: t[1])[:3])
        raise SecateurError(f"cannot export run {run.path} to vLLM's DeciLM: its layers keep different numbers of "
                            f"query heads ({shown}) and DeciLM has one count for every layer; {DEPLOY_HINT}, or "
                            "with --allocation uniform")
    n_heads = kept.pop() if kept else int(cfg["num_attention_heads"])
    for i, ly in enumerate(layers):
        if ly.n_heads and (ly.n_kv == 0 or ly.n_heads % ly.n_kv):
            raise SecateurError(f"cannot export run {run.path} to vLLM's DeciLM: layer {i} has {ly.n_heads} query "
                                f"heads over {ly.n_kv} KV heads, not a whole group each; {RUN_FIX}")
    sh = run.shapes
    notes: list[str] = []
    standin = _standin_layer(layers)
    if standin is not None:  # vLLM's DeciLM needs an attention before the first MLP (module docstring)
        ly = layers[standin]
        layers = [*layers[:standin], LayerShape(n_heads, 1, ly.ff, ly.biases), *layers[standin + 1:]]
        notes.append(f"layer {standin} has no attention and is the first MLP: written as a zero attention of "
                     f"{n_heads} query heads over 1 KV head (output exactly 0; vLLM's and SGLang's DeciLM layers "
                     "fail on an MLP that no attention precedes)")
    tensors: dict[str, torch.Tensor] = {}
    embed = run.raw("model.embed_tokens.weight")
    tied = "lm_head.weight" not in sh
    # biases, folded where a removed sublayer's output bias has no module (module docstring)
    bias: dict[tuple[int, str], torch.Tensor] = {}
    for i, ly in enumerate(layers):
        for r in (*_ATTN, *_MLP):
            if r in ly.biases and (i, r) not in bias:
                bias[(i, r)] = run.raw(_hf(i, r, "bias"))
    to_embed = None
    for i, ly in enumerate(layers):
        for sub, role, gone in (("attn", "o", ly.n_heads == 0), ("mlp", "down", ly.ff == 0)):
            if not gone or (i, role) not in bias:
                continue
            c = bias.pop((i, role))
            where = _fold_target(layers, i, sub)
            if where is None:
                to_embed = c if to_embed is None else to_embed + c
                notes.append(f"layer {i}'s removed {'attention' if sub == 'attn' else 'MLP'} kept an output bias: "
                             "added to every embedding row (nothing before it reads the residual stream)")
            else:
                bias[where] = bias[where] + c if where in bias else c.clone()
                notes.append(f"layer {i}'s removed {'attention' if sub == 'attn' else 'MLP'} kept an output bias: "
                             f"folded into layer {where[0]}'s {where[1]}_proj bias")
    if to_embed is not None:
        if tied:
            tensors["lm_head.weight"] = embed.clone()
            notes.append("lm_head written untied (the embedding carries a folded bias)")
        embed = embed + to_embed.to(embed.dtype)
    attn_bias = any(r in _ATTN and layers[i].n_heads > 0 for i, r in bias)
    mlp_bias = any(r in _MLP and layers[i].ff > 0 for i, r in bias)
    tensors["model.embed_tokens.weight"] = embed
    blocks = []
    for i, ly in enumerate(layers):
        p = f"model.layers.{i}."
        if ly.n_heads:
            norm = p + "input_layernorm.weight"
            tensors[norm] = run.raw(norm) if norm in sh else torch.ones(hidden, dtype=embed.dtype)
            for r in _ATTN:
                zero = {"q": (n_heads * head_dim, hidden), "k": (head_dim, hidden), "v": (head_dim, hidden),
                        "o": (hidden, n_heads * head_dim)}[r]
                w = run.raw(_hf(i, r)) if i != standin else torch.zeros(zero, dtype=embed.dtype)
                tensors[_hf(i, r)] = w
                if attn_bias:
                    tensors[_hf(i, r, "bias")] = bias.get((i, r), torch.zeros(w.shape[0], dtype=w.dtype))
        if ly.ff:
            tensors[p + "post_attention_layernorm.weight"] = run.raw(p + "post_attention_layernorm.weight")
            for r in _MLP:
                w = run.raw(_hf(i, r))
                tensors[_hf(i, r)] = w
                if mlp_bias:
                    tensors[_hf(i, r, "bias")] = bias.get((i, r), torch.zeros(w.shape[0], dtype=w.dtype))
        blocks.append(Block(ly.n_heads, ly.n_kv if ly.n_heads else 0, ly.ff))
    tensors["model.norm.weight"] = run.raw("model.norm.weight")
    if not tied:
        tensors["lm_head.weight"] = run.raw("lm_head.weight")
    spare = [n for n in sh if n not in tensors and not n.endswith(".bias") and not n.endswith("rotary_emb.inv_freq")
             and 0 not in sh[n] and not (n.endswith("layernorm.weight") and _removed_norm(n, layers))]
    if spare:
        raise SecateurError(f"cannot export run {run.path} to vLLM's DeciLM: tensor {spare[0]} has no place in it; "
                            f"{RUN_FIX}")
    out_cfg = _decilm_config(cfg, blocks, n_heads, head_dim, hidden, attn_bias, mlp_bias,
                             tie=tied and to_embed is None)
    return out_cfg, tensors, notes


def _standin_layer(layers) -> int | None:
    """The layer whose removed attention must be written as a zero attention: the first kept MLP when no kept
    attention comes before it. vLLM 0.32.0's ``DeciLMDecoderLayer.forward`` (and SGLang's ``DeciLMDecodeLayer``)
    calls ``post_attention_layernorm(hidden_states, residual)`` with ``residual`` still None there and fails
    ("too many values to unpack"): the residual is set up only by a kept attention's input norm."""
    for i, ly in enumerate(layers):
        if ly.n_heads:
            return None
        if ly.ff:
            return i
    return None


def _removed_norm(name: str, layers) -> bool:
    i = int(name.split(".")[2])
    return (name.endswith("input_layernorm.weight") and layers[i].n_heads == 0) or \
        (name.endswith("post_attention_layernorm.weight") and layers[i].ff == 0)


#: the Llama config fields a DeciLM folder carries over from the run's config (the rest is DeciLM's own)
_CARRY = ("vocab_size", "hidden_size", "num_hidden_layers", "max_position_embeddings", "rms_norm_eps", "hidden_act",
          "initializer_range", "bos_token_id", "eos_token_id", "pad_token_id", "rope_parameters", "rope_scaling",
          "dtype", "torch_dtype", "attention_dropout", "pretraining_tp", "use_cache")


def _decilm_config(cfg: dict, blocks: list[Block], n_heads: int, head_dim: int, hidden: int, attn_bias: bool,
                   mlp_bias: bool, tie: bool) -> dict:
    d = {k: cfg[k] for k in _CARRY if k in cfg}
    rope = cfg.get("rope_parameters") or {}
    theta = rope.get("rope_theta", cfg.get("rope_theta"))
    if theta is not None:
        d["rope_theta"] = theta  # engines on older transformers read config.rope_theta (SGLang: getattr, 10000)
    kv = next((b.n_kv for b in blocks if b.n_heads), n_heads)
    d.update({"architectures": ["DeciLMForCausalLM"], "model_type": "nemotron-nas",
              "auto_map": {"AutoConfig": "configuration_decilm.DeciLMConfig"},
              "num_attention_heads": n_heads, "num_key_value_heads": kv, "head_dim": head_dim,
              "intermediate_size": max((b.width for b in blocks), default=0) or int(cfg.get("intermediate_size", 1)),
              "attention_bias": attn_bias, "qkv_bias": attn_bias, "mlp_bias": mlp_bias,
              "tie_word_embeddings": tie, "block_configs": block_configs(blocks, n_heads, hidden)})
    return d


def check_decilm(cfg: dict, shapes: dict[str, tuple[int, ...]], where: str) -> None:
    """Refuse a DeciLM config whose widths disagree with the tensors (``shapes``: name -> shape), as vLLM would
    build the layers from ``block_configs``: one line naming the layer, the tensor and both widths."""
    heads, hidden = int(cfg["num_attention_heads"]), int(cfg["hidden_size"])
    hd = int(cfg.get("head_dim") or hidden // heads)
    if len(cfg.get("block_configs") or []) != int(cfg["num_hidden_layers"]):
        raise SecateurError(f"{where}: block_configs has {len(cfg.get('block_configs') or [])} entries for "
                            f"{cfg['num_hidden_layers']} layers; export the run again")
    for i, entry in enumerate(cfg["block_configs"]):
        g = entry["attention"].get("n_heads_in_group")
        if not entry["attention"]["no_op"] and (not isinstance(g, int) or g <= 0 or heads % g):
            raise SecateurError(f"{where}: layer {i}: n_heads_in_group {g!r} does not divide the {heads} query heads; "
                                "export the run again")
    for i, b in enumerate(blocks_of_config(cfg)):
        want = {}
        if b.n_heads:
            want |= {_hf(i, "q"): (b.n_heads * hd, hidden), _hf(i, "k"): (b.n_kv * hd, hidden),
                     _hf(i, "v"): (b.n_kv * hd, hidden), _hf(i, "o"): (hidden, b.n_heads * hd)}
        if b.width:
            want |= {_hf(i, "gate"): (b.width, hidden), _hf(i, "up"): (b.width, hidden),
                     _hf(i, "down"): (hidden, b.width)}
        for name, shape in want.items():
            got = shapes.get(name)
            if got != shape:
                raise SecateurError(f"{where}: layer {i}: block_configs imply {name} of shape {list(shape)}, the "
                                    f"weights hold {list(got) if got else 'none'}; the config disagrees with the "
                                    "weights: export the run again")
        extra = [n for n in shapes if n.startswith(f"model.layers.{i}.") and n.endswith(".weight")
                 and "layernorm" not in n and n not in want]
        if extra:
            raise SecateurError(f"{where}: layer {i}: tensor {extra[0]} belongs to a sublayer block_configs marks "
                                "no_op; the config disagrees with the weights: export the run again")


def check_decilm_folder(folder: str | os.PathLike) -> dict:
    """:func:`check_decilm` on a DeciLM folder on disk (its ``config.json`` and safetensors headers); returns the
    config. For ``secateur serve-check`` before an engine starts."""
    from secateur.files import read_json
    from secateur.models.folder_check import held_shapes, weight_files

    folder = Path(folder)
    cfg = read_json(folder / "config.json", "export the run again")
    if not isinstance(cfg, dict) or "block_configs" not in cfg:
        raise SecateurError(f"{folder}/config.json has no block_configs; not a DeciLM folder")
    files = weight_files(str(folder), folder) or []
    check_decilm(cfg, {k: tuple(v) for k, v in held_shapes(files).items()}, str(folder))
    return cfg


# --- dense / stock -------------------------------------------------------------------------------------


def _masked_tensors(run: RunFolder) -> tuple[dict[str, torch.Tensor], int]:
    """Every tensor of ``run``, masks applied (``secateur-masks.npz``: True = pruned); (tensors, masks applied)."""
    from secateur.masks_file import load_masks

    tensors = {n: run.raw(n) for n in run.shapes}
    path = run.path / MASKS_NAME
    masks = load_masks(path) if path.is_file() else {}
    for key, m in masks.items():
        name = key if key in tensors else key + ".weight"
        w = tensors.get(name)
        if w is None:
            raise SecateurError(f"{path}: mask {key} names no tensor of the run; {RUN_FIX}")
        if tuple(m.shape) != tuple(w.shape):
            if tuple(m.shape[::-1]) != tuple(w.shape) or m.dim() != 2:
                raise SecateurError(f"{path}: mask {key} has shape {list(m.shape)} for a weight of "
                                    f"{list(w.shape)}; {RUN_FIX}")
            m = m.T  # GPT-2's Conv1D stores [in, out]
        tensors[name] = w.masked_fill(m.to(torch.bool), 0)
    return tensors, len(masks)


def _route(cfg: dict, run: RunFolder) -> str:
    if str(cfg.get("model_type", "")).startswith("secateur_"):
        return "decilm"
    return "dense" if (run.path / MASKS_NAME).is_file() or not _report_kind(run).startswith("structured") \
        else "stock"


def _report_kind(run: RunFolder) -> str:
    from secateur.files import read_json

    p = run.path / REPORT_NAME
    if not p.is_file():
        return ""
    rep = read_json(p, RUN_FIX)
    return str(rep.get("kind", "")) if isinstance(rep, dict) else ""


def _copy_side_files(src: Path, dst: Path) -> list[str]:
    """Tokenizer, generation config, chat template, model card: every regular file but the weights and
    secateur's own."""
    done = []
    for f in sorted(src.iterdir()):
        if f.is_file() and not f.is_symlink() and f.name not in _SKIP and not f.name.endswith(".safetensors") \
                and not f.name.startswith("secateur-") and f.name not in METHOD_NAMES:
            shutil.copyfile(f, dst / f.name)
            done.append(f.name)
    return done


def _save_tensors(tensors: dict[str, torch.Tensor], folder: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})


# --- the exporter --------------------------------------------------------------------------------------


@checked_call
def export_vllm(run_dir: str | os.PathLike, out: str | os.PathLike, overwrite: bool = False,
                engine: str = "vllm") -> dict:
    """Write the run folder ``run_dir`` as the folder ``out`` for vLLM (atomically; see the module doc).
    ``engine``: the DeciLM loader the folder must also satisfy (``vllm``, ``sglang``, ``tensorrt-llm``).
    Returns ``{"path", "route", "notes", "engines", "tensors", "bytes"}``."""
    if engine not in ENGINES:
        raise SecateurError(f"--engine {engine!r} is not one of {', '.join(ENGINES)}; choose one of those")
    if Path(out).resolve() == Path(run_dir).resolve() or Path(run_dir).resolve() in Path(out).resolve().parents:
        raise SecateurError(f"output {out} is inside the run folder {run_dir}; write the export elsewhere")
    with contextlib.ExitStack() as stack:
        stack.enter_context(output_lock(out))
        run = RunFolder(run_dir, stack)
        cfg = run.config
        route = _route(cfg, run)
        notes: list[str] = []
        engines: dict[str, str] = {e: "yes" for e in ENGINES}
        if route == "decilm":
            hidden = int(cfg["hidden_size"])
            head_dim = int(cfg.get("head_dim") or hidden // int(cfg["num_attention_heads"]))
            out_cfg, tensors, notes = plan_decilm(run, head_dim)
            check_decilm(out_cfg, {k: tuple(v.shape) for k, v in tensors.items()}, f"export of {run.path}")
            engines = engines_accepting(out_cfg)
            if engines[engine] != "yes":
                raise SecateurError(f"cannot export run {run.path} for {engine}: {engines[engine]}")
        else:
            tensors, n_masks = _masked_tensors(run)
            out_cfg = dict(cfg)
            if n_masks:
                notes.append(f"{n_masks} masks applied; vLLM runs the zeros dense (no sparse kernels): same speed "
                             "as the dense model")
        need = sum(t.numel() * t.element_size() for t in tensors.values()) + (16 << 20)
        with atomic_dir(out, overwrite, need=need) as tmp:
            _save_tensors(tensors, tmp)
            copied = _copy_side_files(run.path, tmp)
            (tmp / "config.json").write_text(json.dumps(out_cfg, indent=2, sort_keys=True) + "\n")
            if route == "decilm":
                from secateur.export import configuration_decilm

                (tmp / CONFIG_MODULE).write_text(Path(configuration_decilm.__file__).read_text())
            (tmp / EXPORT_MARKER).write_text(json.dumps(
                {"route": route, "architectures": out_cfg.get("architectures"), "engines": engines,
                 "source": run.path.name, "notes": notes, "copied": copied}, indent=1))
        size = sum(f.stat().st_size for f in Path(out).iterdir() if f.is_file())
    return {"path": str(out), "route": route, "notes": notes, "engines": engines, "tensors": len(tensors),
            "bytes": size}


# --- CLI -------------------------------------------------------------------------------------------------


def register_cli(export_subparsers) -> argparse.ArgumentParser:
    """Add ``secateur export vllm``."""
    p = export_subparsers.add_parser(
        "vllm", help="write a run folder as the folder vLLM serves (stock config, or DeciLM per layer)",
        description="Write a secateur prune --out folder for vLLM: masked runs as a dense folder with the masks "
                    "applied, uniform structured runs with their stock config, per-layer runs as NVIDIA's "
                    "DeciLMForCausalLM (block_configs, configuration_decilm.py; serve with "
                    "trust_remote_code=True). Runs the format cannot hold are refused before anything is written.")
    p.add_argument("run", metavar="RUN_DIR", help="a secateur prune --out folder")
    p.add_argument("--out", required=True, help="the folder to write (atomically)")
    p.add_argument("--engine", default="vllm", choices=ENGINES,
                   help="the DeciLM loader the folder must satisfy; sglang and tensorrt-llm read MLP widths only "
                        "as multiples of 256 and fewer biases (default: %(default)s)")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it is a folder secateur wrote")
    p.set_defaults(func=_cmd_vllm)
    return p


def _cmd_vllm(args) -> int:
    r = export_vllm(args.run, args.out, args.overwrite, args.engine)
    ok = ", ".join(e for e, v in r["engines"].items() if v == "yes")
    print(f"wrote {r['path']}: {r['route']}, {r['tensors']} tensors, {r['bytes'] / 1e6:.1f} MB; read by: {ok}")
    for e, why in r["engines"].items():
        if why != "yes":
            print(f"  not {e}: {why}")
    for note in r["notes"]:
        print(f"  note: {note}")
    return 0
