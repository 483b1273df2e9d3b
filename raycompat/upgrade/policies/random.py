"""``random``: a uniformly random permutation, seeded (knows N and the seed)."""

from __future__ import annotations

import numpy as np

from raycompat.upgrade.policies.base import Policy, PolicyInputs, register_policy

__all__ = ["RandomPolicy", "random_order"]


def random_order(n: int, seed: int = 0) -> np.ndarray:
    """A uniformly random permutation from ``numpy.random.default_rng(seed)``."""
    return np.random.default_rng(seed).permutation(n).astype(np.int64)


@register_policy
class RandomPolicy(Policy):
    name = "random"
    knows = "N, seed (numpy.random.default_rng(seed))"

    def order(self, inputs: PolicyInputs) -> np.ndarray:
        return random_order(inputs.n_items, inputs.seed)
