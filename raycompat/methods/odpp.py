"""``odpp``: optimisation-driven prototype perturbation (NDPP paper Eq.9-11;
docs/methods.md, Training objectives).

A learnable perturbation ``r^c`` per old prototype (init 0, warm-started from the previous
epoch's value) minimises, at the start of every epoch,

``sum_{c != c'} max(0, (p_o^c + r^c).(p_o^c' + r^c') - theta_old)
 + gamma * sum_{c != c''} max(0, (p_o^c + r^c).p_n^c'' - theta_new)``   (Eq.11)

with theta_old = theta_new = 0.6, gamma = 1, ``p_n`` the current new prototypes (first ``D_o``
dims of ``phi_n``, distributed pass), by plain SGD (lr 1e-3) for 50 epochs of N_img random
ordered pairs ``(c, c')``, ``c != c'`` (N_img = size of the training set), 1024 pairs per step;
each step minimises the *sum* over its pairs (the objective is a sum). One pair feeds both
terms. The pseudo-old prototype ``p_hat_o^c = p_o^c + r^c`` (Eq.10, no scale) replaces the
positive column of P2S; negatives keep the real prototypes.

Determinism: the optimisation runs in float64 on every worker from the all-reduced (hence
identical) prototypes with a generator seeded by ``seed`` and the epoch, so every worker
ends with the same ``r`` whatever the number of workers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from raycompat.config import nonnegative, positive
from raycompat.methods.base import register_method
from raycompat.methods.p2s import P2S


def perturbation_objective(
    p_old: torch.Tensor,
    r: torch.Tensor,
    p_new: torch.Tensor | None,
    pairs: torch.Tensor,
    theta_old: float,
    theta_new: float,
    gamma: float,
) -> torch.Tensor:
    """Eq.11 summed over ``pairs`` [P, 2] of distinct classes ``(c, c')``."""
    c, c2 = pairs[:, 0], pairs[:, 1]
    q = p_old[c] + r[c]
    loss = F.relu((q * (p_old[c2] + r[c2])).sum(dim=1) - theta_old).sum()
    if p_new is not None and gamma > 0:
        loss = loss + gamma * F.relu((q * p_new[c2]).sum(dim=1) - theta_new).sum()
    return loss


def random_pairs(num_classes: int, count: int, generator: torch.Generator) -> torch.Tensor:
    """``count`` ordered pairs ``(c, c')``, uniform over ``c != c'``."""
    c = torch.randint(num_classes, (count,), generator=generator)
    c2 = (c + torch.randint(1, num_classes, (count,), generator=generator)) % num_classes
    return torch.stack([c, c2], dim=1)


def optimise_perturbation(
    p_old: torch.Tensor,
    p_new: torch.Tensor | None,
    r_init: torch.Tensor,
    *,
    theta_old: float,
    theta_new: float,
    gamma: float,
    lr: float,
    epochs: int,
    pairs_per_epoch: int,
    batch_pairs: int,
    seed: int,
) -> torch.Tensor:
    """Minimise Eq.11 over ``r`` by SGD from ``r_init``; deterministic in ``seed``."""
    num_classes = p_old.shape[0]
    if num_classes < 2 or epochs == 0 or pairs_per_epoch == 0:
        return r_init.clone()
    generator = torch.Generator().manual_seed(seed)
    p_old = p_old.detach().double().cpu()
    p_new = None if p_new is None else p_new.detach().double().cpu()
    r = r_init.detach().double().cpu().clone().requires_grad_(True)
    optimiser = torch.optim.SGD([r], lr=lr, foreach=False)
    with torch.enable_grad():
        for _ in range(epochs):
            for start in range(0, pairs_per_epoch, batch_pairs):
                pairs = random_pairs(
                    num_classes, min(batch_pairs, pairs_per_epoch - start), generator
                )
                optimiser.zero_grad(set_to_none=True)
                perturbation_objective(
                    p_old, r, p_new, pairs, theta_old, theta_new, gamma
                ).backward()
                optimiser.step()
    return r.detach().to(device=r_init.device, dtype=r_init.dtype)


@register_method
class ODPP(P2S):
    name = "odpp"
    description = (
        "P2S with optimisation-driven prototype perturbation, re-optimised every epoch (Eq.11)"
    )

    @dataclass
    class Options(P2S.Options):
        theta_old: float = 0.6
        theta_new: float = 0.6
        gamma: float = nonnegative(1.0)
        perturb_lr: float = positive(1e-3)
        perturb_epochs: int = nonnegative(50)
        pairs_per_epoch: int = nonnegative(0)  # 0: the number of training images
        batch_pairs: int = positive(1024)
        seed: int = 0

    def __init__(self, options, context):
        super().__init__(options, context)
        self.register_buffer("perturbation", torch.zeros_like(self.old_prototypes))

    def needs_new_prototypes(self) -> bool:
        return self.options.gamma > 0

    def perturb(self, epoch, new_prototypes):
        o = self.options
        self.perturbation.copy_(
            optimise_perturbation(
                self.old_prototypes,
                new_prototypes,
                self.perturbation,
                theta_old=o.theta_old,
                theta_new=o.theta_new,
                gamma=o.gamma,
                lr=o.perturb_lr,
                epochs=o.perturb_epochs,
                pairs_per_epoch=o.pairs_per_epoch or self.num_images,
                batch_pairs=o.batch_pairs,
                seed=o.seed * 1_000_003 + epoch,
            )
        )

    def positive_prototypes(self):
        return self.old_prototypes + self.perturbation
