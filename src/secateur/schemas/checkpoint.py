"""The schema of a prune checkpoint's ``manifest.json`` (:mod:`secateur.calib.resume`): the marker, the output it
belongs to and the run's fingerprint, typed so that a damaged or hand-edited manifest is one line (remove the
checkpoint folder, or drop ``--resume``) instead of a TypeError while comparing fingerprints.

Open: a newer secateur may add keys to the manifest; the ones read here are checked.
"""

from __future__ import annotations

from typing import Any

from secateur.schemas import NonNegInt, Open


class Fingerprint(Open):
    """Everything that determines a checkpointed run's result: a prune's (``resume.fingerprint``: options, model
    files, calibration digest, versions) or another run's own keys (the CoCurve sweep of the bench: model, preset,
    sweep config, tokens); the keys a prune writes are typed when present."""

    options: dict[str, Any] | None = None
    model_files: Any = None  # [[name, size, mtime_ns], ...] of a local model, or the digest of in-memory weights
    calibration_sha256: str | None = None
    versions: dict[str, Any] | None = None


class CheckpointManifest(Open):
    """``<parent>/.<name>.secateur-ckpt/manifest.json``."""

    secateur_checkpoint: NonNegInt
    out: str
    fingerprint: Fingerprint


__all__ = ["CheckpointManifest", "Fingerprint"]
