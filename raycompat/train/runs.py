"""Named, resumable training runs for jobs that train several models (the main job, the
reproduction report): the run name carries a hash of the options, so re-running a job with
identical options resumes or reuses its runs instead of retraining."""

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

    cfg = TrainConfig.from_dict(dict(values, storage_path=runs_dir, run_name=f"{name}-{tag}"))
    started = time.time()
    run = fit(cfg, export_to=os.path.join(models_dir, export_name or name), overwrite=overwrite)
    return run, time.time() - started
