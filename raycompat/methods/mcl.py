"""``mcl``: metric-compatible contrastive learning for online backfilling (RM Eq.11-13;
docs/methods.md, Training objectives).

With ``rho^new = rho(phi_n(x))`` (trained; the final new embedding) and ``rho^rev =
psi_rev(rho^new)``, ``s_new_ik = exp(-d(rho^new_i, rho^new_k))`` and ``s_old_ik =
exp(-d(rho^rev_i, phi_o(x_k)))``:

``L_i = -log[ P_old / (P_old + N_old + N_new) ] - log[ P_new / (P_new + N_new + N_old) ]``

P over same-label ``k``, N over the others, ``k`` over the global batch gathered from every
DDP worker (see ``gathered``). The printed Eq.11 repeats ``N_new`` in the second
denominator; docs/methods.md fixes the symmetric form above, which is what the text describes.
``P_new`` leaves out ``k = i`` (``s_new_ii = 1`` always; the old system's ``k = i`` is the
real cross-model pair of the same image and stays); an anchor with no other sample of its
class in the global batch skips the second term. Optional hard mining keeps the hardest
half of positives and of negatives per anchor, in each system.
``rho`` is one Linear initialised to the identity by default (``rho_blocks=0``); with
hidden blocks it is ``rho_blocks`` x [Linear-BN-ReLU] + Linear. It trains on class-balanced
P x K batches (K = 4, inherited from ``cl``): P and N are class-level sums, empty for most
anchors of a random batch over many classes (``raycompat.train.batches``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from raycompat.config import nonnegative, positive
from raycompat.methods.base import register_method
from raycompat.methods.cl import CL
from raycompat.methods.gathered import gather, global_batch_loss, same_label
from raycompat.methods.rank_merge import log_sums, pairwise_distance


@register_method
class MCL(CL):
    name = "mcl"
    description = (
        "RM: metric-compatible contrastive training of rho and psi_rev on frozen old/new "
        "models (exported as 'rho', 'psi_rev'); needs --init-model"
    )
    trains_rho = True

    @dataclass
    class Options(CL.Options):
        rho_dim: int = nonnegative(0)  # 0: the new embedder's dimension
        rho_hidden: int = positive(1024)
        rho_blocks: int = nonnegative(0)

    def rank_merge_loss(self, new, rev, old, labels):
        labels, new, rev, old = gather(labels, new, rev, old)
        opts = self.options
        log_p_old, log_n_old = self.backward_system(rev, old, labels)
        same = same_label(labels, labels)
        others = same & ~torch.eye(len(labels), dtype=torch.bool, device=labels.device)
        log_p_new, log_n_new = log_sums(
            pairwise_distance(new, new, opts.distance),
            others,
            ~same,
            opts.temperature,
            opts.hard_mining,
        )
        old_term = (
            torch.logsumexp(torch.stack([log_p_old, log_n_old, log_n_new]), dim=0) - log_p_old
        )
        new_term = (
            torch.logsumexp(torch.stack([log_p_new, log_n_new, log_n_old]), dim=0) - log_p_new
        )
        valid = others.any(dim=1)
        new_loss = new_term[valid].mean() if valid.any() else new_term.sum() * 0.0
        return {
            "mcl_old": global_batch_loss(old_term.mean()),
            "mcl_new": global_batch_loss(new_loss),
        }
