"""Everything one training run needs, as one JSON-able dataclass shipped to every worker."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from raycompat.config import ConfigError, choices, nonnegative, parse_options, positive


@dataclass
class TrainConfig:
    # what to train
    method: str = "independent"
    method_options: dict = field(default_factory=dict)
    backbone: str = "resnet10t"
    embed_dim: int = positive(128)
    head: str = choices("softmax", "cosface", "arcface", default="cosface")
    head_scale: float | None = None
    head_margin: float | None = None
    pretrained_path: str | None = None
    old_model: str | None = None          # bundle path of the frozen predecessor
    init_model: str | None = None         # bundle to start from (e.g. frozen phi_n for mcl)
    # data: a scenario dict (raycompat.data.Scenario.to_dict()) and the split to train on
    scenario: dict = field(default_factory=dict)
    split: str = "new_train"
    resolution: int = positive(32)
    in_chans: int = positive(1)
    data_seed: int = 0
    # optimisation
    epochs: int = positive(10)
    batch_size: int = positive(128)       # global batch, split evenly over workers
    optimizer: str = choices("sgd", "adamw", default="sgd")
    lr: float = positive(0.1)
    weight_decay: float = nonnegative(5e-4)
    momentum: float = nonnegative(0.9)
    warmup_epochs: int = nonnegative(1)
    seed: int = 0
    # execution
    num_workers: int = positive(1)
    use_gpu: bool = False
    gpus_per_worker: float = positive(1.0)
    cpus_per_worker: float = positive(1.0)
    threads_per_worker: int = 0           # 0: cores of this machine / workers
    loader_workers: int = nonnegative(0)
    max_failures: int = 2
    storage_path: str = "~/raycompat_runs"
    run_name: str = "train"
    checkpoints_to_keep: int = positive(2)
    log_every: int = positive(20)
    diagnostics_dir: str | None = None    # per-rank pid and parameter digests (tests)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "TrainConfig":
        cfg = parse_options(cls, values, owner="train config")
        cfg.validate()
        return cfg

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def validate(self) -> None:
        from raycompat.methods import method_class, parse_method_options

        cls = method_class(self.method)
        parse_method_options(self.method, self.method_options)
        if cls.needs_old_model and not self.old_model:
            raise ConfigError(f"method {self.method!r} needs old_model (--old-model PATH)")
        if getattr(cls, "needs_init_model", False) and not self.init_model:
            raise ConfigError(f"method {self.method!r} needs init_model "
                              "(the frozen new model, --init-model PATH)")
        if self.batch_size % self.num_workers:
            raise ConfigError(f"batch_size {self.batch_size} must be divisible by "
                              f"num_workers {self.num_workers}")
        if not self.scenario:
            raise ConfigError("scenario is empty: build one with raycompat.data.build_scenario")
        splits = self.scenario.get("splits", {})
        if self.split not in splits:
            raise ConfigError(f"split {self.split!r} is not in the scenario; "
                              f"allowed splits: {sorted(splits)}")
