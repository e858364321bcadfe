"""LoRA recovery of a pruned run (``secateur recover RUN_DIR --out DIR``): adapters on every attention and MLP
projection, trained to match the dense teacher (top-k distillation KL) or the text (cross-entropy) on text disjoint
from every evaluation split, merged into the pruned weights (masked runs: the masks re-applied exactly) and written
as a run folder like any other. See ``docs/recovery.md``.

Modules: :mod:`~.options` (the settings and their checks), :mod:`~.runfolder` (the pruned run), :mod:`~.teacher`
(the dense model, found from the run), :mod:`~.data` (training and held-out windows), :mod:`~.loss`,
:mod:`~.lora` (peft adapters, merge, masks), :mod:`~.plan` (memory plan), :mod:`~.train` (the loop and its
checkpoints), :mod:`~.output` (the run folder, card, recipe, adapter folder), :mod:`~.run` (:func:`recover`),
:mod:`~.cli` (``secateur recover``).
"""

from secateur.recovery.options import RecoverOptions
from secateur.recovery.run import RecoverResult, recover

__all__ = ["RecoverOptions", "RecoverResult", "recover"]
