"""Named, resumable training runs: the run name carries a hash of the options that decide the
model, so re-running a job with identical options resumes or reuses its runs instead of
retraining (the main job, the reproduction report, and the training jobs' default names,
:func:`default_run_name`)."""

from __future__ import annotations

import hashlib
import json
import os
import time
from typing import Any


def config_tag(*parts: Any) -> str:
    """Identical parts -> identical 10-hex-digit tag (sha256 of their sorted JSON)."""
    blob = json.dumps(list(parts), sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:10]


def default_run_name(prefix: str, cfg) -> str:
    """``<prefix>-<tag>`` for a :class:`~raycompat.train.TrainConfig`: the tag hashes every
    field that decides the trained model (not where or how the run executes:
    :data:`~raycompat.train.export.RUN_ONLY_FIELDS`) and the fingerprints of its old and init
    bundles where they exist, so the same configuration (against the same predecessor) gets the
    same name and resumes from its last checkpoint."""
    from raycompat.config import ConfigError
    from raycompat.models.fingerprint import bundle_fingerprint
    from raycompat.train.export import RUN_ONLY_FIELDS

    values = {k: v for k, v in cfg.to_dict().items() if k not in RUN_ONLY_FIELDS}
    # the batches as trained (the method's own when unset); random ones, what every run trained
    # before other batches existed, are left out so that those runs keep their names
    for key in ("batch_images_per_class", "batch_old_fraction"):
        values.pop(key, None)
    values.update(cfg.batches())
    bundles = {}
    for key in ("old_model", "init_model"):
        path = values.get(key)
        try:
            bundles[key] = None if path is None else bundle_fingerprint(path)
        except ConfigError:  # not there yet (checked later): the path alone names it
            bundles[key] = None
    return f"{prefix}-{config_tag(values, bundles)}"


def train_named(
    values: dict,
    name: str,
    tag: str,
    runs_dir: str,
    models_dir: str,
    export_name: str | None = None,
    overwrite: bool = False,
):
    """Train ``TrainConfig.from_dict(values)`` as run ``<name>-<tag>`` under ``runs_dir`` and
    export its bundle to ``<models_dir>/<export_name or name>``. Returns ``(TrainRun, wall s)``."""
    from raycompat.train import TrainConfig, fit
    from raycompat.train.data import check_training_images

    cfg = TrainConfig.from_dict(dict(values, storage_path=runs_dir, run_name=f"{name}-{tag}"))
    check_training_images(cfg)  # your images: a bad one is named before the workers start
    started = time.time()
    run = fit(cfg, export_to=os.path.join(models_dir, export_name or name), overwrite=overwrite)
    return run, time.time() - started
