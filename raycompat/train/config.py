"""Everything one training run needs, as one JSON-able dataclass shipped to every worker."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any

from raycompat.config import (
    ConfigError,
    choices,
    fraction,
    nonnegative,
    parse_options,
    positive,
)


@functools.lru_cache(maxsize=1)
def _timm_models() -> frozenset:
    import timm

    return frozenset(timm.list_models())


def check_backbone(name: str, key: str = "backbone") -> None:
    """``name`` must be a timm model name (the rule of ``raycompat.models.Embedder``)."""
    import difflib

    if name not in _timm_models():
        close = difflib.get_close_matches(str(name), sorted(_timm_models()), n=8)
        raise ConfigError(
            f"{key} {name!r} is not a timm model name"
            + (f"; similar names: {close}" if close else "")
        )


@dataclass
class TrainConfig:
    # what to train
    method: str = "independent"
    method_options: dict = field(default_factory=dict)
    backbone: str = "resnet10t"
    embed_dim: int = positive(128)
    head: str = choices("softmax", "cosface", "arcface", "dsimplex", default="cosface")
    head_scale: float | None = None
    head_margin: float | None = None
    pretrained_path: str | None = None
    old_model: str | None = None  # bundle path of the frozen predecessor
    init_model: str | None = None  # bundle to start from (e.g. frozen phi_n for mcl)
    # data: a scenario dict (raycompat.data.Scenario.to_dict()) and the split to train on
    scenario: dict = field(default_factory=dict)
    split: str = "new_train"
    resolution: int = positive(32)
    in_chans: int = positive(1)
    data_seed: int = 0
    # optimisation
    epochs: int = positive(10)
    batch_size: int = positive(128)  # global batch, split evenly over workers
    # class-balanced P x K batches, K images of each of batch_size / K classes
    # (raycompat.train.batches); 0: uniformly random batches; none: the method's own
    # (CompatMethod.batch_images_per_class: 4 for mcl and cl, 0 for the others)
    batch_images_per_class: int | None = None
    # the share of each batch drawn from the classes the old model knows, the rest from the
    # others (raycompat.train.batches.OldNewBatches); 0: not balanced; none: the method's own
    # (CompatMethod.batch_old_fraction: 0.5 for dsimplex, 0 for the others)
    batch_old_fraction: float | None = fraction(None)
    optimizer: str = choices("sgd", "adamw", default="sgd")
    lr: float = positive(0.1)
    weight_decay: float = nonnegative(5e-4)
    momentum: float = nonnegative(0.9)
    warmup_epochs: int = nonnegative(1)
    seed: int = 0
    # execution
    num_workers: int = nonnegative(1)  # 0: Ray Train's local mode (the driver's process)
    use_gpu: bool = False
    gpus_per_worker: float = positive(1.0)
    cpus_per_worker: float = positive(1.0)
    placement: str = choices("pack", "spread", "strict-spread", default="pack")
    threads_per_worker: int = 0  # 0: cores of this machine / workers
    loader_workers: int = nonnegative(0)
    max_failures: int = 2
    storage_path: str = "~/raycompat_runs"
    run_name: str = "train"
    checkpoints_to_keep: int = positive(2)
    log_every: int = positive(20)
    diagnostics_dir: str | None = None  # per-rank pid and parameter digests (tests)

    @classmethod
    def from_dict(cls, values: dict[str, Any], check_paths: bool = True) -> TrainConfig:
        cfg = parse_options(cls, values, owner="train config")
        cfg.validate(check_paths)
        return cfg

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def class_batch_size(self) -> int:
        """``K`` of the run's P x K batches (0: random batches): ``batch_images_per_class``,
        or the method's own when it is none."""
        if self.batch_images_per_class is not None:
            return self.batch_images_per_class
        from raycompat.methods import method_class

        return method_class(self.method).batch_images_per_class

    def old_batch_fraction(self) -> float:
        """The share of each batch from the old model's classes (0: not balanced):
        ``batch_old_fraction``, or the method's own when it is none."""
        if self.batch_old_fraction is not None:
            return self.batch_old_fraction
        from raycompat.methods import method_class

        return method_class(self.method).batch_old_fraction

    def batches(self) -> dict:
        """How the run's batches are drawn, the values that differ from uniformly random
        batches only (``{}`` for those): what names a run (``default_run_name``)."""
        got = {
            "batch_images_per_class": self.class_batch_size(),
            "batch_old_fraction": self.old_batch_fraction(),
        }
        return {k: v for k, v in got.items() if v}

    def validate(self, check_paths: bool = True) -> None:
        """Every check that can run on the driver; ``check_paths=False`` skips reading the
        old/init bundles (a job planning runs whose predecessors are not trained yet)."""
        from raycompat.methods import method_class, parse_method_options

        cls = method_class(self.method)
        parse_method_options(self.method, self.method_options)
        if cls.needs_old_model and not self.old_model:
            raise ConfigError(f"method {self.method!r} needs old_model (--old-model PATH)")
        if getattr(cls, "needs_init_model", False) and not self.init_model:
            raise ConfigError(
                f"method {self.method!r} needs init_model (the frozen new model, --init-model PATH)"
            )
        self._validate_values()
        old = self._bundle_manifest("old_model") if self.old_model and check_paths else None
        init = self._bundle_manifest("init_model") if self.init_model and check_paths else None
        if old is not None and int(old["embed_dim"]) > self.embed_dim:
            raise ConfigError(
                f"embed_dim {self.embed_dim} is smaller than the old model's "
                f"{old['embed_dim']}: the compatible subspace needs embed_dim >= "
                f"{old['embed_dim']}"
            )
        if old is not None and "in_chans" in old and int(old["in_chans"]) != self.in_chans:
            raise ConfigError(
                f"old_model {self.old_model!r} takes in_chans={old['in_chans']}, but this run "
                f"has in_chans={self.in_chans} (glyphs: 1, your images: 3): they must match"
            )
        if old is not None and old.get("resolution") not in (None, self.resolution):
            raise ConfigError(
                f"old_model {self.old_model!r} takes {old['resolution']} px images, but this run "
                f"has resolution {self.resolution}: pass --resolution {old['resolution']}"
            )
        if old is not None:
            check_old_classes(old, self.scenario, self.old_model)
        if init is not None:
            for key in ("backbone", "embed_dim", "in_chans"):
                if key in init and init[key] != getattr(self, key):
                    raise ConfigError(
                        f"init_model {self.init_model!r} has {key}={init[key]!r}, but "
                        f"this run has {key}={getattr(self, key)!r}: they must match"
                    )
        cls.check_config(self, old)
        if self.num_workers and self.batch_size % self.num_workers:
            raise ConfigError(
                f"batch_size {self.batch_size} must be divisible by num_workers {self.num_workers}"
            )
        if not self.scenario:
            raise ConfigError("scenario is empty: build one with raycompat.data.build_scenario")
        splits = self.scenario.get("splits", {})
        aliases = self.scenario.get("aliases", {})
        if self.split not in splits and self.split not in aliases:
            raise ConfigError(
                f"split {self.split!r} is not in the scenario; "
                f"allowed splits: {sorted(set(splits) | set(aliases))}"
            )
        items = splits.get(aliases.get(self.split, self.split), {}).get("labels")
        if items is not None and len(items) < self.batch_size:
            raise ConfigError(
                f"split {self.split!r} has {len(items)} images: fewer than one batch "
                f"(batch_size {self.batch_size})"
            )
        if self.class_batch_size() and self.old_batch_fraction():
            raise ConfigError(
                "batch_images_per_class and batch_old_fraction draw batches two ways: set one "
                "of them to 0"
            )
        if self.old_batch_fraction() and not self.old_model:
            raise ConfigError("batch_old_fraction needs an old model (its classes)")
        if self.class_batch_size() and items is not None:
            from raycompat.train.batches import check_class_batches

            check_class_batches(
                self.batch_size, self.class_batch_size(), self.num_workers, len(set(items))
            )
        if self.head == "dsimplex" and items is not None:
            from raycompat.models.heads import check_simplex_size

            check_simplex_size(self.embed_dim, len(set(items)), f"split {self.split!r}")

    def _validate_values(self) -> None:
        """Checks that would otherwise fail inside a worker (timm, the renderer, torch)."""
        import os

        check_backbone(self.backbone)
        if self.pretrained_path and not os.path.isfile(os.path.expanduser(self.pretrained_path)):
            raise ConfigError(f"pretrained_path {self.pretrained_path!r}: no such file")
        if self.head_scale is not None and self.head_scale <= 0:
            raise ConfigError(f"head_scale must be > 0, got {self.head_scale}")
        if self.head_margin is not None and self.head_margin < 0:
            raise ConfigError(f"head_margin must be >= 0, got {self.head_margin}")
        if self.resolution < 8:
            raise ConfigError(f"resolution must be >= 8 pixels, got {self.resolution}")
        for key in ("seed", "data_seed", "threads_per_worker", "batch_images_per_class"):
            if (getattr(self, key) or 0) < 0:
                raise ConfigError(f"{key} must be >= 0, got {getattr(self, key)}")
        if self.max_failures < -1:
            raise ConfigError(
                f"max_failures must be >= -1 (-1: unlimited), got {self.max_failures}"
            )

    def _bundle_manifest(self, key: str) -> dict:
        """The manifest of the bundle named by option ``key`` (old_model / init_model)."""
        import json
        import os

        from raycompat.storage import is_uri, local_copy

        path = getattr(self, key)
        try:
            path = local_copy(path) if is_uri(path) else os.path.expanduser(path)
        except FileNotFoundError as exc:
            raise ConfigError(f"{key} {getattr(self, key)!r}: {exc}") from exc
        manifest = os.path.join(path, "manifest.json")
        if not os.path.isfile(manifest):
            raise ConfigError(
                f"{key} {getattr(self, key)!r} is not a model bundle (no manifest.json there)"
            )
        with open(manifest) as f:
            data = json.load(f)
        # bundles saved by hand may carry the sizes only in the embedder's module spec
        embedder = data.get("modules", {}).get("embedder", {})
        for field_name in ("embed_dim", "in_chans", "backbone"):
            if field_name not in data and field_name in embedder:
                data[field_name] = embedder[field_name]
        return data


def check_old_classes(old: dict, scenario: dict, path: str) -> None:
    """The old model's head rows must name the classes this scenario's labels name: a model
    trained on another scenario of your images (or on glyphs) would silently pair its rows with
    other classes. Imported models (no head rows) pass."""
    rows = old.get("classes") or []
    if not rows:
        return
    names = scenario.get("class_names")
    old_names = old.get("class_names")
    if names is None and old_names is None:
        return  # both on glyphs: the catalog fingerprint guards the labels
    if names is None or old_names is None:
        trained = "your images" if old_names is not None else "the built-in glyphs"
        raise ConfigError(
            f"old_model {path!r} was trained on {trained}, this run is not: its classes and "
            "this scenario's labels are different things"
        )
    wrong = [
        (label, old_name, names[label] if 0 <= label < len(names) else None)
        for label, old_name in zip(rows, old_names, strict=True)
        if not 0 <= label < len(names) or names[label] != old_name
    ]
    if wrong:
        shown = ", ".join(f"label {lab}: {o!r} vs {n!r}" for lab, o, n in wrong[:5])
        raise ConfigError(
            f"old_model {path!r} and this scenario disagree on {len(wrong)} class(es) "
            f"(old model vs scenario: {shown}): train both with the same --scenario scenario.json"
        )
