"""``cl``: contrastive reverse transform, backward system only (RM Eq.10;
docs/methods.md, Training objectives, a baseline of ``mcl``):
``L_i = -log[ P_old / (P_old + N_old) ]``, ``s_old_ik = exp(-d(psi_rev(phi_n(x_i)), phi_o(x_k)))``,
P over same-label ``k`` (i included: the cross-model pair of the same image), N over the
others, ``k`` over the global batch gathered from every DDP worker (see ``gathered``).
``rho`` is the identity here; optional hard mining keeps the hardest half of positives and
of negatives per anchor (RM footnote 2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from raycompat.config import positive
from raycompat.methods.base import register_method
from raycompat.methods.gathered import gather, global_batch_loss, same_label
from raycompat.methods.rank_merge import RankMergeMethod, log_sums, pairwise_distance


@register_method
class CL(RankMergeMethod):
    name = "cl"
    description = (
        "RM baseline: supervised contrastive reverse transform, backward system only (Eq.10)"
    )
    # Eq.10's positives are the anchor's class: P x K batches, 16 x 4 in a batch of 64
    batch_images_per_class = 4

    @dataclass
    class Options(RankMergeMethod.Options):
        temperature: float = positive(1.0)
        hard_mining: bool = False

    def backward_system(self, rev, old, labels):
        """(log P_old, log N_old) per anchor of the gathered batch."""
        same = same_label(labels, labels)
        return log_sums(
            pairwise_distance(rev, old, self.options.distance),
            same,
            ~same,
            self.options.temperature,
            self.options.hard_mining,
        )

    def rank_merge_loss(self, new, rev, old, labels):
        labels, rev, old = gather(labels, rev, old)
        log_p, log_n = self.backward_system(rev, old, labels)
        loss = (torch.logaddexp(log_p, log_n) - log_p).mean()
        return {"cl": global_batch_loss(loss)}
