"""Ray Train: one DDP training loop for every method (``loop``), the driver (``trainer``),
and the training jobs (``job``, ``old_job``, ``ract_job``).

``fit`` and ``TrainRun`` are imported on first use (they import Ray Train and torch), so a
job's ``--help`` and its option checks start quickly.
"""

from raycompat.train.config import TrainConfig

__all__ = ["TrainConfig", "TrainRun", "fit"]


def __getattr__(name: str):
    if name in ("TrainRun", "fit"):
        from raycompat.train import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'raycompat.train' has no attribute {name!r}")
