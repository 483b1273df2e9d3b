"""``advbct``: adversarial alignment and an elastic class boundary (Pan et al., "Boundary-Aware
Backward-Compatible Representation via Adversarial Learning in Image Retrieval", CVPR 2023; the
released AdvBCT code; docs/methods.md, Field methods).

Once, from the frozen old model over its own training split (``boundary_split=old``, the
released metadata: ``gen_class_meta`` over the old model's training data; ``new``: over the new
training set), per class: the centre ``c = mean_i normalize(phi_o(x_i))`` (not re-normalised),
the distances
``r_i = ||normalize(phi_o(x_i)) - c||``, and ``r_max`` = the largest distance left after dropping
those outside Tukey's fences ``[q1 - 1.5 IQR, q3 + 1.5 IQR]`` (``q1``, ``q3`` = the sorted
distances at ``floor(n/4)``, ``floor(3n/4)``; no filtering below 4 items), as the released code
computes them. With ``n = normalize(phi_n(x)[:D_o])`` and ``o = normalize(phi_o(x))``:

``L = L_cls + L_bound + w_e * L_adv``

- ``L_adv = CE(Dsc(GRL_a(n')), 0) + CE(Dsc(o'), 1)``, with
  ``Dsc`` = Linear(D_o, 100)-BN-ReLU-Linear(100, 2); the gradient reversal ``GRL_a`` passes
  ``-a`` times the gradient to ``phi_n``, ``a = 2 / (1 + exp(-10 p)) - 1`` with ``p`` the
  training progress in [0, 1] (per step), or the constant ``grl_alpha``;
- ``w_e = (E - e + 1) / E``, ``e`` the 0-based epoch, ``E`` the number of epochs: the released
  code's formula, kept as is (from (E + 1)/E down to 2/E); ``adv_decay=false`` gives ``w_e = 1``;
- ``r_c = r_max,c + sigmoid(v_c) |r_max,c - T|`` if ``r_max,c < T``, else
  ``r_max,c - sigmoid(v_c) |r_max,c - T|``, T = 0.5 (the released default), ``v`` a learnable
  vector over the new head's rows (init U(-1, 1));
- ``L_bound = mean over {i : h_i > 0} of h_i``, ``h_i = max(||n_i - c_{y_i}|| - r_{y_i}, 0)``,
  over the samples of the global batch whose class has a boundary (a centre and more than one
  distance left).

The discriminator (``discriminator=released``, default) runs as the released model: two
passes, ``n' = phi_n(x)[:D_o]`` and ``o' = phi_o(x)`` raw (unnormalised), each with its own
BatchNorm statistics. ``joint`` feeds the normalised ``n``, ``o`` as one batch, so that its
BatchNorm sees both (two separate passes normalise away the mean shift between the domains).
Centres belong to the classes the old model knows (``centre_classes=old``, the released code's
old metadata); ``all`` gives every class one. A dimension change uses ``phi_n(x)[:D_o]`` for both
terms. ``Dsc`` and ``v`` train with the network (same learning rate) and are not exported: they
are not needed at inference. The mean radius is logged as the term ``elastic_radius`` (not part
of the loss).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from raycompat.config import ConfigError, choices, nonnegative, parse_options, positive
from raycompat.methods.base import CompatMethod, TrainBatch, old_split_name, register_method
from raycompat.methods.gathered import global_mean
from raycompat.methods.prototypes import eval_mode, item_features, old_class_centres


class GradientReversal(torch.autograd.Function):
    """Identity forward; the backward pass multiplies the gradient by ``-alpha``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, alpha: float) -> torch.Tensor:
        ctx.alpha = alpha
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return -ctx.alpha * grad, None


def grl_coefficient(progress: float) -> float:
    """DANN's schedule ``2 / (1 + exp(-10 p)) - 1``: 0 at the start, ~1 at the end."""
    return 2.0 / (1.0 + math.exp(-10.0 * progress)) - 1.0


def tukey_max(values: torch.Tensor, rows: torch.Tensor, num_rows: int):
    """``(r_max, kept)`` per row: the largest of the row's values inside Tukey's fences
    ``[q1 - 1.5 IQR, q3 + 1.5 IQR]``, ``q1``/``q3`` the sorted values at ``floor(n/4)`` /
    ``floor(3n/4)`` (all values kept when ``n < 4``), and how many were kept. ``rows`` = -1:
    skipped. A row without values gets ``(0, 0)``."""
    keep = rows >= 0
    values, rows = values[keep], rows[keep]
    by_value = torch.argsort(values, stable=True)
    by_row = torch.argsort(rows[by_value], stable=True)
    order = by_value[by_row]
    values, rows = values[order], rows[order]  # grouped by row, ascending within a row
    counts = torch.bincount(rows, minlength=num_rows)
    starts = torch.cumsum(counts, 0) - counts
    last = max(len(values) - 1, 0)
    q1 = values[(starts + counts // 4).clamp(max=last)] if len(values) else counts.double()
    q3 = values[(starts + (3 * counts) // 4).clamp(max=last)] if len(values) else counts.double()
    iqr = q3 - q1
    inside = (values >= (q1 - 1.5 * iqr)[rows]) & (values <= (q3 + 1.5 * iqr)[rows])
    kept_mask = inside | (counts < 4)[rows]
    kept = torch.bincount(rows[kept_mask], minlength=num_rows)
    r_max = torch.zeros(num_rows, dtype=values.dtype, device=values.device)
    r_max = r_max.scatter_reduce(0, rows[kept_mask], values[kept_mask], "amax", include_self=False)
    return r_max, kept


@register_method
class AdvBCT(CompatMethod):
    name = "advbct"
    description = (
        "AdvBCT: adversarial alignment of new and old features (discriminator with gradient "
        "reversal) and an elastic boundary around old class centres"
    )

    @dataclass
    class Options:
        lambda_compat: float = nonnegative(1.0)
        threshold: float = nonnegative(0.5)  # T of the elastic radius (released defaults.py)
        disc_hidden: int = positive(100)
        grl_alpha: float | None = None  # None: DANN's schedule over the training progress
        adv_decay: bool = True  # w_e = (E - e + 1) / E; false: 1
        centre_classes: str = choices("old", "all", default="old")
        # the items of the centres and radii: the old model's training split, or the new set
        boundary_split: str = choices("old", "new", default="old")
        # two raw passes as the released model, or one normalised pass of both domains
        discriminator: str = choices("released", "joint", default="released")

    @classmethod
    def check_config(cls, cfg, old_manifest: dict | None) -> None:
        """``boundary_split=old`` needs the old model's training split in this scenario."""
        opts = parse_options(cls.Options, cfg.method_options, owner="method advbct")
        if opts.boundary_split == "old" and old_manifest is not None:
            if old_split_name(cfg.scenario, old_manifest) is None:
                split = (old_manifest.get("data") or {}).get("split")
                raise ConfigError(
                    f"method advbct: boundary_split=old needs the old model's training split "
                    f"({split!r}) in this run's scenario; pass --opt boundary_split=new"
                )

    def __init__(self, options, context):
        super().__init__(options, context)
        dim, num_rows = context.compatible_dim, len(context.new_classes)
        self.discriminator = nn.Sequential(
            nn.Linear(dim, options.disc_hidden),
            nn.BatchNorm1d(options.disc_hidden),
            nn.ReLU(),
            nn.Linear(options.disc_hidden, 2),
        )
        self.elastic = nn.Parameter(torch.empty(num_rows).uniform_(-1.0, 1.0))
        # from the frozen old model: not in checkpoints, recomputed at the first epoch start
        self.register_buffer("centres", torch.zeros(num_rows, dim), persistent=False)
        self.register_buffer("max_radius", torch.zeros(num_rows), persistent=False)
        self.register_buffer("has_boundary", torch.zeros(num_rows, dtype=torch.bool), False)
        self._ready = False
        self._epoch, self._step = 0, 0

    def boundary_context(self):
        """The context whose epoch pass gives the boundary's items (``boundary_split``)."""
        if self.options.boundary_split == "new":
            return self.context
        if self.context.old_split_pass_loader is None:
            raise RuntimeError(
                "advbct: boundary_split=old, but the old model's training split is not in this "
                "run's scenario"
            )
        return dataclasses.replace(
            self.context, epoch_pass_loader=self.context.old_split_pass_loader
        )

    def on_epoch_start(self, epoch, model):
        self._epoch, self._step = epoch, 0
        if self._ready:
            return
        context = self.boundary_context()
        centres, counts = old_class_centres(context, self.options.centre_classes)
        old = self.old.embedder

        def distance_to_centre(batch):
            own = centres[batch.new_targets.clamp(min=0)]
            return (F.normalize(old(batch.x_old), dim=1) - own).norm(dim=1, keepdim=True)

        with eval_mode(old):
            values, rows = item_features(context, {"r": (distance_to_centre, 1)})
        rows = torch.where((rows >= 0) & (counts > 0)[rows.clamp(min=0)], rows, -1)
        r_max, kept = tukey_max(values["r"][:, 0].double(), rows, len(counts))
        self.centres.copy_(centres)
        self.max_radius.copy_(r_max.float())
        self.has_boundary.copy_(kept > 1)
        self._ready = True

    def schedule(self) -> tuple[float, float]:
        """``(a, w_e)``: the gradient-reversal coefficient and the adversarial weight now."""
        ctx, opts = self.context, self.options
        epochs, steps = max(1, ctx.epochs), max(1, ctx.steps_per_epoch)
        progress = min(1.0, (self._epoch * steps + self._step) / (epochs * steps))
        alpha = grl_coefficient(progress) if opts.grl_alpha is None else opts.grl_alpha
        weight = max(0.0, (epochs - self._epoch + 1) / epochs) if opts.adv_decay else 1.0
        return alpha, weight

    def radii(self) -> torch.Tensor:
        """The elastic radius of every row: ``r_max`` moved toward T by ``sigmoid(v)``."""
        r_max, t = self.max_radius, self.options.threshold
        sign = torch.where(r_max < t, 1.0, -1.0)
        return r_max + sign * torch.sigmoid(self.elastic) * (r_max - t).abs()

    def compat_loss(self, model, batch: TrainBatch, emb):
        alpha, weight = self.schedule()
        if self.training:
            self._step += 1
        raw_new, raw_old = self.compatible_part(emb), self.old_features(batch.x_old)
        new, old = F.normalize(raw_new, dim=1), F.normalize(raw_old, dim=1)
        if self.options.discriminator == "released":
            new_logits = self.discriminator(GradientReversal.apply(raw_new, alpha))
            old_logits = self.discriminator(raw_old)
        else:
            logits = self.discriminator(torch.cat([GradientReversal.apply(new, alpha), old]))
            new_logits, old_logits = logits[: len(new)], logits[len(new) :]
        targets = batch.new_targets
        adv = F.cross_entropy(new_logits, torch.zeros_like(targets)) + F.cross_entropy(
            old_logits, torch.ones_like(targets)
        )
        hinge = F.relu((new - self.centres[targets]).norm(dim=1) - self.radii()[targets])
        bound = global_mean(hinge, self.has_boundary[targets] & (hinge.detach() > 0))
        return {"bound": bound, "adv": weight * adv}

    def compute_loss(self, model, batch):
        terms = super().compute_loss(model, batch)
        with torch.no_grad():
            radii = self.radii()[self.has_boundary]
            terms["elastic_radius"] = radii.mean() if len(radii) else radii.sum()
        return terms
