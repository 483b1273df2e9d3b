"""``ndpp``: neighbour-driven prototype perturbation (NDPP paper Eq.4-8;
docs/methods.md, Training objectives).

Rebuilt at the start of every epoch, not cumulative (Eq.8):
``p_hat_o^c = p_o^c + a1 * r_o^c + a2 * r_t^c`` with a1 = a2 = 0.01, where

- ``r_o^c = sum_{c' in K_o(c)} s(p_o^c, p_o^c') (p_o^c - p_o^c') / sum s`` over the K=100
  nearest *other* old prototypes (Eq.4; c itself excluded);
- ``r_t^c`` is the same against the K nearest new prototypes of *other* classes, taken from
  the current ``phi_n`` (first ``D_o`` dims) by a distributed pass at the start of every epoch,
  and measured from ``p_o^c + a1 * r_o^c`` (the paper's Algorithm 1, line 13).

Similarities are cosines. A neighbour with a negative cosine gets weight 0 (the paper's
K-NN among thousands of classes never meets one; with few classes the signed weights could
sum to ~0). The loss is P2S with the pseudo-old prototype in the positive column only (Eq.6):
negatives keep the real ``p_o^c'``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from raycompat.config import nonnegative, positive
from raycompat.methods.base import register_method
from raycompat.methods.p2s import P2S


def neighbour_repulsion(
    anchors: torch.Tensor, bank: torch.Tensor, k: int, exclude: torch.Tensor
) -> torch.Tensor:
    """``r^c = sum_{c' in K(c)} w_cc' (anchors^c - bank^c') / sum_{c' in K(c)} w_cc'`` over the
    ``k`` most cosine-similar bank rows not ``exclude``d ([C, Cb] bool), ``w = max(cos, 0)``;
    0 for an anchor with no positive-weight neighbour. float64."""
    anchors, bank = anchors.double(), bank.double()
    sims = F.normalize(anchors, dim=1) @ F.normalize(bank, dim=1).t()
    sims = sims.masked_fill(exclude, float("-inf"))
    k = min(k, bank.shape[0])
    top, index = sims.topk(k, dim=1)  # [C, k]
    weights = top.clamp(min=0.0)  # -inf (excluded) -> 0 as well
    diffs = anchors[:, None, :] - bank[index]  # [C, k, D]
    total = weights.sum(dim=1, keepdim=True)
    r = (weights[:, :, None] * diffs).sum(dim=1) / total.clamp(min=1e-12)
    return torch.where(total > 0, r, torch.zeros_like(r))


def ndpp_prototypes(
    old: torch.Tensor, new: torch.Tensor | None, alpha_old: float, alpha_new: float, k: int
) -> torch.Tensor:
    """NDPP Eq.8 pseudo-old prototypes from the old and (current) new prototypes [C, D_o]."""
    eye = torch.eye(old.shape[0], dtype=torch.bool, device=old.device)
    p_hat = old.double() + alpha_old * neighbour_repulsion(old, old, k, eye)
    if new is not None and alpha_new > 0:
        p_hat = p_hat + alpha_new * neighbour_repulsion(p_hat, new, k, eye)
    return p_hat.to(old.dtype)


@register_method
class NDPP(P2S):
    name = "ndpp"
    description = (
        "P2S with neighbour-driven prototype perturbation, rebuilt every epoch (NDPP Eq.8)"
    )

    @dataclass
    class Options(P2S.Options):
        alpha_old: float = nonnegative(0.01)
        alpha_new: float = nonnegative(0.01)
        k: int = positive(100)

    def __init__(self, options, context):
        super().__init__(options, context)
        self.register_buffer("pseudo_prototypes", torch.zeros_like(self.old_prototypes))

    def needs_new_prototypes(self) -> bool:
        return self.options.alpha_new > 0

    def perturb(self, epoch, new_prototypes):
        o = self.options
        self.pseudo_prototypes.copy_(
            ndpp_prototypes(self.old_prototypes, new_prototypes, o.alpha_old, o.alpha_new, o.k)
        )

    def positive_prototypes(self):
        return self.pseudo_prototypes
