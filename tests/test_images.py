"""Images in, accuracy out: ``secateur.data.images.load_images`` (every source kind, seeded selection, channels,
every refused input) and ``secateur.eval.accuracy`` (exact top-1/top-5, label mapping, the CLI)."""

from __future__ import annotations

import gzip
import json
import os
import struct
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from secateur.data.idx import read_idx
from secateur.data.images import FASHION_MNIST_CLASSES, ImageSet, load_images, model_geometry
from secateur.errors import SecateurError
from secateur.eval.accuracy import accuracy, eval_accuracy

DATA_DIR = Path(os.environ.get("SECATEUR_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
FMNIST = DATA_DIR / "fashion-mnist"
MEAN, STD = 0.286, 0.353


def _processor_config(channels: int, **over) -> dict:
    cfg = {"image_processor_type": "ViTImageProcessor", "do_resize": False, "size": {"height": 28, "width": 28},
           "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [MEAN] * channels,
           "image_std": [STD] * channels}
    return {**cfg, **over}


def _tiny_vit(folder: Path, channels: int = 1, head: bool = True) -> Path:
    from transformers import ViTConfig, ViTForImageClassification, ViTModel

    torch.manual_seed(0)
    cfg = ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=28,
                    patch_size=4, num_channels=channels, num_labels=10, id2label=dict(enumerate(FASHION_MNIST_CLASSES)),
                    label2id={c: i for i, c in enumerate(FASHION_MNIST_CLASSES)})
    (ViTForImageClassification if head else ViTModel)(cfg).save_pretrained(folder)
    (folder / "preprocessor_config.json").write_text(json.dumps(_processor_config(channels)))
    return folder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return _tiny_vit(tmp_path_factory.mktemp("vit1"))


@pytest.fixture(scope="module")
def tiny_rgb(tmp_path_factory) -> Path:
    return _tiny_vit(tmp_path_factory.mktemp("vit3"), channels=3)


def _ref(x: np.ndarray) -> np.ndarray:
    """What the tiny model's processor makes of uint8 pixels [N, H, W]: [N, 1, H, W]."""
    return ((x.astype(np.float64) / 255 - MEAN) / STD)[:, None]


def _gray(n: int = 12, h: int = 28, w: int = 28, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, h, w), dtype=np.uint8)


def _close(px: torch.Tensor, x: np.ndarray) -> None:
    assert px.dtype == torch.float32 and list(px.shape) == [x.shape[0], 1, *x.shape[1:3]]
    np.testing.assert_allclose(px.numpy(), _ref(x), atol=1e-5, rtol=0)


def _write_idx(path: Path, a: np.ndarray, dims: tuple | None = None) -> Path:
    dims = a.shape if dims is None else dims
    raw = bytes([0, 0, 8, len(dims)]) + struct.pack(f">{len(dims)}I", *dims) + a.astype(np.uint8).tobytes()
    path.write_bytes(gzip.compress(raw) if path.suffix == ".gz" else raw)
    return path


def _png(path: Path, a: np.ndarray) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(a).save(path)
    return path


# --- Fashion-MNIST ------------------------------------------------------------------------------------------------

def test_fashion_mnist_splits(tiny):
    if not FMNIST.is_dir():
        pytest.skip(f"no Fashion-MNIST at {FMNIST}")
    test = load_images("fashion-mnist", tiny, n=None, split="test", data_dir=str(DATA_DIR), need_labels=True)
    raw = read_idx(FMNIST / "t10k-images-idx3-ubyte.gz")
    _close(test.pixel_values, raw)
    assert test.labels.dtype == np.int64 and np.array_equal(test.labels, read_idx(FMNIST / "t10k-labels-idx1-ubyte.gz"))
    assert test.class_names == list(FASHION_MNIST_CLASSES)
    assert test.manifest["split"] == "test" and test.manifest["n"] == 10000
    assert test.manifest["processor"].startswith("ViTImageProcessor")
    train = load_images("fashion-mnist", tiny, n=300, seed=5, split="train", data_dir=str(DATA_DIR))
    idx = np.sort(np.random.default_rng(5).choice(60000, 300, replace=False))
    _close(train.pixel_values, read_idx(FMNIST / "train-images-idx3-ubyte.gz")[idx])
    assert np.array_equal(train.labels, read_idx(FMNIST / "train-labels-idx1-ubyte.gz")[idx])
    with pytest.raises(SecateurError, match="splits train and test"):
        load_images("fashion-mnist", tiny, n=1, split="val", data_dir=str(DATA_DIR))


def test_fashion_mnist_missing_data_dir(tiny, tmp_path):
    with pytest.raises(SecateurError) as e:
        load_images("fashion-mnist", tiny, n=1, data_dir=str(tmp_path))
    assert "\n" not in str(e.value) and "fashion-mnist" in str(e.value) and "--data-dir" in str(e.value)


# --- selection ----------------------------------------------------------------------------------------------------

def test_seeded_selection(tiny, tmp_path):
    x = _gray(50)
    np.save(tmp_path / "x.npy", x)
    a = load_images(str(tmp_path / "x.npy"), tiny, n=10, seed=3)
    b = load_images(str(tmp_path / "x.npy"), tiny, n=10, seed=3)
    assert torch.equal(a.pixel_values, b.pixel_values) and a.manifest == b.manifest
    _close(a.pixel_values, x[np.sort(np.random.default_rng(3).choice(50, 10, replace=False))])
    assert load_images(str(tmp_path / "x.npy"), tiny, n=10, seed=4).manifest["pixels_sha256"] != \
        a.manifest["pixels_sha256"]
    with pytest.raises(SecateurError, match="holds 50 images, fewer than the 51"):
        load_images(str(tmp_path / "x.npy"), tiny, n=51)


# --- every input kind ---------------------------------------------------------------------------------------------

CLASSES = ["Bag", "Coat", "Dress"]  # sorted: labels 0, 1, 2 of the folder; model ids 8, 4, 3


def _source(kind: str, root: Path, x: np.ndarray, y: np.ndarray) -> tuple[Path, bool]:
    """``x`` (sorted by label, as an ImageFolder lists it) written as ``kind``; whether it carries labels."""
    if kind in ("imagefolder", "splits"):
        base = root / "test" if kind == "splits" else root
        for i, (img, lab) in enumerate(zip(x, y)):
            _png(base / CLASSES[lab] / f"{i:03d}.png", img)
        if kind == "splits":
            _png(root / "train" / "Bag" / "0.png", x[0])
        return root, True
    if kind == "flat":
        for i, img in enumerate(x):
            _png(root / f"{i:03d}.png", img)
        return root, False
    if kind == "npy":
        np.save(root / "x.npy", x[..., None])
        return root / "x.npy", False
    if kind == "npz":
        np.savez(root / "d.npz", x=x, y=y)
        return root / "d.npz", True
    name = "set-images-idx3-ubyte" + (".gz" if kind == "idx.gz" else "")
    _write_idx(root / name.replace("images-idx3", "labels-idx1"), y)
    return _write_idx(root / name, x), True


@pytest.mark.parametrize("kind", ["imagefolder", "splits", "flat", "npy", "npz", "idx", "idx.gz"])
def test_input_kinds(tiny, tmp_path, kind):
    y = np.repeat(np.arange(3), 4)
    x = _gray(12)
    src, labelled = _source(kind, tmp_path, x, y)
    s = load_images(str(src), tiny, n=None, split="test", need_labels=labelled)
    _close(s.pixel_values, x)
    assert (s.labels is not None) == labelled
    if labelled:
        assert np.array_equal(s.labels, y)
    assert s.class_names == (CLASSES if kind in ("imagefolder", "splits") else None)
    assert s.manifest["split"] == ("test" if kind == "splits" else None)


def test_float_images_equal_uint8(tiny, tmp_path):
    x = _gray(6)
    np.save(tmp_path / "f.npy", x.astype(np.float32) / 255)
    _close(load_images(str(tmp_path / "f.npy"), tiny, n=None).pixel_values, x)


def test_gray_into_rgb_model(tiny_rgb, tmp_path, capsys):
    x = _gray(5)
    np.save(tmp_path / "g.npy", x)
    px = load_images(str(tmp_path / "g.npy"), tiny_rgb, n=None).pixel_values
    assert list(px.shape) == [5, 3, 28, 28]
    for c in range(3):
        np.testing.assert_allclose(px[:, c:c + 1].numpy(), _ref(x), atol=1e-5, rtol=0)
    assert "replicated" in capsys.readouterr().err


def test_rgb_into_gray_model(tiny, tmp_path):
    x = _gray(4)
    np.save(tmp_path / "eq.npy", np.repeat(x[..., None], 3, axis=3))
    _close(load_images(str(tmp_path / "eq.npy"), tiny, n=None).pixel_values, x)
    _png(tmp_path / "rgb" / "a.png", np.stack([x[0], x[1], x[2]], axis=2))
    with pytest.raises(SecateurError, match="colour image"):
        load_images(str(tmp_path / "rgb"), tiny, n=None)


@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 5), h=st.integers(4, 12), w=st.integers(4, 12), last=st.booleans(),
       seed=st.integers(0, 2**16))
def test_npy_shapes_property(tiny, tmp_path_factory, n, h, w, last, seed):
    x = _gray(n, h, w, seed)
    path = tmp_path_factory.mktemp("prop") / "x.npy"
    np.save(path, x[..., None] if last else x)
    s = load_images(str(path), tiny, n=None)
    _close(s.pixel_values, x)
    assert s.manifest["n"] == n and s.labels is None


# --- refused inputs: one line naming the file ---------------------------------------------------------------------

def _bad(kind: str, root: Path) -> tuple[Path, str]:
    """A bad source of ``kind`` under ``root`` and the part of the path its error must name."""
    x = _gray(3)
    if kind == "empty folder":
        (root / "empty").mkdir()
        return root / "empty", "empty"
    if kind == "corrupt image":
        (root / "c" / "Bag").mkdir(parents=True)
        (root / "c" / "Bag" / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\n" + os.urandom(64))
        return root / "c", "bad.png"
    if kind == "truncated image":
        good = _png(root / "t" / "full.png", x[0])
        good.write_bytes(good.read_bytes()[:60])
        return root / "t", "full.png"
    if kind == "image below patch":
        _png(root / "small" / "tiny.png", x[0, :3, :3])
        return root / "small", "tiny.png"
    if kind == "array below patch":
        np.save(root / "small.npy", x[:, :3, :5])
        return root / "small.npy", "small.npy"
    if kind == "idx header":
        return _write_idx(root / "h-images-idx3-ubyte", x, dims=(4, 28, 28)), "h-images-idx3-ubyte"
    if kind == "labels as images":
        np.save(root / "labels.npy", np.arange(10))
        return root / "labels.npy", "labels.npy"
    if kind == "npz without images":
        np.savez(root / "noimg.npz", pictures=x)
        return root / "noimg.npz", "noimg.npz"
    if kind == "label count":
        np.savez(root / "count.npz", images=x, labels=np.arange(5))
        return root / "count.npz", "count.npz"
    if kind == "idx label count":
        _write_idx(root / "k-labels-idx1-ubyte", np.arange(2))
        return _write_idx(root / "k-images-idx3-ubyte", x), "k-images-idx3-ubyte"
    if kind == "missing path":
        return root / "nowhere.npy", "nowhere.npy"
    if kind == "fifo":
        os.mkfifo(root / "pipe.npy")
        return root / "pipe.npy", "pipe.npy"
    if kind == "fifo image":
        (root / "fi").mkdir()
        os.mkfifo(root / "fi" / "pipe.png")
        return root / "fi", "pipe.png"
    if kind == "channels first":
        np.save(root / "cf.npy", np.zeros((2, 3, 28, 28), np.uint8))
        return root / "cf.npy", "cf.npy"
    if kind == "float range":
        np.save(root / "fr.npy", x.astype(np.float32))
        return root / "fr.npy", "fr.npy"
    if kind == "uneven sizes":
        _png(root / "u" / "a.png", x[0])
        _png(root / "u" / "b.png", x[1, :20])
        return root / "u", "u"
    if kind == "npz not a zip":
        (root / "junk.npz").write_bytes(b"not a zip")
        return root / "junk.npz", "junk.npz"
    if kind == "unknown kind":
        (root / "x.csv").write_text("1,2")
        return root / "x.csv", "x.csv"
    raise AssertionError(kind)


BAD = ["empty folder", "corrupt image", "truncated image", "image below patch", "array below patch", "idx header",
       "labels as images", "npz without images", "label count", "idx label count", "missing path", "fifo",
       "fifo image", "channels first", "float range", "uneven sizes", "npz not a zip", "unknown kind"]


@pytest.mark.parametrize("kind", BAD)
def test_bad_inputs(tiny, tmp_path, kind):
    src, named = _bad(kind, tmp_path)
    with pytest.raises(SecateurError) as e:
        load_images(str(src), tiny, n=None)
    msg = str(e.value)
    assert "\n" not in msg and named in msg and ";" in msg, msg


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_unreadable_file(tiny, tmp_path):
    np.save(tmp_path / "locked.npy", _gray(2))
    (tmp_path / "locked.npy").chmod(0)
    with pytest.raises(SecateurError, match="locked.npy"):
        load_images(str(tmp_path / "locked.npy"), tiny, n=None)


def test_model_and_label_refusals(tiny, tmp_path):
    np.save(tmp_path / "x.npy", _gray(3))
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text((tiny / "config.json").read_text())
    with pytest.raises(SecateurError, match="has no preprocessor_config.json; add one") as e:
        load_images(str(tmp_path / "x.npy"), tmp_path / "m", n=None)
    assert "\n" not in str(e.value) and str(tmp_path / "m") in str(e.value)
    with pytest.raises(SecateurError, match="has no labels"):
        load_images(str(tmp_path / "x.npy"), tiny, n=None, need_labels=True)
    with pytest.raises(SecateurError, match="integer >= 1"):
        load_images(str(tmp_path / "x.npy"), tiny, n=0)


def test_model_geometry_vision_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "siglip", "vision_config": {"num_channels": 3,
                                                                                             "patch_size": 16}}))
    assert model_geometry(tmp_path) == (3, 16)
    (tmp_path / "config.json").write_text(json.dumps({"num_channels": 0}))
    with pytest.raises(SecateurError, match="num_channels is 0"):
        model_geometry(tmp_path)


def test_hub_path_offline(tiny, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(SecateurError, match="`datasets` is not installed") as e:
        load_images("someone/some-images", tiny, n=None)
    assert "\n" not in str(e.value)

    def offline(*a, **k):
        raise ConnectionError("no network\nsecond line")

    monkeypatch.setitem(sys.modules, "datasets", SimpleNamespace(load_dataset=offline))
    with pytest.raises(SecateurError, match="could not be fetched from the hub") as e:
        load_images("someone/some-images", tiny, n=None)
    assert "\n" not in str(e.value) and "someone/some-images" in str(e.value)


# --- accuracy -----------------------------------------------------------------------------------------------------

class TableModel(torch.nn.Module):
    """Logits looked up from a table by the image id held in pixel [0, 0, 0]: accuracy is known exactly."""

    def __init__(self, table: torch.Tensor, names: list[str] | None = None):
        super().__init__()
        self.table = torch.nn.Parameter(table, requires_grad=False)
        k = table.shape[1]
        id2label = dict(enumerate(names)) if names else {i: f"LABEL_{i}" for i in range(k)}
        self.config = SimpleNamespace(num_labels=k, id2label=id2label)

    def forward(self, pixel_values):
        return SimpleNamespace(logits=self.table[pixel_values[:, 0, 0, 0].long()])


def _ids(n: int, labels, names=None) -> ImageSet:
    px = torch.arange(n, dtype=torch.float32)[:, None, None, None].expand(n, 1, 4, 4).contiguous()
    return ImageSet(px, np.asarray(labels, dtype=np.int64), names, {})


def test_accuracy_exact():
    k = 7
    table = torch.arange(k, dtype=torch.float32).repeat(6, 1)  # class 6 first, then 5, 4, ...: rank of c = 6 - c
    table[4] = 0.0  # all tied: rank of c = c (first index wins, as argmax)
    table[5, 3] = float("nan")  # a non-finite row: a miss
    labels = [6, 2, 1, 0, 0, 6]  # ranks 0, 4, 5, 6, 0, miss
    model = TableModel(table).train()
    res = accuracy(model, _ids(6, labels), batch=4)
    assert res["top1"] == 2 / 6 and res["top5"] == 3 / 6 and res["n_images"] == 6
    assert res["nonfinite_rows"] == 1 and res["label_map"] == "by index" and res["protocol"]
    assert model.training  # the caller's mode is given back
    assert accuracy(TableModel(table[:, :5]), _ids(6, [4, 0, 0, 0, 1, 0]))["top5"] is None
    with pytest.raises(SecateurError, match="label 7 .* 7 classes"):
        accuracy(model, _ids(2, [7, 0]))


def test_accuracy_maps_names():
    names = ["cat", "dog", "Bird", "fish", "cow", "ant"]
    model = TableModel(torch.eye(6), names)  # image i predicts model class i
    ds = ["ant", "bird", "Cat", "cow", "dog", "fish"]  # the dataset's classes sorted, in other case
    labels = [next(j for j, d in enumerate(ds) if d.lower() == n.lower()) for n in names]
    assert labels != list(range(6))  # taken by index, most would miss
    res = accuracy(model, _ids(6, labels, ds))
    assert res["top1"] == 1.0 and res["label_map"] == "by name"
    with pytest.raises(SecateurError, match="dataset class 0 is 'Antelope', model label 0 is 'cat'") as e:
        accuracy(model, _ids(2, [0, 1], ["Antelope", "dog"]))
    assert "\n" not in str(e.value)


def test_eval_accuracy_and_refusals(tiny, tmp_path):
    x, y = _gray(20), np.arange(20) % 10
    np.savez(tmp_path / "d.npz", images=x, labels=y)
    res = eval_accuracy(str(tiny), str(tmp_path / "d.npz"), max_images=8, json_path=str(tmp_path / "r.json"))
    assert res["n_images"] == 8 and 0 <= res["top1"] <= res["top5"] <= 1
    assert json.loads((tmp_path / "r.json").read_text())["images_sha256"] == res["images_sha256"]
    from transformers import AutoModelForImageClassification

    net = AutoModelForImageClassification.from_pretrained(str(tiny))
    again = eval_accuracy(net, str(tmp_path / "d.npz"), max_images=8, processor_dir=str(tiny))
    assert again["top1"] == res["top1"] and again["top5"] == res["top5"]
    backbone = _tiny_vit(tmp_path / "backbone", head=False)
    with pytest.raises(SecateurError, match="`secateur eval features` is for backbones"):
        eval_accuracy(str(backbone), str(tmp_path / "d.npz"))
    with pytest.raises(SecateurError, match="processor_dir"):
        eval_accuracy(net, str(tmp_path / "d.npz"))


def test_cli_accuracy(tiny, tmp_path, capsys):
    from secateur.cli import main

    x, y = _gray(100), np.arange(100) % 10
    np.savez(tmp_path / "d.npz", images=x, labels=y)
    out = tmp_path / "acc.json"
    rc = main(["eval", "accuracy", "--model", str(tiny), "--dataset", str(tmp_path / "d.npz"), "--max-images", "64",
               "--json", str(out), "--quiet"])
    assert rc == 0
    res = json.loads(out.read_text())
    assert {"top1", "top5", "n_images"} <= set(res) and res["n_images"] == 64
    assert f"top-1 {res['top1']:.4f}  top-5 {res['top5']:.4f}  (64 images" in capsys.readouterr().out
    bad = tmp_path / "bad.json"
    rc = main(["eval", "accuracy", "--model", str(tiny), "--dataset", str(tmp_path / "d.npz"), "--max-images", "101",
               "--json", str(bad), "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and not bad.exists() and "holds 100 images" in err and "Traceback" not in err
