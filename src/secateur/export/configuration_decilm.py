"""The config class of a ``secateur export vllm`` DeciLM folder, copied into it as ``configuration_decilm.py``.

Self-contained (transformers only): the folder's ``config.json`` names it with
``"auto_map": {"AutoConfig": "configuration_decilm.DeciLMConfig"}``, so ``AutoConfig.from_pretrained(folder,
trust_remote_code=True)`` (and vLLM, which calls it) reads the folder with nothing fetched. Neither transformers nor
vLLM ships a config class for ``model_type = "nemotron-nas"``.

Format (NVIDIA's Nemotron-NAS / Puzzle checkpoints, ``DeciLMForCausalLM``): a Llama config plus ``block_configs``,
one entry per decoder layer::

    {"attention": {"no_op": bool, "replace_with_linear": false, "n_heads_in_group": int | null},
     "ffn": {"no_op": bool, "replace_with_linear": false, "intermediate_size": int | null, "ffn_mult": float}}

Query heads are one global count (``num_attention_heads``, each ``head_dim`` wide); a layer's KV heads are
``num_attention_heads // n_heads_in_group``. ``ffn_mult`` is present only when the MLP width is a multiple of 256
that ``find_multiple(int(2 * ffn_mult * hidden_size / 3), 256)`` gives back exactly (the only width rule of
SGLang's and TensorRT-LLM's loaders); ``intermediate_size`` is always there (vLLM reads it when ``ffn_mult`` is
absent). Engines read each entry by attribute (``block_config.attention.no_op``, ``hasattr(block_config.ffn,
"ffn_mult")``), so entries become :class:`BlockPart` objects whose attributes are exactly the JSON keys (a key
left out is an attribute that does not exist). Biases are global flags: ``qkv_bias`` (q/k/v), ``attention_bias``
(o_proj, and q/k/v where ``qkv_bias`` is absent), ``mlp_bias`` (gate/up/down).
"""

from __future__ import annotations

from typing import Any

from transformers import LlamaConfig

try:  # transformers 5 configs are strict dataclasses: the class validators are collected per decorated class
    from huggingface_hub.dataclasses import strict
except ImportError:  # an older stack: plain classes

    def strict(cls):  # noqa: D103
        return cls


class BlockPart:
    """One ``attention`` / ``ffn`` entry of a block config: its JSON keys as attributes."""

    def __init__(self, **entries: Any) -> None:
        self.__dict__.update(entries)

    def to_dict(self) -> dict:
        return dict(self.__dict__)

    def __repr__(self) -> str:
        return f"BlockPart({self.__dict__})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BlockPart) and other.__dict__ == self.__dict__


class BlockConfig:
    """One decoder layer's entry of ``block_configs``: ``.attention`` and ``.ffn`` (:class:`BlockPart`)."""

    def __init__(self, attention: dict | BlockPart, ffn: dict | BlockPart, **more: Any) -> None:
        self.attention = attention if isinstance(attention, BlockPart) else BlockPart(**attention)
        self.ffn = ffn if isinstance(ffn, BlockPart) else BlockPart(**ffn)
        self.__dict__.update(more)

    def to_dict(self) -> dict:
        return {k: v.to_dict() if isinstance(v, BlockPart) else v for k, v in self.__dict__.items()}

    def __repr__(self) -> str:
        return f"BlockConfig({self.to_dict()})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BlockConfig) and other.to_dict() == self.to_dict()


def _block(b: Any) -> BlockConfig:
    return b if isinstance(b, BlockConfig) else BlockConfig(**b)


@strict
class DeciLMConfig(LlamaConfig):
    """A Llama config with per-layer ``block_configs`` (module docstring)."""

    model_type = "nemotron-nas"
    block_configs: list | None = None

    def __post_init__(self, **kwargs: Any) -> None:
        super().__post_init__(**kwargs)
        self.block_configs = [_block(b) for b in (self.block_configs or [])]

    def validate_architecture(self) -> None:
        """``head_dim`` is explicit: the query heads need not divide the hidden size (LlamaConfig's own check)."""
        if self.block_configs and len(self.block_configs) != self.num_hidden_layers:
            raise ValueError(f"block_configs has {len(self.block_configs)} entries for {self.num_hidden_layers} "
                             "layers")

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        d["block_configs"] = [_block(b).to_dict() for b in (self.block_configs or [])]
        return d
