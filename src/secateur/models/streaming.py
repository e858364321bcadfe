"""Block-streamed models: bigger than memory, one decoder block materialized at a time.

:func:`load_streamed` builds the model from its config with every *parameter* on the meta device (buffers such as
RoPE tables are built for real, as without streaming), then loads the tensors outside the decoder blocks
(embeddings, final norm, LM head; tied weights tied again) from the model's safetensors files. Decoder blocks stay
on the meta device until :class:`BlockStream` loads one: :class:`BlockStream` is the streamed *block source* of
:mod:`secateur.models.blocks`, so the calibration engine (and the perplexity evaluator) calls
:meth:`BlockStream.load` before visiting block ``i`` and :meth:`BlockStream.release` after it
(:meth:`secateur.models.blocks.Blocks.scope`), which hands the finished block to the run's sink (the shard writer,
:class:`secateur.export.shards.ShardSink`) and puts its parameters back on the meta device.

Tensors are read lazily with :func:`safetensors.safe_open` from one ``*.safetensors`` file or a sharded folder
(``model.safetensors.index.json``), cast to the model's dtype exactly as ``from_pretrained(dtype=...)`` casts them.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
from torch import nn

from secateur.errors import SecateurError
from secateur.models.blocks import BlockSink

SAFE_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
               "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
               "BOOL": torch.bool}


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]


def _header(path: Path) -> dict:
    with path.open("rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(n).decode("utf-8"))


class LazyWeights:
    """The tensors of a model folder, read one at a time (never the whole file): name -> file, dtype, shape."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        index = self.folder / "model.safetensors.index.json"
        if index.exists():
            files = sorted({self.folder / f for f in json.loads(index.read_text())["weight_map"].values()})
        else:
            files = sorted(self.folder.glob("*.safetensors"))
        if not files:
            raise SecateurError(f"--stream reads safetensors files; model folder {self.folder} has none "
                                "(re-save it with save_pretrained(safe_serialization=True))")
        self.info: dict[str, TensorInfo] = {}
        for f in files:
            if not f.exists():
                raise SecateurError(f"model folder {self.folder}: shard {f.name} named by its index is missing")
            for name, v in _header(f).items():
                if name == "__metadata__":
                    continue
                if v["dtype"] not in SAFE_DTYPES:
                    raise SecateurError(f"model file {f}: tensor {name} has dtype {v['dtype']}, which --stream "
                                        "does not read")
                self.info[name] = TensorInfo(f, SAFE_DTYPES[v["dtype"]], tuple(v["shape"]))
        self._open: dict[Path, object] = {}

    def get(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        f = self.info[name].file
        if f not in self._open:
            self._open[f] = safe_open(str(f), framework="pt", device="cpu")
        return self._open[f].get_tensor(name)

    def close(self) -> None:
        self._open.clear()


def _file_key(name: str, weights: LazyWeights, prefix: str) -> str | None:
    """The file's name of model tensor ``name`` (checkpoints may omit or add the base model's prefix)."""
    if name in weights.info:
        return name
    if prefix and name.startswith(prefix + ".") and name[len(prefix) + 1:] in weights.info:
        return name[len(prefix) + 1:]
    if prefix and f"{prefix}.{name}" in weights.info:
        return f"{prefix}.{name}"
    return None


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """Build modules with every parameter on the meta device and every buffer real (accelerate's
    ``init_empty_weights(include_buffers=False)``): nothing as large as a weight is ever touched, and
    buffers computed at construction (RoPE's ``inv_freq``, scaled-embedding factors) stay right."""
    old = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        old(module, name, param)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = old


def _set_tensor(root: nn.Module, name: str, value: torch.Tensor) -> None:
    mod_name, _, leaf = name.rpartition(".")
    mod = root.get_submodule(mod_name) if mod_name else root
    if leaf in mod._parameters:
        mod._parameters[leaf] = nn.Parameter(value, requires_grad=False)
    else:
        mod._buffers[leaf] = value


def saved_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state-dict entries an export writes: tied tensors once (the first name, as ``save_pretrained``)."""
    seen: set[int] = set()
    out = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            out[name] = t
    return out


@dataclass
class BlockStream:
    """The streamed block source (:class:`secateur.models.blocks.BlockSource`): loads and frees decoder blocks of a
    model built by :func:`open_streamed` (see the module docstring); a finished block goes to the run's sink."""

    streamed: ClassVar[bool] = True

    model: nn.Module
    weights: LazyWeights
    prefix: str  # qualified name of the block list, e.g. "model.layers"
    file_keys: dict[str, str]  # model state-dict name -> the file's name
    device: torch.device
    loaded: set[int] = field(default_factory=set)
    deferred: set[str] = field(default_factory=set)  # resident tensors left on meta (see load_resident)

    def tensor(self, name: str) -> torch.Tensor:
        """The model's parameter or buffer ``name`` (on the meta device while not loaded)."""
        return self.model.get_parameter(name) if _is_param(self.model, name) else self.model.get_buffer(name)

    def block_names(self, index: int) -> list[str]:
        p = f"{self.prefix}.{index}."
        return [k for k in self.file_keys if k.startswith(p)]

    def load(self, index: int) -> None:
        """Materialize block ``index`` from the files (in the dtype the model was built in)."""
        if index in self.loaded:
            return
        for name in self.block_names(index):
            target = self.tensor(name)
            t = self.weights.get(self.file_keys[name])
            if tuple(t.shape) != tuple(target.shape):
                raise SecateurError(f"model file tensor {self.file_keys[name]} has shape {list(t.shape)}, the "
                                    f"config builds {list(target.shape)}")
            _set_tensor(self.model, name, t.to(device=self.device, dtype=target.dtype))
        self.weights.close()  # unmap the files: their touched pages are not kept resident across blocks
        self.loaded.add(index)

    def block_state(self, index: int) -> dict[str, torch.Tensor]:
        """Block ``index``'s state-dict entries by model name, as the block is now (a structured run slices it
        while it is loaded: new widths, biases added by compensation)."""
        layer = self.model.get_submodule(self.prefix)[index]
        p = f"{self.prefix}.{index}."
        return {p + k: v for k, v in layer.state_dict(keep_vars=True).items()}

    def release(self, index: int, sink: BlockSink | None = None) -> None:
        """Block ``index`` is finished (``sink``: hand it its tensors first); back to meta."""
        if index not in self.loaded:
            return
        state = self.block_state(index)
        if sink is not None:
            sink.write_block(index, state)
        for name, t in state.items():
            _set_tensor(self.model, name, torch.empty_like(t, device="meta"))
        self.loaded.discard(index)

    def resident(self) -> dict[str, torch.Tensor]:
        """The tensors outside the blocks (loaded for the whole run), by state-dict name."""
        p = f"{self.prefix}."
        return {k: self.tensor(k).detach() for k in self.file_keys if not k.startswith(p)}

    def untied_head(self) -> list[str]:
        """The state-dict name of the LM head when it is a tensor of its own (not tied to the embeddings)."""
        head = self.model.get_output_embeddings()
        if head is None or head.weight is self.model.get_input_embeddings().weight:
            return []
        return [k for k, v in self.model.named_parameters() if v is head.weight and k in self.file_keys]

    def load_resident(self, defer_head: bool = False) -> None:
        """Load the tensors outside the blocks and tie tied weights (the blocks stay on meta until loaded).

        ``defer_head``: an untied LM head stays on the meta device (a prune never computes logits; the head is
        copied from the input files to the output by :meth:`resident_items`): its bytes (0.55 GB for
        Qwen2.5-0.5B in float32) are never held."""
        model, device = self.model, self.device
        self.deferred = set(self.untied_head()) if defer_head else set()
        for name, t in self.resident().items():
            if name not in self.deferred:
                _set_tensor(model, name, self.weights.get(self.file_keys[name]).to(device=device, dtype=t.dtype))
        self.weights.close()
        model.tie_weights()
        p = self.prefix + "."
        left = [n for n, t in model.named_parameters()
                if t.device.type == "meta" and not n.startswith(p) and n not in self.deferred]
        if left:
            raise SecateurError(f"model folder {self.weights.folder}: {left[0]} was not loaded (not in the files, "
                                "not tied)")
        for name, b in list(model.named_buffers()):  # buffers are real already; move them with the model
            if b.device != device:
                _set_tensor(model, name, b.to(device))

    def resident_items(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` of every resident tensor for the writer; a deferred one is read from the files
        for the moment it is written (in the model's dtype, as :meth:`load_resident` would hold it)."""
        for name, t in self.resident().items():
            if name in self.deferred:
                t = self.weights.get(self.file_keys[name]).to(dtype=t.dtype)
                self.weights.close()
            yield name, t

    def tokenizer(self):
        """The folder's tokenizer (a vision encoder: its image processor, None without one)."""
        from transformers import AutoTokenizer

        from secateur.models.files import model_class_for

        if model_class_for(str(self.weights.folder))[1]:
            from secateur.models.loading import image_processor

            return image_processor(str(self.weights.folder))
        return AutoTokenizer.from_pretrained(self.weights.folder, trust_remote_code=False)

    def materialized_blocks(self) -> list[int]:
        """Blocks with any parameter off the meta device (the tests' peak-memory check)."""
        blocks = self.model.get_submodule(self.prefix)
        return [i for i, b in enumerate(blocks) if any(p.device.type != "meta" for p in b.parameters())]


def _is_param(model: nn.Module, name: str) -> bool:
    mod_name, _, leaf = name.rpartition(".")
    return leaf in (model.get_submodule(mod_name) if mod_name else model)._parameters


def local_folder(spec: str, dtype: str | torch.dtype, resolved: str | Path | None = None) -> Path:
    """The local folder of a model spec (GGUF inputs: their cached folder); a hub id is refused. ``resolved``: the
    spec's path as :func:`secateur.models.loading.resolve` gave it already (not resolved again)."""
    from secateur.models.loading import resolve

    path = Path(resolve(spec, dtype)[0] if resolved is None else resolved)
    if not path.is_dir():
        raise SecateurError(f"--stream reads a local model folder; {spec} is not one (download it first, e.g. "
                            "huggingface-cli download, and pass the folder)")
    return path


def _folder_config(spec: str, folder: Path) -> dict:
    from secateur.models.loading import read_config

    return read_config(str(folder), str(folder), {}) or {}  # the folder's own config.json (a GGUF's: the cache's)


def build_meta(folder: Path, dtype: torch.dtype) -> nn.Module:
    """The model of ``folder``'s config with every parameter on the meta device, in eval mode, SDPA attention (a
    language model through ``AutoModelForCausalLM``, a vision encoder as the class its config names)."""
    from transformers import AutoConfig

    from secateur.models.files import model_class_for, register_custom_classes

    register_custom_classes()
    config = AutoConfig.from_pretrained(folder, trust_remote_code=False)
    cls, vision = model_class_for(str(folder))
    with params_on_meta():
        if vision:
            model = cls._from_config(config, dtype=dtype, attn_implementation="sdpa")
        else:
            model = cls.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def open_streamed(spec: str, dtype: str | torch.dtype = "float32", device: str = "cpu",
                  folder: Path | None = None) -> BlockStream:
    """The model of ``spec`` built on the meta device and its :class:`BlockStream` (nothing loaded yet; the
    memory plan is computed from it, then :meth:`BlockStream.load_resident`). ``folder``: the spec's local folder
    when the caller resolved it already (:class:`secateur.models.spec.ModelSpec`)."""
    from secateur.models.adapters import get_adapter
    from secateur.models.folder_check import check_layer_count, check_sizes, compare, loaded_names
    from secateur.models.loading import parse_dtype

    folder = local_folder(spec, dtype) if folder is None else folder
    weights = LazyWeights(folder)
    held = {name: info.shape for name, info in weights.info.items()}
    cfg = _folder_config(spec, folder)
    check_sizes(spec, cfg)
    check_layer_count(spec, cfg, held)  # before the model is built: a config's layer count the weights lack
    model = build_meta(folder, parse_dtype(dtype))
    names = {v: k for k, v in SAFE_DTYPES.items()}
    dtypes = {name: names[info.dtype] for name, info in weights.info.items()}
    compare(spec, model, held, cfg, dtypes)  # every tensor the config implies, its shape, float weights; nothing else
    keys = {}
    held_as = loaded_names(model, held)  # older checkpoint formats (ViT's encoder.layer.N...) by their loaded names
    for name in saved_tensors(model):
        fk = held_as.get(name) or _file_key(name, weights, model.base_model_prefix)
        if fk is None:
            raise SecateurError(f"model folder {spec}: tensor {name} is not in its safetensors files")
        keys[name] = fk
    stream = BlockStream(model, weights, get_adapter(model).base_prefix, keys, torch.device(device))
    return stream


def load_streamed(spec: str, dtype: str | torch.dtype = "float32", device: str = "cpu"
                  ) -> tuple[nn.Module, object, BlockStream]:
    """``(model, tokenizer, stream)``: embeddings, final norm and head loaded, every decoder block on the meta
    device until ``stream.load(i)`` (pass ``Blocks(stream)`` to whatever visits the blocks)."""
    stream = open_streamed(spec, dtype, device)
    stream.load_resident()
    return stream.model, stream.tokenizer(), stream


class PackedMasks(MutableMapping):
    """Boolean masks stored bit-packed (1 bit per weight instead of torch.bool's byte), read back as tensors:
    the masks of a streamed prune grow with depth, so they are kept at 1/16 of the bf16 weights."""

    def __init__(self) -> None:
        self._bits: dict[str, tuple[np.ndarray, tuple[int, ...]]] = {}

    def __setitem__(self, key: str, mask: torch.Tensor) -> None:
        self._bits[key] = (np.packbits(mask.detach().cpu().numpy().astype(bool).ravel()), tuple(mask.shape))

    def __getitem__(self, key: str) -> torch.Tensor:
        bits, shape = self._bits[key]
        n = int(np.prod(shape))
        return torch.from_numpy(np.unpackbits(bits, count=n).astype(bool).reshape(shape))

    def __delitem__(self, key: str) -> None:
        del self._bits[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._bits)

    def __len__(self) -> int:
        return len(self._bits)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b, _ in self._bits.values())
