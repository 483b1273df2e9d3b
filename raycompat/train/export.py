"""Where a training run exports its model bundle: never over another model by accident.

:func:`check_bundle_target` runs before any training (``fit`` calls it, and so can a job
before it starts Ray). An export location that holds a bundle trained with the same model
configuration is ``identical``: the run goes ahead (it resumes from its checkpoints when its
run name is the same) and exports the same model again. Anything else there (a bundle trained
with another configuration, a file, a folder of other files) is refused with a
``ConfigError`` naming the path, unless ``overwrite`` (``--overwrite``) is given. See
docs/architecture.md, "Jobs".
"""

from __future__ import annotations

import hashlib
import json
import os

from raycompat.config import ConfigError
from raycompat.outputs import config_differences
from raycompat.storage import is_uri, resolve_location

__all__ = ["RUN_ONLY_FIELDS", "check_bundle_target", "scenario_fingerprint"]

#: TrainConfig fields that say where and how a run executes, not which model it trains:
#: left out when an existing bundle's ``train_config`` is compared with a new run's
RUN_ONLY_FIELDS = (
    "run_name",
    "storage_path",
    "log_every",
    "diagnostics_dir",
    "max_failures",
    "checkpoints_to_keep",
    "loader_workers",
    "threads_per_worker",
    "cpus_per_worker",
    "placement",
    "gpus_per_worker",
    "use_gpu",
)


def scenario_fingerprint(scenario: dict) -> str:
    """sha256 (16 hex) of a scenario dict's sorted JSON: equal data, equal fingerprint."""
    blob = json.dumps(scenario, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _model_fields(train_config: dict) -> dict:
    drop = set(RUN_ONLY_FIELDS) | {"scenario"}
    kept = {k: v for k, v in train_config.items() if k not in drop}
    return json.loads(json.dumps(kept, sort_keys=True, default=str))


def _train_config_defaults() -> dict:
    from raycompat.train.config import TrainConfig

    return TrainConfig().to_dict()


def _old_model_fingerprint(old_model: str) -> str:
    from raycompat.models.fingerprint import bundle_fingerprint

    return bundle_fingerprint(old_model if is_uri(old_model) else os.path.expanduser(old_model))


def bundle_differences(manifest: dict, train_config: dict) -> str:
    """The model options that differ between a bundle's manifest and a run's
    ``train_config`` (``TrainConfig.to_dict()``, with or without its scenario); ``''``
    when none does. The old model and the data are compared by fingerprint where the
    manifest records one."""
    there = _model_fields(manifest.get("train_config") or {})
    here = _model_fields(train_config)
    if there:  # an option added after the bundle was trained, at its default: the same model
        defaults = _model_fields(_train_config_defaults())
        there |= {k: v for k, v in here.items() if k not in there and v == defaults.get(k)}
    recorded = (manifest.get("predecessor") or {}).get("fingerprint")
    if recorded and here.get("old_model"):
        there["old_model"], here["old_model"] = recorded, _old_model_fingerprint(here["old_model"])
    data = (manifest.get("data") or {}).get("fingerprint")
    if data and train_config.get("scenario"):
        there["scenario"], here["scenario"] = data, scenario_fingerprint(train_config["scenario"])
    return config_differences(there, here)


def check_bundle_target(path: str, train_config: dict, overwrite: bool) -> str:
    """``'new'`` (nothing at ``path``, or an empty folder), ``'identical'`` (a bundle trained
    with the same model configuration: the run goes ahead) or ``'overwrite'``
    (``overwrite``); anything else raises ``ConfigError`` naming ``path`` and what it holds."""
    target = resolve_location(path, "--out")
    kind, names = target.kind(), target.listdir()
    if kind == "missing" or (kind == "folder" and not names):
        return "new"
    if overwrite:
        return "overwrite"
    manifest = target.read_json("manifest.json")
    if kind == "file":
        holds = "a file"
    elif manifest is None:
        holds = f"files ({', '.join(names[:3])}) but no model bundle (no manifest.json)"
    elif not manifest.get("train_config"):
        holds = "a model bundle with no recorded training config (not trained by this project)"
    else:
        diff = bundle_differences(manifest, train_config)
        if not diff:
            return "identical"
        holds = f"a model bundle trained with a different config ({diff})"
    raise ConfigError(f"{path} holds {holds}: pass --overwrite to replace it, or another --out")
