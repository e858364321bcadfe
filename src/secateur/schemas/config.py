"""A model folder's ``config.json`` (the sizes secateur and transformers build the model from) and its
``model.safetensors.index.json``, validated before any model is built from them.

Only the fields that size the model or name token ids are checked; every other key is kept as it is
(configs are extended by every family and by secateur's own heterogeneous exports). A size must be a positive
integer: ``max_position_embeddings: -5``, ``num_hidden_layers: 0`` or ``hidden_size: 64.0`` are refused (an MLP
width may be 0: secateur's structured exports remove whole MLPs); a token id an integer (or a list of them, or
null). Whether the sizes agree with the weights is :func:`secateur.models.folder_check.check_folder`'s business,
which uses this first.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from secateur.schemas import NonNegInt, Open, PositiveInt

PositiveNumber = Annotated[float, Field(gt=0)]
TokenId = int | list[int] | None

#: the size fields checked (config.json names of every supported family: GPT-2's n_embd, OPT's ffn_dim...)
SIZE_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "intermediate_size", "max_position_embeddings", "head_dim", "n_embd", "n_layer", "n_head", "n_inner",
               "n_positions", "n_ctx", "ffn_dim", "word_embed_proj_dim", "sliding_window",
               "original_max_position_embeddings", "query_pre_attn_scalar")


class ModelSizes(Open):
    """The sizes of a model config (``config.json``): positive where given; unknown keys kept."""

    vocab_size: PositiveInt | None = None
    hidden_size: PositiveInt | None = None
    num_hidden_layers: PositiveInt | None = None
    num_attention_heads: PositiveInt | None = None
    num_key_value_heads: PositiveInt | None = None
    intermediate_size: NonNegInt | None = None  # 0: an MLP pruned away entirely (a secateur export)
    max_position_embeddings: PositiveInt | None = None
    head_dim: PositiveInt | None = None
    # GPT-2 names
    n_embd: PositiveInt | None = None
    n_layer: PositiveInt | None = None
    n_head: PositiveInt | None = None
    n_inner: NonNegInt | None = None
    n_positions: PositiveInt | None = None
    n_ctx: PositiveInt | None = None
    # OPT
    ffn_dim: NonNegInt | None = None
    word_embed_proj_dim: PositiveInt | None = None
    # sliding-window attention, long-context RoPE, Gemma's attention scale
    sliding_window: PositiveInt | None = None
    original_max_position_embeddings: PositiveInt | None = None
    query_pre_attn_scalar: PositiveNumber | None = None
    # token ids: their type only (real configs carry -1 for "none"; the embedding checks its padding index)
    bos_token_id: TokenId = None
    eos_token_id: TokenId = None
    pad_token_id: TokenId = None


class ShardIndex(Open):
    """``model.safetensors.index.json``: which shard file holds each tensor (``metadata`` and more are kept)."""

    weight_map: dict[str, Annotated[str, Field(pattern=r"^[^/\\]+\.safetensors$")]]


__all__ = ["SIZE_FIELDS", "ModelSizes", "ShardIndex"]
