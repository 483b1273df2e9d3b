"""``unibct``: structural prototype refinement (Zhang et al., "Towards Universal Backward-Compatible
Representation Learning", IJCAI 2022; refinement as in the MixBCT reimplementation, "Eq.9-10";
docs/methods.md, Field methods).

Old prototypes for every class of the new training set (unseen classes included: the
"universal" part), refined over a graph of the *new* model's features. Per class ``c`` with items
``i = 1..n_c`` (at most ``max_per_class``, a seeded subset beyond):

- ``O`` (n_c x D_o): ``normalize(phi_o(x_i))``; ``N`` (n_c x D_n): ``normalize(phi_n(x_i))``, the
  current new model in eval mode;
- ``A = softmax(N N^T / tau)`` with the diagonal masked, tau = 0.05;
- ``O~ = (1 - lambda) (I - lambda A)^{-1} O``, lambda = 0.9 (closed-form label propagation);
- ``p_c = mean_i O~_i``.

``L_compat = CE(ArcFace_{s,m}(cos(phi_n(x)[:D_o], p)), y)`` over every prototype row: ``s cos``
with ``s cos(theta + m)`` on the target, s = 30, m = 0.3, the released trainer's ArcFace
(``margin=0``: the plain ``s cos`` softmax).

Choices:

- ``affinity=row`` (default): the softmax runs over each row, so ``A`` and ``(1 - lambda)(I -
  lambda A)^{-1}`` are row-stochastic and each ``O~_i`` is a convex combination of the class's old
  features, weighted toward the new model's neighbours. The MixBCT code's softmax over dim 0
  (``affinity=column``) makes every column of ``A`` sum to 1; then ``1^T (I - lambda A)^{-1} =
  1^T / (1 - lambda)`` and ``p_c`` is exactly the plain class mean: that refinement changes nothing.
- Cosine-softmax with the scale s (MixBCT uses unscaled dot products, which learn slowly), features
  normalised before the graph (MixBCT's are raw, divided by tau).
- Schedule: the compatibility term is 0 before ``start_epoch``. Until the first refinement the
  prototypes are the plain class means of ``normalize(phi_o(x))`` (the released trainer's old
  centres); they are refined with the current ``phi_n`` from epoch
  ``max(start_epoch, ceil(refine_from * E))`` on, every ``refine_every`` epochs, so that the
  graph is built on a trained new model (default ``refine_from = 0.5``: halfway; MixBCT's
  ``start_epoch=10, refine_every=10`` of 30 epochs refines at a third). ``refine_from = 0``
  refines at ``start_epoch``, at epoch 0 on the untrained model (the premise run).
- Every item's features are gathered in training-set order on every worker (``item_features``),
  so the prototypes are the same whatever the number of workers; each worker refines the classes
  ``c = rank (mod W)`` and the prototype matrix is all-reduced. Dimension change: ``p`` lives in
  ``D_o`` and meets ``phi_n(x)[:D_o]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from raycompat.config import ConfigError, choices, fraction, nonnegative, positive
from raycompat.methods.base import CompatMethod, TrainBatch, register_method
from raycompat.methods.prototypes import (
    item_features,
    normalised_old_features,
    old_class_centres,
    prototype_logits,
)
from raycompat.models.heads import margin_logits
from raycompat.torch_distributed import all_reduce_sum, rank, world_size


def refined_prototype(
    old: torch.Tensor, new: torch.Tensor, tau: float, lam: float, affinity: str
) -> torch.Tensor:
    """``mean_i [(1 - lam) (I - lam A)^{-1} O]_i`` of one class (float64), ``A`` the softmax of
    ``N N^T / tau`` (diagonal masked) over rows (``row``) or over columns (``column``)."""
    old, new = old.double(), new.double()
    n = old.shape[0]
    eye = torch.eye(n, dtype=old.dtype, device=old.device)
    edges = (new @ new.t() / tau).masked_fill(eye.bool(), -1e9)
    affinity_matrix = F.softmax(edges, dim=1 if affinity == "row" else 0)
    refined = (1.0 - lam) * torch.linalg.solve(eye - lam * affinity_matrix, old)
    return refined.mean(dim=0)


def class_items(rows: torch.Tensor, row: int, cap: int) -> torch.Tensor:
    """Indices of the items of ``row``, in training-set order; at most ``cap`` (0: all), a
    subset seeded by the row."""
    index = (rows == row).nonzero().flatten()
    if 0 < cap < len(index):
        pick = torch.randperm(len(index), generator=torch.Generator().manual_seed(row))[:cap]
        index = index[pick.sort().values.to(index.device)]
    return index


@register_method
class UniBCT(CompatMethod):
    name = "unibct"
    description = (
        "universal BCT: old prototypes of every class refined over a graph of the new "
        "features, CE(s * cos(phi_n(x), prototypes), y)"
    )

    @dataclass
    class Options:
        lambda_compat: float = nonnegative(1.0)
        scale: float = positive(30.0)
        margin: float = nonnegative(0.3)  # ArcFace m on the target prototype; 0: plain s * cos
        tau: float = positive(0.05)
        propagation: float = nonnegative(0.9)  # lambda of O~ = (1-lambda)(I - lambda A)^-1 O
        affinity: str = choices("row", "column", default="row")
        start_epoch: int = nonnegative(0)
        refine_from: float = fraction(0.5)  # first refinement at ceil(refine_from * epochs)
        refine_every: int = positive(10)
        max_per_class: int = nonnegative(1000)  # 0: every item

        def __post_init__(self):
            if self.propagation >= 1.0:
                raise ConfigError(
                    f"method unibct: option 'propagation' = {self.propagation} must be < 1"
                )

    def __init__(self, options, context):
        super().__init__(options, context)
        shape = (len(context.new_classes), context.compatible_dim)
        # persistent: a resumed run keeps the prototypes of its last refinement
        self.register_buffer("prototypes", torch.zeros(shape))
        self.register_buffer("refined_at", torch.tensor(-1))
        self._active = False

    @property
    def first_refinement(self) -> int:
        """The epoch of the first refinement: ``max(start_epoch, ceil(refine_from * E))``."""
        opts = self.options
        return max(opts.start_epoch, math.ceil(opts.refine_from * self.context.epochs))

    def refines_at(self, epoch: int) -> bool:
        start = self.first_refinement
        return epoch >= start and (epoch - start) % self.options.refine_every == 0

    def on_epoch_start(self, epoch, model):
        self._active = epoch >= self.options.start_epoch
        if not self._active:
            return
        if self.refines_at(epoch) or (epoch > self.first_refinement and int(self.refined_at) < 0):
            self.prototypes.copy_(self.refine(model))
            self.refined_at.fill_(epoch)
        elif int(self.refined_at) == -1:  # before the first refinement: the plain class means
            self.prototypes.copy_(old_class_centres(self.context, "all")[0])
            self.refined_at.fill_(-2)

    def refine(self, model) -> torch.Tensor:
        """The refined prototype of every new-head row (one distributed pass)."""
        embedder = model.embedder
        features = {
            "old": normalised_old_features(self.context),
            "new": (lambda b: F.normalize(embedder(b.x_new), dim=1), embedder.embed_dim),
        }
        items, rows = item_features(self.context, features, (embedder, self.old.embedder))
        opts = self.options
        out = torch.zeros(self.prototypes.shape, dtype=torch.float64, device=rows.device)
        counts = torch.bincount(rows[rows >= 0], minlength=out.shape[0])
        if (counts == 0).any():
            missing = [int(i) for i in (counts == 0).nonzero().flatten()[:5]]
            raise RuntimeError(f"unibct: classes (new-head rows) {missing} have no training sample")
        for row in range(rank(), out.shape[0], world_size()):
            index = class_items(rows, row, opts.max_per_class)
            out[row] = refined_prototype(
                items["old"][index], items["new"][index], opts.tau, opts.propagation, opts.affinity
            )
        return all_reduce_sum(out).float()

    def compat_loss(self, model, batch: TrainBatch, emb):
        if not self._active:
            return {"unibct": emb.new_zeros(())}
        opts = self.options
        cos = prototype_logits(self.compatible_part(emb), batch.new_targets, self.prototypes, 1.0)
        logits = margin_logits(cos, batch.new_targets, "arcface", opts.scale, opts.margin)
        return {"unibct": F.cross_entropy(logits, batch.new_targets)}
