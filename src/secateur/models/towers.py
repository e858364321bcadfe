"""Vision-language models as two towers: each tower is a model secateur already prunes (issue 47, first slice).

A LLaVA-style VLM (``LlavaForConditionalGeneration``: ``model.vision_tower``, ``model.multi_modal_projector``,
``model.language_model``, ``lm_head``) is a vision encoder of a supported family (CLIP or SigLIP vision tower), a
projector and a decoder of a supported family; so are Idefics3 and SmolVLM (``Idefics3ForConditionalGeneration`` /
``SmolVLMForConditionalGeneration``: vision blocks ``model.vision_model.encoder.layers.N``, the connector
``model.connector`` (pixel shuffle + projection), language blocks ``model.text_model.layers.N``; :class:`VLMType`
holds each class's paths and differences). :func:`tower_model` hands one tower to the ordinary pipeline as a
model of its own family, sharing the VLM's modules (pruning it prunes the VLM in place):

* ``vision``: the vision tower module itself (a ``CLIPVisionModel`` / ``SiglipVisionModel`` /
  ``Idefics3VisionTransformer``), calibrated on images
  through the VLM's image processor;
* ``language``: a ``*ForCausalLM`` of the text config's family built on the meta device whose decoder and LM head
  are the VLM's own modules (no weight is copied), calibrated on text through the VLM's tokenizer.

The projector, the embeddings and the LM head are never pruned (they are outside both towers' blocks). The
tower's hidden width (what the projector reads and writes) is never sliced by any method, so the VLM stays
consistent. A pruned tower is saved back into the VLM's config only where the stock config can express it
(every layer the same widths: :func:`secateur.vlm_config.write_back`, above the export stage); per-layer widths inside
a VLM are refused in one line before anything is written. The joint inventory over both towers (one budget, one
CoCurve graph, ``--towers joint``) is :mod:`secateur.vlm_joint`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from secateur.errors import SecateurError


@dataclass(frozen=True)
class VLMType:
    """Where a VLM class keeps its towers (module paths from the ``*ForConditionalGeneration``, read from the
    installed transformers) and the few ways the families differ.

    ``connector``: the projector between the towers (never pruned). ``image_token``: the config key of the image
    token id. ``image_dim``: the VLM's forward takes pixel values ``[N, 1, C, H, W]`` (one image per sequence,
    Idefics3 / SmolVLM) instead of ``[N, C, H, W]``; secateur keeps ``[N, C, H, W]`` and adds the dimension at the
    call (:func:`vlm_inputs`). ``vision_per_layer``: a per-layer vision config reloads inside the VLM's folder:
    LLaVA builds its tower through an Auto factory (the ``secateur_<family>`` class); Idefics3 and SmolVLM build it
    from their own class, which secateur's family module makes honour ``secateur_layers``
    (:func:`secateur.models.families.idefics3.per_layer_init`); Qwen2.5-VL's cannot: per-layer vision widths are
    refused there in one line before anything is written (uniform widths: the stock config)."""

    vision: str
    language: str
    head: str
    connector: str
    image_token: str = "image_token_index"
    image_dim: bool = False
    vision_per_layer: bool = True
    #: the VLM builds its language model through ``AutoModel.from_config`` (per-layer widths reload)
    language_per_layer: bool = True
    #: the text family whose ``*ForCausalLM`` stands in for a language model of the VLM's own type (Qwen2.5-VL's
    #: ``qwen2_5_vl_text``: Qwen2 blocks under M-RoPE), None: the text config's own family
    text_family: str | None = None
    #: the vision tower is a model of a family the engine runs (False: Qwen2.5-VL's patch-row tower, whose MLP
    #: channels :mod:`secateur.models.qwen_vision` prunes on its own; not in a joint inventory, refused in one line)
    vision_supported: bool = True
    #: pixel values are Qwen2-VL patch rows with ``image_grid_thw`` (secateur keeps them ``[N, h, w, D]``)
    patches: bool = False


_IDEFICS3 = VLMType("model.vision_model", "model.text_model", "lm_head", "model.connector", "image_token_id",
                    image_dim=True)
#: VLM model_type -> its :class:`VLMType` (``LlavaForConditionalGeneration``, ``Idefics3ForConditionalGeneration``,
#: ``SmolVLMForConditionalGeneration``)
VLM_TYPES: dict[str, VLMType] = {
    "llava": VLMType("model.vision_tower", "model.language_model", "lm_head", "model.multi_modal_projector"),
    "idefics3": _IDEFICS3,
    "smolvlm": _IDEFICS3,
    # Qwen2_5_VLForConditionalGeneration: both towers built from their own classes (no per-layer widths); the
    # language blocks are Qwen2's (q/k/v biases, GQA) under M-RoPE; the vision tower (model.visual.blocks.N, fused
    # attn.qkv, window attention over patch rows): its MLP channels only (secateur.models.qwen_vision)
    "qwen2_5_vl": VLMType("model.visual", "model.language_model", "lm_head", "model.visual.merger", "image_token_id",
                          vision_per_layer=False, language_per_layer=False, text_family="qwen2",
                          vision_supported=False, patches=True),
}
TOWERS = ("vision", "language")  # in the data's order
#: the methods that rank Qwen2.5-VL's vision MLP channels (:mod:`secateur.models.qwen_vision` prunes them)
VISION_MLP_METHODS = ("wanda-sp", "magnitude-sp", "random")


def vlm_type(config) -> VLMType:
    mt = getattr(config, "model_type", None)
    if mt not in VLM_TYPES:
        raise SecateurError(f"{mt!r} is not a supported vision-language model ({', '.join(VLM_TYPES)})")
    return VLM_TYPES[mt]


def image_token_id(config) -> int:
    """The id of the token that stands for one image feature in the VLM's input ids."""
    return int(getattr(config, vlm_type(config).image_token))


def image_seq_length(config, pixel_values: torch.Tensor | None = None) -> int:
    """Image tokens per image: LLaVA's ``image_seq_length``; Idefics3 / SmolVLM: the patch grid shrunk by the
    connector's pixel shuffle, ``(image_size / patch)^2 / scale_factor^2``; Qwen2.5-VL: ``t h w / merge^2`` of the
    processed image (``pixel_values [N, h, w, D]``, t = 1: its size depends on the image, not the config)."""
    mt = getattr(config, "model_type", None)
    if mt == "llava":
        return int(config.image_seq_length)
    vc = config.vision_config
    if vlm_type(config).patches:
        if pixel_values is None:
            raise SecateurError(f"{mt}: the image token count depends on the processed image; pass its pixel values")
        return int(pixel_values.shape[1] * pixel_values.shape[2]) // int(vc.spatial_merge_size) ** 2
    return int((vc.image_size // vc.patch_size) ** 2 // config.scale_factor ** 2)


def vlm_inputs(vlm, input_ids: torch.Tensor, pixel_values: torch.Tensor) -> dict:
    """The VLM forward's keyword arguments for ``input_ids [N, T]`` and one image per sequence ``[N, C, H, W]``
    (Qwen2.5-VL: ``[N, h, w, D]`` patch rows -> ``pixel_values [N h w, D]``, ``image_grid_thw`` and
    ``mm_token_type_ids``)."""
    t = vlm_type(vlm.config)
    if t.patches:
        n, h, w, d = pixel_values.shape
        grid = torch.tensor([[1, h, w]] * n, dtype=torch.long)
        # mm_token_type_ids (1 on image tokens), as the processor returns them: without them the VLM gives every
        # token a 1-D position instead of its M-RoPE (temporal, height, width) position
        types = (input_ids == image_token_id(vlm.config)).long()
        return {"input_ids": input_ids, "pixel_values": pixel_values.reshape(n * h * w, d), "image_grid_thw": grid,
                "mm_token_type_ids": types}
    px = pixel_values[:, None] if t.image_dim else pixel_values
    return {"input_ids": input_ids, "pixel_values": px}


def is_vlm(config) -> bool:
    return getattr(config, "model_type", None) in VLM_TYPES


TOWERS_FIX = ("--towers takes vision, language, both with a ratio each: vision=0.2,language=0.3 (a tower "
              "without a ratio takes --sparsity), or joint (one --sparsity over both towers' units; joint:language "
              "or joint:vision for one tower's units alone)")


def parse_towers(spec: str, sparsity: float) -> list[tuple[str, float]]:
    """``--towers`` -> ``[(tower, ratio)]`` in the data's order (vision first: the language tower then calibrates
    through the pruned vision tower): ``vision``, ``language``, ``vision,language`` (each at ``sparsity``) or
    ``vision=0.2,language=0.3``; ``joint`` / ``joint:language`` / ``joint:vision`` -> ``[(spec, sparsity)]`` (one
    budget over those towers' units, :mod:`secateur.vlm_joint`). One line on anything else."""
    from secateur.errors import check_fraction

    s = str(spec).strip()
    if s == "joint" or s in (f"joint:{t}" for t in TOWERS):
        check_fraction(float(sparsity))
        return [(s, float(sparsity))]
    out: dict[str, float] = {}
    for part in str(spec).split(","):
        name, _, ratio = part.strip().partition("=")
        if name not in TOWERS or name in out:
            raise SecateurError(f"{TOWERS_FIX}; got {spec!r}")
        try:
            r = float(ratio) if ratio else float(sparsity)
        except ValueError:
            raise SecateurError(f"{TOWERS_FIX}; {ratio!r} is not a number") from None
        check_fraction(r)
        out[name] = r
    return [(t, out[t]) for t in TOWERS if t in out]


def check_tower(config, tower: str | None, sparsity: float = 0.5) -> list[tuple[str, float]]:
    """The towers a VLM run prunes and their ratios (:func:`parse_towers`), or a one-line refusal (a VLM without
    ``--towers``; ``--towers`` on a model that has no towers; a malformed list). ``[]``: not a VLM run."""
    mt = getattr(config, "model_type", None)
    if not is_vlm(config):
        if tower is not None:
            raise SecateurError(f"--towers applies to a vision-language model ({', '.join(VLM_TYPES)}); this model "
                                f"is {mt!r}; drop --towers")
        return []
    if tower is None:
        raise SecateurError(f"{mt!r} is a vision-language model and names no towers to prune; pass --towers joint "
                            "(one budget over both towers), vision, language or vision=R,language=R")
    plan = parse_towers(tower, sparsity)
    if not VLM_TYPES[mt].vision_supported and any(t in ("joint", "joint:vision") for t, _ in plan):
        raise SecateurError(f"the vision tower of a {mt} model is not in a joint inventory yet; prune its language "
                            "tower with --towers joint:language, or its vision MLP channels with --towers vision")
    return plan


def check_vision_mlp(config, towers: list[str], method: str, units) -> None:
    """Qwen2.5-VL's vision tower prunes MLP channels only (:mod:`secateur.models.qwen_vision`): a method that does
    not rank them, or attention units asked for, is one line before loading."""
    if "vision" not in towers or not vlm_type(config).patches:
        return
    if method not in VISION_MLP_METHODS:
        raise SecateurError(f"the vision tower of a {config.model_type} model prunes MLP channels with "
                            f"{', '.join(VISION_MLP_METHODS)}; got --method {method}")
    if isinstance(units, str):
        units = [u.strip() for u in units.split(",")]
    if units is None or tuple(units) != ("channel",):
        raise SecateurError(f"the vision tower of a {config.model_type} model prunes MLP channels only (its heads "
                            "stay): pass --units channel")


class ImageTextProcessor:
    """A VLM's image processor and tokenizer as one processor (``image_processor``, ``tokenizer``, ``image_token``,
    ``chat_template``, ``save_pretrained``): what secateur's caption paths read of a processor, for a VLM whose own
    processor class cannot be built here (``Qwen2_5_VLProcessor`` requires a video processor, which needs
    torchvision)."""

    def __init__(self, image_processor, tokenizer, image_token: str) -> None:
        self.image_processor, self.tokenizer, self.image_token = image_processor, tokenizer, image_token
        self.chat_template = getattr(tokenizer, "chat_template", None)

    def save_pretrained(self, path) -> None:
        self.image_processor.save_pretrained(path)
        self.tokenizer.save_pretrained(path)


def load_processor(folder, config):
    """``AutoProcessor.from_pretrained(folder)``; for a Qwen2.5-VL folder whose processor needs what is not installed
    (torchvision for its video processor), its image processor and tokenizer as an :class:`ImageTextProcessor`."""
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(folder)
    except ImportError:
        if not vlm_type(config).patches:
            raise
    from transformers import AutoImageProcessor, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    return ImageTextProcessor(AutoImageProcessor.from_pretrained(folder), tok,
                              getattr(tok, "image_token", None) or "<|image_pad|>")


def _get(obj, path: str):
    for name in path.split("."):
        obj = getattr(obj, name)
    return obj


def tower_model(vlm: nn.Module, tower: str) -> nn.Module:
    """The model of ``tower``'s own family that shares ``vlm``'s modules (see the module docstring)."""
    from secateur.models.families import family_class

    t = vlm_type(vlm.config)
    vpath, lpath, head = t.vision, t.language, t.head
    if tower == "vision" and not t.vision_supported:
        raise SecateurError(f"the vision tower of a {vlm.config.model_type} model is not a model of a supported "
                            "family (its MLP channels: secateur.models.qwen_vision, --towers vision)")
    if tower == "vision":
        model = _get(vlm, vpath)
    else:
        text_cfg = vlm.config.text_config
        cls = family_class(t.text_family or text_cfg.model_type)
        if cls is None or cls.modality != "text":
            raise SecateurError(f"the language tower's family {text_cfg.model_type!r} is not supported")
        if t.text_family is not None:  # the stand-in family's config with the VLM text config's values
            drop = ("model_type", "architectures", "transformers_version", "auto_map")
            text_cfg = cls.config_class.from_dict({k: v for k, v in text_cfg.to_dict().items() if k not in drop})
        with torch.device("meta"):
            model = _embeds_class(cls.model_class)(text_cfg)
        model.model = _get(vlm, lpath)
        model.lm_head = _get(vlm, head)
        model.config = text_cfg
        model.eval()
    fam = getattr(model.config, "model_type", None)
    if family_class(fam) is None:
        raise SecateurError(f"the {tower} tower's family {fam!r} is not supported")
    return model


_EMBEDS_CLASSES: dict[type, type] = {}


def _embeds_class(model_class: type) -> type:
    """``model_class`` whose forward also takes floating "ids": the merged image + text embeddings of a VLM's
    calibration pairs (:func:`merged_embeddings`), passed on as ``inputs_embeds`` (the engine slices them along
    dimension 0 in chunks like token ids; the family's adapter, checks and exports see the stock class)."""
    if model_class not in _EMBEDS_CLASSES:
        def forward(self, input_ids=None, inputs_embeds=None, **kw):
            if input_ids is not None and input_ids.is_floating_point():
                input_ids, inputs_embeds = None, input_ids
                hidden = int(self.config.hidden_size)
                if inputs_embeds.shape[-1] > hidden:  # M-RoPE position ids carried as trailing channels
                    kw["position_ids"] = inputs_embeds[..., hidden:].round().long().permute(2, 0, 1)
                    inputs_embeds = inputs_embeds[..., :hidden]
            return model_class.forward(self, input_ids=input_ids, inputs_embeds=inputs_embeds, **kw)

        _EMBEDS_CLASSES[model_class] = type(model_class.__name__, (model_class,), {"forward": forward})
    return _EMBEDS_CLASSES[model_class]


@torch.no_grad()
def merged_embeddings(vlm: nn.Module, input_ids: torch.Tensor, pixel_values: torch.Tensor,
                      chunk: int = 8) -> torch.Tensor:
    """The language model's input embeddings for image + text sequences, as the VLM's own forward merges them (its
    image features scattered into the image-token positions): captured at the language model's entry. Qwen2.5-VL
    also gives its language model M-RoPE position ids (``[3, N, T]``: temporal, height and width of the image
    tokens): they are appended as trailing channels (``[N, T, hidden + 3]``, exact integers in float32), which the
    language stand-in's forward splits off again (:func:`_embeds_class`)."""
    t = vlm_type(vlm.config)
    lm = _get(vlm, t.language)
    got: list[torch.Tensor] = []

    class _Stop(Exception):
        pass

    def hook(_m, args, kwargs):
        emb = kwargs["inputs_embeds"].detach().float()
        if t.patches:
            emb = torch.cat([emb, kwargs["position_ids"].detach().permute(1, 2, 0).float()], -1)
        got.append(emb)
        raise _Stop

    h = lm.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        for s in range(0, input_ids.shape[0], chunk):
            try:
                vlm.model(**vlm_inputs(vlm, input_ids[s:s + chunk], pixel_values[s:s + chunk]))
            except _Stop:
                pass
    finally:
        h.remove()
    return torch.cat(got)
