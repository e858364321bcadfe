"""Images in: the pixels an image model sees, from Fashion-MNIST, a folder, an array file or the hub.

An accuracy is only comparable between a dense and a pruned model (or two runs) when both saw the same pixels: so
the pixels come from the model's own image processor (``preprocessor_config.json``), the images are chosen by a
seeded rule, and the manifest holds the rule and the sha256 of the pixels and the labels. Every input is checked
where it enters: a bad one is one :class:`SecateurError` line naming the file and the fix, before the model runs.

Sources (``source``):
  * ``fashion-mnist``: ``<data_dir>/fashion-mnist/{train,t10k}-{images-idx3,labels-idx1}-ubyte.gz``;
  * a folder: one sub-folder of images per class (class names: the sorted sub-folder names; a folder of split
    sub-folders ``train/``, ``test/``, ... reads ``split``'s), or a flat folder of images (no labels);
  * a file: idx (``.idx``, ``.gz``; labels from the sibling ``...labels-idx1...`` file), ``.npy`` (``[N, H, W]`` or
    ``[N, H, W, C]``, uint8 0..255 or float 0..1), ``.npz`` (``images`` or ``x``, optional ``labels`` or ``y``);
  * anything else: a ``datasets`` hub name (``image`` / ``img`` and ``label`` columns), for users who are online.
"""

from __future__ import annotations

import hashlib
import io
import os
import sys
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from secateur.data.idx import read_idx
from secateur.data.sources import resolve_data_dir
from secateur.errors import SecateurError, one_line
from secateur.files import read_json, read_regular_bytes, regular_file

FASHION_MNIST = "fashion-mnist"
FASHION_MNIST_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag",
                         "Ankle boot")
IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm",
                            ".pbm"})
SPLIT_DIRS = frozenset({"train", "test", "val", "valid", "validation"})
BATCH = 256  # images per processor call: bounds the decoded images held at once
_EIGHT_BIT = frozenset({"1", "L", "LA", "P", "PA", "RGB", "RGBA", "RGBX", "CMYK", "YCbCr", "LAB", "HSV"})
_IMAGE_FIX = "replace it with a readable 8-bit image or remove it"
_SOURCES = "pass fashion-mnist, a folder of images (one sub-folder per class) or an .npy/.npz/idx file"


@dataclass
class ImageSet:
    """Processed images: ``pixel_values`` ``[N, C, H, W]`` float32 as the model's image processor made them,
    ``labels`` int64 ``[N]`` (None: an unlabelled set), ``class_names`` (label i's name, when the source has
    names) and ``manifest`` (source, split, selection rule, seed, processor, sha256 of pixels and labels)."""

    pixel_values: torch.Tensor
    labels: np.ndarray | None
    class_names: list[str] | None
    manifest: dict = field(default_factory=dict)


@dataclass
class _Source:
    """A set before decoding, so a selection decodes only the images it keeps: ``get(i)`` is image ``i`` as an
    ``H x W x C`` array with the name its errors give (the file, or the array file and the index)."""

    name: str
    count: int
    get: Callable[[int], tuple[np.ndarray, str]]
    labels: np.ndarray | None = None
    class_names: list[str] | None = None
    split: str | None = None
    no_labels_fix: str = "give a labelled source"


# --- checks of arrays and labels ---------------------------------------------------------------------------------

def _check_image_array(a: np.ndarray, where: str) -> None:
    """An images array is ``[N, H, W]`` or ``[N, H, W, C]`` (C 1 or 3) of numbers; a labels array, one image or a
    channels-first array passed by mistake is named with the reshape that fixes it."""
    if a.ndim == 1:
        raise SecateurError(f"{where} holds a 1-D array of {a.shape[0]} values (labels?), not images; pass the "
                            "images array [N, H, W] or [N, H, W, C]")
    if a.ndim == 2:
        raise SecateurError(f"{where} holds one 2-D array {a.shape[0]}x{a.shape[1]}; images are [N, H, W] or "
                            "[N, H, W, C]: add the leading image axis (x[None])")
    if a.ndim == 4 and a.shape[3] not in (1, 3):
        fix = ("it looks channels-first: transpose it to [N, H, W, C] (x.transpose(0, 2, 3, 1))" if a.shape[1] in (1, 3)
               else "images have 1 (gray) or 3 (RGB) channels")
        raise SecateurError(f"{where} holds an array of shape {list(a.shape)} with {a.shape[3]} channels last; {fix}")
    if a.ndim > 4:
        raise SecateurError(f"{where} holds a {a.ndim}-D array {list(a.shape)}; images are [N, H, W] or [N, H, W, C]")
    if a.dtype.kind not in "uifb":
        raise SecateurError(f"{where} holds {a.dtype} values, not numbers; save uint8 (0..255) or float (0..1) images")
    if a.shape[0] == 0:
        raise SecateurError(f"{where} holds no images (an array of shape {list(a.shape)}); pass a non-empty array")


def _check_labels(labels: np.ndarray, count: int, where: str) -> np.ndarray:
    """Labels as int64 ``[N]``: integers, one per image, not negative."""
    labels = np.asarray(labels)
    if labels.ndim != 1 or labels.dtype.kind not in "iu":
        raise SecateurError(f"labels of {where} are {labels.dtype} of shape {list(labels.shape)}; give one integer "
                            "class id per image (a 1-D integer array)")
    if len(labels) != count:
        raise SecateurError(f"{where} holds {count} images but {len(labels)} labels; give one label per image")
    if len(labels) and labels.min() < 0:
        raise SecateurError(f"labels of {where} include {int(labels.min())}; class ids are 0, 1, 2, ...")
    return labels.astype(np.int64)


def _as_hwc(a: np.ndarray, where: str) -> np.ndarray:
    """One image as ``H x W x C``: uint8 (integers in 0..255) or float32 (floats in [0, 1], the usual float image
    range); other values are refused, not clipped or rescaled by a guess."""
    a = np.asarray(a)
    if a.ndim == 2:
        a = a[..., None]
    if a.dtype == np.uint8:
        return a
    if a.dtype.kind in "iub":
        if a.size and (a.min() < 0 or a.max() > 255):
            raise SecateurError(f"{where}: integer pixels outside 0..255 ({a.min()}..{a.max()}); save 8-bit images "
                                "(uint8 0..255)")
        return a.astype(np.uint8)
    a = a.astype(np.float32)
    if not np.isfinite(a).all() or (a.size and (a.min() < 0 or a.max() > 1)):
        raise SecateurError(f"{where}: float pixels outside [0, 1] (or not finite); save floats in [0, 1] or uint8 "
                            "images in 0..255")
    return a


# --- sources --------------------------------------------------------------------------------------------------------

def _array_source(images: np.ndarray, where: str, labels: np.ndarray | None, no_labels_fix: str,
                  class_names: list[str] | None = None, split: str | None = None, name: str | None = None) -> _Source:
    _check_image_array(images, where)
    if labels is not None:
        labels = _check_labels(labels, images.shape[0], where)
    return _Source(name or where, images.shape[0], lambda i: (_as_hwc(images[i], f"{where} image {i}"),
                                                               f"{where} image {i}"),
                   labels, class_names, split, no_labels_fix)


def _idx_file(path: Path, what: str, fix: str) -> np.ndarray:
    return read_idx(regular_file(path, what, fix))  # the FIFO check first: read_idx would wait on one forever


def _fashion_mnist(split: str, data_dir: str | Path | None) -> _Source:
    """Fashion-MNIST from the shared data folder (``--data-dir``, ``SECATEUR_DATA``, ``../shared/data``)."""
    if split not in ("train", "test"):
        raise SecateurError(f"fashion-mnist has the splits train and test, not {split!r}; pass --split train or test")
    root = resolve_data_dir(data_dir)
    if root is None:
        raise SecateurError("no data directory for fashion-mnist; pass --data-dir or set SECATEUR_DATA to a folder "
                            "holding fashion-mnist/ (laid out like ../shared/data)")
    prefix = "train" if split == "train" else "t10k"
    folder = root / "fashion-mnist"
    fix = f"check --data-dir / SECATEUR_DATA: {folder} must hold the Fashion-MNIST idx.gz files"
    images = _idx_file(folder / f"{prefix}-images-idx3-ubyte.gz", "fashion-mnist file", fix)
    labels = _idx_file(folder / f"{prefix}-labels-idx1-ubyte.gz", "fashion-mnist file", fix)
    return _array_source(images, str(folder / f"{prefix}-images-idx3-ubyte.gz"), labels, "",
                         list(FASHION_MNIST_CLASSES), split, FASHION_MNIST)


def _idx_source(path: Path) -> _Source:
    fix = "give an idx images file (as Fashion-MNIST's *-images-idx3-ubyte.gz)"
    images = _idx_file(path, "idx file", fix)
    labels, sibling = None, None
    if "images-idx3" in path.name:
        sibling = path.with_name(path.name.replace("images-idx3", "labels-idx1"))
        if os.path.lexists(sibling):
            labels = _idx_file(sibling, "idx labels file", "replace it with the labels of the images file")
    return _array_source(images, f"idx file {path}", labels,
                         f"put its labels next to it as {sibling.name if sibling else '<name>-labels-idx1-ubyte.gz'}")


def _magic(path: Path, magic: bytes, what: str, fix: str) -> None:
    """The file starts as ``what`` does: numpy would otherwise try a foreign file as a pickle and say so."""
    try:
        with open(path, "rb") as f:
            head = f.read(len(magic))
    except OSError as e:
        raise SecateurError(f"{what} {path} cannot be read ({e.strerror or type(e).__name__}); {fix}") from None
    if head != magic:
        raise SecateurError(f"{what} {path} is not in the {what.split()[0]} format (it does not start with "
                            f"{magic!r}); {fix}")


def _npy_source(path: Path) -> _Source:
    _magic(path, b"\x93NUMPY", "npy file", "save the images with numpy.save")
    try:  # memory-mapped: a selection reads only the images it keeps
        a = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        raise SecateurError(f"npy file {path} cannot be read ({one_line(str(e)) or type(e).__name__}); save the "
                            "images with numpy.save") from None
    if not isinstance(a, np.ndarray):
        raise SecateurError(f"npy file {path} is an npz archive; name it .npz")
    return _array_source(a, f"npy file {path}", None, "save images and labels in an .npz (keys images, labels)")


def _npz_source(path: Path) -> _Source:
    where = f"npz file {path}"
    fix = "save it with numpy.savez(f, images=x, labels=y)"
    _magic(path, b"PK", "npz file", fix)
    try:
        z = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise SecateurError(f"{where} cannot be read ({one_line(str(e)) or type(e).__name__}); {fix}") from None
    if not isinstance(z, np.lib.npyio.NpzFile):
        raise SecateurError(f"{where} is a plain .npy array, not an npz archive; name it .npy")
    with z:
        key = next((k for k in ("images", "x") if k in z.files), None)
        if key is None:
            raise SecateurError(f"{where} has no images array (it holds: {', '.join(z.files) or 'nothing'}); "
                                "save the images under the key images (numpy.savez(f, images=x, labels=y))")
        lkey = next((k for k in ("labels", "y") if k in z.files), None)
        try:
            images, labels = z[key], (z[lkey] if lkey else None)
        except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile, zlib.error) as e:
            raise SecateurError(f"{where} cannot be read ({one_line(str(e)) or type(e).__name__}); {fix}") from None
    return _array_source(images, where, labels, "save its labels under the key labels")


def _pil_array(im, where: str) -> np.ndarray:
    """A Pillow image as ``H x W x 1`` (gray) or ``H x W x 3`` uint8: 16-bit and float images are refused, not
    clipped to 8 bits by Pillow's conversion."""
    if im.mode not in _EIGHT_BIT:
        raise SecateurError(f"{where} is a {im.mode} image (16-bit or float); save it as an 8-bit image")
    gray = im.mode in ("1", "L", "LA")
    return _as_hwc(np.asarray(im.convert("L" if gray else "RGB")), where)


def _read_image(path: Path) -> np.ndarray:
    from PIL import Image, UnidentifiedImageError

    raw = read_regular_bytes(path, "image file", _IMAGE_FIX)
    try:
        with Image.open(io.BytesIO(raw)) as im:
            im.load()
            return _pil_array(im, f"image file {path}")
    except UnidentifiedImageError:
        raise SecateurError(f"image file {path} is not in an image format Pillow reads; {_IMAGE_FIX}") from None
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise SecateurError(f"image file {path} cannot be decoded ({one_line(str(e)) or type(e).__name__}); "
                            f"{_IMAGE_FIX}") from None


def _entries(folder: Path) -> list[Path]:
    try:
        return sorted(p for p in folder.iterdir() if not p.name.startswith("."))
    except OSError as e:
        raise SecateurError(f"image folder {folder} cannot be listed ({e.strerror or type(e).__name__}); pass a "
                            "folder you can read") from None


def _images_under(folder: Path) -> list[Path]:
    """The image files under a class folder, at any depth (hidden files and folders skipped), in name order."""
    found = []
    for dirpath, dirnames, filenames in os.walk(folder, onerror=_walk_error):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        found += [Path(dirpath) / f for f in filenames
                  if not f.startswith(".") and Path(f).suffix.lower() in IMAGE_SUFFIXES]
    return sorted(found)


def _walk_error(e: OSError) -> None:
    raise SecateurError(f"image folder {e.filename} cannot be listed ({e.strerror or type(e).__name__}); pass a "
                        "folder you can read")


def _folder_source(root: Path, split: str) -> _Source:
    """An ImageFolder tree (one sub-folder per class) or a flat folder of images; a folder of split sub-folders
    (``train/``, ``test/``, ...) stands for ``split``'s sub-folder."""
    entries, used_split = _entries(root), None
    dirs = [p for p in entries if p.is_dir()]
    if dirs and {d.name for d in dirs} <= SPLIT_DIRS:
        if not (root / split).is_dir():
            raise SecateurError(f"image folder {root} has the split folders {', '.join(d.name for d in dirs)} but no "
                                f"{split}/; pass --split one of them")
        root, used_split = root / split, split
        entries = _entries(root)
        dirs = [p for p in entries if p.is_dir()]
    files = [p for p in entries if not p.is_dir() and p.suffix.lower() in IMAGE_SUFFIXES]
    if not dirs:
        if not files:
            raise SecateurError(f"image folder {root} holds no images ({', '.join(sorted(IMAGE_SUFFIXES))}); put "
                                "images in it, or one sub-folder of images per class")
        return _Source(str(root), len(files), lambda i: (_read_image(files[i]), f"image file {files[i]}"),
                       split=used_split, no_labels_fix="put the images in one sub-folder per class")
    if files:
        raise SecateurError(f"image folder {root} mixes image files ({files[0].name}) and class folders; move the "
                            "files into their class folders")
    paths, labels = [], []
    for k, d in enumerate(dirs):
        found = _images_under(d)
        if not found:
            raise SecateurError(f"class folder {d} holds no images; put its images in it or remove it")
        paths += found
        labels += [k] * len(found)
    return _Source(str(root), len(paths), lambda i: (_read_image(paths[i]), f"image file {paths[i]}"),
                   np.asarray(labels, dtype=np.int64), [d.name for d in dirs], used_split)


def _hub_source(name: str, split: str) -> _Source:
    """A ``datasets`` hub set (online users): an ``image``/``img`` column and a ``label`` column."""
    try:
        import datasets
    except ImportError:
        raise SecateurError(f"{name} is not a file or folder and `datasets` is not installed to fetch it from the "
                            f"hub; {_SOURCES}") from None
    try:
        ds = datasets.load_dataset(name, split=split)
    except Exception as e:  # offline, unknown name, unknown split: network and hub errors come in many types
        raise SecateurError(f"{name} is not a file or folder and could not be fetched from the hub "
                            f"({type(e).__name__}: {one_line(str(e).splitlines()[0] if str(e) else '')}); "
                            f"{_SOURCES}") from None
    cols = list(ds.column_names)
    icol = next((c for c in ("image", "img") if c in cols), None)
    if icol is None:
        raise SecateurError(f"hub dataset {name} has no image or img column (columns: {', '.join(cols)}); pass a set "
                            "with an image column, or save the images to a folder")
    lcol = next((c for c in ("label", "labels") if c in cols), None)
    labels = _check_labels(np.asarray(ds[lcol]), len(ds), f"hub dataset {name}") if lcol else None
    names = getattr(ds.features[lcol], "names", None) if lcol else None
    return _Source(name, len(ds), lambda i: (_pil_array(ds[i][icol], f"hub image {name}[{i}]"),
                                               f"hub image {name}[{i}]"), labels,
                   list(names) if names else None, split, "pass a set with a label column")


def _file_source(path: Path) -> _Source:
    regular_file(path, "image data file", _SOURCES)
    suffix, name = path.suffix.lower(), path.name.lower()
    if suffix == ".npy":
        return _npy_source(path)
    if suffix == ".npz":
        return _npz_source(path)
    if suffix in (".idx", ".gz") or "idx3-ubyte" in name:
        return _idx_source(path)
    raise SecateurError(f"image data file {path}: unknown kind ({suffix or 'no suffix'}); {_SOURCES}")


def _open_source(source: str, split: str, data_dir: str | Path | None) -> _Source:
    if source == FASHION_MNIST:
        return _fashion_mnist(split, data_dir)
    path = Path(source).expanduser()
    if os.path.lexists(path):
        return _folder_source(path, split) if path.is_dir() else _file_source(path)
    if source.startswith((".", "/", "~")) or path.suffix.lower() in IMAGE_SUFFIXES | {".npy", ".npz", ".gz", ".idx"}:
        raise SecateurError(f"image source {source} does not exist; {_SOURCES}")
    return _hub_source(source, split)


# --- the model's side: processor, channels, patch ------------------------------------------------------------------

def _processor(model_dir: Path):
    """The model's own image processor: the pixels are the ones it was trained on, not a guess of ours."""
    if not model_dir.is_dir():
        raise SecateurError(f"model folder {model_dir} does not exist; pass the model's folder (with its "
                            "preprocessor_config.json)")
    cfg = model_dir / "preprocessor_config.json"
    if not os.path.lexists(cfg):
        raise SecateurError(f"model folder {model_dir} has no preprocessor_config.json; add one naming the model's "
                            'image processor (e.g. {"image_processor_type": "ViTImageProcessor", "size": ..., '
                            '"image_mean": ..., "image_std": ...}), as in the model\'s hub repository')
    read_json(cfg, "fix the JSON or copy preprocessor_config.json from the model's hub repository",
              "image processor config")  # a FIFO or broken JSON: one line here, not the loader's traceback
    from secateur.extras import require

    require("PIL", "an image model's processor")
    from transformers import AutoImageProcessor

    try:
        return AutoImageProcessor.from_pretrained(str(model_dir), trust_remote_code=False)
    except Exception as e:  # unknown processor type, bad values: transformers raises many kinds
        raise SecateurError(f"image processor config {cfg} cannot be loaded ({type(e).__name__}: "
                            f"{one_line(str(e).splitlines()[0] if str(e) else '')}); name a transformers image "
                            "processor in image_processor_type") from None


def _positive_int(value, what: str, where: Path) -> int:
    v = min(value) if isinstance(value, list | tuple) and value else value
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise SecateurError(f"model config {where}: {what} is {value!r}; it must be a positive integer")
    return v


def model_geometry(model_dir: str | Path, processor=None) -> tuple[int, int]:
    """``(num_channels, patch_size)`` of the model in ``model_dir`` (``config.json``, or its ``vision_config`` for
    SigLIP/CLIP-style configs). Without a config.json: the processor's channel count (its ``image_mean``), 3 if
    it has none, and no patch size (1)."""
    path = Path(model_dir) / "config.json"
    if not os.path.lexists(path):
        mean = getattr(processor, "image_mean", None)
        return (len(mean) if isinstance(mean, list | tuple) and mean else 3), 1
    cfg = read_json(path, "fix the JSON or re-download the model's config.json", "model config")
    if not isinstance(cfg, dict):
        raise SecateurError(f"model config {path} is not a JSON object; re-download the model's config.json")
    vision = cfg.get("vision_config") if isinstance(cfg.get("vision_config"), dict) else {}
    channels = cfg.get("num_channels", vision.get("num_channels", 3))
    patch = cfg.get("patch_size", vision.get("patch_size", 1))
    return _positive_int(channels, "num_channels", path), _positive_int(patch, "patch_size", path)


def _to_channels(a: np.ndarray, channels: int, where: str) -> tuple[np.ndarray, bool]:
    """``a`` with the model's channel count, only when no information is lost: gray into a 3-channel model is
    replicated (True: the caller prints one notice); RGB into a 1-channel model only when its channels are equal."""
    c = a.shape[2]
    if c == channels:
        return a, False
    if c == 1 and channels == 3:
        return np.repeat(a, 3, axis=2), True
    if c == 3 and channels == 1 and (a[..., 0] == a[..., 1]).all() and (a[..., 0] == a[..., 2]).all():
        return a[..., :1], False
    if c == 3 and channels == 1:
        raise SecateurError(f"{where} is a colour image and the model takes 1 channel (gray); convert the images to "
                            "grayscale with the conversion the model was trained with")
    raise SecateurError(f"{where} has {c} channels and the model takes {channels}; give {channels}-channel images")


def _run_processor(processor, imgs: list[np.ndarray], source: str, channels: int) -> torch.Tensor:
    """One processor call on ``H x W x C`` arrays (the channel axis named: a 1-channel image is ambiguous to it).
    Float images (in [0, 1]) are scaled to what the processor's own rescaling makes of 0..255 pixels, and not
    rescaled again."""
    kw = {}
    if imgs[0].dtype != np.uint8:
        scale = 255.0 * (float(processor.rescale_factor) if getattr(processor, "do_rescale", False) else 1.0)
        imgs = imgs if abs(scale - 1.0) < 1e-9 else [a * np.float32(scale) for a in imgs]
        kw["do_rescale"] = False
    try:
        out = processor(images=imgs, return_tensors="pt", input_data_format="channels_last", **kw)
        px, grid = out["pixel_values"], out.get("image_grid_thw")
    except Exception as e:  # the processor's own refusals (mean of another channel count, uneven sizes, ...)
        sizes = sorted({a.shape[:2] for a in imgs})
        if len(sizes) > 1:
            raise _uneven(source, sizes[0], sizes[1]) from None
        raise SecateurError(f"the image processor ({type(processor).__name__}) refused the images of {source} "
                            f"({type(e).__name__}: {one_line(str(e).splitlines()[0] if str(e) else '')}); check "
                            "preprocessor_config.json (image_mean/image_std: one value per channel)") from None
    if grid is not None:  # Qwen2-VL: patch rows of every image, its (t, h, w) grid: kept [N, h, w, D]
        return _patch_grid(px, grid, source)
    if isinstance(px, torch.Tensor) and px.ndim == 5:  # Idefics3 / SmolVLM: [samples, images, C, H, W]
        if px.shape[1] == 1:
            px = px[:, 0]
        elif px.shape[0] == 1 and px.shape[1] == len(imgs):  # a flat list is one sample of len(imgs) images
            px = px[0]
    if not isinstance(px, torch.Tensor) or px.ndim != 4 or px.shape[1] != channels:
        raise SecateurError(f"the image processor ({type(processor).__name__}) made pixels of shape "
                            f"{list(getattr(px, 'shape', []))} from {source}; the model takes [N, {channels}, H, W]: "
                            "check preprocessor_config.json against config.json")
    return px.float()


def _patch_grid(px: torch.Tensor, grid: torch.Tensor, source: str) -> torch.Tensor:
    """Qwen2-VL's ``pixel_values [sum t h w, D]`` with ``image_grid_thw [N, 3]`` as ``[N, h, w, D]`` (the rows in the
    processor's order, regrouped per image; one frame, t = 1, and one grid for every image)."""
    g = grid.tolist()
    if any(t != 1 for t, _, _ in g) or len({tuple(x) for x in g}) > 1:
        raise SecateurError(f"the images of {source} give the processor patch grids {sorted({tuple(x) for x in g})}; "
                            "secateur needs one single-frame grid: resize the images to one size")
    _, h, w = g[0]
    return px.reshape(len(g), h, w, px.shape[-1]).float()


def _uneven(source: str, a: tuple, b: tuple) -> SecateurError:
    return SecateurError(f"images of {source} have different sizes ({a[0]}x{a[1]}, {b[0]}x{b[1]}) and the model's "
                         "image processor does not resize them; resize the images to one size or set do_resize and "
                         "size in preprocessor_config.json")


def _pixels(src: _Source, idx: np.ndarray, processor, channels: int, patch: int) -> torch.Tensor:
    """Pixels of the selected images, ``BATCH`` images decoded at a time."""
    out, replicated = None, False
    for start in range(0, len(idx), BATCH):
        imgs = []
        for i in idx[start:start + BATCH]:
            a, where = src.get(int(i))
            if min(a.shape[:2]) < patch:
                raise SecateurError(f"{where} is {a.shape[0]}x{a.shape[1]}, smaller than the model's "
                                    f"{patch}x{patch} patches; use images of at least {patch}x{patch} pixels")
            a, rep = _to_channels(a, channels, where)
            replicated |= rep
            imgs.append(a)
        px = _run_processor(processor, imgs, src.name, channels)
        if out is None:
            out = torch.empty((len(idx), *px.shape[1:]), dtype=torch.float32)
        elif px.shape[1:] != out.shape[1:]:
            raise _uneven(src.name, tuple(out.shape[2:]), tuple(px.shape[2:]))
        out[start:start + len(imgs)] = px
    if replicated:
        print(f"secateur: note: gray images of {src.name} replicated to the model's 3 channels (lossless)",
              file=sys.stderr)
    return out


def _select(count: int, n: int | None, seed: int, source: str) -> tuple[np.ndarray, str]:
    if n is None:
        return np.arange(count), f"all {count} images in order"
    if n > count:
        raise SecateurError(f"{source} holds {count} images, fewer than the {n} asked for; ask for at most {count} "
                            "(--max-images) or leave it out")
    idx = np.sort(np.random.default_rng(seed).choice(count, size=n, replace=False))
    return idx, f"{n} of {count} drawn without replacement by numpy.random.default_rng(seed).choice, sorted"


def _check_count(value, what: str, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low:
        raise SecateurError(f"{what} must be an integer >= {low}, got {value!r}")


def _sha256(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def load_images(source: str, model_dir: str | Path, *, n: int | None, seed: int = 0, split: str = "train",
                data_dir: str | Path | None = None, need_labels: bool = False) -> ImageSet:
    """The images of ``source`` as the model in ``model_dir`` sees them (its processor, its channel count): all of
    them, or ``n`` drawn without replacement with ``seed`` (sorted: a stable order). ``need_labels``: refuse an
    unlabelled source now, before any image is decoded. ``split`` applies to sources that have splits."""
    model_dir = Path(model_dir)
    processor = _processor(model_dir)
    channels, patch = model_geometry(model_dir, processor)
    return processed_images(source, processor, channels, patch, n=n, seed=seed, split=split, data_dir=data_dir,
                            need_labels=need_labels)


def processed_images(source: str, processor, channels: int, patch: int, *, n: int | None, seed: int = 0,
                     split: str = "train", data_dir: str | Path | None = None, need_labels: bool = False) -> ImageSet:
    """:func:`load_images` with the processor and the model's channel count and patch size given (a loaded model)."""
    if n is not None:
        _check_count(n, "the number of images (n, --max-images)", 1)
    _check_count(seed, "the seed", 0)
    src = _open_source(str(source), split, data_dir)
    if need_labels and src.labels is None:
        raise SecateurError(f"image source {src.name} has no labels and accuracy needs them; {src.no_labels_fix}")
    idx, rule = _select(src.count, n, seed, src.name)
    pixels = _pixels(src, idx, processor, channels, patch)
    labels = src.labels[idx] if src.labels is not None else None
    manifest = {"source": src.name, "split": src.split, "rule": rule, "seed": seed, "n": len(idx),
                "n_total": src.count, "processor": type(processor).__name__, "pixels_shape": list(pixels.shape),
                "pixels_sha256": _sha256(pixels.numpy()),
                "labels_sha256": _sha256(labels) if labels is not None else None}
    return ImageSet(pixels, labels, src.class_names, manifest)


# --- calibration images for a prune ------------------------------------------------------------------------------

TEXT_SOURCES = frozenset({"self", "c4", "wikitext2", "ptb"})


def check_image_source(source: str, data_dir: str | Path | None) -> None:
    """``--calib`` of a vision model, before the model is loaded: images, not text (one line naming the kinds)."""
    if source in TEXT_SOURCES or str(source).endswith(".txt"):
        raise SecateurError(f"--calib {source} is text and a vision model calibrates on images; {_SOURCES} "
                            f"(--calib {FASHION_MNIST} reads the shared copy)")
    _open_source(str(source), "train", data_dir)


def calibration_images(source: str, processor, config, n: int, seed: int, data_dir: str | Path | None):
    """``(pixel_values [n, C, H, W], manifest)``: the seeded calibration images of a prune (the train split where
    the source has splits; labels are not read), through the model's own image processor. The manifest is the
    text calibration's (:class:`secateur.data.windows.Manifest`) with ``seqlen`` the tokens an image gives the
    blocks' patch grid (``(H / patch) * (W / patch)``) and ``tokenizer`` the processor's class."""
    from secateur.data.windows import Manifest

    if processor is None:
        raise SecateurError("the model has no image processor (preprocessor_config.json in its folder; for a model "
                            "in memory: tokenizer=its image processor); add one naming the model's image processor")
    vc = getattr(config, "vision_config", None) or config
    channels, patch = int(getattr(vc, "num_channels", 3)), int(getattr(vc, "patch_size", 1))
    images = processed_images(source, processor, channels, patch, n=n, seed=seed, split="train", data_dir=data_dir)
    px = images.pixel_values
    tokens = (px.shape[2] // patch) * (px.shape[3] // patch)
    m = images.manifest
    man = Manifest(source=m["source"], n=m["n"], seqlen=tokens, seed=seed, sha256=m["pixels_sha256"],
                   tokenizer=m["processor"], rule=f"images: {m['rule']} ({m['split'] or 'no split'})")
    return px, man
