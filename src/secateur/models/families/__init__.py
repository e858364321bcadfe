"""The family registry: one module per model family, each declaring the family's adapter and layout.

A family module (``llama.py``, ``opt.py``, ...) defines one :class:`~secateur.models.families.base.Adapter`
subclass and names it ``ADAPTER``. The subclass is everything secateur knows about the family: its
``model_type`` (``family``), its stock Hugging Face config/model classes, its
:class:`~secateur.models.hetero.FamilyLayout` (where structured pruning finds layers and projections), its
GGUF architecture, and the staged forward the calibration engine runs. Shared behaviour lives in
:mod:`~secateur.models.families.base`; a family close to another subclasses its adapter (Mistral, Qwen2 and
Qwen3 are one line each: :func:`~secateur.models.families.llama.llama_like`, Llama's adapter with their own
stock classes and layout).

This package imports the modules named in :data:`FAMILY_MODULES` (in that order: it is the order of every
list of families secateur prints) and derives every per-family table from their ``ADAPTER`` classes:
:data:`ADAPTERS` (family -> adapter class, read by :func:`get_adapter`,
:func:`adapter_class` and the model checks), the heterogeneous export classes and layouts of
:mod:`secateur.models.hetero` (via :func:`~secateur.models.hetero.define_family`) and the GGUF families of
:mod:`secateur.models.gguf_cache`. No other module keeps a per-family table (the test fixtures of
:mod:`secateur.testing` aside).

Adding a family (say ``falcon``):

1. ``src/secateur/models/families/falcon.py``: a subclass of :class:`~secateur.models.families.base.Adapter` (or of
   a close family's adapter) with ``family = "falcon"``, ``config_class, model_class = FalconConfig,
   FalconForCausalLM``, ``layout = FamilyLayout(...)``, ``gguf_architecture`` (or None), ``projections``
   (``(name in the block, role)`` pairs in forward order), and the structure/staged-forward methods the base
   leaves abstract (``base``, ``layers``, ``geometry``, ``attn_norm``, ``attn_core``, ``mlp_norm``,
   ``mlp_core``, ``final_hidden``); where the family departs from
   the plain pre-norm block, the hooks with defaults: ``attn_residual`` / ``mlp_residual`` (Gemma-3 normalizes
   a sublayer's output before the residual add), ``capture_inputs`` / ``layer_kwargs`` (Gemma-3's per-layer-type
   masks and RoPE tables), ``role_refs`` (row slices of fused projections: GPT-2, Phi-3); end with
   ``ADAPTER = FalconAdapter``. A family with Llama's module names and forward is one line:
   ``ADAPTER = llama_like(FalconConfig, FalconForCausalLM, **layout_changes)``. Add ``"falcon"`` to
   :data:`FAMILY_MODULES`. ``ADAPTER(model).check_layout()`` on a model of the family says whether the
   layout matches its modules.
2. Its tiny-model fixture: one entry in :data:`secateur.testing.TINY_CONFIGS` (a small random config).
   Every test parametrized over :data:`secateur.testing.FAMILIES` then covers it, and
   ``tests/test_structured_layout.py`` checks that the fixtures and the registry name the same families and
   that the layout matches the modules' shapes.
"""

from __future__ import annotations

import importlib

from torch import nn

from secateur.errors import SecateurError
from secateur.models import hetero
from secateur.models.families.base import HETERO_PREFIX, Adapter
from secateur.models.hetero import FamilyLayout

# The family modules of this package, in registration order.
FAMILY_MODULES = ("llama", "mistral", "qwen2", "qwen3", "opt", "gpt2", "gemma3", "phi3",
                  "vit", "deit", "dinov2", "siglip", "clip", "siglip_classifier", "clip_classifier",
                  "idefics3", "smolvlm")


def _load() -> dict[str, type[Adapter]]:
    found: dict[str, type[Adapter]] = {}
    for name in FAMILY_MODULES:
        cls = importlib.import_module(f"{__name__}.{name}").ADAPTER
        check_adapter(cls)
        if cls.family in found:
            raise RuntimeError(f"family {cls.family!r} is declared by both {found[cls.family].__name__} and "
                               f"{cls.__name__}")
        found[cls.family] = cls
    return found


def check_adapter(cls: type[Adapter]) -> None:
    """Refuse an adapter class that does not declare what the registry needs (a programming error)."""
    missing = [a for a in ("config_class", "model_class", "layout") if getattr(cls, a, None) is None]
    if cls.family == Adapter.family or missing:
        raise TypeError(f"{cls.__name__} must declare family, config_class, model_class and layout "
                        f"(missing: {', '.join(missing) or 'family'})")
    if getattr(cls.config_class, "model_type", None) != cls.family:
        raise TypeError(f"{cls.__name__}.family is {cls.family!r} but its config class "
                        f"{cls.config_class.__name__} has model_type {cls.config_class.model_type!r}")


ADAPTERS: dict[str, type[Adapter]] = _load()
for _cls in ADAPTERS.values():
    hetero.define_family(_cls.family, _cls.layout, _cls.config_class, _cls.model_class, _cls.more_classes,
                         _cls.auto_class)


def _backbone_class(family: str) -> type | None:
    """The headless decoder class ``AutoModel`` builds for a text family (``LlamaModel``), or None."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    name = MODEL_MAPPING_NAMES.get(family)
    return getattr(transformers, name, None) if isinstance(name, str) else None


for _cls in ADAPTERS.values():  # a VLM's language model with per-layer widths (hetero.define_backbone)
    if _cls.modality == "text" and (_base := _backbone_class(_cls.family)) is not None \
            and _base is not _cls.model_class:
        hetero.define_backbone(_cls.family, _base)


def supported_model_types() -> list[str]:
    return sorted(ADAPTERS)


def supported_text() -> str:
    """The supported ``model_type`` values for messages, text families first: ``gemma3_text, ..., qwen3 (text);
    clip_vision_model, ..., vit (vision)``."""
    by = {m: sorted(f for f, a in ADAPTERS.items() if a.modality == m) for m in ("text", "vision")}
    return "; ".join(f"{', '.join(names)} ({m})" for m, names in by.items() if names)


def base_model_type(model_type) -> str | None:
    """``secateur_llama`` (a heterogeneous export) -> ``llama``; other values pass through."""
    if isinstance(model_type, str) and model_type.startswith(HETERO_PREFIX):
        return model_type[len(HETERO_PREFIX):]
    return model_type


def family_class(model_type) -> type[Adapter] | None:
    """The adapter class of a ``model_type`` (stock or ``secateur_<family>``; any value: a config read from a file),
    or None when no family handles it: what config-only code asks before anything is loaded."""
    return ADAPTERS.get(base_model_type(model_type)) if isinstance(model_type, str) else None


def adapter_class(config) -> type[Adapter]:
    """The adapter class of ``config``'s family (stock or ``secateur_<family>``), or a SecateurError naming
    the supported ones. Its ``family`` and ``layout`` are what config-only code (exports, efficiency) needs."""
    mt = getattr(config, "model_type", None)
    cls = family_class(mt)
    if cls is None:
        raise SecateurError(f"unsupported model family {mt!r}; supported: {supported_text()}")
    return cls


def family_of(config) -> str:
    """The family name (stock ``model_type``) of ``config``; a SecateurError when no adapter handles it."""
    return adapter_class(config).family


def layout_of(family: str) -> FamilyLayout:
    """The :class:`~secateur.models.hetero.FamilyLayout` its adapter declares for ``family``."""
    return ADAPTERS[family].layout


def get_adapter(model: nn.Module) -> Adapter:
    """The adapter for ``model``'s family, or a SecateurError naming the supported ones."""
    return adapter_class(model.config)(model)


def gguf_families() -> dict[str, str]:
    """GGUF ``general.architecture`` -> model_type, for the families that declare one."""
    return {cls.gguf_architecture: fam for fam, cls in ADAPTERS.items() if cls.gguf_architecture}
