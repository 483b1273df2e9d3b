"""``fd``: focal distillation (Yan et al., "Positive-Congruent Training: Towards Regression-Free
Model Updates", CVPR 2021; the OpenCompatible ``fd`` baseline; docs/methods.md, Field methods).

A per-sample weighted feature distillation on the raw (unnormalised) features:

``d_i = (1/D_o) * ||phi_n(x_i)[:D_o] - phi_o(x_i)||^2`` (``features=raw``),
``w_i = alpha + beta * 1_i``, ``L_fd = mean_i w_i * d_i``, alpha = 1, beta = 5.

The indicator ``1_i`` (option ``indicator``):

- ``old`` (default, the paper's "positive congruence"): the old model classifies the sample
  correctly, ``argmax w_o(phi_o(x_i)) == y_i`` (0 for a class the old head does not know); needs
  the old head, so an imported (head-less) old model is refused with a pointer to ``new``;
- ``new`` (the released code): the new model's own prediction, ``argmax w_n(phi_n(x_i)) == y_i``.

Option ``features``: ``raw`` (default, the released code) as above; ``normalized``:
``d_i = ||phi_n^(x_i)[:D_o] - phi_o^(x_i)||^2 = 2 - 2 cos`` (summed, not averaged, over the dims:
the mean over D_o of a unit vector's squares is too small to align anything). Raw distillation
ties the new features to the old model's feature norm, which our cosine heads leave free (about
190 for the reproduction's old model): the term is then ~160 times the classification loss,
diverges under SGD at 0.1 and under AdamW neither aligns nor learns the classes; the reproduction
trains ``features=normalized`` (docs/methods.md, Field methods).

Predictions are the margin-free logits of the heads (``inference_logits``); the indicator carries
no gradient. Dimension change: ``phi_n(x)[:D_o]`` is compared (BCT's compatible subspace).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from raycompat.config import ConfigError, choices, nonnegative, parse_options
from raycompat.methods.base import CompatMethod, TrainBatch, register_method
from raycompat.methods.lwf import check_old_head


@register_method
class FD(CompatMethod):
    name = "fd"
    description = (
        "focal distillation (PCT): per-sample weighted MSE of raw (or normalised) features, "
        "weight alpha + beta where the old (or new) model is right"
    )

    @dataclass
    class Options:
        lambda_compat: float = nonnegative(1.0)
        alpha: float = nonnegative(1.0)
        beta: float = nonnegative(5.0)
        indicator: str = choices("old", "new", default="old")
        features: str = choices("raw", "normalized", default="raw")

    @classmethod
    def check_config(cls, cfg, old_manifest):
        options = parse_options(cls.Options, cfg.method_options, owner="method fd")
        if options.indicator == "old":
            check_old_head(
                "fd",
                cfg,
                old_manifest,
                "indicator=old; use indicator=new, the released code's form",
            )

    def __init__(self, options, context):
        super().__init__(options, context)
        if options.indicator == "old" and not self.old.has_head:
            raise ConfigError(
                "method 'fd' with indicator=old needs the old model's classifier head; it has "
                "none: use indicator=new (the released code's form)"
            )

    @torch.no_grad()
    def congruent(self, model, batch: TrainBatch, emb: torch.Tensor, old: torch.Tensor):
        """``1_i``: the old (or new) head's margin-free prediction equals the label."""
        if self.options.indicator == "old":
            predicted = self.old.head.inference_logits(old).argmax(dim=1)
            return (predicted == batch.old_targets) & (batch.old_targets >= 0)
        return model.head.inference_logits(emb).argmax(dim=1) == batch.new_targets

    def compat_loss(self, model, batch: TrainBatch, emb):
        old = self.old_features(batch.x_old)
        new = self.compatible_part(emb)
        if self.options.features == "normalized":  # ||a^ - b^||^2 = 2 - 2 cos(a, b)
            distance = (F.normalize(new, dim=1) - F.normalize(old, dim=1)).pow(2).sum(dim=1)
        else:
            distance = (new - old).pow(2).mean(dim=1)
        weight = self.options.alpha + self.options.beta * self.congruent(model, batch, emb, old)
        return {"fd": (weight * distance).mean()}
