"""``lce``: Learning Compatible Embeddings (Meng, Zhang, Xu, Zhou, ICCV 2021; docs/methods.md,
Field methods).

Once, from the frozen old model over the new training set (a distributed pass): per class ``j``
the centre ``c_j = normalize(mean_i normalize(phi_o(x_i)))`` and the boundary
``b_j = min_i <normalize(phi_o(x_i)), c_j>`` (the cosine of the widest old sample). Then

``L = L_cls + lambda_a * L_align + lambda_b * L_bound``, lambda_a = 100, lambda_b = 1,

- ``L_align = mean_{j,d} (normalize(w_n[j, :D_o])[d] - c_j[d])^2`` over the classes with a centre:
  the new classifier's rows pulled onto the old class centres;
- ``L_bound = mean_i max(b_{y_i} - <normalize(phi_n(x_i)[:D_o]), c_{y_i}>, 0)`` over the samples of
  those classes in the global batch: each new feature inside its class's old boundary.

Choices: the boundary hinge is in cosine space (the official code) rather than AdvBCT's angle
space; ``phi_n`` is normalised before the dot product (the official code only clamps it). The
centres belong to the classes the old model knows (``centre_classes=old``, as LCE assumes a shared
class set; ``all`` gives every class of the new training set one). A dimension change uses the
compatible prefix ``[:D_o]`` of the features and of the classifier rows, BCT's convention, instead
of LCE's transformation modules (broken as released). ``lambda_compat`` scales both terms.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from raycompat.config import choices, nonnegative
from raycompat.methods.base import CompatMethod, TrainBatch, register_method
from raycompat.methods.gathered import global_mean
from raycompat.methods.prototypes import eval_mode, item_features, old_class_centres


def class_minimum(values: torch.Tensor, rows: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Per row, the minimum of ``values`` over the items of that row (``rows``; ``-1``: skipped);
    +inf for a row without items."""
    keep = rows >= 0
    out = torch.full((num_rows,), float("inf"), dtype=values.dtype, device=values.device)
    return out.scatter_reduce(0, rows[keep], values[keep], "amin", include_self=True)


@register_method
class LCE(CompatMethod):
    name = "lce"
    description = (
        "learning compatible embeddings: new classifier rows aligned to old class centres, "
        "new features inside the old class boundaries"
    )

    @dataclass
    class Options:
        lambda_compat: float = nonnegative(1.0)
        lambda_align: float = nonnegative(100.0)
        lambda_bound: float = nonnegative(1.0)
        centre_classes: str = choices("old", "all", default="old")

    def __init__(self, options, context):
        super().__init__(options, context)
        shape = (len(context.new_classes), context.compatible_dim)
        # from the frozen old model: not in checkpoints, recomputed at the first epoch start
        self.register_buffer("centres", torch.zeros(shape), persistent=False)
        self.register_buffer("boundaries", torch.zeros(shape[0]), persistent=False)
        self.register_buffer("has_centre", torch.zeros(shape[0], dtype=torch.bool), False)
        self._ready = False

    def on_epoch_start(self, epoch, model):
        """Centres and boundaries depend on the frozen old model only: computed once."""
        if self._ready:
            return
        means, counts = old_class_centres(self.context, self.options.centre_classes)
        centres = F.normalize(means, dim=1)
        old = self.old.embedder

        def cosine_to_centre(batch):
            own = centres[batch.new_targets.clamp(min=0)]
            return (F.normalize(old(batch.x_old), dim=1) * own).sum(dim=1, keepdim=True)

        with eval_mode(old):
            values, rows = item_features(self.context, {"cos": (cosine_to_centre, 1)})
        has_centre = counts > 0
        rows = torch.where(has_centre[rows.clamp(min=0)] & (rows >= 0), rows, -1)
        minimum = class_minimum(values["cos"][:, 0], rows, len(counts))
        self.centres.copy_(centres)
        self.boundaries.copy_(torch.where(has_centre, minimum, torch.zeros_like(minimum)))
        self.has_centre.copy_(has_centre)
        self._ready = True

    def compat_loss(self, model, batch: TrainBatch, emb):
        opts = self.options
        rows = self.has_centre.nonzero().flatten()
        rows_n = F.normalize(model.head.weight[rows, : self.context.compatible_dim], dim=1)
        align = (rows_n - self.centres[rows]).pow(2).mean() if len(rows) else emb.sum() * 0.0
        targets = batch.new_targets
        cos = (F.normalize(self.compatible_part(emb), dim=1) * self.centres[targets]).sum(dim=1)
        hinge = F.relu(self.boundaries[targets] - cos)
        bound = global_mean(hinge, self.has_centre[targets])
        return {"align": opts.lambda_align * align, "bound": opts.lambda_bound * bound}
