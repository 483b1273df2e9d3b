"""``p2s``: point-to-set (prototype) contrastive compatibility (NDPP paper Eq.2;
docs/methods.md, Training objectives).

Old prototypes ``p_o^c`` = mean of normalised ``phi_o(x)`` over the *new* training set, per
class of the new head (classes the old model never saw included), computed once by the
distributed pass of ``prototypes``; ``L_bc = CE(cos(phi_n(x)[:D_o], P_o) / tau, y)``, tau=0.07.
NDPP and ODPP subclass this and only change the positive column (``positive_prototypes``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from raycompat.config import nonnegative, positive
from raycompat.methods.base import CompatMethod, TrainBatch, register_method
from raycompat.methods.prototypes import (
    class_prototypes,
    normalised_new_features,
    normalised_old_features,
    prototype_logits,
)


@register_method
class P2S(CompatMethod):
    name = "p2s"
    description = "prototype contrastive compatibility: CE(cos(phi_n(x), old prototypes)/tau, y)"

    @dataclass
    class Options:
        lambda_compat: float = nonnegative(1.0)
        tau: float = positive(0.07)

    def __init__(self, options, context):
        super().__init__(options, context)
        shape = (len(context.new_classes), context.compatible_dim)
        self.register_buffer("old_prototypes", torch.zeros(shape))
        self._old_ready = False
        self.num_images = 0

    @property
    def num_classes(self) -> int:
        return self.old_prototypes.shape[0]

    def on_epoch_start(self, epoch, model):
        """One distributed pass computes what this epoch needs: the old prototypes (frozen old
        model: on the first call only) and, for NDPP/ODPP, the current new prototypes."""
        features = {}
        if not self._old_ready:
            features["old"] = normalised_old_features(self.context)
        if self.needs_new_prototypes():
            features["new"] = normalised_new_features(model.embedder, self.context.compatible_dim)
        new_prototypes = None
        if features:
            protos, counts = class_prototypes(
                self.context, self.num_classes, features, modules=(model.embedder,)
            )
            self.num_images = int(counts.sum())
            if "old" in protos:
                self.old_prototypes.copy_(protos["old"])
                self._old_ready = True
            new_prototypes = protos.get("new")
        self.perturb(epoch, new_prototypes)

    def needs_new_prototypes(self) -> bool:
        return False

    def perturb(self, epoch: int, new_prototypes: torch.Tensor | None) -> None:
        """Recompute the pseudo-old prototypes (NDPP, ODPP). P2S: none."""

    def positive_prototypes(self) -> torch.Tensor | None:
        """Prototypes of the positive column; ``None``: the real old prototypes."""
        return None

    def compat_loss(self, model, batch: TrainBatch, emb):
        logits = prototype_logits(
            self.compatible_part(emb),
            batch.new_targets,
            self.old_prototypes,
            self.options.tau,
            self.positive_prototypes(),
        )
        return {"p2s": F.cross_entropy(logits, batch.new_targets)}
