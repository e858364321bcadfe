"""Feature similarity of a pruned vision encoder to its dense model (``secateur eval features``): images in, how far
the pruned model's representation moved, and how much a linear head reading it loses.

Three measures, on the same test images through the same pixels (the reference's image processor; the model's
must make the same pixels, checked by sha256):

* **pooled features** (:func:`pooled_features`): the vector a linear head reads, one rule per family (below); per
  image ``cos_i = <f_i, g_i> / (||f_i|| ||g_i||)`` of the pruned ``f`` and dense ``g`` features (float64; a pair
  with a zero vector counts 1 when both are zero, else 0); reported: the mean and the min over images;
* **block errors** (:func:`block_errors`): per block ``l``, ``||H_l - H_l^dense||_F / ||H_l^dense||_F`` over all
  images' block outputs (tokens x hidden), both models walked block by block by their adapters
  (``capture_inputs`` + ``block_forward``); a model with another block count (ShortGPT removed blocks) gives the
  error of the final hidden states (``final_hidden`` of the last block's output) instead, named by
  ``block_error_scope``;
* **linear probe** (:func:`linear_probe`): a closed-form ridge regression on one-hot labels fitted on the
  features of ``probe_train`` train-split images, scored (top-1) on the test images, for both models (each with
  its own features). Skipped, and said so, when the source has no labels.

Pooling rules (:func:`pooling_rule`), decided by the family and the adapter's ``special_tokens``:

* ViT, DeiT, DINOv2 (a CLS token): ``last_hidden_state[:, 0]``, the CLS token after the final LayerNorm (what
  ViT's and DeiT's classifiers read; DINOv2's classifier reads ``concat(CLS, mean of patch tokens)``: the CLS half);
* CLIP vision tower (``clip_vision_model``): ``pooler_output = post_layernorm(CLS)``;
* CLIP image classifier (``clip``): the mean of the patch tokens of ``last_hidden_state`` (CLS left out), its
  classifier's input;
* SigLIP (``special_tokens == 0``, no CLS): ``pooler_output`` (the attention-pool head) when the tower has a head
  (``vision_use_head``), else the mean over the tokens of ``last_hidden_state`` (SigLIP's classifier's input).

Split-less sources (an ``.npz``, a flat folder): the probe's training images and the test images are drawn from
the one set without overlap: ``numpy.random.default_rng(seed).permutation`` of the drawn images, the first
``probe_train`` for training, the rest for the test.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn

from secateur.data.images import FASHION_MNIST, ImageSet, load_images
from secateur.errors import SecateurError
from secateur.files import read_json
from secateur.safe_write import check_writable_output, write_file_atomic
from secateur.schemas.api import checked_call

PROTOCOL = ("features: pooled-feature cosine (CLS / pooler / token mean by family), per-block relative Frobenius "
            "error of block outputs, ridge linear probe (one-hot, centred, lambda = 1e-3 tr(X^T X)/D, float64, "
            "argmax ties to the lower class) fitted on train-split images, top-1 on the test images")
PROBE_TRAIN = 2000


def _positive(value, what: str, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise SecateurError(f"{what} must be a positive integer, got {value!r}; {fix}")


# --- pooled features -------------------------------------------------------------------------------------------

def pooling_rule(model: nn.Module) -> str:
    """The pooling rule of ``model`` (module docstring): ``cls``, ``pooler``, ``mean`` or ``mean-patches``."""
    from secateur.models.families import get_adapter

    ad = get_adapter(model)
    if ad.modality != "vision":
        raise SecateurError(f"model {type(model).__name__} is a {ad.family} text model; feature similarity compares "
                            "vision encoders (use `secateur eval ppl` for a language model)")
    if ad.family == "clip_vision_model":
        return "pooler"
    if ad.family == "clip":
        return "mean-patches"
    if ad.special_tokens == 0:
        return "pooler" if getattr(ad.vision_config, "vision_use_head", False) else "mean"
    return "cls"


def _pool(out, rule: str) -> torch.Tensor:
    h = out.last_hidden_state
    if rule == "cls":
        return h[:, 0]
    if rule == "mean-patches":
        return h[:, 1:].mean(1)
    if rule == "pooler" and getattr(out, "pooler_output", None) is not None:
        return out.pooler_output
    return h.mean(1)


def pooled_features(model: nn.Module, pixels: torch.Tensor, batch: int = 256) -> torch.Tensor:
    """``[N, D]`` float32 features of ``pixels`` ``[N, C, H, W]``: the backbone (the adapter's ``base``) run in
    eval mode without gradients, ``batch`` images at a time, pooled by :func:`pooling_rule` (module docstring)."""
    from secateur.models.families import get_adapter

    _positive(batch, "batch", "pass --batch N with N >= 1")
    rule = pooling_rule(model)
    base = get_adapter(model).base
    param = next(model.parameters())
    was_training = model.training
    model.eval()
    parts = []
    try:
        with torch.inference_mode():
            for start in range(0, pixels.shape[0], batch):
                px = pixels[start:start + batch].to(param.device, param.dtype)
                parts.append(_pool(base(pixel_values=px), rule).float().cpu())
    finally:
        model.train(was_training)
    if not parts:
        raise SecateurError("no images to compute features of; give at least one image")
    return torch.cat(parts)


def cosines(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per row ``<a_i, b_i> / (||a_i|| ||b_i||)`` in float64; a row pair with a zero vector: 1 when both rows are
    zero, else 0."""
    a, b = a.double(), b.double()
    na, nb = a.norm(dim=1), b.norm(dim=1)
    den = na * nb
    cos = (a * b).sum(1) / torch.where(den > 0, den, torch.ones_like(den))
    return torch.where(den > 0, cos, ((na == 0) & (nb == 0)).double())


# --- block errors ----------------------------------------------------------------------------------------------

def block_errors(model: nn.Module, dense: nn.Module, pixels: torch.Tensor, batch: int = 256) -> list[float]:
    """Per block ``l``: ``||H_l - H_l^dense||_F / ||H_l^dense||_F``, ``H_l`` the output of block ``l`` for every
    image (``[N, T, d]``; both sums of squares accumulated in float64 over batches of ``batch`` images), each model
    walked from its own stem (``capture_inputs``) through its blocks (``block_forward``). Models with different
    block counts: one value, the relative error of the final hidden states (``final_hidden`` of the last block's
    output; see :func:`block_error_scope`). A zero dense norm gives 0 when the outputs agree, else ``inf``."""
    from secateur.models.families import get_adapter

    _positive(batch, "batch", "pass --batch N with N >= 1")
    ads = (get_adapter(model), get_adapter(dense))
    same_depth = len(ads[0].layers) == len(ads[1].layers)
    n_out = len(ads[0].layers) if same_depth else 1
    diff = torch.zeros(n_out, dtype=torch.float64)
    ref = torch.zeros(n_out, dtype=torch.float64)
    states = [(m, m.training) for m in (model, dense)]
    for m, _ in states:
        m.eval()
    try:
        with torch.inference_mode():
            for start in range(0, pixels.shape[0], batch):
                walks = []
                for ad, m in zip(ads, (model, dense), strict=True):
                    param = next(m.parameters())
                    h, kw = ad.capture_inputs(pixels[start:start + batch].to(param.device, param.dtype))
                    outs = []
                    for i, layer in enumerate(ad.layers):
                        h = ad.block_forward(layer, h, ad.layer_kwargs(i, kw))
                        if same_depth:
                            outs.append(h.double().cpu())
                    walks.append(outs if same_depth else [ad.final_hidden(h).double().cpu()])
                for i, (hm, hd) in enumerate(zip(*walks, strict=True)):
                    diff[i] += (hm - hd).square().sum()
                    ref[i] += hd.square().sum()
    finally:
        for m, was in states:
            m.train(was)
    err = torch.where(ref > 0, diff.sqrt() / torch.where(ref > 0, ref, torch.ones_like(ref)).sqrt(),
                      torch.where(diff > 0, torch.full_like(diff, float("inf")), torch.zeros_like(diff)))
    return [float(e) for e in err]


def block_error_scope(model: nn.Module, dense: nn.Module) -> str:
    """What :func:`block_errors` measured: ``per-block``, or ``final hidden states`` when the block counts differ."""
    from secateur.models.families import get_adapter

    n, d = len(get_adapter(model).layers), len(get_adapter(dense).layers)
    return "per-block" if n == d else f"final hidden states (the model has {n} blocks, the reference {d})"


# --- linear probe ----------------------------------------------------------------------------------------------

def _features_and_labels(feats, labels, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.as_tensor(np.asarray(feats) if not isinstance(feats, torch.Tensor) else feats).double()
    y = torch.as_tensor(np.asarray(labels) if not isinstance(labels, torch.Tensor) else labels)
    if x.ndim != 2 or x.shape[0] < 1:
        raise SecateurError(f"{what} features have shape {list(x.shape)}; give an [N, D] array with N >= 1")
    if y.shape != (x.shape[0],) or y.dtype.is_floating_point or y.dtype == torch.bool:
        raise SecateurError(f"{what} labels have shape {list(y.shape)} and dtype {y.dtype}; give one integer label "
                            f"per image ({x.shape[0]})")
    if int(y.min()) < 0:
        raise SecateurError(f"{what} labels hold {int(y.min())}; give class ids >= 0")
    return x, y.long()


def linear_probe(train_feats, train_labels, test_feats, test_labels, ridge: float | None = None) -> dict:
    """A ridge-regression linear probe, closed form, in float64.

    ``X`` (``[n, D]``) centred by its column means ``mu``, ``Y`` the one-hot labels (``C = max label + 1`` classes
    over both sets): ``W = (X_c^T X_c + lambda I)^-1 X_c^T Y`` (``torch.linalg.solve``), intercept
    ``b = mean(Y) - mu W``; a test image's class is ``argmax(x W + b)``, ties to the lower class, a row with a
    non-finite score a miss. ``lambda`` (``ridge``) defaults to ``1e-3 tr(X_c^T X_c) / D`` (1 when that trace is 0:
    constant features). Returns ``top1``, ``lambda``, ``weight`` ``[D, C]``, ``bias`` ``[C]``, the counts and
    ``nonfinite_rows``."""
    x, y = _features_and_labels(train_feats, train_labels, "probe training")
    xt, yt = _features_and_labels(test_feats, test_labels, "probe test")
    if xt.shape[1] != x.shape[1]:
        raise SecateurError(f"probe training features have {x.shape[1]} dimensions and test features "
                            f"{xt.shape[1]}; give features of one model")
    if ridge is not None and (isinstance(ridge, bool) or not isinstance(ridge, int | float) or not ridge >= 0
                              or not np.isfinite(ridge)):
        raise SecateurError(f"ridge must be a finite number >= 0, got {ridge!r}")
    d = x.shape[1]
    classes = int(max(int(y.max()), int(yt.max()))) + 1
    yy = torch.nn.functional.one_hot(y, classes).double()
    mu = x.mean(0)
    xc = x - mu
    gram = xc.T @ xc
    if ridge is None:
        tr = float(torch.trace(gram))
        lam = 1e-3 * tr / d if tr > 0 and np.isfinite(tr) else 1.0
    else:
        lam = float(ridge)
    try:
        w = torch.linalg.solve(gram + lam * torch.eye(d, dtype=torch.float64), xc.T @ yy)
    except RuntimeError:  # torch.linalg.LinAlgError: singular (ridge 0 on rank-deficient features)
        if torch.isfinite(x).all():
            raise SecateurError(f"the probe's normal equations are singular with ridge {lam:g} ({d} features, "
                                f"{x.shape[0]} training images); pass a ridge > 0") from None
        w = torch.full((d, classes), float("nan"), dtype=torch.float64)  # non-finite features: every row a miss
    b = yy.mean(0) - mu @ w
    scores = xt @ w + b
    finite = torch.isfinite(scores).all(1)
    hits = (scores.argmax(1) == yt) & finite
    return {"top1": hits.double().mean().item(), "lambda": lam, "weight": w, "bias": b, "n_train": x.shape[0],
            "n_test": xt.shape[0], "classes": classes, "nonfinite_rows": int((~finite).sum())}


# --- folders, images, the evaluation ---------------------------------------------------------------------------

def _folder_config(spec: str, flag: str) -> tuple[Path, dict]:
    """The folder of ``spec`` and its config.json, refused in one line when it is missing, not a folder, of a text
    family or of no supported family, or when its weights disagree with its config."""
    from secateur.models.families import ADAPTERS, base_model_type
    from secateur.models.loading import _check_regular_files, check_family, check_model

    folder = Path(spec).expanduser()
    if not folder.is_dir():
        raise SecateurError(f"{flag} {spec} is not a folder; pass a vision encoder's folder (config.json, weights, "
                            "preprocessor_config.json)")
    _check_regular_files(spec, folder)
    cfg = read_json(folder / "config.json", "re-download or re-export the model's config.json", "model config")
    if not isinstance(cfg, dict):
        raise SecateurError(f"{flag} {spec}: config.json is not a JSON object; re-download or re-export it")
    check_family(spec, cfg)
    family = base_model_type(cfg.get("model_type"))
    if ADAPTERS[family].modality != "vision":
        raise SecateurError(f"{flag} {spec} is a {family} text model; `secateur eval features` compares vision "
                            "encoders (use `secateur eval ppl` for a language model)")
    check_model(spec, str(folder), {})  # the weights against the config (headers only), before any image is read
    return folder, cfg


def _sizes(cfg: dict) -> tuple[int, int, tuple[int, int]]:
    """``(hidden_size, num_channels, patch grid)`` of a vision config (or its ``vision_config``)."""
    c = cfg.get("vision_config") if isinstance(cfg.get("vision_config"), dict) else cfg
    size, patch = c.get("image_size", 224), c.get("patch_size", 16)
    size = tuple(size) if isinstance(size, list | tuple) else (size, size)
    patch = tuple(patch) if isinstance(patch, list | tuple) else (patch, patch)
    try:
        grid = (int(size[0]) // int(patch[0]), int(size[1]) // int(patch[1]))
    except (TypeError, ValueError, ZeroDivisionError, IndexError):
        grid = (0, 0)
    return c.get("hidden_size"), c.get("num_channels", 3), grid


def check_comparable(model: str, mcfg: dict, reference: str, rcfg: dict) -> None:
    """One line when the two configs' features cannot be compared: another family, hidden size, channel count or
    patch grid."""
    from secateur.models.families import base_model_type

    fm, fr = base_model_type(mcfg.get("model_type")), base_model_type(rcfg.get("model_type"))
    if fm != fr:
        raise SecateurError(f"model {model} is a {fm} and --reference {reference} a {fr}; their features cannot be "
                            "compared: pass the dense model the pruned one was made from as --reference")
    (hm, cm, gm), (hr, cr, gr) = _sizes(mcfg), _sizes(rcfg)
    for what, a, b in (("hidden size", hm, hr), ("channel count", cm, cr),
                       ("patch grid", f"{gm[0]}x{gm[1]}", f"{gr[0]}x{gr[1]}")):
        if a != b:
            raise SecateurError(f"model {model} has {what} {a} and --reference {reference} {b}; their features "
                                "cannot be compared: pass the dense model the pruned one was made from as "
                                "--reference")


def _processor_config(folder: Path):
    path = folder / "preprocessor_config.json"
    if not path.is_file():
        return None
    return read_json(path, "fix the JSON or copy preprocessor_config.json from the model's hub repository",
                     "image processor config")


def _subset(images: ImageSet, idx: np.ndarray, rule: str) -> ImageSet:
    import hashlib

    px = images.pixel_values[torch.as_tensor(idx)]
    labels = images.labels[idx] if images.labels is not None else None
    manifest = dict(images.manifest, n=len(idx), rule=f"{images.manifest['rule']}; {rule}",
                    pixels_shape=list(px.shape),
                    pixels_sha256=hashlib.sha256(np.ascontiguousarray(px.numpy()).tobytes()).hexdigest(),
                    labels_sha256=None if labels is None
                    else hashlib.sha256(np.ascontiguousarray(labels).tobytes()).hexdigest())
    return ImageSet(px, labels, images.class_names, manifest)


def feature_images(dataset: str, folder: Path, max_images: int | None, probe_train: int | None, seed: int,
                   data_dir: str | None, split: str = "test") -> tuple[ImageSet, ImageSet | None, str | None]:
    """``(test images, probe training images or None, why no probe)`` through ``folder``'s image processor: the
    ``split`` split (``max_images`` drawn with ``seed``, default all) and the train split (``probe_train`` drawn with
    ``seed``, default ``min(2000, all)``); a split-less source split without overlap (module docstring; default
    ``min(2000, half the images)`` for training, the rest, or ``max_images`` of it, for the test)."""
    from secateur.data.images import _open_source  # the set's count, labels and splits, nothing decoded

    src = _open_source(str(dataset), split, data_dir)
    if src.labels is None:
        test = load_images(dataset, folder, n=max_images, seed=seed, split=split, data_dir=data_dir)
        return test, None, "the image source has no labels"
    n_total = src.count
    if src.split is not None:  # a source with splits: test and train are its own
        if split == "train":
            raise SecateurError("--split train is the split the linear probe is fitted on; score another split "
                                "(--split test)")
        avail = _open_source(str(dataset), "train", data_dir).count
        if probe_train is not None and probe_train > avail:
            raise SecateurError(f"the train split of {dataset} holds {avail} images, fewer than --probe-train "
                                f"{probe_train}; pass --probe-train {avail} or fewer")
        test = load_images(dataset, folder, n=max_images, seed=seed, split=split, data_dir=data_dir)
        n_train = probe_train if probe_train is not None else min(PROBE_TRAIN, avail)
        train = load_images(dataset, folder, n=n_train, seed=seed, split="train", data_dir=data_dir,
                            need_labels=True)
        return test, train, None
    n_train = probe_train if probe_train is not None else min(PROBE_TRAIN, n_total // 2)
    n_test = max_images if max_images is not None else n_total - n_train
    if n_train < 1 or n_test < 1 or n_train + n_test > n_total:
        raise SecateurError(f"{dataset} has no splits and holds {n_total} images, too few for {n_train} probe "
                            f"training images and {n_test} test images apart; pass a smaller --probe-train / "
                            "--max-images (their sum at most the image count)")
    both = load_images(dataset, folder, n=None if n_train + n_test == n_total else n_train + n_test, seed=seed,
                       split=split, data_dir=data_dir)
    perm = np.random.default_rng(seed).permutation(n_train + n_test)
    rule = "split apart by numpy.random.default_rng(seed).permutation: first {} for training, the rest for the test"
    return (_subset(both, np.sort(perm[n_train:]), rule.format(n_train) + " (test)"),
            _subset(both, np.sort(perm[:n_train]), rule.format(n_train) + " (training)"), None)


@checked_call
def eval_features(model: str | os.PathLike, reference: str | os.PathLike, dataset: str = FASHION_MNIST,
                  max_images: int | None = None, probe_train: int | None = None, seed: int = 0,
                  data_dir: str | os.PathLike | None = None, json_path: str | os.PathLike | None = None,
                  batch: int = 256, split: str = "test") -> dict:
    """Feature similarity of the vision encoder folder ``model`` to the dense ``reference`` folder (module
    docstring): pooled-feature cosine (mean and min), block errors, linear-probe top-1 of both models, on the
    ``split`` images (the probe fitted on the ``train`` split's).

    Checked before any model is loaded: the output file, the counts, both folders (a missing folder, a text model,
    another family, hidden size, channel count or patch grid refused in one line), then the images (through the
    reference's processor; the model's must make the same pixels). ``json_path`` is written atomically at the end,
    so nothing is written on error."""
    from secateur.models.loading import load_model

    if json_path is not None:  # an unwritable --json fails now, not after the evaluation
        check_writable_output(json_path, folder=False)
    _positive(batch, "batch", "pass --batch N with N >= 1")
    if max_images is not None:
        _positive(max_images, "--max-images", "pass a positive count or leave it out (all test images)")
    if probe_train is not None:
        _positive(probe_train, "--probe-train", "pass a positive count or leave it out (2000)")
    mfolder, mcfg = _folder_config(str(model), "model")
    rfolder, rcfg = _folder_config(str(reference), "--reference")
    check_comparable(str(model), mcfg, str(reference), rcfg)
    test, train, no_probe = feature_images(dataset, rfolder, max_images, probe_train, seed, data_dir, split)
    if _processor_config(mfolder) != _processor_config(rfolder):  # other configs may still make the same pixels
        mine = feature_images(dataset, mfolder, max_images, probe_train, seed, data_dir, split)[0]
        if mine.manifest["pixels_sha256"] != test.manifest["pixels_sha256"]:
            raise SecateurError(f"model {model}'s image processor makes other pixels than --reference {reference}'s "
                                "(their preprocessor_config.json differ); copy the reference's "
                                "preprocessor_config.json into the model folder")
    net, _ = load_model(str(model), resolved=(str(mfolder), {}))
    ref, _ = load_model(str(reference), resolved=(str(rfolder), {}))
    rule = pooling_rule(net)
    if pooling_rule(ref) != rule:
        raise SecateurError(f"model {model} pools its features by {rule} and --reference {reference} by "
                            f"{pooling_rule(ref)}; their features cannot be compared: pass the dense model the "
                            "pruned one was made from as --reference")
    fm, fr = pooled_features(net, test.pixel_values, batch), pooled_features(ref, test.pixel_values, batch)
    cos = cosines(fm, fr)
    res = {"cosine_mean": cos.mean().item(), "cosine_min": cos.min().item(),
           "block_rel_error": block_errors(net, ref, test.pixel_values, batch),
           "block_error_scope": block_error_scope(net, ref), "pooling": rule,
           "probe_top1": None, "probe_top1_reference": None, "probe_lambda": None, "probe_lambda_reference": None,
           "probe_skipped": no_probe, "n_images": int(test.pixel_values.shape[0]),
           "probe_train_images": 0 if train is None else int(train.pixel_values.shape[0]),
           "protocol": PROTOCOL, "model": str(model), "reference": str(reference), "dataset": str(dataset),
           "images": test.manifest, "probe_images": None if train is None else train.manifest}
    if train is not None:
        for key, net_ in (("", net), ("_reference", ref)):
            p = linear_probe(pooled_features(net_, train.pixel_values, batch), train.labels,
                             fm if net_ is net else fr, test.labels)
            res[f"probe_top1{key}"], res[f"probe_lambda{key}"] = p["top1"], p["lambda"]
    from secateur.runinfo import SCHEMA_VERSION

    res["schema_version"] = SCHEMA_VERSION
    if json_path:
        write_file_atomic(json_path, json.dumps(res, indent=2))
    return res


def _cmd_features(args) -> int:
    res = eval_features(args.model, args.reference, args.dataset, args.max_images, args.probe_train, args.seed,
                        args.data_dir, args.json, args.batch, args.split)
    if res["probe_top1"] is None:
        probe = f"probe skipped ({res['probe_skipped']})"
    else:
        probe = f"probe top-1 {res['probe_top1']:.4f} (dense {res['probe_top1_reference']:.4f})"
    errs = res["block_rel_error"]
    if not args.quiet:
        scope = "block errors" if res["block_error_scope"] == "per-block" else "final hidden error"
        print(f"{scope}: {' '.join(f'{e:.4f}' for e in errs)}", file=sys.stderr)
    print(f"cosine {res['cosine_mean']:.4f} (min {res['cosine_min']:.4f})  {probe}  ({res['n_images']} images)")
    return 0


def register_cli(eval_subparsers) -> None:
    """``secateur eval features --model M --reference DENSE --dataset fashion-mnist|DIR|FILE``."""
    p = eval_subparsers.add_parser(
        "features", help="feature similarity of a pruned vision encoder to its dense model (cosine, probe)",
        description="Pooled-feature cosine, per-block relative errors and a ridge linear probe (fitted on train-split "
                    "images, top-1 on the test images) of a pruned vision encoder and its dense reference, on the "
                    "same pixels through the reference's image processor.")
    p.add_argument("--model", required=True, help="the (pruned) vision encoder folder")
    p.add_argument("--reference", required=True, help="the dense model's folder (same family and sizes)")
    p.add_argument("--dataset", default=FASHION_MNIST,
                   help="fashion-mnist | a folder of images | an .npy/.npz/idx file (default: %(default)s)")
    p.add_argument("--split", default="test",
                   help="split of the scored images, for sets that have them (default: %(default)s; the probe is "
                        "fitted on train)")
    p.add_argument("--max-images", type=int, default=None, metavar="N",
                   help="test images drawn without replacement with --seed (default: all)")
    p.add_argument("--probe-train", type=int, default=None, metavar="N",
                   help=f"train-split images the linear probe is fitted on (default: {PROBE_TRAIN} or all if fewer)")
    p.add_argument("--seed", type=int, default=0, help="seed of the image draws (default: %(default)s)")
    p.add_argument("--data-dir", default=None, help="folder laid out like ../shared/data (default: SECATEUR_DATA)")
    p.add_argument("--json", default=None, metavar="FILE", help="write the result with its image manifests as JSON")
    p.add_argument("--batch", type=int, default=256, help="images per forward (default: %(default)s)")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=_cmd_features)
