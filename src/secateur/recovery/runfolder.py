"""The pruned run a recovery starts from: a ``secateur prune --out`` folder, checked before any weight is read.

* ``secateur-report.json``: read and validated (:class:`~secateur.schemas.report.RunReport`), its ``kind`` one of
  ``unstructured`` (same shapes, zeros where ``secateur-masks.npz`` says) or ``structured`` (sliced: smaller dense
  tensors, stock or per-layer config, :mod:`secateur.models.hetero`);
* the weights and config: :func:`secateur.models.loading.check_model` (family, files, every tensor's shape);
* the masks of a masked run: ``secateur-masks.npz`` (:func:`secateur.masks_file.read_packed`), required and
  checked against the run before use (:func:`check_masks`): a mask for every module of the report's
  ``realized_sparsity.per_module`` and for nothing else, each with its weight's shape (from the safetensors
  headers; GPT-2's ``Conv1D`` stores the transpose) and the realized sparsity the report records (per module and
  in total). A masks file that is empty, foreign, partial or of another run would otherwise be silently wrong: a
  recovery without its masks merges a dense delta and undoes the pruning.

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
        """The run's masks (checked by :func:`open_run`)."""
        from secateur.masks_file import load_masks

        return load_masks(self.path / MASKS_NAME)


MASKS_FIX = "restore the run's own masks file, or prune again"


def _weight_shape(held: dict[str, tuple[int, ...]], module: str) -> tuple[int, ...] | None:
    """The stored shape of ``module``'s weight: under its full name, or under the name without the base-model
    prefix (a folder saved from the base model)."""
    name = module + ".weight"
    if name in held:
        return held[name]
    _, _, rest = name.partition(".")
    return held.get(rest) if rest else None


def check_masks(path: Path, report: dict, config: dict | None) -> None:
    """The masks file of the masked run at ``path`` against the run (module docstring); one line naming the file
    and the first mask that disagrees."""
    from secateur.errors import one_line
    from secateur.masks_file import read_packed
    from secateur.models.folder_check import held_shapes, weight_files

    where = str(path / MASKS_NAME)
    packed = read_packed(path / MASKS_NAME)
    rs = report.get("realized_sparsity") if isinstance(report.get("realized_sparsity"), dict) else {}
    per = rs.get("per_module") if isinstance(rs.get("per_module"), dict) else None
    if per is not None:
        missing, extra = sorted(set(per) - set(packed)), sorted(set(packed) - set(per))
        if missing:
            raise SecateurError(f"{where} has no mask for {one_line(missing[0])}"
                                f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}, which the run's "
                                f"report records as pruned; {MASKS_FIX}")
        if extra:
            raise SecateurError(f"{where} holds a mask for {one_line(extra[0])}, which the run's report does not "
                                f"record as pruned; {MASKS_FIX}")
    files = weight_files(str(path), path) or []
    held = held_shapes(files)
    from secateur.models.families import family_class

    fam = family_class((config or {}).get("model_type"))
    conv1d = bool(fam is not None and fam.layout is not None and fam.layout.conv1d)
    pruned = total = 0
    for name, p in packed.items():
        shape = _weight_shape(held, name)
        if shape is None:
            raise SecateurError(f"{where} holds a mask for {one_line(name)}, which has no weight in the run's "
                                f"files; {MASKS_FIX}")
        want = tuple(reversed(shape)) if conv1d else shape
        if p.shape != want:
            raise SecateurError(f"{where}: the mask of {one_line(name)} has shape {list(p.shape)}, its weight "
                                f"{list(want)} (as [out, in]); {MASKS_FIX}")
        n = p.pruned()
        pruned, total = pruned + n, total + p.numel
        frac = per.get(name) if per is not None else None
        if isinstance(frac, (int, float)) and not isinstance(frac, bool) and abs(n / p.numel - frac) > 1e-5:
            raise SecateurError(f"{where}: the mask of {one_line(name)} prunes {n / p.numel:.6f} of its weights, "
                                f"the run's report records {frac:.6f}; {MASKS_FIX}")
    for key, have in (("pruned_weights", pruned), ("targeted_weights", total)):
        want = rs.get(key)
        if isinstance(want, int) and not isinstance(want, bool) and want != have:
            raise SecateurError(f"{where}: its masks count {have} {key.replace('_', ' ')}, the run's report "
                                f"records {want}; {MASKS_FIX}")


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
    if report["kind"] == "unstructured":
        check_masks(path, report, cfg)
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
