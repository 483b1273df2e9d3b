"""``dsimplex``: a fixed d-Simplex classifier shared by every generation (CoReS: Biondi, Pernici,
Bruni, Del Bimbo, "CoReS: Compatible Representations via Stationarity", TPAMI 2023; HOC: Biondi,
Pernici, Ricci, Del Bimbo, "Stationary Representations: Optimally Approximating Compatibility and
Implications for Improved Model Replacements", CVPR 2024; docs/methods.md, Field methods).

The head is the ``dsimplex`` head (``raycompat.models.heads``): ``K`` preallocated classes, the
rows are regular-simplex vertices in ``R^(K-1)`` (fixed, not trained), class label ``y`` (classes
numbered in order of arrival across generations) on row ``K-1-y``, logits ``W phi_n(x)`` on the
unnormalised feature, ``D = K - 1``. Every generation trains with that head (the first one as
``independent --head dsimplex``), so the features of every generation stay where the same
vertices put them.

The cross-entropy runs over all ``K`` vertices, those kept for classes still to come included
(the head appends them to its training logits), as the released code's ``Linear(K-1, K)``.

- ``loss=cores`` (default): ``L = CE(W phi_n(x), y)``; no term involves the old model, whose
  simplex (head kind and ``K``) is only checked;
- ``loss=hoc``: ``L = lambda CE(W phi_n(x), y) + (1 - lambda) L_hoc``, lambda = 0.1, with
  ``L_hoc = mean_i [-mu <o_i, n_i> + logsumexp_j(mu <o_i, n_j> 1[y_j != y_i])]``,
  ``o = phi_o^(x_old)``, ``n = phi_n^(x_new)``, mu = 10, ``j`` over the global batch. As in the
  released code, same-class terms (``j = i`` included) are zeroed, not removed: each adds
  ``exp(0)`` to the sum.

``classes`` (``K``, default 1024 as the released code) is fixed across generations: the run's
``embed_dim`` must be ``K - 1`` and its head ``dsimplex``; the old model's head must be a
``dsimplex`` head with the same ``K``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from raycompat.config import ConfigError, choices, nonnegative, parse_options, positive
from raycompat.methods.base import CompatMethod, TrainBatch, register_method
from raycompat.methods.gathered import gather, global_batch_loss, same_label
from raycompat.models.heads import check_simplex_size


def hoc_loss(old: torch.Tensor, new: torch.Tensor, labels: torch.Tensor, mu: float) -> torch.Tensor:
    """``L_hoc`` (module docstring) over L2-normalised rows of one batch, mean over anchors."""
    similarity = mu * old @ new.t()
    zeroed = similarity.masked_fill(same_label(labels, labels), 0.0)
    return (torch.logsumexp(zeroed, dim=1) - similarity.diagonal()).mean()


def split_classes(cfg) -> set[int]:
    """The classes of the training split of a ``TrainConfig`` (empty if it names none)."""
    splits, aliases = cfg.scenario.get("splits", {}), cfg.scenario.get("aliases", {})
    labels = splits.get(aliases.get(cfg.split, cfg.split), {}).get("labels") or []
    return {int(c) for c in labels}


@register_method
class DSimplex(CompatMethod):
    name = "dsimplex"
    description = (
        "CoReS / HOC: the fixed d-Simplex classifier of every generation (--head dsimplex, "
        "--embed-dim K-1); loss=hoc adds the old-to-new contrastive term"
    )
    # the released trainer's BalancedBatchSampler: half of every batch from the classes seen
    # before (its rehearsal memory), half from the task's new classes
    batch_old_fraction = 0.5

    @dataclass
    class Options:
        classes: int = positive(1024)  # K, preallocated classes
        loss: str = choices("cores", "hoc", default="cores")
        hoc_lambda: float = nonnegative(0.1)  # weight of the CE term in loss=hoc
        mu: float = positive(10.0)

        def __post_init__(self):
            if self.classes < 2:
                raise ConfigError(
                    f"method dsimplex: option 'classes' = {self.classes} must be >= 2"
                )
            if self.hoc_lambda > 1.0:
                raise ConfigError(
                    f"method dsimplex: option 'hoc_lambda' = {self.hoc_lambda} must be <= 1"
                )

    @classmethod
    def check_config(cls, cfg, old_manifest: dict | None) -> None:
        """The simplex: head ``dsimplex``, ``embed_dim = K - 1``, the old head the same simplex,
        and room for every class (``K`` vertices)."""
        k = parse_options(cls.Options, cfg.method_options, owner="method dsimplex").classes
        if cfg.head != "dsimplex":
            raise ConfigError(
                f"method 'dsimplex' trains with the fixed simplex head: pass --head dsimplex "
                f"(this run has head {cfg.head!r})"
            )
        if cfg.embed_dim != k - 1:
            raise ConfigError(
                f"method 'dsimplex': embed_dim {cfg.embed_dim} must be K - 1 = {k - 1} "
                f"(classes K = {k}): pass --embed-dim {k - 1} or --opt classes={cfg.embed_dim + 1}"
            )
        if old_manifest is None:
            return
        head = old_manifest.get("modules", {}).get("head") or {}
        old_k = int(head["embed_dim"]) + 1 if "embed_dim" in head else None
        if head.get("kind") != "dsimplex" or old_k != k:
            raise ConfigError(
                f"method 'dsimplex' needs an old model trained with the same simplex head "
                f"(dsimplex, K = {k}); the old model {cfg.old_model!r} has head "
                f"{head.get('kind')!r}"
                + (f" with K = {old_k}" if head.get("kind") == "dsimplex" else "")
            )
        vertices = head.get("vertices") or []
        new = split_classes(cfg) - set(old_manifest.get("classes") or [])
        check_simplex_size(cfg.embed_dim, max(vertices, default=-1) + 1 + len(new), "the chain")

    def __init__(self, options, context):
        super().__init__(options, context)
        head = self.old.modules.get("head")
        if getattr(head, "kind", None) != "dsimplex":
            raise ConfigError(
                f"method 'dsimplex' needs an old model with a dsimplex head; it has "
                f"{getattr(head, 'kind', None)!r}"
            )

    def compute_loss(self, model, batch: TrainBatch) -> dict[str, torch.Tensor]:
        emb = model.embedder(batch.x_new)
        cls = F.cross_entropy(model.head(emb, batch.new_targets), batch.new_targets)
        if self.options.loss == "cores":
            return {"cls": cls, "loss": cls}
        old = F.normalize(self.old_features(batch.x_old), dim=1)
        labels, old, new = gather(batch.labels, old, F.normalize(emb, dim=1))
        hoc = global_batch_loss(hoc_loss(old, new, labels, self.options.mu))
        lam = self.options.hoc_lambda
        return {"cls": cls, "hoc": hoc, "loss": lam * cls + (1.0 - lam) * hoc}
