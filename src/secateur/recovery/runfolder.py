"""The pruned run a recovery starts from: a ``secateur prune --out`` folder, checked before any weight is read.

* ``secateur-report.json``: read and validated (:class:`~secateur.schemas.report.RunReport`), its ``kind`` one of
  ``unstructured`` (same shapes, zeros where ``secateur-masks.npz`` says) or ``structured`` (sliced: smaller dense
  tensors, stock or per-layer config, :mod:`secateur.models.hetero`);
* the weights and config: :func:`secateur.models.loading.check_model` (family, files, every tensor's shape);
* the masks of a masked run: ``secateur-masks.npz`` (:func:`secateur.masks_file.load_masks`), required.

The model itself loads with one :func:`secateur.models.loading.load_model` call (per-layer widths included).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from secateur.errors import SecateurError
from secateur.safe_write import MASKS_NAME, REPORT_NAME

FIX = "pass a folder that secateur prune --out wrote"


@dataclass
class PrunedRun:
    path: Path
    report: dict
    config: dict | None

    @property
    def kind(self) -> str:
        return self.report["kind"]

    @property
    def masked(self) -> bool:
        return self.kind == "unstructured"

    def masks(self) -> dict[str, torch.Tensor]:
        from secateur.masks_file import load_masks

        try:
            return load_masks(self.path / MASKS_NAME)
        except Exception as e:  # noqa: BLE001 - a damaged archive is one line
            raise SecateurError(f"{self.path / MASKS_NAME} cannot be read ({type(e).__name__}); {FIX}, or prune "
                                "again") from None


def open_run(run_dir: str) -> PrunedRun:
    """The run folder ``run_dir`` checked (report, kind, masks file, config and weight files), nothing loaded."""
    from secateur.files import read_json
    from secateur.models.loading import check_model
    from secateur.report.load import check_schema
    from secateur.schemas.report import RunReport, parse_at

    path = Path(run_dir)
    if not path.exists():
        raise SecateurError(f"run folder {run_dir} does not exist; {FIX}")
    if not path.is_dir():
        raise SecateurError(f"run folder {run_dir} is not a folder; {FIX}")
    rep_path = path / REPORT_NAME
    if not rep_path.is_file():
        raise SecateurError(f"run folder {run_dir} has no {REPORT_NAME} (not a secateur prune output); {FIX}")
    report = read_json(rep_path, FIX)
    if not isinstance(report, dict) or "method" not in report:
        raise SecateurError(f"{rep_path} is not a secateur prune report (no 'method'); {FIX}")
    check_schema(report, rep_path)
    parse_at(RunReport, report, str(rep_path), FIX)
    if report.get("kind") not in ("unstructured", "structured"):
        raise SecateurError(f"{rep_path}: kind {report.get('kind')!r} is neither unstructured nor structured; {FIX}")
    if report.get("recovery"):
        raise SecateurError(f"run folder {run_dir} is already a recovery output; recover from the pruned run itself")
    if report["kind"] == "unstructured" and not (path / MASKS_NAME).is_file():
        raise SecateurError(f"run folder {run_dir} has no {MASKS_NAME} (the masks of its masked run); {FIX}")
    cfg = check_model(str(path))
    return PrunedRun(path, report, cfg)


def read_recipe(run: PrunedRun) -> dict:
    """The run's ``secateur-recipe.yaml`` as a dict (``{}`` when absent or unreadable: only the teacher lookup and
    the card read it)."""
    import yaml

    from secateur.export.card import RECIPE_NAME

    try:
        data = yaml.safe_load((run.path / RECIPE_NAME).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return {}
    return data if isinstance(data, dict) else {}
