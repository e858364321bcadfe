"""The GGUF exports run in llama.cpp (llama-cpp-python, extra ``[deploy]``; skipped without it): for tiny Llama and
Qwen2 runs (dense, uniformly sliced, unevenly sliced -> ``deci``), llama.cpp's logits at every position of a prompt
equal the HF model's (the run folder loaded with one ``from_pretrained``) within a tolerance derived from a
rounding-error model of both programs, evaluated on the run's own tensors and the prompt (not tuned).

The model (:func:`forward_with_bound`): the forward pass in float64 (the exact value), every quantity ``x`` carried
with ``s_x``, the standard deviation of ``computed x - exact x`` to first order, ``u = 2^-24`` (float32's unit
roundoff):

* a dot product of ``n`` terms in float32, summed in *any* order (torch, ggml's SIMD lanes, tinyBLAS tiles: the
  order is what differs between the two programs): each of its ``n - 1`` additions errs by ``delta * partial``
  with ``|delta| <= u`` (variance ``u^2 / 3`` for a rounding error uniform in that range) and ``|partial| <=
  sum |terms|``, so ``s <= sqrt(n / 3) u sum |terms|`` (:func:`dot_dev`; Higham & Mary, SIAM J. Sci. Comput.
  41(5), 2019: the error of a sum of n terms stays below ``lambda sqrt(n) u sum |terms|`` with probability at
  least ``1 - 2 exp(-lambda^2 / 2)``, where the worst-case bound grows with ``n u``);
* errors of different inputs are independent and add in quadrature through a linear map: ``s_y^2 = W^2 s_x^2``
  (the worst-case ``|W| e_x`` instead, with every error aligned, chains to a bound 10^5 times the observed
  error over the ~10 dot products between the embedding and the logits: useless as a test);
* nonlinear maps pass input errors through their exact derivative: softmax ``dp = p (ds - sum p ds)``, SiLU
  ``silu'(g) dg``, RMSNorm ``g (dh / r - h dr / r^2)`` with ``dr = sum h dh / (d r)``, RoPE's rotation; residual
  adds add in quadrature, so errors are carried through every later layer (no per-layer constant);
* elementwise functions (exp, SiLU, rsqrt, sin/cos, a division) err by a few ulps in either library: each is
  charged ``4u`` of its result, RoPE's angle (ggml builds it by repeated multiplication over the head's
  frequencies) ``(hd/2 + 4) u`` of itself.

For an f16 file llama.cpp also rounds to half precision (round to nearest: at most ``2^-11`` relative, ``2^-25``
absolute below f16's normal range; deviation that over ``sqrt 3``) every stored matrix (weights, embedding rows),
every activation entering a matmul with an f16 matrix (ggml converts ``src1`` to the matrix's ``vec_dot_type``),
the K and V written to its default f16 KV cache, and q and the softmax probabilities entering the two attention
matmuls with that cache. For the f32 file the cache is made f32 (``type_k = type_v = F32``) and flash attention
is off, so both programs compute every operation in float32 and differ only in the order of summation and the
last bits of the elementwise functions.

The tolerance of a logit is ``LAMBDA = 6`` deviations: a Gaussian exceeds it with probability 2e-9, the 3072
logits of a test all stay within it but for a chance below 1e-5. Each side is checked against the float64
value first (``|z - z64| <= LAMBDA s``: torch's float32 for the HF side, llama.cpp for the GGUF side; torch's
observed error is 0.2-0.5 of its ``s``, so the model is not optimistic), and llama.cpp against HF follows within
``LAMBDA (s_llama + s_hf)``. The tolerance is also required to be far below the logits' spread (f32: 1e-3 of
it, f16: 5e-2; observed ~6e-5 and ~1e-2), so a wrong layer rule (a dropped attention, a wrong q/k row order, a
missing bias) cannot pass.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import save_run
from safetensors.torch import load_file

from secateur.budgets.select import select_units
from secateur.export import gguf as gx
from secateur.models.adapters import get_adapter
from secateur.structured.selection import LayerKeep, Selection
from secateur.structured.slicing import Replacement
from secateur.testing import random_ids, tiny_model

llama_cpp = pytest.importorskip("llama_cpp")

U32 = 2.0 ** -24
F16_REL, F16_ABS = 2.0 ** -11, 2.0 ** -25
EL = 4 * U32  # an elementwise function (exp, SiLU, rsqrt, sin/cos, a division), either library
T = 24  # prompt length
LAMBDA = 6.0  # deviations (module docstring)


def gamma(n: int) -> float:
    return n * U32 / (1 - n * U32)


# --- runs ------------------------------------------------------------------------------------------------


def _uneven_llama():
    """Layer 0 loses a KV group, 1 its MLP, 2 its attention, 3 both, 4 part of its MLP."""
    sel = Selection(8, 5, {0: LayerKeep(heads=[0, 1], kv_heads=[0]), 1: LayerKeep(channels=[]),
                           2: LayerKeep(heads=[], kv_heads=[]), 3: LayerKeep(heads=[], kv_heads=[], channels=[]),
                           4: LayerKeep(channels=list(range(40)))})
    return 5, sel, None


def _uneven_qwen2():
    """Qwen2 keeps its heads (llama.cpp reads the q bias with n_embd rows): uneven MLPs, layer 1's removed with a
    compensation bias, layer 2 an o_proj compensation bias (deci reads both biases)."""
    g = torch.Generator().manual_seed(0)
    sel = Selection(8, 3, {0: LayerKeep(channels=list(range(48))), 1: LayerKeep(channels=[])})
    reps = {(1, "down"): Replacement(torch.zeros(32, 0), 0.1 * torch.randn(32, generator=g)),
            (2, "o"): Replacement(0.02 * torch.randn(32, 32, generator=g), 0.1 * torch.randn(32, generator=g))}
    return 3, sel, reps


def _uneven0_llama():
    """Layer 0 loses its attention (llama.cpp takes the head size from layer 0: a zero head), layer 1 a KV group
    and its MLP, layer 2 its attention and MLP but keeps an o_proj bias (a zero head carrying it)."""
    g = torch.Generator().manual_seed(1)
    sel = Selection(8, 4, {0: LayerKeep(heads=[], kv_heads=[]), 1: LayerKeep(heads=[2, 3], kv_heads=[1], channels=[]),
                           2: LayerKeep(heads=[], kv_heads=[], channels=[])})
    return 4, sel, {(2, "o"): Replacement(torch.zeros(32, 0), 0.1 * torch.randn(32, generator=g))}


def _heads_qwen2():
    """Qwen2 with a KV group removed in layer 0 (the q bias has 16 rows: deci reads it per layer)."""
    return 2, Selection(8, 2, {0: LayerKeep(heads=[0, 1], kv_heads=[0])}), None


UNEVEN = {("llama", "uneven"): _uneven_llama, ("qwen2", "uneven"): _uneven_qwen2,
          ("llama", "uneven0"): _uneven0_llama, ("qwen2", "heads"): _heads_qwen2}


def make_run(family: str, case: str, path: Path) -> Path:
    if case == "dense":
        return save_run(tiny_model(family, layers=2), path)
    if case == "uniform":
        m = tiny_model(family, layers=2)
        kinds = ("kv_group", "channel") if family == "llama" else ("channel",)
        return save_run(m, path, select_units(get_adapter(m), "magnitude", 0.5, kinds=kinds))
    layers, sel, reps = UNEVEN[family, case]()
    return save_run(tiny_model(family, layers=layers), path, sel, reps)


# --- the float64 forward with its error bound ----------------------------------------------------------


class Impl:
    """How one program rounds: ``f16``: llama.cpp on an f16 file (module docstring); else float32 throughout.
    Every error is carried as its standard deviation ``s`` (module docstring)."""

    def __init__(self, f16: bool):
        self.f16 = f16

    def store(self, a: np.ndarray) -> np.ndarray:
        """Deviation of rounding ``a`` to the format an f16 program stores it in (0 for float32)."""
        return (F16_REL * np.abs(a) + F16_ABS) / np.sqrt(3) if self.f16 else np.zeros_like(a)

    def linear(self, x, s, w, b):
        """``y = x W^T + b``: the input's deviation through W, the dot's own rounding, and under f16 the rounding
        of W (stored) and of x (converted to f16 for the matmul)."""
        w2 = w * w
        var = (s * s) @ w2.T + dot_dev(w.shape[1], np.abs(x) @ np.abs(w).T) ** 2
        if self.f16:
            var += self.store(x) ** 2 @ w2.T + (x * x) @ (self.store(w) ** 2).T
        y = x @ w.T
        if b is not None:
            y = y + b
        return y, np.sqrt(var) + EL * np.abs(y)


def dot_dev(n: int, terms: np.ndarray) -> np.ndarray:
    """Deviation of a sum of ``n`` terms (``terms``: the sum of their magnitudes) in float32, any order: each of
    the n - 1 additions errs by ``delta |partial|``, ``|delta| <= u`` uniform (variance u^2 / 3), ``|partial|
    <= terms``."""
    return np.sqrt(n / 3) * U32 * terms


def rms_norm(h, s, g, eps):
    d = h.shape[-1]
    r = np.sqrt((h * h).mean(-1, keepdims=True) + eps)
    s_r = np.sqrt(((h * s) ** 2).sum(-1, keepdims=True)) / (d * r) + EL * r  # dr = sum h dh / (d r)
    y = g * h / r
    return y, np.sqrt((g * s / r) ** 2 + (y * s_r / r) ** 2) + 2 * EL * np.abs(y)


def rope(x, s, theta: float, hd: int):
    """HF's half-split RoPE on ``x [heads, T, hd]`` (the permuted GGUF rows give the same numbers in llama.cpp)."""
    inv = theta ** -(np.arange(0, hd, 2) / hd)
    ang = np.arange(x.shape[1])[:, None] * inv[None, :]
    cos, sin = np.cos(ang), np.sin(ang)
    x1, x2 = x[..., :hd // 2], x[..., hd // 2:]
    s1, s2 = s[..., :hd // 2], s[..., hd // 2:]
    y = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)
    # sin/cos of an angle with relative error (hd/2 + 4) u (ggml builds it by repeated multiplication), then EL
    da = ((hd // 2 + 4) * U32 * np.abs(ang) + EL) * (np.abs(x1) + np.abs(x2))
    sy = np.concatenate([np.sqrt((s1 * cos) ** 2 + (s2 * sin) ** 2) + da,
                         np.sqrt((s2 * cos) ** 2 + (s1 * sin) ** 2) + da], -1)
    return y, sy + EL * np.abs(y)


def attention(x, s, W: dict, n_heads: int, n_kv: int, hd: int, theta: float, imp: Impl):
    t = x.shape[0]
    q, sq = imp.linear(x, s, W["q"], W.get("q.b"))
    k, sk = imp.linear(x, s, W["k"], W.get("k.b"))
    v, sv = imp.linear(x, s, W["v"], W.get("v.b"))

    def heads(a, n):
        return a.reshape(t, n, hd).transpose(1, 0, 2)

    q, sq = rope(heads(q, n_heads), heads(sq, n_heads), theta, hd)
    k, sk = rope(heads(k, n_kv), heads(sk, n_kv), theta, hd)
    v, sv = heads(v, n_kv), heads(sv, n_kv)
    sk, sv = np.hypot(sk, imp.store(k)), np.hypot(sv, imp.store(v))  # the KV cache
    rep = n_heads // n_kv
    k, sk, v, sv = (np.repeat(a, rep, 0) for a in (k, sk, v, sv))
    sq = np.hypot(sq, imp.store(q))  # q converted to the cache's type for k.q

    def tr(a):
        return a.transpose(0, 2, 1)

    scale = 1 / np.sqrt(hd)
    sc = scale * q @ tr(k)
    ss = scale * np.sqrt(sq ** 2 @ tr(k ** 2) + q ** 2 @ tr(sk ** 2)
                         + dot_dev(hd, np.abs(q) @ tr(np.abs(k))) ** 2) + EL * np.abs(sc)
    mask = np.tril(np.ones((t, t), bool))
    sc = np.where(mask, sc, -np.inf)
    ss = np.where(mask, ss, 0.0)
    z = sc - sc.max(-1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(-1, keepdims=True)
    # dp_i = p_i (ds_i - sum_j p_j ds_j); exp(z) errs by |dz| = u |z| plus EL; the sum and the division
    sp = p * (ss + np.sqrt((p * p * ss * ss).sum(-1, keepdims=True))) \
        + p * (U32 * np.abs(np.where(mask, z, 0)) + 2 * EL) + dot_dev(t, p.sum(-1, keepdims=True)) * p
    sp = np.hypot(sp, imp.store(p))  # probabilities converted to the cache's type for V.p
    a = p @ v
    sa = np.sqrt(sp ** 2 @ v ** 2 + p ** 2 @ sv ** 2 + dot_dev(t, p @ np.abs(v)) ** 2)
    a, sa = (b.transpose(1, 0, 2).reshape(t, n_heads * hd) for b in (a, sa))
    return imp.linear(a, sa, W["o"], W.get("o.b"))


def mlp(x, s, W: dict, imp: Impl):
    g, sg = imp.linear(x, s, W["gate"], W.get("gate.b"))
    u, su = imp.linear(x, s, W["up"], W.get("up.b"))
    sig = 1 / (1 + np.exp(-g))
    act = g * sig
    s_act = np.abs(sig * (1 + g * (1 - sig))) * sg + EL * np.abs(act)  # |silu'(g)| dg
    m = act * u
    sm = np.sqrt((s_act * u) ** 2 + (act * su) ** 2) + EL * np.abs(m)
    return imp.linear(m, sm, W["down"], W.get("down.b"))


def residual(h, s, y, sy):
    h = h + y
    return h, np.sqrt(s * s + sy * sy) + EL * np.abs(h)


def forward_with_bound(run: Path, ids: np.ndarray, imp: Impl) -> tuple[np.ndarray, np.ndarray]:
    """``(logits [T, vocab], error bound [T, vocab])`` of the run folder's model in float64."""
    import json

    cfg = json.loads((run / "config.json").read_text())
    sd = {}
    for f in sorted(run.glob("*.safetensors")):
        sd |= {k: v.double().numpy() for k, v in load_file(str(f)).items()}
    d = cfg["hidden_size"]
    hd = cfg.get("head_dim") or d // cfg["num_attention_heads"]
    theta = gx._rope_theta(cfg)
    eps = cfg["rms_norm_eps"]
    emb = sd["model.embed_tokens.weight"]
    h = emb[ids]
    e = imp.store(h)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        W = {}
        for role, mod in (("q", "self_attn.q_proj"), ("k", "self_attn.k_proj"), ("v", "self_attn.v_proj"),
                          ("o", "self_attn.o_proj"), ("gate", "mlp.gate_proj"), ("up", "mlp.up_proj"),
                          ("down", "mlp.down_proj")):
            W[role] = sd[p + mod + ".weight"]
            if p + mod + ".bias" in sd:
                W[role + ".b"] = sd[p + mod + ".bias"]
        n_heads, n_kv = W["o"].shape[1] // hd, W["k"].shape[0] // hd
        if n_heads:
            x, ex = rms_norm(h, e, sd[p + "input_layernorm.weight"], eps)
            h, e = residual(h, e, *attention(x, ex, W, n_heads, n_kv, hd, theta, imp))
        elif "o.b" in W:  # a removed attention whose compensation bias stays
            h, e = residual(h, e, W["o.b"], 0.0)
        if W["down"].shape[1]:
            x, ex = rms_norm(h, e, sd[p + "post_attention_layernorm.weight"], eps)
            h, e = residual(h, e, *mlp(x, ex, W, imp))
        elif "down.b" in W:  # a removed MLP whose compensation bias stays
            h, e = residual(h, e, W["down.b"], 0.0)
    x, ex = rms_norm(h, e, sd["model.norm.weight"], eps)
    return imp.linear(x, ex, sd.get("lm_head.weight", emb), None)


# --- llama.cpp -------------------------------------------------------------------------------------------


def llama_logits(path: Path, ids: np.ndarray, f32_cache: bool) -> np.ndarray:
    kw = {"type_k": llama_cpp.GGML_TYPE_F32, "type_v": llama_cpp.GGML_TYPE_F32} if f32_cache else {}
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, n_batch=64, n_ubatch=64, n_threads=1,
                          n_threads_batch=1, logits_all=True, flash_attn=False, verbose=False, **kw)
    try:
        llm.eval(ids.tolist())
        return np.asarray(llm.scores[:len(ids)], dtype=np.float64)
    finally:
        llm.close()


def hf_logits(run: Path, ids: np.ndarray) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(run, dtype=torch.float32).eval()
    with torch.no_grad():
        return m(torch.as_tensor(ids)[None]).logits[0].double().numpy()


CASES = [("llama", "dense", "llama"), ("llama", "uniform", "llama"), ("llama", "uneven", "deci"),
         ("llama", "uneven0", "deci"), ("qwen2", "dense", "qwen2"), ("qwen2", "uniform", "qwen2"),
         ("qwen2", "uneven", "deci"), ("qwen2", "heads", "deci")]


@pytest.mark.parametrize("qtype", ["f32", "f16"])
@pytest.mark.parametrize(("family", "case", "arch"), CASES, ids=[f"{f}-{c}" for f, c, _ in CASES])
def test_llama_cpp_logits_match_hf(family, case, arch, qtype, tmp_path):
    run = make_run(family, case, tmp_path / "run")
    r = gx.export_gguf(run, tmp_path / "m.gguf", qtype)
    assert r["arch"] == arch
    ids = random_ids(1, T, vocab=127, seed=1)[0].numpy()
    hf = hf_logits(run, ids)
    ll = llama_logits(tmp_path / "m.gguf", ids, f32_cache=qtype == "f32")
    z64, s_hf = forward_with_bound(run, ids, Impl(f16=False))
    _, s_ll = forward_with_bound(run, ids, Impl(f16=qtype == "f16"))
    tol = LAMBDA * (s_ll + s_hf)
    spread = float(z64.std())
    info = (f"max|llama-hf| {np.abs(ll - hf).max():.3g}, max tol {tol.max():.3g}, worst ratio "
            f"{(np.abs(ll - hf) / tol).max():.3g}, llama.cpp vs float64 {(np.abs(ll - z64) / s_ll).max():.3g} "
            f"deviations, logits std {spread:.3g}")
    assert np.all(np.abs(hf - z64) <= LAMBDA * s_hf), "HF's float32 forward outside its model: " + info
    assert np.all(np.abs(ll - z64) <= LAMBDA * s_ll), "llama.cpp outside its model: " + info
    assert np.all(np.abs(ll - hf) <= tol), info
    # tight enough to catch a wrong rule: far below the logits' spread
    assert tol.max() < (1e-3 if qtype == "f32" else 5e-2) * spread, info
