"""Held-out QK reconstruction error (QK-Wanda Eq. 49) and stage errors (Eq. 51), App. E.3.

Data (spec evaluation.md §3, adapted to the local files): ``n = 16`` sequences of ``T = 512`` tokens,
seed ``20260810``, drawn with Wanda's rule (a random document longer than ``T``, then a random offset) from
the *held-out* C4 documents ``[1500, 2000)`` of ``c4-validation-2k`` -- disjoint from the calibration pool
``[0, 1500)`` (:mod:`secateur.data.sources`). The paper samples rows ``>= 1100`` of the 45k-document
validation shard, disjoint from its C4 perplexity subset too; the local file has only 2000 documents,
so these sequences may share documents with the local C4 perplexity text (a diagnostic; nothing is tuned
on it). Without a data folder the hub shard is used, rows ``[1100, 3100)``. ``text=`` (CLI ``--text``)
samples from a text file instead.

Procedure: one **dense** forward supplies every block's q/k input ``X_l^(s)`` (dense inputs for every
method: no error propagation). With ``W``/``W^`` the dense/pruned q/k weights (biases retained)::

    B^(h,s)_l = Q^(h,s)T K^(g,s)        (pre-RoPE, all T x T pairs, no causal mask, no centering, no 1/sqrt(m))
    E_QK = (100 / D) sum_l [ sum_{s,h} ||B^_l - B_l||_F^2 / sum_{s,h} ||B_l||_F^2 ]            (Eq. 49)

a per-block ratio over all sequences and all H_Q query heads, then an equal-weight mean over blocks, no
square root (1% <=> 10% relative Frobenius error). Numerics as in App. E.3: projections in the model
dtype, dot products in float32 (TF32 off), squared-error sums in float64. Only one ``T x T`` product per
head exists at a time (one sequence's ``[H_Q, T, T]`` stack, dense and pruned).

Stage errors (Eq. 51), pooled over blocks and sequences, ``100 * sum ||Y^ - Y||^2 / sum ||Y||^2``:

``logits``   post-RoPE causal logits ``C * Z^(h,s) / sqrt(m)`` stacked over heads (the model's own rotary
             tables; identity rotation for models without RoPE), same dense inputs;
``block``    block outputs, the dense input fed to each pruned block ("same input");
``rollout``  block outputs, each pruned block fed the previous pruned block's output.

Q/K norms (Qwen3) are applied when the attention has them, so the diagnostic also covers such models
(their products are then post-norm). Per-block Q/K removal fractions (Fig. 3) come from the masks, or,
for a pruned model, from the weights that differ from the dense ones.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from secateur.budgets.masks import allocation_summary
from secateur.calib.rope import apply_rope
from secateur.errors import SecateurError
from secateur.models.adapters import Adapter, get_adapter
from secateur.models.linear import LinearRef

QK_ERROR_SEED = 20260810
QK_ERROR_N = 16
QK_ERROR_SEQLEN = 512
HUB_DOCS = (1100, 3100)
STAGES = ("qk", "logits", "block", "rollout")
PROTOCOL = "qk-error-eq49"


# ---------------------------------------------------------------------------------------------- data

def heldout_ids(tokenizer, n: int = QK_ERROR_N, seqlen: int = QK_ERROR_SEQLEN, seed: int = QK_ERROR_SEED,
                data_dir: str | Path | None = None, text: str | Path | None = None) -> tuple[torch.Tensor, dict]:
    """``[n, seqlen]`` held-out token ids and their manifest (see the module docstring for the rule)."""
    from secateur.data.sources import C4_EVAL_DOCS, c4_documents, resolve_data_dir
    from secateur.data.windows import sample_windows, token_sha256

    if n < 1 or seqlen < 2:
        raise SecateurError("the QK-error set needs n >= 1 sequences of >= 2 tokens")
    if text is not None:
        p = Path(text)
        if not p.is_file():
            raise SecateurError(f"missing held-out text file {text}")
        docs, source = [p.read_text(encoding="utf-8")], str(p)
    else:
        d = resolve_data_dir(data_dir)
        if d is not None:
            docs = c4_documents(d, *C4_EVAL_DOCS)
            source = f"c4-validation-2k documents [{C4_EVAL_DOCS[0]}, {C4_EVAL_DOCS[1]}) (held out from calibration)"
        else:
            docs = _hub_docs()
            source = f"allenai/c4 en/c4-validation.00000-of-00008 rows [{HUB_DOCS[0]}, {HUB_DOCS[1]})"
    ids, rule = sample_windows(docs, tokenizer, n, seqlen, seed)
    name = getattr(tokenizer, "name_or_path", type(tokenizer).__name__)
    return ids, {"source": source, "n": n, "seqlen": seqlen, "seed": seed, "rule": rule,
                 "sha256": token_sha256(ids), "tokenizer": str(name)}


def _hub_docs() -> list[str]:
    try:
        from datasets import load_dataset

        ds = load_dataset("allenai/c4", data_files={"validation": "en/c4-validation.00000-of-00008.json.gz"},
                          split="validation")
        return list(ds[HUB_DOCS[0]:HUB_DOCS[1]]["text"])
    except Exception as e:  # ImportError or any network error
        raise SecateurError("no data directory for the held-out C4 sequences and the hub is unreachable "
                            f"({type(e).__name__}); pass --data-dir, set SECATEUR_DATA or use --text") from e


# ------------------------------------------------------------------------------------------ candidates

@contextlib.contextmanager
def _no_tf32() -> Iterator[None]:
    """Float32 dot products without TF32 (App. E.3); a no-op on CPUs."""
    old = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def _module_mask(masks: Mapping[str, torch.Tensor], key: str, ref: LinearRef) -> torch.Tensor | None:
    m = masks.get(key)
    if m is None:
        return None
    full = ref.module.weight.T if ref.conv1d else ref.module.weight
    if tuple(m.shape) != tuple(full.shape):
        raise SecateurError(f"mask {key} has shape {tuple(m.shape)}, the projection {tuple(full.shape)}")
    return m.to(torch.bool)


class _Candidate:
    """A pruned counterpart of the dense model: another model of the same architecture, or masks."""

    def __init__(self, name: str, dense: Adapter, source: nn.Module | Mapping[str, torch.Tensor]) -> None:
        self.name, self.dense = name, dense
        self.model: Adapter | None = None
        self.masks: Mapping[str, torch.Tensor] | None = None
        if isinstance(source, nn.Module):
            ad = get_adapter(source)
            if type(ad) is not type(dense) or ad.n_layers != dense.n_layers or ad.geometry != dense.geometry:
                raise SecateurError(f"{name}: the pruned model's architecture differs from the dense model's")
            self.model = ad
        else:
            self.masks = source
            prefix = dense.base_prefix
            known = {f"{prefix}.{i}.{n}" for i, layer in enumerate(dense.layers) for n in dense.linears(layer)}
            unknown = sorted(set(source) - known)
            if unknown:
                raise SecateurError(f"{name}: mask {unknown[0]} matches no projection of the dense model")

    def key(self, i: int, ref: LinearRef) -> str:
        layer = self.dense.layers[i]
        name = next(n for n, r in self.dense.linears(layer).items() if r.module is ref.module)
        return f"{self.dense.base_prefix}.{i}.{name}"

    def qk(self, i: int) -> tuple[LinearRef, LinearRef, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(q_ref, k_ref, Wq^, Wk^, removed_q, removed_k)`` for block ``i`` (weights ``[out, in]``)."""
        d = self.dense.role_refs(self.dense.layers[i])
        dq, dk = d["q"], d["k"]
        if self.model is not None:
            p = self.model.role_refs(self.model.layers[i])
            wq, wk = p["q"].weight.detach(), p["k"].weight.detach()
            return p["q"], p["k"], wq, wk, wq != dq.weight, wk != dk.weight
        out = []
        for ref in (dq, dk):
            m = _module_mask(self.masks, self.key(i, ref), ref)
            m = torch.zeros(ref.weight.shape, dtype=torch.bool) if m is None else (m[ref.rows] if ref.rows else m)
            m = m.to(ref.weight.device)
            out += [ref.weight.detach().masked_fill(m, 0), m]
        return dq, dk, out[0], out[2], out[1], out[3]

    def layer(self, i: int) -> nn.Module:
        """The pruned block ``i`` (for masks: a masked copy of the dense block, one block at a time)."""
        if self.model is not None:
            return self.model.layers[i]
        layer = copy.deepcopy(self.dense.layers[i])
        for n, ref in self.dense.linears(layer).items():
            m = _module_mask(self.masks, f"{self.dense.base_prefix}.{i}.{n}", ref)
            if m is not None:
                with torch.no_grad():
                    ref.weight.masked_fill_(m.to(ref.weight.device), 0)
        return layer


# -------------------------------------------------------------------------------------------- the pass

def _heads(attn: nn.Module, x: torch.Tensor, ref: LinearRef, W: torch.Tensor, n: int, m: int,
           norm: str) -> torch.Tensor:
    """``[B, T, n, m]`` projection ``x W^T + b`` in the model dtype (q/k norm applied when present)."""
    y = F.linear(x, W, ref.bias).reshape(*x.shape[:2], n, m)
    mod = getattr(attn, norm, None)
    return mod(y) if mod is not None else y


def _products(Q: torch.Tensor, K: torch.Tensor, group: int) -> torch.Tensor:
    """``[H_Q, T, T]`` float32 products ``Q_t . K_u`` of one sequence (``Q [T, H_Q, m]``, ``K [T, H_K, m]``)."""
    K = K.repeat_interleave(group, dim=1)
    return torch.einsum("thm,uhm->htu", Q.float(), K.float())


def _sq(t: torch.Tensor) -> float:
    return float(t.double().square().sum())


def _check_stages(stages: tuple[str, ...]) -> None:
    bad = set(stages) - set(STAGES)
    if bad or "qk" not in stages:
        raise SecateurError(f"stages must include qk and come from {', '.join(STAGES)}; got {', '.join(stages)}")


class _Errors:
    """Running sums of Eq. 49 (per block) and of the Eq. 51 stages (pooled) for every candidate, fed block by
    block from the dense walk (:class:`secateur.calib.engine.Walk`)."""

    def __init__(self, ad: Adapter, cands: dict[str, _Candidate], stages: tuple[str, ...], walk, seqlen: int) -> None:
        self.ad, self.cands, self.stages = ad, cands, stages
        g = ad.geometry
        self.hq, self.hk, self.m = g.n_heads, g.n_kv_heads, g.head_dim
        self.tables = None  # the RoPE tables of the block being visited (per layer type: Gemma-3)
        self.causal = torch.ones(seqlen, seqlen, dtype=torch.bool, device=walk.device).tril()
        self.roll = {c: [h.clone() for h in walk.hs] for c in cands} if "rollout" in stages else {}
        self.res = {c: {"qk_num": [], "qk_den": [], "removal": [], "sums": dict.fromkeys(stages[1:], 0.0)}
                    for c in cands}
        self.den = dict.fromkeys(stages[1:], 0.0)

    def rot(self, t: torch.Tensor) -> torch.Tensor:
        """Post-RoPE (identity without rotary embeddings)."""
        return t.float() if self.tables is None else apply_rope(t.float(), *self.tables)

    def block(self, visit) -> None:
        """All sums of one block: Q/K products per chunk and sequence, then the block outputs."""
        i, layer = visit.index, visit.layer
        rope = visit.kwargs.get("position_embeddings")
        self.tables = None if rope is None else (rope[0].float(), rope[1].float())
        qk = {c: cand.qk(i) for c, cand in self.cands.items()}
        blocks = ({c: cand.layer(i) for c, cand in self.cands.items()}
                  if {"block", "rollout"} & set(self.stages) else {})
        num, den = dict.fromkeys(self.cands, 0.0), 0.0
        for j in range(len(visit.inputs)):
            h = visit.input(j)
            den = self._products(layer, h, qk, num, den)
            self._outputs(visit, j, h, blocks)
        if den <= 0:
            raise SecateurError(f"block {i}: the dense QK products are all zero; Eq. 49 is undefined")
        for c, v in qk.items():
            nq, nk = int(v[4].sum()), int(v[5].sum())
            self.res[c]["qk_num"].append(num[c])
            self.res[c]["qk_den"].append(den)
            self.res[c]["removal"].append({"block": i, "q_removed": nq, "k_removed": nk, "q_total": v[4].numel(),
                                           "k_total": v[5].numel(), "rho_q": nq / v[4].numel(),
                                           "rho_k": nk / v[5].numel()})

    def _products(self, layer: nn.Module, h: torch.Tensor, qk: dict, num: dict[str, float], den: float) -> float:
        """Adds one chunk's Eq. 49 terms to ``num`` (per candidate) and returns the dense sum plus ``den``."""
        ad, hq, hk, m = self.ad, self.hq, self.hk, self.m
        attn = getattr(layer, "self_attn", getattr(layer, "attn", None))
        refs = ad.role_refs(layer)
        x = ad.attn_norm(layer, h)
        Qd = _heads(attn, x, refs["q"], refs["q"].weight, hq, m, "q_norm")
        Kd = _heads(attn, x, refs["k"], refs["k"].weight, hk, m, "k_norm")
        Qc = {c: _heads(attn, x, v[0], v[2], hq, m, "q_norm") for c, v in qk.items()}  # v[0]: its bias
        Kc = {c: _heads(attn, x, v[1], v[3], hk, m, "k_norm") for c, v in qk.items()}
        for s in range(h.shape[0]):
            Bd = _products(Qd[s], Kd[s], hq // hk)
            den += _sq(Bd)
            for c in self.cands:
                num[c] += _sq(_products(Qc[c][s], Kc[c][s], hq // hk) - Bd)
            del Bd
            if "logits" in self.stages:
                self._logits(Qd[s:s + 1], Kd[s:s + 1], {c: (Qc[c][s:s + 1], Kc[c][s:s + 1]) for c in self.cands})
        return den

    def _logits(self, qd: torch.Tensor, kd: torch.Tensor, cand: dict) -> None:
        """Eq. 51 ``logits`` terms of one sequence (post-RoPE, causal, scaled by ``1/sqrt(m)``)."""
        g, scale = self.hq // self.hk, math.sqrt(self.m)
        Zd = _products(self.rot(qd)[0], self.rot(kd)[0], g) / scale
        Zd = Zd * self.causal
        self.den["logits"] += _sq(Zd)
        for c, (qc, kc) in cand.items():
            Zc = _products(self.rot(qc)[0], self.rot(kc)[0], g) / scale
            self.res[c]["sums"]["logits"] += _sq(Zc * self.causal - Zd)

    def _outputs(self, visit, j: int, h: torch.Tensor, blocks: dict[str, nn.Module]) -> None:
        """The dense block output of chunk ``j`` (the walk's next input) and its Eq. 51 block/rollout terms."""
        ad, kw = self.ad, visit.kwargs
        y = visit.output(j, h)
        if "block" in self.stages:
            self.den["block"] += _sq(y)
            for c in self.cands:
                self.res[c]["sums"]["block"] += _sq(ad.block_forward(blocks[c], h, kw) - y)
        if "rollout" in self.stages:
            self.den["rollout"] += _sq(y)
            for c in self.cands:
                yr = ad.block_forward(blocks[c], self.roll[c][j].to(visit.device), kw)
                self.res[c]["sums"]["rollout"] += _sq(yr - y)
                self.roll[c][j] = yr.to("cpu")

    def results(self, shape: list[int]) -> dict[str, dict]:
        out = {}
        for c, r in self.res.items():
            per_block = [100 * a / b for a, b in zip(r["qk_num"], r["qk_den"])]
            rec = {"protocol": PROTOCOL, "e_qk": sum(per_block) / len(per_block), "per_block": per_block,
                   "qk_num": r["qk_num"], "qk_den": r["qk_den"], "removal": allocation_summary(r["removal"]),
                   "stages": list(self.stages), "sequences": shape}
            for st in self.stages[1:]:
                rec[f"e_{st}"] = 100 * r["sums"][st] / self.den[st] if self.den[st] > 0 else float("nan")
            out[c] = rec
        return out


def qk_errors(dense: nn.Module, candidates: Mapping[str, nn.Module | Mapping[str, torch.Tensor]],
              ids: torch.Tensor, stages: tuple[str, ...] = ("qk",), chunk_size: int = 4,
              progress: bool = True) -> dict[str, dict]:
    """Eq. 49 (and the requested Eq. 51 stages) of every candidate against ``dense`` on ``ids [n, T]``.

    ``candidates``: name -> a pruned model of the same architecture, or masks (``True`` = pruned, keyed like
    ``secateur-masks.npz``) to apply to the dense weights. One dense pass (the calibration engine's block
    walker) serves all candidates.
    """
    from secateur.calib.engine import Walk

    _check_stages(stages)
    ad = get_adapter(dense)
    cands = {name: _Candidate(name, ad, src) for name, src in candidates.items()}
    with torch.no_grad(), _no_tf32():
        walk = Walk(ad, ids.to(ad.device), chunk_size)
        sums = _Errors(ad, cands, stages, walk, ids.shape[1])
        for visit in walk.blocks(progress=progress, desc="qk-error blocks"):
            sums.block(visit)
    return sums.results(list(ids.shape))


def qk_error(dense: nn.Module, pruned: nn.Module | None = None, masks: Mapping[str, torch.Tensor] | None = None,
             ids: torch.Tensor | None = None, tokenizer=None, stages: tuple[str, ...] = ("qk",),
             data_dir: str | Path | None = None, chunk_size: int = 4, progress: bool = True) -> dict:
    """Eq. 49 (+ stages) of one pruned model *or* one mask set against ``dense``; ``ids`` default to the
    held-out set (:func:`heldout_ids` with ``tokenizer``)."""
    if (pruned is None) == (masks is None):
        raise SecateurError("give exactly one of a pruned model or masks")
    manifest = None
    if ids is None:
        if tokenizer is None:
            raise SecateurError("the held-out QK-error set needs the tokenizer (or pass ids)")
        ids, manifest = heldout_ids(tokenizer, data_dir=data_dir)
    res = qk_errors(dense, {"pruned": pruned if pruned is not None else masks}, ids, stages, chunk_size,
                    progress)["pruned"]
    if manifest is not None:
        res["heldout"] = manifest
    return res


# ------------------------------------------------------------------------------------------------ CLI

def register_cli(eval_subparsers) -> argparse.ArgumentParser:
    """Add ``qk-error`` to the ``secateur eval`` subcommands."""
    p = eval_subparsers.add_parser(
        "qk-error", help="held-out relative QK reconstruction error (QK-Wanda Eq. 49) and stage errors (Eq. 51)",
        description="Compares a pruned model (--model) or a mask file (--masks, applied to --dense) with the dense "
                    "model on 16 held-out C4 sequences of 512 tokens (seed 20260810): block-mean relative "
                    "squared error of the pre-RoPE QK products on dense block inputs (Eq. 49), pooled stage "
                    "errors of post-RoPE causal logits and block outputs (Eq. 51), and per-block Q/K removal.")
    p.add_argument("--model", default=None, help="pruned model folder (e.g. written by secateur prune)")
    p.add_argument("--masks", default=None,
                   help="secateur-masks.npz, or a pruned folder holding one, applied to --dense")
    p.add_argument("--dense", default=None,
                   help="dense reference: HF id/folder, .gguf or alias (default: the model named in the pruned "
                        "folder's secateur-report.json)")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16 (default: %(default)s)")
    p.add_argument("--device", default="cpu", help="torch device (default: %(default)s)")
    p.add_argument("--data-dir", default=None, help="local data folder (default: $SECATEUR_DATA or ../shared/data)")
    p.add_argument("--text", default=None, metavar="FILE", help="sample the held-out sequences from this text file")
    p.add_argument("--n", type=int, default=QK_ERROR_N, help="held-out sequences (default: %(default)s)")
    p.add_argument("--seqlen", type=int, default=QK_ERROR_SEQLEN, help="tokens per sequence (default: %(default)s)")
    p.add_argument("--seed", type=int, default=QK_ERROR_SEED, help="sampling seed (default: %(default)s)")
    p.add_argument("--stages", default=",".join(STAGES),
                   help="comma list from qk, logits, block, rollout (default: %(default)s)")
    p.add_argument("--chunk-size", type=int, default=4, help="sequences per forward (default: %(default)s)")
    p.add_argument("--json", default=None, metavar="FILE", help="write the result with its protocol as JSON")
    p.add_argument("--plot", default=None, metavar="PNG", help="per-block Q/K removal plot (paper Fig. 3)")
    p.add_argument("--plot-errors", default=None, metavar="PNG", help="per-block relative QK error plot")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cli_qk_error)
    return p


def _masks_path(spec: str) -> Path:
    from secateur.safe_write import MASKS_NAME

    p = Path(spec)
    if p.is_dir():
        p = p / MASKS_NAME
    if not p.is_file():
        raise SecateurError(f"mask file {p} does not exist; pass the secateur-masks.npz of a prune output")
    return p


def _dense_spec(args) -> str:
    if args.dense:
        return args.dense
    from secateur.safe_write import REPORT_NAME

    folder = Path(args.model or args.masks)
    folder = folder if folder.is_dir() else folder.parent
    rep = folder / REPORT_NAME
    if rep.is_file():
        model = json.loads(rep.read_text()).get("model")
        recipe = folder / "secateur-recipe.yaml"
        if model and not Path(model).exists() and recipe.is_file():  # named portably: found by its digest
            import yaml

            from secateur.models.digest import known_model

            want = ((yaml.safe_load(recipe.read_text()) or {}).get("check") or {}).get("model_sha256")
            found = known_model(want) if isinstance(want, str) else None
            if found is not None:
                return str(found)
        if model:
            return model
    raise SecateurError("name the dense reference with --dense (no secateur-report.json names it)")


def cli_qk_error(args) -> int:
    from secateur.masks_file import load_masks
    from secateur.models.loading import load_model
    from secateur.runinfo import machine, versions
    from secateur.safe_write import check_writable_output, write_file_atomic

    if (args.model is None) == (args.masks is None):
        raise SecateurError("give exactly one of --model PRUNED or --masks FILE")
    stages = tuple(s.strip() for s in args.stages.split(",") if s.strip())
    if "qk" not in stages or set(stages) - set(STAGES):
        raise SecateurError(f"--stages must include qk and come from {', '.join(STAGES)}")
    if args.n < 1 or args.seqlen < 2 or args.chunk_size < 1:
        raise SecateurError("--n and --chunk-size must be >= 1 and --seqlen >= 2; pass positive counts")
    if args.json is not None:  # an unwritable --json fails before the models are loaded
        check_writable_output(args.json, folder=False)
    masks = load_masks(_masks_path(args.masks)) if args.masks else None
    dense_spec = _dense_spec(args)
    from secateur.models.loading import check_model, check_seqlen

    check_seqlen(dense_spec, args.seqlen, check_model(dense_spec))  # before any weight is read
    dense, tok = load_model(dense_spec, args.dtype, args.device)
    pruned = load_model(args.model, args.dtype, args.device)[0] if args.model else None
    ids, manifest = heldout_ids(tok, args.n, args.seqlen, args.seed, args.data_dir, args.text)
    res = qk_errors(dense, {"pruned": pruned if pruned is not None else masks}, ids, stages, args.chunk_size,
                    progress=not args.quiet)["pruned"]
    res.update({"heldout": manifest, "dense": dense_spec, "pruned": args.model or args.masks,
                "versions": versions(), "machine": machine()})
    al = res["removal"]
    extra = ", ".join(f"{s} {res['e_' + s]:.4f}%" for s in stages if s != "qk")
    print(f"relative QK error (Eq. 49, {args.n}x{args.seqlen} held-out, seed {args.seed}): {res['e_qk']:.4f}%"
          + (f"; stage errors (Eq. 51): {extra}" if extra else ""))
    print(f"Q/K removal: mean {100 * al['mean_rho_q']:.2f}% of W_Q, {100 * al['mean_rho_k']:.2f}% of W_K "
          f"({al['qk_removed']}/{al['qk_total']} QK weights)")
    if args.json:
        write_file_atomic(args.json, json.dumps(res, indent=2, default=str))
    if args.plot or args.plot_errors:
        try:
            from secateur import plots
        except ImportError:
            raise SecateurError("plots need matplotlib: pip install 'secateur[plots]'") from None
        if args.plot:
            plots.plot_qk_removal({"pruned": al}, args.plot, title=f"Q/K removal per block: {res['pruned']}")
        if args.plot_errors:
            plots.plot_block_errors({"pruned": res["per_block"]}, args.plot_errors,
                                    title=f"relative QK error per block (Eq. 49): {res['pruned']}")
    sys.stdout.flush()
    return 0
