"""Schemas of the files ``secateur export gguf`` reads from a run folder besides its report
(:class:`~secateur.schemas.report.RunReport`): ``config.json`` (the fields the exporter sizes the GGUF from),
``model.safetensors.index.json`` and ``tokenizer.json`` (the parts the byte-level BPE vocabulary is built from).

Open: a config or tokenizer carries many keys the exporter does not read. A damaged or hand-edited file is one
line naming the file and the field (``run/config.json: hidden_size: input should be greater than 0``), never a
TypeError or a GGUF with nonsense metadata.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator, Field, StringConstraints
from pydantic_core import PydanticCustomError

from secateur.schemas import NonNegInt, Open, PositiveInt

PositiveNumber = Annotated[float, Field(gt=0)]


class RopeParameters(Open):
    rope_theta: PositiveNumber | None = None
    rope_type: str | None = None


class RopeScaling(Open):
    rope_type: str | None = None
    type: str | None = None


class ConfigFamily(Open):
    """``config.json``'s family, read first: a family the exporter does not write is refused by name."""

    model_type: str


class RunConfig(ConfigFamily):
    """``config.json`` as the exporter reads it (per-layer widths come from the tensors, not from here)."""

    hidden_size: PositiveInt
    num_attention_heads: PositiveInt
    num_hidden_layers: PositiveInt
    head_dim: PositiveInt | None = None
    max_position_embeddings: PositiveInt
    rms_norm_eps: PositiveNumber
    rope_theta: PositiveNumber | None = None
    rope_parameters: RopeParameters | None = None
    rope_scaling: RopeScaling | None = None


class ShardIndex(Open):
    """``model.safetensors.index.json``: the shard file of each tensor, a plain file name in the run folder."""

    weight_map: dict[str, Annotated[str, StringConstraints(pattern=r"^[^/\\]+\.safetensors$")]]


def _merge(v: Any) -> Any:
    if isinstance(v, str) or isinstance(v, list) and len(v) == 2 and all(isinstance(x, str) for x in v):
        return v
    raise PydanticCustomError("merge", "a merge is 'a b' or a pair of strings")


class TokenizerModel(Open):
    type: str | None = None
    vocab: dict[str, NonNegInt] | None = None
    merges: list[Annotated[Any, BeforeValidator(_merge)]] | None = None
    byte_fallback: bool | None = None


class AddedToken(Open):
    id: NonNegInt
    content: str
    special: bool | None = None


class SplitPattern(Open):
    Regex: str | None = None
    String: str | None = None


class PreTokenizer(Open):
    type: str | None = None
    pretokenizers: list[PreTokenizer] | None = None
    use_regex: bool | None = None
    individual_digits: bool | None = None
    pattern: SplitPattern | None = None


class Decoder(Open):
    type: str | None = None


class TokenizerFile(Open):
    """``tokenizer.json`` (Hugging Face tokenizers): the parts a GGUF vocabulary is built from."""

    model: TokenizerModel | None = None
    added_tokens: list[AddedToken] | None = None
    pre_tokenizer: PreTokenizer | None = None
    decoder: Decoder | None = None


PreTokenizer.model_rebuild()

__all__ = ["ConfigFamily", "RunConfig", "ShardIndex", "TokenizerFile"]
