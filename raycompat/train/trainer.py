"""Driver side: run the training loop on a Ray cluster with ``TorchTrainer`` and export the model.

The run directory is ``<storage_path>/<run_name>``; Ray Train restores its state from there,
so re-running an identical configuration resumes it instead of starting over.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass

from raycompat.models import ModelBundle
from raycompat.train.config import TrainConfig
from raycompat.train.loop import BUNDLE_DIR, HISTORY, train_loop_per_worker


@dataclass
class TrainRun:
    """What a finished run left behind."""

    bundle_path: str          # exported model bundle (manifest + state dicts)
    checkpoint_path: str      # the final Ray Train checkpoint
    run_path: str             # the Ray Train run folder
    history: list[dict]       # one metrics dict per epoch

    def load(self) -> ModelBundle:
        return ModelBundle.load(self.bundle_path)


def fit(cfg: TrainConfig, export_to: str | None = None) -> TrainRun:
    """Train with ``cfg.num_workers`` DDP workers; copy the final bundle to ``export_to``."""
    import ray.train
    from ray.train.torch import TorchTrainer

    cfg.validate()
    storage = os.path.abspath(os.path.expanduser(cfg.storage_path))
    os.makedirs(storage, exist_ok=True)
    resources = {"CPU": cfg.cpus_per_worker}
    if cfg.use_gpu:
        resources["GPU"] = cfg.gpus_per_worker
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config=cfg.to_dict(),
        scaling_config=ray.train.ScalingConfig(num_workers=cfg.num_workers, use_gpu=cfg.use_gpu,
                                               resources_per_worker=resources),
        run_config=ray.train.RunConfig(
            name=cfg.run_name, storage_path=storage,
            failure_config=ray.train.FailureConfig(max_failures=cfg.max_failures),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=cfg.checkpoints_to_keep)),
    )
    result = trainer.fit()
    if result.checkpoint is None:
        raise RuntimeError(f"training run {cfg.run_name} finished without a checkpoint")
    checkpoint_path = result.checkpoint.path
    with open(os.path.join(checkpoint_path, HISTORY)) as f:
        history = json.load(f)
    bundle_path = os.path.join(checkpoint_path, BUNDLE_DIR)
    if export_to:
        export_to = os.path.abspath(os.path.expanduser(export_to))
        tmp = export_to + ".partial"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(bundle_path, tmp)
        shutil.rmtree(export_to, ignore_errors=True)
        os.replace(tmp, export_to)
        bundle_path = export_to
    return TrainRun(bundle_path=bundle_path, checkpoint_path=checkpoint_path,
                    run_path=str(result.path), history=history)
