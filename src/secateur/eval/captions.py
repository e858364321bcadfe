"""Caption scores of a vision-language model (``secateur eval captions``, issue 47 §3): images in, captions scored.

On Fashion-MNIST test images (a seeded draw, through the VLM's own image processor and channel count), three
numbers, each over caption tokens only (the paper's scoring: the image and prompt tokens are context, never
scored):

* caption accuracy: the greedy caption (at most 8 new tokens after ``"Caption:"``) names the image's class
  (:func:`secateur.data.captions.named_class`: the longest class name it contains);
* caption perplexity: ``exp`` of the mean negative log-likelihood of the caption tokens and EOS under the two
  held-out templates (never used in calibration or training);
* multiple-choice accuracy: the class whose caption (first training template) has the highest summed
  log-likelihood of its tokens, among the ten (the answer-token harness of the paper's multiple-choice suites).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch
from torch import nn

from secateur.data.captions import HELD_OUT_TEMPLATES, NAMES, PROMPT, TEMPLATES, caption_ids, image_head, named_class
from secateur.errors import SecateurError
from secateur.models.towers import load_processor, vlm_inputs
from secateur.safe_write import check_writable_output, write_file_atomic
from secateur.schemas.api import checked_call

PROTOCOL = "fashion-mnist test captions: greedy 8 tokens, held-out-template perplexity, 10-way answer likelihood"


def caption_nll(vlm: nn.Module, pixel_values: torch.Tensor, ids: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-sequence summed negative log-likelihood of the ``target`` tokens (``[N]``): the LM head on the positions
    that predict a target token only (a 49k-row product over every position would be most of the cost)."""
    h = vlm.model(**vlm_inputs(vlm, ids, pixel_values)).last_hidden_state
    pred = target[:, 1:]  # position t predicts token t + 1
    logp = torch.log_softmax(vlm.lm_head(h[:, :-1][pred]).float(), -1)
    ll = logp.gather(-1, ids[:, 1:][pred][:, None])[:, 0]
    seq = torch.arange(ids.shape[0])[:, None].expand_as(pred)[pred]
    return -torch.zeros(ids.shape[0], dtype=ll.dtype).index_add(0, seq, ll)


@torch.no_grad()
def caption_scores(vlm: nn.Module, tok, pixel_values: torch.Tensor, labels: np.ndarray, batch: int = 16) -> dict:
    """The three scores of the module docstring on these images (``labels``: their class indices into NAMES)."""
    vlm.eval()
    hit = mc = 0
    nll = toks = 0.0
    prompt = caption_ids(tok, vlm.config, [""], pixel_values)[0]
    prompt = prompt[:, :len(image_head(tok, vlm.config, pixel_values)) + len(tok(PROMPT, add_special_tokens=False)
                                                                             ["input_ids"])]
    for s in range(0, len(labels), batch):
        x, y = pixel_values[s:s + batch], labels[s:s + batch]
        n = len(y)
        ids = prompt.repeat(n, 1)
        out = vlm.generate(**vlm_inputs(vlm, ids, x), attention_mask=torch.ones_like(ids), max_new_tokens=8,
                           do_sample=False, pad_token_id=tok.eos_token_id)
        texts = tok.batch_decode(out[:, ids.shape[1]:], skip_special_tokens=True)
        hit += sum(named_class(t) == NAMES[int(c)] for t, c in zip(texts, y, strict=True))
        for tpl in HELD_OUT_TEMPLATES:
            ids_t, target = caption_ids(tok, vlm.config, [tpl.format(NAMES[int(c)]) for c in y], x)
            nll += float(caption_nll(vlm, x, ids_t, target).sum())
            toks += float(target.sum())
        scores = [-caption_nll(vlm, x, *caption_ids(tok, vlm.config, [TEMPLATES[0].format(name)] * n, x))
                  for name in NAMES]
        mc += int((torch.stack(scores, 1).argmax(1).numpy() == np.asarray(y)).sum())
    n = len(labels)
    return {"caption_accuracy": hit / n, "multiple_choice_accuracy": mc / n, "caption_ppl": float(np.exp(nll / toks)),
            "images": n, "protocol": PROTOCOL}


@checked_call
def eval_captions(model: str | os.PathLike, max_images: int = 200, seed: int = 0,
                  data_dir: str | os.PathLike | None = None, json_path: str | os.PathLike | None = None,
                  batch: int = 16) -> dict:
    """:func:`caption_scores` of the VLM folder ``model`` on ``max_images`` Fashion-MNIST test images drawn with
    ``seed``; inputs checked (output, folder, family) before anything is loaded; ``json_path`` written atomically."""
    from transformers import AutoModelForImageTextToText

    from secateur.data.images import processed_images
    from secateur.models.towers import VLM_TYPES

    if json_path is not None:
        check_writable_output(json_path, folder=False)
    if isinstance(max_images, bool) or not isinstance(max_images, int) or max_images < 1:
        raise SecateurError(f"--max-images must be a positive integer, got {max_images!r}; pass --max-images N "
                            "with N >= 1")
    cfg = Path(model) / "config.json"
    if not cfg.is_file():
        raise SecateurError(f"{model}: no config.json; pass a vision-language model folder")
    try:
        mt = json.loads(cfg.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError) as e:
        raise SecateurError(f"{cfg}: not readable JSON ({e})") from None
    if mt not in VLM_TYPES:
        raise SecateurError(f"{model} is {mt!r}, not a vision-language model ({', '.join(VLM_TYPES)}); captions "
                            "need one (an image classifier: secateur eval accuracy)")
    from secateur.extras import require

    require("PIL", "secateur eval captions")
    try:
        vlm = AutoModelForImageTextToText.from_pretrained(model).eval()
        proc = load_processor(model, vlm.config)
    except (OSError, ValueError, KeyError, ImportError) as e:
        raise SecateurError(f"{model}: the VLM or its processor does not load ({str(e).splitlines()[0]})") from None
    from secateur.data.captions import check_processor, vision_channels

    check_processor(proc, vlm.config)
    vc = vlm.config.vision_config
    imgs = processed_images("fashion-mnist", proc.image_processor, vision_channels(vc), int(vc.patch_size),
                            n=max_images, seed=seed, split="test", data_dir=data_dir, need_labels=True)
    res = caption_scores(vlm, proc.tokenizer, imgs.pixel_values, imgs.labels, batch)
    res.update(model=str(model), images_sha256=imgs.manifest["pixels_sha256"], images_manifest=imgs.manifest)
    if json_path:
        write_file_atomic(json_path, json.dumps(res, indent=2))
    return res


def _cmd_captions(args) -> int:
    res = eval_captions(args.model, args.max_images, args.seed, args.data_dir, args.json, args.batch)
    print(f"caption accuracy {res['caption_accuracy']:.4f}  multiple choice {res['multiple_choice_accuracy']:.4f}  "
          f"caption perplexity {res['caption_ppl']:.3f}  ({res['images']} Fashion-MNIST test images)")
    return 0


def register_cli(eval_subparsers) -> None:
    """``secateur eval captions --model VLM_FOLDER``."""
    p = eval_subparsers.add_parser(
        "captions", help="caption accuracy, caption perplexity and multiple-choice accuracy of a VLM",
        description=__doc__.split("\n\n")[1] if __doc__ else None)
    p.add_argument("--model", required=True, help="vision-language model folder (LLaVA, Idefics3, SmolVLM) with its "
                   "processor")
    p.add_argument("--max-images", type=int, default=200, metavar="N",
                   help="Fashion-MNIST test images drawn with --seed (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-dir", default=None, help="folder laid out like ../shared/data (default: SECATEUR_DATA)")
    p.add_argument("--json", default=None, metavar="FILE", help="write the result as JSON")
    p.add_argument("--batch", type=int, default=16)
    p.set_defaults(func=_cmd_captions)
