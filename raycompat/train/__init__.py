"""Ray Train: one DDP training loop for every method (``loop``), the driver (``trainer``)."""
from raycompat.train.config import TrainConfig
from raycompat.train.trainer import TrainRun, fit

__all__ = ["TrainConfig", "TrainRun", "fit"]
