"""Top-1 / top-5 accuracy of an image classifier (``secateur eval accuracy``): images in, accuracy out.

The pixels are the model's own processor's (:func:`secateur.data.images.load_images`), so a dense and a pruned
model given the same source, count and seed are scored on the same images (``images_sha256``). Dataset classes are
matched to the model's labels by name when both have names: an ImageFolder sorted alphabetically and a model
trained in another class order would otherwise score near chance without a word.

Ranks are exact and tie-stable: an image's rank is the number of logits above its label's, plus the equal ones at
a lower class id (``argmax``'s first-index rule), so top-1 is the argmax accuracy; a row with a non-finite logit
counts as a miss.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from secateur.data.images import FASHION_MNIST, ImageSet, load_images
from secateur.errors import SecateurError, one_line
from secateur.files import read_json
from secateur.safe_write import check_writable_output, write_file_atomic
from secateur.schemas.api import checked_call

PROTOCOL = "top-k over processor pixels"
_HEADS = ("ForImageClassification", "ForImageClassificationWithTeacher")


def _label_names(config) -> dict[int, str] | None:
    """The model's label names, None when it has none (transformers' default ``LABEL_i`` names are no names)."""
    id2label = {int(k): str(v) for k, v in (getattr(config, "id2label", None) or {}).items()}
    if not id2label or all(v == f"LABEL_{k}" for k, v in id2label.items()):
        return None
    return id2label


def _targets(images: ImageSet, config, num_labels: int) -> tuple[torch.Tensor, str]:
    """The model's class id of every image: by name (case-insensitive) when the set and the model both name their
    classes, else the set's integer labels as they are (checked below ``num_labels``)."""
    labels = images.labels.astype(np.int64)
    if labels.shape != (images.pixel_values.shape[0],):
        raise SecateurError(f"the image set has {images.pixel_values.shape[0]} images and labels of shape "
                            f"{list(labels.shape)}; give one label per image")
    names = _label_names(config)
    if images.class_names is not None and names is not None:
        by_name: dict[str, int] = {}
        for k, v in sorted(names.items()):
            by_name.setdefault(v.strip().lower(), k)
        if len(labels) and not 0 <= labels.min() <= labels.max() < len(images.class_names):
            raise SecateurError(f"the image set has label {int(labels.max())} and names "
                                f"{len(images.class_names)} classes; give labels below the number of class names")
        ids = []
        for i, c in enumerate(images.class_names):
            if c.strip().lower() not in by_name:
                raise SecateurError(f"dataset class names do not match the model's labels: dataset class {i} is "
                                    f"{c!r}, model label {i} is {names.get(i)!r}; rename the dataset's classes to the "
                                    "model's labels (config.json id2label), or fix id2label")
            ids.append(by_name[c.strip().lower()])
        return torch.as_tensor(np.asarray(ids, dtype=np.int64)[labels]), "by name"
    if images.class_names is not None:
        print("secateur: note: the model's config names no labels (id2label LABEL_i); dataset class i is taken as "
              "model label i", file=sys.stderr)
    if len(labels) and labels.max() >= num_labels:
        raise SecateurError(f"the image set has label {int(labels.max())} and the model has {num_labels} classes "
                            f"(0..{num_labels - 1}); give labels the model knows")
    return torch.as_tensor(labels), "by index"


def _ranks(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Each row's rank of its target (0: top-1), ties broken by class id; a non-finite row ranks last."""
    own = logits.gather(1, target[:, None])
    cls = torch.arange(logits.shape[1], device=logits.device)
    rank = (logits > own).sum(1) + ((logits == own) & (cls[None] < target[:, None])).sum(1)
    return torch.where(torch.isfinite(logits).all(1), rank, torch.full_like(rank, logits.shape[1]))


def _forward(model: nn.Module, px: torch.Tensor, first: bool) -> torch.Tensor:
    try:
        return model(pixel_values=px).logits
    except (ValueError, RuntimeError) as e:  # pixels the model cannot take: the first batch says so
        if not first:
            raise
        raise SecateurError(f"the model cannot take the processor's pixels {list(px.shape)} ({type(e).__name__}: "
                            f"{one_line(str(e).splitlines()[0] if str(e) else '')}); make preprocessor_config.json's "
                            "size match config.json's image_size and num_channels") from None


def accuracy(model: nn.Module, images: ImageSet, batch: int = 256, progress: bool = False) -> dict:
    """Top-1 and top-5 (only for more than 5 classes) accuracy of ``model`` (its output's ``.logits``; a DeiT
    with teacher gives the mean of its two heads) on a labelled image set, in eval mode (restored after)."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise SecateurError(f"batch must be a positive integer, got {batch!r}")
    if images.labels is None:
        raise SecateurError("the image set has no labels; accuracy needs a labelled source (one folder per class, "
                            "an .npz with labels, idx labels)")
    config = model.config
    num_labels = int(config.num_labels)
    target, label_map = _targets(images, config, num_labels)
    param = next(model.parameters())
    n = images.pixel_values.shape[0]
    hits = torch.zeros(2, dtype=torch.int64)
    nonfinite = 0
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            for start in tqdm(range(0, n, batch), desc="accuracy", disable=not progress):
                px = images.pixel_values[start:start + batch].to(param.device, param.dtype)
                logits = _forward(model, px, start == 0).float()
                if logits.ndim != 2 or logits.shape[1] != num_labels:
                    raise SecateurError(f"the model's logits have shape {list(logits.shape)}, its config says "
                                        f"{num_labels} classes; fix num_labels / id2label in config.json")
                rank = _ranks(logits, target[start:start + batch].to(logits.device)).cpu()
                hits += torch.stack([(rank < 1).sum(), (rank < 5).sum()])
                nonfinite += int((~torch.isfinite(logits).all(1)).sum())
    finally:
        model.train(was_training)
    return {"top1": hits[0].item() / n, "top5": hits[1].item() / n if num_labels > 5 else None, "n_images": n,
            "protocol": PROTOCOL, "label_map": label_map, "nonfinite_rows": nonfinite}


def _classifier_folder(spec: str) -> Path:
    """A model folder whose config.json names an image-classification head (a backbone is refused: its head
    would be initialised at random)."""
    from secateur.models.loading import _check_regular_files  # not at import: the CLI builds its parser from here

    folder = Path(spec).expanduser()
    if not folder.is_dir():
        raise SecateurError(f"model {spec} is not a folder; pass an image classifier's folder (config.json, weights, "
                            "preprocessor_config.json), e.g. downloaded with `hf download ID --local-dir DIR`")
    _check_regular_files(spec, folder)
    cfg = read_json(folder / "config.json", "re-download or re-export the model's config.json", "model config")
    archs = cfg.get("architectures") if isinstance(cfg, dict) else None
    if isinstance(archs, list) and archs and not any(str(a).endswith(_HEADS) for a in archs):
        raise SecateurError(f"model {spec} is a {archs[0]}, not an image classifier (no classification head); "
                            "`secateur eval accuracy` needs a *ForImageClassification model, `secateur eval features` "
                            "is for backbones")
    return folder


def _load_classifier(spec: str, folder: Path) -> nn.Module:
    """The classifier through secateur's loader: the folder checked against its config first (family, weights,
    shapes), then loaded as the class its config names (a per-layer export as secateur's own class; DeiT with
    teacher keeps both heads), a weight the loader had to make up or drop refused."""
    from secateur.models.loading import check_model, load_model

    check_model(spec, str(folder), {})
    model, _ = load_model(spec, resolved=(str(folder), {}))
    return model.eval()


@checked_call
def eval_accuracy(model: str | os.PathLike | nn.Module, dataset: str = FASHION_MNIST, split: str = "test",
                  max_images: int | None = None, seed: int = 0, data_dir: str | os.PathLike | None = None,
                  json_path: str | os.PathLike | None = None, batch: int = 256,
                  processor_dir: str | os.PathLike | None = None, progress: bool = False) -> dict:
    """Accuracy of an image classifier folder (or an in-memory model with ``processor_dir``, a folder holding its
    preprocessor_config.json) on ``dataset`` (:func:`load_images`' sources; ``max_images`` drawn with ``seed``).
    Inputs are checked (output, model folder, images) before the model is loaded; ``json_path`` is written
    atomically at the end, so nothing is written on error."""
    if json_path is not None:  # an unwritable --json fails now, not after the evaluation
        check_writable_output(json_path, folder=False)
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise SecateurError(f"batch must be a positive integer, got {batch!r}; pass --batch N with N >= 1")
    if isinstance(model, os.PathLike):
        model = os.fspath(model)
    if isinstance(model, str | Path):
        folder = _classifier_folder(str(model))
        images = load_images(dataset, processor_dir or folder, n=max_images, seed=seed, split=split,
                             data_dir=data_dir, need_labels=True)
        net, name = _load_classifier(str(model), folder), str(model)
        if not hasattr(net, "num_labels") or getattr(net.config, "num_labels", 0) < 1:
            raise SecateurError(f"model {model} has no classification head; `secateur eval features` is for "
                                "backbones")
    else:
        if processor_dir is None:
            raise SecateurError("an in-memory model needs processor_dir: a folder with its preprocessor_config.json "
                                "(and config.json)")
        images = load_images(dataset, processor_dir, n=max_images, seed=seed, split=split, data_dir=data_dir,
                             need_labels=True)
        net, name = model, getattr(getattr(model, "config", None), "_name_or_path", "") or "in-memory"
    res = accuracy(net, images, batch, progress)
    res.update(model=name, dataset=str(dataset), split=images.manifest["split"],
               images_sha256=images.manifest["pixels_sha256"], images=images.manifest)
    if json_path:
        write_file_atomic(json_path, json.dumps(res, indent=2))
    return res


def _cmd_accuracy(args) -> int:
    res = eval_accuracy(args.model, args.dataset, args.split, args.max_images, args.seed, args.data_dir, args.json,
                        args.batch, progress=not args.quiet)
    top5 = f"{res['top5']:.4f}" if res["top5"] is not None else "n/a"
    where = f"{res['dataset']} {res['split']}" if res["split"] else res["dataset"]
    print(f"top-1 {res['top1']:.4f}  top-5 {top5}  ({res['n_images']} images, {where})")
    return 0


def register_cli(eval_subparsers) -> None:
    """``secateur eval accuracy --model M --dataset fashion-mnist|DIR|FILE``."""
    p = eval_subparsers.add_parser(
        "accuracy", help="top-1 / top-5 accuracy of an image classifier",
        description="Top-1 / top-5 accuracy of an image classifier folder on Fashion-MNIST, an image folder (one "
                    "sub-folder per class) or an .npy/.npz/idx file, through the model's own image processor.")
    p.add_argument("--model", required=True, help="image classifier folder (config.json, weights, "
                                                  "preprocessor_config.json)")
    p.add_argument("--dataset", default=FASHION_MNIST,
                   help="fashion-mnist | a folder of images | an .npy/.npz/idx file (default: %(default)s)")
    p.add_argument("--split", default="test", help="split of sets that have them (default: %(default)s)")
    p.add_argument("--max-images", type=int, default=None, metavar="N",
                   help="evaluate N images drawn without replacement with --seed (default: all)")
    p.add_argument("--seed", type=int, default=0, help="seed of the --max-images draw (default: %(default)s)")
    p.add_argument("--data-dir", default=None, help="folder laid out like ../shared/data (default: SECATEUR_DATA)")
    p.add_argument("--json", default=None, metavar="FILE", help="write the result with its image manifest as JSON")
    p.add_argument("--batch", type=int, default=256, help="images per forward (default: %(default)s)")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=_cmd_accuracy)
