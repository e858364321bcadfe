"""The GGUF cache's manifest: what an entry held when secateur wrote it.

A GGUF file is dequantized once into ``<cache>/gguf/<sha256[:16]>-<dtype>/`` (:mod:`secateur.models.gguf_cache`);
the entry's ``secateur-cache.json`` records the GGUF it came from and, for every file written, its size, mtime
and sha256. At use, each file's size and mtime are compared with the manifest (cheap), and its sha256 only where
those changed; an entry that no longer matches, or whose manifest does not validate against :class:`CacheManifest`,
is derived again from the GGUF, never used as it is.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from secateur.schemas import NonNegInt, Sha256, Strict

MANIFEST_SCHEMA = 1
#: a file of the entry, by its bare name (no folder part: a manifest never points outside its entry)
FileName = Annotated[str, Field(pattern=r"^[^/\\]+$")]


class CachedFile(Strict):
    size: NonNegInt
    mtime_ns: NonNegInt
    sha256: Sha256


class CacheManifest(Strict):
    """``secateur-cache.json`` of one cache entry."""

    secateur_gguf_cache: Literal[1]
    gguf_sha256: Sha256  # the content digest of the GGUF the entry was derived from
    dtype: str
    files: dict[FileName, CachedFile] = Field(min_length=1)


__all__ = ["MANIFEST_SCHEMA", "CacheManifest", "CachedFile"]
