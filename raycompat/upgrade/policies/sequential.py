"""``sequential``: the gallery's own order (ingestion order); knows N only."""

from __future__ import annotations

import numpy as np

from raycompat.upgrade.policies.base import Policy, PolicyInputs, register_policy

__all__ = ["SequentialPolicy", "sequential_order"]


def sequential_order(n: int) -> np.ndarray:
    """``0..n-1``: deterministic."""
    return np.arange(n, dtype=np.int64)


@register_policy
class SequentialPolicy(Policy):
    name = "sequential"
    knows = "N (item order = ingestion order)"

    def order(self, inputs: PolicyInputs) -> np.ndarray:
        return sequential_order(inputs.n_items)
