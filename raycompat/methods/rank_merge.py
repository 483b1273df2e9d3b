"""Shared base of the online-backfilling methods of the RM paper (docs/methods.md, Training
objectives): ``mcl`` and its baselines ``rqt`` and ``cl``.

``phi_o`` and ``phi_n`` were trained independently and stay frozen (``phi_n`` is the
``init_model``); the method trains

- ``rho``: a head on ``phi_n`` whose output is the final new embedding (RM Sec 3.3). Only
  ``mcl`` trains it; ``rqt`` and ``cl`` predate it and use a frozen identity ``rho``, exported
  all the same so that the gallery side always scores ``rho(q)`` and ``psi_rev(rho(q))``;
- ``psi_rev``: the reverse query transform new -> old (RM Eq.9).

Both are exported, as ``rho`` and ``psi_rev``. There is no classification loss.
Distances ``d`` are taken between L2-normalised vectors: squared L2 (default), L2 or cosine
distance ``1 - cos``; the gallery side must use the same (``distance`` in the manifest's
method options). ``s_ik = exp(-d_ik / temperature)``; temperature 1 is the paper's form
(the temperature is an addition, configurable).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from raycompat.config import choices, nonnegative, positive
from raycompat.methods.base import CompatMethod, TrainBatch
from raycompat.methods.gathered import hardest_half, masked_logsumexp
from raycompat.models import ProjectionMLP


def pairwise_distance(a: torch.Tensor, b: torch.Tensor, kind: str) -> torch.Tensor:
    """[Na, Nb] distances between the L2-normalised rows of ``a`` and ``b``."""
    cos = F.normalize(a, dim=1) @ F.normalize(b, dim=1).t()
    if kind == "cosine":
        return 1.0 - cos
    squared = (2.0 - 2.0 * cos).clamp(min=0.0)
    return squared if kind == "squared_l2" else (squared + 1e-12).sqrt()


def paired_distance(a: torch.Tensor, b: torch.Tensor, kind: str) -> torch.Tensor:
    """[N] distances between matching L2-normalised rows of ``a`` and ``b``."""
    cos = (F.normalize(a, dim=1) * F.normalize(b, dim=1)).sum(dim=1)
    if kind == "cosine":
        return 1.0 - cos
    squared = (2.0 - 2.0 * cos).clamp(min=0.0)
    return squared if kind == "squared_l2" else (squared + 1e-12).sqrt()


def identity_rho(dim: int) -> ProjectionMLP:
    """A ``rho`` that starts as the identity map: one Linear (an ``mlp`` with no hidden block,
    so bundles load it like any other), weight I, bias 0."""
    rho = ProjectionMLP(dim, dim, num_blocks=0, role="rho")
    with torch.no_grad():
        rho.net[0].weight.copy_(torch.eye(dim))
        rho.net[0].bias.zero_()
    return rho


def log_sums(
    distance: torch.Tensor,
    positives: torch.Tensor,
    negatives: torch.Tensor,
    temperature: float,
    hard_mining: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per anchor ``(log P, log N)`` with ``P = sum_pos s_ik``, ``N = sum_neg s_ik`` and
    ``s_ik = exp(-d_ik / temperature)``; ``hard_mining`` keeps the hardest half of each set."""
    if hard_mining:
        positives = hardest_half(distance, positives, largest=True)
        negatives = hardest_half(distance, negatives, largest=False)
    logits = -distance / temperature
    return masked_logsumexp(logits, positives), masked_logsumexp(logits, negatives)


class RankMergeMethod(CompatMethod):
    """Frozen ``phi_o``/``phi_n``; trains ``psi_rev`` (and ``rho`` when ``trains_rho``)."""

    trains_embedder = False
    needs_init_model = True
    trains_rho: ClassVar[bool] = False

    @dataclass
    class Options:
        distance: str = choices("squared_l2", "l2", "cosine", default="squared_l2")
        psi_rev_hidden: int = positive(1024)
        psi_rev_blocks: int = nonnegative(3)

    def setup(self, embedder, head):
        dim = embedder.embed_dim
        opts = self.options
        if not self.trains_rho:
            self.rho = identity_rho(dim).requires_grad_(False)
        elif opts.rho_blocks == 0 and opts.rho_dim in (0, dim):
            # Starts as the identity: rho^new = phi_n keeps its discriminability at step 0.
            self.rho = identity_rho(dim)
        else:
            self.rho = ProjectionMLP(
                dim,
                opts.rho_dim or dim,
                hidden_dim=opts.rho_hidden,
                num_blocks=opts.rho_blocks,
                role="rho",
            )
        self.psi_rev = ProjectionMLP(
            self.rho.out_dim,
            self.old.embed_dim,
            hidden_dim=self.options.psi_rev_hidden,
            num_blocks=self.options.psi_rev_blocks,
            role="psi_rev",
        )

    def exports(self) -> dict[str, nn.Module]:
        return {"rho": self.rho, "psi_rev": self.psi_rev}

    def compute_loss(self, model, batch: TrainBatch) -> dict[str, torch.Tensor]:
        """No classification loss: ``phi_n`` and its head are frozen."""
        with torch.no_grad():
            feat = model.embedder(batch.x_new)
        new = self.rho(feat)
        terms = self.rank_merge_loss(
            new, self.psi_rev(new), self.old_features(batch.x_old), batch.labels
        )
        terms["loss"] = sum(terms.values())
        return terms

    def rank_merge_loss(
        self, new: torch.Tensor, rev: torch.Tensor, old: torch.Tensor, labels: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """``new = rho(phi_n(x))``, ``rev = psi_rev(new)``, ``old = phi_o(x)``, unnormalised."""
        raise NotImplementedError
