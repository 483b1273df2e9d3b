"""Driver side: run the training loop on a Ray cluster with ``TorchTrainer`` and export the model.

The run directory is ``<storage_path>/<run_name>``; Ray Train restores its state from there,
so re-running an identical configuration resumes it instead of starting over. With
``num_workers=0`` the run uses Ray Train's local mode: the loop runs in this process (no
controller or worker processes to start, which is most of a tiny run's time), one run at a
time, and writes its checkpoints to the same run folder (docs/training.md, "Local mode").

The storage is a local folder or any pyarrow URI (:mod:`raycompat.storage`); it is checked
for writing before any worker starts, and the export location is checked too: another model
there is not replaced unless ``overwrite`` (:func:`raycompat.train.export.check_bundle_target`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
from dataclasses import dataclass

from raycompat import console
from raycompat.models import ModelBundle
from raycompat.storage import is_uri, local_copy, open_storage
from raycompat.train.config import TrainConfig
from raycompat.train.export import check_bundle_target
from raycompat.train.loop import BUNDLE_DIR, HISTORY, is_local_mode, train_loop_per_worker


@dataclass
class TrainRun:
    """What a finished run left behind."""

    bundle_path: str  # exported model bundle (manifest + state dicts)
    checkpoint_path: str  # the final Ray Train checkpoint
    run_path: str  # the Ray Train run folder
    history: list[dict]  # one metrics dict per epoch

    def load(self) -> ModelBundle:
        return ModelBundle.load(self.bundle_path)


#: How often the Ray Train controller polls its workers (Ray's default is 2 s). A worker holds
#: one unconsumed ``ray.train.report`` at a time, so with Ray's default every epoch shorter than
#: 2 s waits for the next poll. Set ``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S`` to override.
CONTROLLER_POLL_INTERVAL_S = "0.25"


def console_settings():
    """``(LoggingConfig, worker env_vars)`` of a run: unless the job is verbose
    (:func:`raycompat.console.is_verbose`), Ray Train's own INFO lines (worker group start,
    "Checkpoint successfully created", "Reporting training result ...") are off on the
    controller and the workers; ``RAYCOMPAT_VERBOSE`` reaches the workers, whose loop then
    prints one progress line per epoch (and, verbose, one line every ``log_every`` steps)."""
    import ray.train

    verbose = console.is_verbose()
    logging_config = ray.train.LoggingConfig(log_level="INFO" if verbose else "WARNING")
    return logging_config, {"RAYCOMPAT_VERBOSE": "1" if verbose else "0"}


def fit(cfg: TrainConfig, export_to: str | None = None, overwrite: bool = False) -> TrainRun:
    """Train with ``cfg.num_workers`` DDP workers; copy the final bundle to ``export_to``.
    A different model already at ``export_to`` is refused before training (``ConfigError``)
    unless ``overwrite``; a bundle trained with the same model options is exported again.
    ``num_workers=0``: Ray Train's local mode, in this process."""
    cfg.validate()
    if export_to:
        check_bundle_target(export_to, cfg.to_dict(), overwrite)
    # read by the driver when it starts the controller actor (Ray propagates it there)
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", CONTROLLER_POLL_INTERVAL_S)
    storage = open_storage(cfg.storage_path)  # StorageError now, not after the first epoch
    finished = finished_run(cfg, storage)
    if finished is not None:
        if export_to:
            finished.bundle_path = _export(finished.bundle_path, export_to)
        return finished
    trainer = _trainer(cfg, storage)
    if is_local_mode(cfg):
        return _fit_local(cfg, trainer, storage, export_to)
    result = trainer.fit()
    if result.checkpoint is None:
        raise RuntimeError(f"training run {cfg.run_name} finished without a checkpoint")
    checkpoint_path = result.checkpoint.path
    if not storage.local:
        checkpoint_path = _as_uri(storage, checkpoint_path)
    with result.checkpoint.as_directory() as local_checkpoint:  # a download for remote storage
        with open(os.path.join(local_checkpoint, HISTORY)) as f:
            history = json.load(f)
        bundle_path = os.path.join(checkpoint_path, BUNDLE_DIR)
        if export_to:
            bundle_path = _export(os.path.join(local_checkpoint, BUNDLE_DIR), export_to)
    run_path = str(result.path) if storage.local else _as_uri(storage, str(result.path))
    return TrainRun(
        bundle_path=bundle_path, checkpoint_path=checkpoint_path, run_path=run_path, history=history
    )


def _trainer(cfg: TrainConfig, storage):
    """The ``TorchTrainer`` of ``cfg``: its workers, storage, failures, checkpoints, logs."""
    import ray.train
    from ray.train.torch import TorchTrainer

    logging_config, worker_env = console_settings()
    resources = {"CPU": cfg.cpus_per_worker}
    if cfg.use_gpu:
        resources["GPU"] = cfg.gpus_per_worker
    scaling = (
        ray.train.ScalingConfig(num_workers=0)
        if is_local_mode(cfg)
        else ray.train.ScalingConfig(
            num_workers=cfg.num_workers,
            use_gpu=cfg.use_gpu,
            resources_per_worker=resources,
            placement_strategy=cfg.placement.upper().replace("-", "_"),
        )
    )
    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config=cfg.to_dict(),
        scaling_config=scaling,
        run_config=ray.train.RunConfig(
            name=cfg.run_name,
            storage_path=storage.uri,
            failure_config=ray.train.FailureConfig(max_failures=cfg.max_failures),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=cfg.checkpoints_to_keep),
            logging_config=logging_config,
            worker_runtime_env={"env_vars": worker_env},
        ),
    )


#: Ray Train's local mode keeps one training context per process: local runs take turns
_LOCAL_RUN = threading.Lock()


def _fit_local(cfg: TrainConfig, trainer, storage, export_to: str | None) -> TrainRun:
    """Run the loop in this process (local mode, one run at a time), leaving this process's
    torch threads and random states as they were; the run is then read back from the
    checkpoints the loop wrote (:func:`finished_run`)."""
    with _LOCAL_RUN, _process_state_kept():
        trainer.fit()
    run = finished_run(cfg, storage, anywhere=True)
    if run is None:
        raise RuntimeError(f"training run {cfg.run_name} finished without a checkpoint")
    if export_to:
        run.bundle_path = _export(local_copy(run.bundle_path), export_to)
    return run


@contextlib.contextmanager
def _process_state_kept():
    """Torch's intra-op threads and the torch and numpy random states, restored on exit (the
    loop sets them for its run)."""
    import numpy as np
    import torch

    threads, torch_rng, numpy_rng = (
        torch.get_num_threads(),
        torch.get_rng_state(),
        np.random.get_state(),
    )
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.set_rng_state(torch_rng)
        np.random.set_state(numpy_rng)


def finished_run(cfg: TrainConfig, storage, anywhere: bool = False) -> TrainRun | None:
    """The run ``cfg.run_name`` when it has already trained every epoch of this configuration
    (docs/training.md, "Resume"): its last checkpoint ``epoch_<epochs>`` holds the history of
    every epoch and a bundle trained with the same model options. Re-running it would only
    restore that checkpoint, at the cost of starting Ray Train's controller and workers (tens
    of seconds), so :func:`fit` returns it as it is. Local storage only (elsewhere Ray Train
    restores the run), unless ``anywhere`` (a local-mode run, read back after it finished)."""
    from raycompat.train.export import bundle_differences

    if not (storage.on_disk or anywhere) or not cfg.run_name:
        return None
    run = storage.child(cfg.run_name)
    checkpoint = run.child(f"epoch_{cfg.epochs:04d}")
    try:
        history = json.loads(checkpoint.read_bytes(HISTORY))
    except (OSError, ValueError):
        return None
    manifest = checkpoint.read_json(BUNDLE_DIR, "manifest.json")
    if not isinstance(history, list) or len(history) != cfg.epochs or manifest is None:
        return None
    if bundle_differences(manifest, cfg.to_dict()):
        return None
    return TrainRun(
        bundle_path=checkpoint.join(BUNDLE_DIR),
        checkpoint_path=checkpoint.uri,
        run_path=run.uri,
        history=history,
    )


def _as_uri(storage, fs_path: str) -> str:
    """A path inside the storage's filesystem, written as a URI under the storage."""
    relative = (
        fs_path[len(storage.root) :].lstrip("/") if fs_path.startswith(storage.root) else fs_path
    )
    return storage.join(relative)


def _export(local_bundle: str, export_to: str) -> str:
    """Copy the bundle folder to ``export_to`` (a local path or a storage URI), atomically
    for local paths; returns where it went."""
    if is_uri(export_to):
        parent, name = export_to.rstrip("/").rsplit("/", 1)
        return open_storage(parent).upload_dir(local_bundle, name)
    export_to = os.path.abspath(os.path.expanduser(export_to))
    tmp = export_to + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(local_bundle, tmp)
    shutil.rmtree(export_to, ignore_errors=True)
    os.replace(tmp, export_to)
    return export_to
