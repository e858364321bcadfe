"""A pruned tower's new sizes written into its vision-language model's config (the modules are the VLM's own
already): :func:`write_back`, shared by the one-tower runs (:mod:`secateur.vlm_run`) and the joint run
(:mod:`secateur.vlm_joint`)."""

from __future__ import annotations

from secateur.errors import SecateurError


def write_back(vlm, tower: str, model, per_layer: bool = False) -> str:
    """Put the pruned tower's sizes into the VLM's config (the modules are the VLM's already); returns the route.
    Per-layer widths: refused (the per-tower runs), or with ``per_layer`` (``--towers joint``) the tower's sub-config
    becomes its family's per-layer config (``secateur_<family>``, :mod:`secateur.models.hetero`), which the VLM's
    ``AutoModel.from_config`` builds in a process that imported secateur."""
    from secateur.export.sliced import export_config
    from secateur.models.families import family_of as model_family
    from secateur.models.towers import vlm_type

    cfg, route = export_config(model)
    key = "vision_config" if tower == "vision" else "text_config"
    if route != "stock":
        if tower == "vision" and not vlm_type(vlm.config).vision_per_layer:
            raise SecateurError(f"the pruned vision tower has per-layer widths (or fewer heads), which a "
                                f"{vlm.config.model_type} folder cannot reload (it builds its vision tower from its "
                                "own class): prune its vision tower with the same widths in every layer and all "
                                "heads kept (MLP channels, a uniform allocation), or --towers joint:language")
        if tower == "language" and not vlm_type(vlm.config).language_per_layer:
            raise SecateurError(f"the pruned language tower has per-layer widths, which a {vlm.config.model_type} "
                                "folder cannot reload (it builds its language model from its own class): use a "
                                "uniform allocation (the same widths in every layer) for its language tower")
        if not per_layer:
            raise SecateurError(f"the pruned {tower} tower has per-layer widths, which a {vlm.config.model_type} "
                                "config cannot express: use an unstructured method or a uniform allocation for a VLM "
                                "tower, or --towers joint (per-layer configs)")
        d = {k: v for k, v in cfg.to_dict().items() if k not in ("auto_map", "architectures")}
        setattr(vlm.config, key, type(cfg).from_dict(d))
        return route
    sub = getattr(vlm.config, key)
    keys = None
    if type(sub) is not type(cfg):  # a stand-in family's config (Qwen2.5-VL's text tower as Qwen2): its sizes only
        from secateur.models.families import layout_of

        lay = layout_of(model_family(cfg))
        keys = {lay.heads_key, lay.kv_heads_key, lay.inter_key, "head_dim", "num_hidden_layers"}
    for k, v in cfg.to_dict().items():
        if hasattr(sub, k) and k not in ("architectures", "model_type", "transformers_version", "dtype") \
                and (keys is None or k in keys):
            setattr(sub, k, v)
    return route
