"""The contract between the one training loop and every compatible-training method.

A method is a small ``nn.Module`` (like a pytorch-metric-learning loss): it owns the extra
trainable modules it needs (psi, rho, prototypes...), computes the loss of a batch from
the shared model pieces, and may run a distributed pass over the training set at the
start of every epoch. The loop never looks inside a method.

Loss convention (docs/methods.md, Training objectives): ``L = L_cls(new head) + lambda * L_compat``.

Multi-worker convention: the ``loss`` a worker returns is such that DDP's *average* of the
workers' gradients equals the gradient of the loss of the whole global batch computed in one
process (every worker holds the same number of samples). Per-sample terms are a local mean;
terms that couple samples (gathered negatives, batch-softmax weights) are computed over the
global batch with the helpers of ``raycompat.methods.gathered``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from raycompat.config import nonnegative
from raycompat.models import ModelBundle


@dataclass
class TrainBatch:
    """One batch. ``x_new`` / ``x_old`` are two independent augmentations of the same images
    (docs/methods.md, Notation); ``new_targets`` index the new head's rows, ``old_targets`` the old
    head's rows (-1 where the old head does not know the class)."""

    x_new: torch.Tensor
    labels: torch.Tensor
    new_targets: torch.Tensor
    x_old: torch.Tensor | None = None
    old_targets: torch.Tensor | None = None


@dataclass
class MethodContext:
    """What a method may use besides the trainable new embedder and head."""

    old: ModelBundle | None
    new_classes: list[int]
    old_classes: list[int]
    compatible_dim: int
    device: torch.device
    # Yields this worker's shard of the training set once (no shuffle, no padding) as
    # TrainBatch objects, for per-epoch passes (prototypes, synthesised classifier rows).
    epoch_pass_loader: Callable[[], Iterator[TrainBatch]] | None = None
    # The run's length, for terms that follow training progress (advbct's gradient reversal
    # and adversarial weight decay).
    epochs: int = 1
    steps_per_epoch: int = 1
    # The same kind of pass over the old model's own training split (its manifest's split, in
    # this run's scenario), None when the scenario has no such split: what the old model was
    # trained on (advbct's boundary, as the released metadata).
    old_split_pass_loader: Callable[[], Iterator[TrainBatch]] | None = None


def old_split_name(scenario: dict, old_manifest: dict | None) -> str | None:
    """The old model's training split (its manifest's ``data.split``) when ``scenario`` (a
    ``Scenario.to_dict()``) has a split of that name, else None."""
    split = ((old_manifest or {}).get("data") or {}).get("split")
    known = set(scenario.get("splits", {})) | set(scenario.get("aliases", {}))
    return split if split in known else None


class CompatMethod(nn.Module):
    """Base class of every training method; subclasses register with ``@register_method``."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    needs_old_model: ClassVar[bool] = True
    # False: the new embedder and head are frozen (loaded from ``init_model``); only the
    # method's own modules train (RM family: rho, psi_rev).
    trains_embedder: ClassVar[bool] = True
    # True: meaningless without ``init_model`` (the frozen phi_n); for the config to check.
    needs_init_model: ClassVar[bool] = False
    # K of the class-balanced P x K batches the method trains with by default
    # (raycompat.train.batches; TrainConfig.batch_images_per_class overrides it); 0: random
    batch_images_per_class: ClassVar[int] = 0
    # the share of each batch the method draws from the old model's classes by default
    # (raycompat.train.batches.OldNewBatches; TrainConfig.batch_old_fraction overrides it)
    batch_old_fraction: ClassVar[float] = 0.0

    @dataclass
    class Options:
        lambda_compat: float = nonnegative(1.0)

    @classmethod
    def check_config(cls, cfg: Any, old_manifest: dict | None) -> None:
        """Method-specific checks of a ``TrainConfig`` on the driver, before any worker starts
        (``old_manifest``: the old bundle's manifest, if any); raise ``ConfigError``. Default:
        nothing."""

    def __init__(self, options: Any, context: MethodContext):
        super().__init__()
        self.options = options
        # Not registered as a submodule: the old model is frozen and stays out of DDP.
        self.__dict__["context"] = context

    # -- hooks the loop calls -------------------------------------------------------------
    def setup(self, embedder: nn.Module, head: nn.Module) -> None:
        """Build the modules that depend on the new model (e.g. psi's output width). Called by
        ``TrainingModule`` before the loop moves it to the device, wraps it in DDP and builds
        the optimizer. Default: nothing."""

    def on_epoch_start(self, epoch: int, model: TrainingModule) -> None:
        """Distributed per-epoch pass (prototypes, synthesised rows). Default: nothing."""

    def compute_loss(self, model: TrainingModule, batch: TrainBatch) -> dict[str, torch.Tensor]:
        """Loss terms of one batch; ``'loss'`` is the total that is back-propagated."""
        emb = model.embedder(batch.x_new)
        terms = {"cls": F.cross_entropy(model.head(emb, batch.new_targets), batch.new_targets)}
        compat = self.compat_loss(model, batch, emb)
        if compat:
            terms.update(compat)
            total = terms["cls"] + self.options.lambda_compat * sum(compat.values())
        else:
            total = terms["cls"]
        terms["loss"] = total
        return terms

    def compat_loss(
        self, model: TrainingModule, batch: TrainBatch, emb: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """The compatibility term(s); empty for the independent paragon."""
        return {}

    def exports(self) -> dict[str, nn.Module]:
        """Extra modules saved into the model bundle (e.g. ``psi``)."""
        return {}

    def deployed_embedder(self, embedder: nn.Module) -> nn.Module:
        """The embedder saved into the model bundle, what retrieval runs: the trained one by
        default; a method whose deployed embedding is a function of it (bt2's basis
        transform) returns that module."""
        return embedder

    # -- shared pieces --------------------------------------------------------------------
    @property
    def old(self) -> ModelBundle:
        if self.context.old is None:
            raise RuntimeError(f"method {self.name!r} needs an old model")
        return self.context.old

    @torch.no_grad()
    def old_features(self, x_old: torch.Tensor) -> torch.Tensor:
        """phi_o(x) of the old model's view, frozen."""
        return self.old.embedder(x_old)

    def compatible_part(self, emb: torch.Tensor) -> torch.Tensor:
        """The first D_old dims of a new embedding: the compatible subspace (BCT, dim change)."""
        return emb[:, : self.context.compatible_dim]


class TrainingModule(nn.Module):
    """What DDP wraps: the new embedder, its head, and the method's own modules.

    ``forward(batch)`` returns the method's loss terms, so DDP's gradient hooks see every
    trainable parameter.
    """

    def __init__(self, embedder: nn.Module, head: nn.Module, method: CompatMethod):
        super().__init__()
        self.embedder = embedder
        self.head = head
        self.method = method
        method.setup(embedder, head)
        if not method.trains_embedder:
            self.embedder.requires_grad_(False)
            self.head.requires_grad_(False)

    def forward(self, batch: TrainBatch) -> dict[str, torch.Tensor]:
        return self.method.compute_loss(self, batch)


_REGISTRY: dict[str, type[CompatMethod]] = {}


def register_method(cls: type[CompatMethod]) -> type[CompatMethod]:
    """Class decorator: make a method available by ``cls.name`` to ``jobs/train.py --method``."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    if cls.name in _REGISTRY:
        raise ValueError(f"method {cls.name!r} registered twice")
    if not dataclasses.is_dataclass(cls.Options):
        raise TypeError(f"{cls.__name__}.Options must be a dataclass")
    _REGISTRY[cls.name] = cls
    return cls


def available_methods() -> dict[str, type[CompatMethod]]:
    return dict(sorted(_REGISTRY.items()))
