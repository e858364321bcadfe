"""The shared adapter of the vision encoder families (ViT, DeiT, DINOv2, SigLIP and CLIP vision towers).

A vision encoder block is the text block without a mask or positions in its attention: pre-LayerNorm,
bidirectional multi-head attention (``is_causal = False``; patch positions are added in the stem, so no RoPE),
a GELU MLP with biases, residual adds (DINOv2 scales each sublayer's output first: ``layer_scale``). What differs
from a language model is only what enters and what leaves, declared here as the adapter's modality:

* inputs: ``pixel_values [N, C, H, W]`` (:attr:`EncoderAdapter.main_input`); the engine slices them along dimension 0
  in chunks, as it slices token ids, and the stem (patch embedding, CLS/distillation tokens, position table) is
  the model's own forward, stopped at block 0 (:meth:`~secateur.models.families.base.Adapter.capture_inputs`);
* outputs: class logits or pooled features (:attr:`EncoderAdapter.auto_class`), never next-token logits, so the
  evaluators are accuracy and feature similarity, not perplexity.

Every model of a family is handled: the task model (``*ForImageClassification``) and its headless backbone
(``ViTModel``, ``SiglipVisionModel``...), whose block list is the task model's path without the backbone prefix
(:func:`secateur.models.hetero.layers_path`). The patch embedding, position table, CLS/distillation tokens,
pooler and classifier are never pruned: they are not among :attr:`~secateur.models.families.base.Adapter.projections`.
"""

from __future__ import annotations

from torch import nn

from secateur.models import hetero
from secateur.models.families.base import Adapter, Geometry, run_until


class EncoderAdapter(Adapter):
    """A pre-LN vision encoder: subclasses name their modules (the ``_names`` of norms, attention, MLP) and their
    stock classes; the staged forward below is common."""

    modality = "vision"
    main_input = "pixel_values"
    auto_class = "AutoModelForImageClassification"
    #: (attention norm, MLP norm, attention module, MLP module, final norm of the backbone)
    _names: tuple[str, str, str, str, str] = ("layernorm_before", "layernorm_after", "attention", "mlp", "layernorm")

    #: tokens the stem adds to the patch grid (ViT, DINOv2, CLIP: a CLS token; DeiT: CLS + distillation; SigLIP: 0)
    special_tokens = 1

    def sample_tokens(self, seqlen: int) -> int:
        return image_tokens(self.vision_config.to_dict(), self.special_tokens)

    @property
    def base(self) -> nn.Module:
        prefix = type(self.model).base_model_prefix
        return getattr(self.model, prefix, self.model)

    @property
    def layers(self) -> nn.ModuleList:
        return hetero.decoder_layers(self.family, self.model)

    @property
    def vision_config(self):
        """The config that holds the encoder's sizes (the model's own for a flat config)."""
        return getattr(self.config, "vision_config", None) or self.config

    @property
    def geometry(self) -> Geometry:
        """The unpruned geometry, from the config (as the text families read theirs): later passes of a run see the
        same numbers whatever an earlier one sliced (CORP narrows q/k block by block)."""
        c, lay = self.vision_config, self.layout
        heads = c.num_attention_heads
        inter = getattr(c, lay.inter_key)
        attn = getattr(self.layers[0], self._names[2])
        return Geometry(hidden=c.hidden_size, n_heads=heads, n_kv_heads=heads, head_dim=hetero.head_dim_of(c),
                        intermediate=int(inter * c.hidden_size) if lay.inter_ratio else inter, rope=False,
                        qkv_bias=getattr(attn, lay.q).bias is not None, o_bias=getattr(attn, lay.out).bias is not None,
                        mlp_bias=True, qk_norm=False, gated_mlp=False)

    def attn_norm(self, layer, h):
        return getattr(layer, self._names[0])(h)

    def attn_core(self, layer, x, kw):
        attn = getattr(layer, self._names[2])
        return run_until(lambda: attn(hidden_states=x, **kw), getattr(attn, self.layout.out))

    def mlp_norm(self, layer, h):
        return getattr(layer, self._names[1])(h)

    def mlp_core(self, layer, x):
        mlp = getattr(layer, self._names[3])
        return mlp.activation_fn(getattr(mlp, self.layout.mlp_in[0])(x))

    def final_hidden(self, h):
        return getattr(self.base, self._names[4])(h)

    def forward_until_stop(self, inputs) -> None:
        import torch

        from secateur.models.families.base import _Stop

        try:
            with torch.no_grad():
                self.model(**{self.main_input: inputs.to(self.device)})
        except _Stop:
            pass

    def check_calibration_length(self, seqlen: int) -> None:
        """Images have no sequence length to check (every image gives the same patch count)."""


def encoder_projections(layout: hetero.FamilyLayout, attn: str, mlp: str) -> tuple[tuple[str, str], ...]:
    """The prunable projections of an encoder block, ``(name inside the block, role)`` in forward order."""
    return ((f"{attn}.{layout.q}", "q"), (f"{attn}.{layout.k}", "k"), (f"{attn}.{layout.v}", "v"),
            (f"{attn}.{layout.out}", "o"), (f"{mlp}.{layout.mlp_in[0]}", "up"), (f"{mlp}.{layout.mlp_out}", "down"))


def vit_layout(layers: str) -> hetero.FamilyLayout:
    """ViT and DeiT: ``attention.{q,k,v,o}_proj``, ``mlp.fc1/fc2``, LayerNorms; q/k/v biases by ``qkv_bias``."""
    return hetero.FamilyLayout(
        layers=layers, attn="attention", q="q_proj", k="k_proj", v="v_proj", out="o_proj", mlp="mlp",
        mlp_in=("fc1",), mlp_out="fc2", heads_key="num_attention_heads", inter_key="intermediate_size",
        qkv_bias="qkv_bias", o_bias=True, mlp_bias=True, layer_norm=True)


def image_tokens(cfg: dict, special: int = 1) -> int:
    """Tokens an image gives the blocks of the encoder whose config is ``cfg``: its patch grid plus ``special``."""
    size, patch = cfg.get("image_size", 224), cfg.get("patch_size", 16)
    size = size if isinstance(size, list | tuple) else (size, size)
    patch = patch if isinstance(patch, list | tuple) else (patch, patch)
    return (int(size[0]) // int(patch[0])) * (int(size[1]) // int(patch[1])) + special
