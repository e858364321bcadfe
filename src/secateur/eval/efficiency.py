"""Efficiency: parameter counts (from a model or from a config alone), FLOPs/token, peak memory and
prefill/decode throughput (evaluation.md §4).

* Params: unique parameter storages of the model (tied embeddings counted once).
* :func:`count_params_from_config`: the same number from the config alone (optionally with per-layer
  widths), for the Llama family (llama, mistral, qwen2, qwen3), OPT and GPT-2. It reproduces COEC
  Table 4 for Qwen2.5-7B: 7,615,616,512 -> 5,699,162,112 parameters at rho = 30% with ceil-kept MLP
  channels (13,261 of 18,944) and KV groups (3 of 4), see :func:`uniform_layer_specs`.
* FLOPs/token: COEC's convention ``2 x params`` (Table 4: 15.2 -> 11.4 GFLOPs); ``attention_context``
  adds the score/value FLOPs ``4 L H_Q m T_ctx``.
* Peak memory: CUDA ``max_memory_allocated`` after ``reset_peak_memory_stats``. On the CPU, torch's
  allocations are invisible to ``tracemalloc``; we reset the kernel's resident-set high-water mark by
  writing ``5`` to ``/proc/self/clear_refs`` and read ``VmHWM`` from ``/proc/self/status`` after the
  workload (kind ``cpu_rss_hwm``; the model's own weights are included, as on the GPU). Where the reset
  is not permitted the lifetime peak is reported (kind ``cpu_rss_hwm_lifetime``, an upper bound).
  ``peak_memory_delta_bytes`` subtracts the usage at the start (CUDA allocated / CPU RSS): the
  workload's activations and KV cache.
* Throughput: prefill = ``batch x prompt_len / t(prompt forward)``; decode = ``batch x new_tokens /
  t(greedy loop with KV cache)``; ``warmup`` untimed runs, then the median of ``repeats``.

Vision encoders (the adapter's ``modality == "vision"``; :func:`measure_vision_efficiency`):

* FLOPs/image (:func:`vision_flops`, counted, not from the parameter count): forward hooks on one image count
  multiply-accumulates (MACs) of every ``nn.Linear`` called (``rows x in x out``), every ``nn.Conv2d`` (the patch
  embedding: ``output elements x in/groups x kh x kw``) and every ``nn.MultiheadAttention`` (SigLIP's attention-pool
  head: its in/out projections); FLOPs = ``2 x MACs`` + the attention products of each block,
  ``2 T^2 w_q`` (scores, ``w_q = H d_qk`` the query projection's output width) + ``2 T^2 w_v`` (the weighted sum of
  values, ``w_v = H d_v``), i.e. ``4 H T^2 d_head`` for a dense block, read from the widths the block's q and v
  projections have now (heads removed, or CORP's narrowed q/k heads: the narrow width for the scores); ``T`` the
  tokens the block sees. Biases, norms, activations and softmax are not counted.
* Latency: ``batch_latency`` (1) images per forward, ``warmup`` untimed forwards, then the median of ``repeats``
  (ms); throughput: ``batch_throughput`` (16) images / the median time of a forward of that many; pixel values
  ``torch.randn`` with a fixed seed (the time does not depend on them), ``torch.no_grad``, eval mode. Several models
  (``--dense``) are timed alternately in each repeat, dense first, in the same process.
* Peak memory: as for text, around one forward of ``batch_throughput`` images (with ``--dense`` both models are
  resident, so the peak includes both models' weights; ``peak_memory_delta_bytes`` is the workload's own).
"""

from __future__ import annotations

import inspect
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from secateur.budgets.allocate import keep_count
from secateur.errors import SecateurError
from secateur.models import hetero
from secateur.models.families import family_of, layout_of


def count_params(model: nn.Module) -> int:
    """Parameters over unique storages (tied weights once)."""
    seen: set = set()
    total = 0
    for _, p in model.named_parameters(remove_duplicate=False):
        key = id(p) if p.device.type == "meta" else (p.untyped_storage().data_ptr(), p.storage_offset(),
                                                     tuple(p.shape))
        if key in seen:
            continue
        seen.add(key)
        total += p.numel()
    return total


def _spec_list(config, layers: list[dict] | None) -> list[dict]:
    if layers is not None:
        return [dict(s) if isinstance(s, dict) else s.to_dict() for s in layers]
    got = getattr(config, "secateur_layers", None)
    if got:
        return [dict(s) for s in got]
    layout = layout_of(family_of(config))
    n_heads = config.num_attention_heads
    n_kv = getattr(config, "num_key_value_heads", None) or n_heads
    inter = getattr(config, layout.inter_key) or layout.default_inner_mult * config.hidden_size
    if layout.inter_ratio:
        inter = inter * config.hidden_size
    o_bias, down_bias = layout.flag(config, layout.o_bias), layout.flag(config, layout.mlp_bias)
    return [{"n_heads": n_heads, "n_kv_heads": n_kv, "intermediate": inter, "o_bias": o_bias,
             "down_bias": down_bias} for _ in range(config.num_hidden_layers)]


def count_params_from_config(config, layers: list[dict] | None = None) -> int:
    """Parameter count implied by ``config`` (and per-layer widths ``layers``, default the config's own or
    its ``secateur_layers``) without building the model.

    Read from the family's :class:`~secateur.models.hetero.FamilyLayout` (bias rules, gating, norms,
    learned positions) and the standard config fields (``word_embed_proj_dim``,
    ``layer_norm_elementwise_affine``, ``do_layer_norm_before`` where a family has them)."""
    layout = layout_of(family_of(config))
    specs = _spec_list(config, layers)
    d, v = config.hidden_size, config.vocab_size
    m = hetero.head_dim_of(config)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    wp = getattr(config, "word_embed_proj_dim", None) or d  # OPT: embeddings projected to/from d
    norm = (2 * d if layout.layer_norm else d) if getattr(config, "layer_norm_elementwise_affine", True) else 0
    total = v * wp * (1 if tied else 2) + 2 * d * wp * (wp != d)
    if layout.positions:
        total += (getattr(config, layout.positions) + layout.position_offset) * d
    if getattr(config, "do_layer_norm_before", True) and not getattr(config, "_remove_final_layer_norm", False):
        total += norm  # final norm
    qkv_b = layout.flag(config, layout.qkv_bias)
    in_b = layout.flag(config, layout.mlp_bias)
    n_in = layout.n_mlp_in
    for s in specs:
        h, f = s["n_heads"], s["intermediate"]
        kv = s["n_kv_heads"] if layout.gqa else h
        o_b = s["o_bias"] or layout.o_bias is True  # an always-biased projection cannot lose its bias
        down_b = s["down_bias"] or layout.mlp_bias is True
        total += d * m * (2 * h + 2 * kv) + qkv_b * (h + 2 * kv) * m + o_b * d + layout.norms_per_layer * norm
        total += (n_in + 1) * d * f + n_in * f * in_b + down_b * d + 2 * m * layout.qk_norm
    return int(total)


def uniform_layer_specs(config, rho: float, rounding: str = "ceil", attention: bool = True,
                        mlp: bool = True) -> list[dict]:
    """Per-layer widths of a uniform structured prune: keep ``ceil((1 - rho) H_K)`` KV groups (whole
    groups of query heads; under MQA ``ceil((1 - rho) H_Q)`` query heads and the KV head) and
    ``ceil((1 - rho) f)`` channels in every layer (COEC §1 [A6])."""
    out = []
    for s in _spec_list(config, None):
        s = dict(s)
        if attention and s["n_kv_heads"] == 1 < s["n_heads"]:  # MQA: query heads go, the KV head stays
            s["n_heads"] = keep_count(s["n_heads"], rho, rounding)
        elif attention:
            gs = s["n_heads"] // s["n_kv_heads"]
            kv = keep_count(s["n_kv_heads"], rho, rounding)
            s.update(n_kv_heads=kv, n_heads=kv * gs)
        if mlp:
            s["intermediate"] = keep_count(s["intermediate"], rho, rounding)
        out.append(s)
    return out


def flops_per_token(params: int | nn.Module, config=None, attention_context: int = 0) -> float:
    """COEC convention ``2 x params`` (+ ``4 L H_Q m T_ctx`` attention FLOPs when ``attention_context``)."""
    n = count_params(params) if isinstance(params, nn.Module) else int(params)
    flops = 2.0 * n
    if attention_context:
        if config is None:
            config = params.config if isinstance(params, nn.Module) else None
        if config is None:
            raise SecateurError("attention FLOPs need the model config")
        m = hetero.head_dim_of(config)
        heads = sum(s["n_heads"] for s in _spec_list(config, None))
        flops += 4.0 * heads * m * attention_context
    return flops


# --- peak memory -----------------------------------------------------------------------------------

def _proc_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


class PeakMemory:
    """Context manager measuring the peak memory of a workload (see module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak_bytes: int | None = None
        self.start_bytes: int | None = None
        self.kind = ""

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start_bytes = int(torch.cuda.memory_allocated(self.device))
            self.kind = "cuda_max_allocated"
        else:
            kib = _proc_kib("VmRSS")
            self.start_bytes = None if kib is None else kib * 1024
            try:
                Path("/proc/self/clear_refs").write_text("5")
                self.kind = "cpu_rss_hwm"
            except OSError:
                self.kind = "cpu_rss_hwm_lifetime"
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = int(torch.cuda.max_memory_allocated(self.device))
        else:
            kib = _proc_kib("VmHWM")
            self.peak_bytes = None if kib is None else kib * 1024


# --- throughput -------------------------------------------------------------------------------------

def _cache_kw(model: nn.Module) -> str:
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _prefill(model: nn.Module, ids: torch.Tensor):
    out = model(input_ids=ids, use_cache=True)
    cache = getattr(out, "cache", None)
    if cache is None:
        cache = getattr(out, "past_key_values", None)
    return out.logits[:, -1].argmax(-1, keepdim=True), cache


def _decode(model: nn.Module, tok: torch.Tensor, cache, steps: int, kw: str) -> torch.Tensor:
    for _ in range(steps):
        out = model(input_ids=tok, use_cache=True, **{kw: cache})
        c = getattr(out, "cache", None)
        cache = c if c is not None else getattr(out, "past_key_values", cache)
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
    return tok


def measure_efficiency(model: nn.Module, tokenizer=None, prompt_len: int = 2048, new_tokens: int = 256,
                       warmup: int = 3, repeats: int = 10, batch_size: int = 1, seed: int = 0,
                       prompt: str | None = None) -> dict:
    """Params, FLOPs/token, peak memory and greedy prefill/decode throughput of ``model`` (eval mode,
    KV cache on). The prompt is ``prompt`` tokenized and tiled to ``prompt_len`` when a tokenizer and a
    text are given, else seeded random token ids (throughput does not depend on the token values).

    A vision encoder goes to :func:`measure_vision_efficiency` (``batch_size`` images per latency forward, the
    config's image size and channels; ``prompt_len`` / ``new_tokens`` unused)."""
    if _is_vision(model):
        size, channels = vision_input(model)
        return measure_vision_efficiency(model, size, channels, batch_latency=batch_size, warmup=warmup,
                                         repeats=repeats, seed=seed)
    device = next(model.parameters()).device
    vocab = model.get_input_embeddings().weight.shape[0]
    if tokenizer is not None and prompt:
        base = torch.tensor(tokenizer(prompt)["input_ids"], dtype=torch.long)
        ids = base.repeat(prompt_len // max(base.numel(), 1) + 1)[:prompt_len]
        ids = ids.unsqueeze(0).repeat(batch_size, 1)
    else:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, vocab, (batch_size, prompt_len), generator=g)
    ids = ids.to(device)
    kw = _cache_kw(model)
    was_training = model.training
    model.eval()
    pre_t, dec_t = [], []
    try:
        with torch.inference_mode():
            for r in range(warmup + repeats):
                _sync(device)
                t0 = time.perf_counter()
                tok, cache = _prefill(model, ids)
                _sync(device)
                t1 = time.perf_counter()
                _decode(model, tok, cache, new_tokens, kw)
                _sync(device)
                t2 = time.perf_counter()
                if r >= warmup:
                    pre_t.append(t1 - t0)
                    dec_t.append(t2 - t1)
                del cache
            with PeakMemory(device) as pm:
                tok, cache = _prefill(model, ids)
                _decode(model, tok, cache, new_tokens, kw)
                del cache
    finally:
        model.train(was_training)
    params = count_params(model)
    pre, dec = statistics.median(pre_t), statistics.median(dec_t)
    return {
        "params": params,
        "flops_per_token": flops_per_token(params),
        "peak_memory_bytes": pm.peak_bytes,
        "peak_memory_gib": None if pm.peak_bytes is None else pm.peak_bytes / 2**30,
        "peak_memory_kind": pm.kind,
        "peak_memory_delta_bytes": None if pm.peak_bytes is None or pm.start_bytes is None
        else pm.peak_bytes - pm.start_bytes,
        "prefill_s": pre,
        "decode_s": dec,
        "prefill_tokens_per_s": batch_size * prompt_len / pre if pre > 0 else float("inf"),
        "decode_tokens_per_s": batch_size * new_tokens / dec if dec > 0 else float("inf"),
        "settings": {"prompt_len": prompt_len, "new_tokens": new_tokens, "warmup": warmup, "repeats": repeats,
                     "batch_size": batch_size, "device": str(device), "dtype": str(next(model.parameters()).dtype),
                     "attn_implementation": getattr(model.config, "_attn_implementation", None)},
    }


# --- vision encoders -----------------------------------------------------------------------------------------

VISION_FLOPS_RULE = ("FLOPs/image = 2 x MACs (every Linear, the patch Conv2d, attention-pool projections) + "
                     "2 T^2 (w_q + w_v) attention per block (q / v projection widths)")


def _is_vision(model: nn.Module) -> bool:
    from secateur.models.families import family_class

    cls = family_class(getattr(model.config, "model_type", None))
    return cls is not None and cls.modality == "vision"


def vision_input(model: nn.Module) -> tuple[tuple[int, int], int]:
    """``((height, width), channels)`` of the images ``model`` takes, from its (vision) config."""
    from secateur.models.families import get_adapter

    c = get_adapter(model).vision_config
    size = getattr(c, "image_size", 224)
    size = tuple(int(v) for v in size) if isinstance(size, list | tuple) else (int(size), int(size))
    return size, int(getattr(c, "num_channels", 3))


def _image_shape(image_size, channels) -> tuple[int, int, int]:
    size = tuple(image_size) if isinstance(image_size, list | tuple) else (image_size, image_size)
    if len(size) != 2 or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in (*size, channels)):
        raise SecateurError(f"image size {image_size!r} and channels {channels!r} must be positive integers (size: "
                            "one or (height, width)); fix image_size / num_channels in config.json")
    return channels, size[0], size[1]


def _check_counts(**counts) -> None:
    for name, (value, low) in counts.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise SecateurError(f"{name} must be an integer >= {low}, got {value!r}")


def vision_flops(model: nn.Module, image_size, channels: int) -> dict:
    """FLOPs of one image through ``model`` (module docstring), counted with forward hooks on one forward:
    ``{"flops_per_image", "linear_flops", "attention_flops", "macs", "blocks"}`` (``blocks``: per block ``T``,
    ``w_q``, ``w_v`` as seen)."""
    from secateur.models.families import get_adapter

    c, h, w = _image_shape(image_size, channels)
    ad = get_adapter(model)
    macs = [0]
    attn = [0]
    blocks: list[dict] = []

    def linear(mod, args, out):
        x = args[0]
        macs[0] += x.numel() // max(mod.in_features, 1) * mod.in_features * mod.out_features

    def conv(mod, args, out):
        kh, kw = mod.kernel_size
        macs[0] += out.numel() * (mod.in_channels // mod.groups) * kh * kw

    def mha(mod, args, kwargs, out):  # the functional path calls neither its in- nor its out-projection module
        q = kwargs.get("query", args[0] if args else None)
        k = kwargs.get("key", args[1] if len(args) > 1 else q)
        bf = getattr(mod, "batch_first", False)
        tq, tk = (q.shape[1], k.shape[1]) if bf else (q.shape[0], k.shape[0])
        e = mod.embed_dim
        macs[0] += tq * e * e + tk * e * (mod.kdim + mod.vdim) + tq * e * e
        attn[0] += 4 * tq * tk * e

    def role(block: dict, key: str):
        def hook(mod, args, out):
            block["tokens"] = int(args[0].shape[-2])
            block[key] = int(out.shape[-1])
        return hook

    handles = []
    try:
        for mod in model.modules():
            if isinstance(mod, nn.Linear):
                handles.append(mod.register_forward_hook(linear))
            elif isinstance(mod, nn.Conv2d):
                handles.append(mod.register_forward_hook(conv))
            elif isinstance(mod, nn.MultiheadAttention):
                handles.append(mod.register_forward_hook(mha, with_kwargs=True))
        for layer in ad.layers:
            block: dict = {}
            blocks.append(block)
            refs = ad.role_refs(layer)
            for key, r in (("w_q", "q"), ("w_v", "v")):
                if r in refs:
                    handles.append(refs[r].module.register_forward_hook(role(block, key)))
        param = next(model.parameters())
        px = torch.randn(1, c, h, w, generator=torch.Generator().manual_seed(0)).to(param.device, param.dtype)
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                model(pixel_values=px)
        finally:
            model.train(was_training)
    finally:
        for hd in handles:
            hd.remove()
    for b in blocks:  # a block whose attention lost every head calls neither projection
        t = b.get("tokens", 0)
        attn[0] += 2 * t * t * (b.get("w_q", 0) + b.get("w_v", 0))
    return {"flops_per_image": 2 * macs[0] + attn[0], "linear_flops": 2 * macs[0], "attention_flops": attn[0],
            "macs": macs[0], "blocks": blocks}


def measure_vision_models(models: list[nn.Module], image_size, channels: int, batch_latency: int = 1,
                          batch_throughput: int = 16, warmup: int = 2, repeats: int = 10, threads: int | None = None,
                          seed: int = 0) -> list[dict]:
    """:func:`measure_vision_efficiency` of several models timed alternately: in each of the ``warmup + repeats``
    rounds every model in order (the dense one first) runs one latency forward and one throughput forward, so
    drifts of the machine (clock, other load) fall on all of them alike."""
    _check_counts(batch_latency=(batch_latency, 1), batch_throughput=(batch_throughput, 1), warmup=(warmup, 0),
                  repeats=(repeats, 1), seed=(seed, 0))
    if threads is not None:
        _check_counts(threads=(threads, 1))
    shape = _image_shape(image_size, channels)
    old_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    states = [m.training for m in models]
    try:
        for m in models:
            m.eval()
        params = [next(m.parameters()) for m in models]
        g = torch.Generator().manual_seed(seed)
        px1 = torch.randn(batch_latency, *shape, generator=g)
        pxb = torch.randn(batch_throughput, *shape, generator=g)
        ins = [(px1.to(p.device, p.dtype), pxb.to(p.device, p.dtype)) for p in params]
        lat: list[list[float]] = [[] for _ in models]
        thr: list[list[float]] = [[] for _ in models]
        with torch.no_grad():
            for r in range(warmup + repeats):
                for i, (m, p, (a, b)) in enumerate(zip(models, params, ins, strict=True)):
                    for x, times in ((a, lat[i]), (b, thr[i])):
                        _sync(p.device)
                        t0 = time.perf_counter()
                        m(pixel_values=x)
                        _sync(p.device)
                        if r >= warmup:
                            times.append(time.perf_counter() - t0)
            peaks = []
            for m, p, (_, b) in zip(models, params, ins, strict=True):
                with PeakMemory(p.device) as pm:
                    m(pixel_values=b)
                peaks.append(pm)
        n_threads = torch.get_num_threads()
        out = []
        for m, p, pm, lt, tt in zip(models, params, peaks, lat, thr, strict=True):
            t_lat, t_thr = statistics.median(lt), statistics.median(tt)
            fl = vision_flops(m, shape[1:], shape[0])
            out.append({
                "params": count_params(m),
                "flops_per_image": fl["flops_per_image"],
                "attention_flops_per_image": fl["attention_flops"],
                "flops_rule": VISION_FLOPS_RULE,
                "latency_ms_p50": 1e3 * t_lat,
                "throughput_images_per_s": batch_throughput / t_thr if t_thr > 0 else float("inf"),
                "peak_memory_bytes": pm.peak_bytes,
                "peak_memory_gib": None if pm.peak_bytes is None else pm.peak_bytes / 2**30,
                "peak_memory_kind": pm.kind,
                "peak_memory_delta_bytes": None if pm.peak_bytes is None or pm.start_bytes is None
                else pm.peak_bytes - pm.start_bytes,
                "threads": n_threads,
                "settings": {"image_size": list(shape[1:]), "channels": shape[0], "batch_latency": batch_latency,
                             "batch_throughput": batch_throughput, "warmup": warmup, "repeats": repeats,
                             "models_alternated": len(models), "device": str(p.device), "dtype": str(p.dtype),
                             "attn_implementation": getattr(m.config, "_attn_implementation", None)},
            })
    finally:
        for m, was in zip(models, states, strict=True):
            m.train(was)
        torch.set_num_threads(old_threads)
    return out


def measure_vision_efficiency(model: nn.Module, image_size, channels: int, batch_latency: int = 1,
                              batch_throughput: int = 16, warmup: int = 2, repeats: int = 10,
                              threads: int | None = None, seed: int = 0) -> dict:
    """Params, FLOPs/image, p50 latency (``batch_latency`` images, ms), throughput (``batch_throughput`` images,
    images/s), peak memory and the torch thread count of a vision encoder (module docstring). ``image_size``: one
    side or ``(height, width)``; ``threads``: torch's intra-op threads during the measurement (restored after)."""
    return measure_vision_models([model], image_size, channels, batch_latency, batch_throughput, warmup, repeats,
                                 threads, seed)[0]


def vision_efficiency_table(rows: list[tuple[str, dict]]) -> str:
    """Params, FLOPs/image, p50 latency and throughput with their ratios to the first row (the dense model; a
    latency's speed-up is ``dense / model``, a throughput's ``model / dense``)."""
    base = rows[0][1]

    def ratio(a, b) -> str:
        return f"{a / b:.3f}" if a is not None and b else "-"

    lat = f"p50 latency ms (b={base['settings']['batch_latency']})"
    thr = f"images/s (b={base['settings']['batch_throughput']})"
    lines = [f"| model | params | ratio | GFLOPs/image | ratio | peak memory (GiB) | ratio | {lat} | speed-up | {thr} "
             "| speed-up |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in rows:
        mem = r["peak_memory_gib"]
        lines.append(
            f"| {name} | {r['params']:,} | {ratio(r['params'], base['params'])} | {r['flops_per_image'] / 1e9:.4g} | "
            f"{ratio(r['flops_per_image'], base['flops_per_image'])} | {'-' if mem is None else f'{mem:.3f}'} | "
            f"{ratio(mem, base['peak_memory_gib'])} | {r['latency_ms_p50']:.3f} | "
            f"{ratio(base['latency_ms_p50'], r['latency_ms_p50'])} | {r['throughput_images_per_s']:.1f} | "
            f"{ratio(r['throughput_images_per_s'], base['throughput_images_per_s'])} |")
    return "\n".join(lines)


# --- CLI: secateur eval efficiency ---------------------------------------------------------------------------

def efficiency_table(rows: list[tuple[str, dict]]) -> str:
    """COEC Table 4 / CoCurve Table 5 layout; ratios relative to the first row (the dense model)."""
    base = rows[0][1]

    def ratio(a, b) -> str:
        return f"{a / b:.3f}" if a is not None and b else "-"

    head = ("| model | params | ratio | GFLOPs/token | ratio | peak memory (GiB) | ratio | prefill tok/s | speed-up "
            "| decode tok/s | speed-up |")
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in rows:
        mem = r["peak_memory_gib"]
        lines.append(
            f"| {name} | {r['params']:,} | {ratio(r['params'], base['params'])} | {r['flops_per_token'] / 1e9:.3f} | "
            f"{ratio(r['flops_per_token'], base['flops_per_token'])} | {'-' if mem is None else f'{mem:.3f}'} | "
            f"{ratio(mem, base['peak_memory_gib'])} | {r['prefill_tokens_per_s']:.1f} | "
            f"{ratio(r['prefill_tokens_per_s'], base['prefill_tokens_per_s'])} | {r['decode_tokens_per_s']:.2f} | "
            f"{ratio(r['decode_tokens_per_s'], base['decode_tokens_per_s'])} |")
    return "\n".join(lines)


def _cmd_efficiency(args) -> int:
    import gc
    import json

    from secateur.models.loading import load_model
    from secateur.safe_write import check_writable_output, write_file_atomic

    if args.prompt_len < 1 or args.new_tokens < 1 or args.repeats < 1 or args.warmup < 0 or args.batch_size < 1:
        raise SecateurError("--prompt-len, --new-tokens, --repeats and --batch-size must be >= 1, --warmup >= 0; "
                            "pass positive counts")
    if args.json is not None:  # an unwritable --json fails before the models are loaded
        check_writable_output(args.json, folder=False)
    if (args.threads is not None and args.threads < 1) or args.throughput_batch < 1:
        raise SecateurError("--threads and --throughput-batch must be >= 1; pass positive counts")
    specs = [("dense", args.dense)] if args.dense else []
    specs.append(("pruned" if args.dense else "model", args.model))
    from secateur.models.families import ADAPTERS, base_model_type
    from secateur.models.loading import check_device, check_model, check_seqlen

    check_device(args.device)
    cfgs = [check_model(spec) for _, spec in specs]
    kinds = [ADAPTERS[base_model_type(c.get("model_type"))].modality if c else "text" for c in cfgs]
    if len(set(kinds)) > 1:
        raise SecateurError(f"--dense {args.dense} is a {kinds[0]} model and --model {args.model} a {kinds[1]} model; "
                            "compare a pruned model with the dense model it was made from")
    if kinds[0] == "vision":
        return _vision_efficiency(args, specs)
    for (_, spec), cfg in zip(specs, cfgs, strict=True):  # GPT-2 indexes past its position table: refuse first
        check_seqlen(spec, args.prompt_len + args.new_tokens, cfg, "--prompt-len + --new-tokens")
    rows = []
    for name, spec in specs:
        model, _ = load_model(spec, args.dtype, args.device)
        res = measure_efficiency(model, None, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                                 warmup=args.warmup, repeats=args.repeats, batch_size=args.batch_size,
                                 seed=args.seed)
        res["model"] = spec
        rows.append((f"{name} ({spec})", res))
        del model
        gc.collect()
    s = rows[0][1]["settings"]
    print(f"efficiency [batch {s['batch_size']}, prompt {s['prompt_len']}, decode {s['new_tokens']} tokens, "
          f"{s['warmup']} warm-up + median of {s['repeats']}, {s['device']} {s['dtype']}, peak memory "
          f"{rows[0][1]['peak_memory_kind']}]; FLOPs/token = 2 x params")
    print(efficiency_table(rows))
    if args.json:
        write_file_atomic(args.json, json.dumps([r for _, r in rows], indent=2, default=str))
    return 0


def _vision_efficiency(args, specs: list[tuple[str, str]]) -> int:
    """``secateur eval efficiency`` of vision encoders: every model loaded (dense first), timed alternately in the
    same process (:func:`measure_vision_models`)."""
    import json

    from secateur.models.loading import load_model
    from secateur.safe_write import write_file_atomic

    models = [load_model(spec, args.dtype, args.device)[0] for _, spec in specs]
    inputs = [vision_input(m) for m in models]
    if len(set(inputs)) > 1:
        (sa, ca), (sb, cb) = inputs[0], inputs[-1]
        raise SecateurError(f"--dense {args.dense} takes {sa[0]}x{sa[1]}x{ca} images and --model {args.model} "
                            f"{sb[0]}x{sb[1]}x{cb}; compare a pruned model with the dense model it was made from")
    (size, channels) = inputs[0]
    res = measure_vision_models(models, size, channels, batch_latency=args.batch_size,
                                batch_throughput=args.throughput_batch, warmup=args.warmup, repeats=args.repeats,
                                threads=args.threads, seed=args.seed)
    rows = []
    for (name, spec), r in zip(specs, res, strict=True):
        r["model"] = spec
        rows.append((f"{name} ({spec})", r))
    s = res[0]["settings"]
    alt = ", measured alternately (dense first)" if len(rows) > 1 else ""
    print(f"efficiency [vision, {size[0]}x{size[1]}x{channels} images, latency batch {s['batch_latency']}, throughput "
          f"batch {s['batch_throughput']}, {s['warmup']} warm-up + median of {s['repeats']}{alt}, {s['device']} "
          f"{s['dtype']}, {res[0]['threads']} threads, peak memory {res[0]['peak_memory_kind']}]; {VISION_FLOPS_RULE}")
    print(vision_efficiency_table(rows))
    if args.json:
        write_file_atomic(args.json, json.dumps([r for _, r in rows], indent=2, default=str))
    return 0


def register_cli(eval_subparsers) -> None:
    """``secateur eval efficiency --model PRUNED [--dense DENSE]``."""
    p = eval_subparsers.add_parser(
        "efficiency", help="params, FLOPs/token, peak memory, prefill/decode throughput (vs a dense model)",
        description="Measure a (pruned) model and, with --dense, the dense model in the same process; prints "
                    "COEC Table 4 / CoCurve Table 5 columns with ratios vs dense. A vision encoder: params, "
                    "counted FLOPs/image, p50 latency (--batch-size images) and throughput (--throughput-batch "
                    "images), both models timed alternately.")
    p.add_argument("--model", required=True, help="pruned model folder (or HF id / alias)")
    p.add_argument("--dense", default=None, help="dense reference model (folder, HF id or alias smollm2-135m)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--prompt-len", type=int, default=2048, help="prefill tokens (default: %(default)s)")
    p.add_argument("--new-tokens", type=int, default=256, help="greedy decode tokens (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=3, help="untimed runs (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=10, help="timed runs, median reported (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=1,
                   help="sequences per prompt; vision: images per latency forward (default: %(default)s)")
    p.add_argument("--throughput-batch", type=int, default=16,
                   help="vision: images per throughput forward (default: %(default)s)")
    p.add_argument("--threads", type=int, default=None,
                   help="vision: torch intra-op threads while measuring (default: torch's)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompt ids (vision: pixel values)")
    p.add_argument("--json", default=None, metavar="FILE", help="write the measurements as JSON")
    p.set_defaults(func=_cmd_efficiency)
