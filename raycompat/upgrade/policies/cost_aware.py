"""``cost-aware``: the most benefit per unit of cost first, ``priority_i = b_i / c_i``
(docs/methods.md, "cost-aware").

``b_i`` is the score of a scored base policy (``PolicyInputs.cost_base``: an uncertainty form,
``learned`` or ``hinge-benefit``), ``c_i > 0`` the item's cost from a gallery column (bytes of
the image, pixels, a storage tier's price; 1 for every item without one).  Highest priority
first, ties by lower gallery index.  Knows what its base knows, and the costs."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from raycompat.embeddings.gallery import BackfillInputError
from raycompat.upgrade.policies.base import (
    BlockScorer,
    Policy,
    PolicyInputs,
    order_by_score,
    policy_class,
    register_policy,
)

__all__ = ["CostAwarePolicy", "CostAwareScorer", "cost_aware_priority"]


def cost_aware_priority(benefit: np.ndarray, costs: np.ndarray) -> np.ndarray:
    """``b_i / c_i`` in float64 (``+inf`` benefits, the learned policy's sample, stay first)."""
    return np.asarray(benefit, dtype=np.float64) / np.asarray(costs, dtype=np.float64)


@dataclass(frozen=True)
class CostAwareScorer(BlockScorer):
    """The base policy's block scores over the block's costs (the cost column of its rows)."""

    base: BlockScorer

    def scores(self, block, g0: int) -> np.ndarray:
        return cost_aware_priority(self.base.scores(block, g0), block.costs())


@register_policy
class CostAwarePolicy(Policy):
    name = "cost-aware"
    knows = "what its base policy knows (--cost-base), and every item's cost (--cost-column)"
    needs_embeddings = True
    per_mode = True  # as its base may be (hinge-benefit)
    scored = True

    def _base(self, inputs: PolicyInputs) -> Policy:
        cls = policy_class(inputs.options.cost_base)
        if not cls.scored or cls is CostAwarePolicy:
            allowed = [n for n, c in _scored_policies().items() if c is not CostAwarePolicy]
            raise BackfillInputError(
                f"cost-aware needs a scored base policy (--cost-base), one of "
                f"{', '.join(allowed)}; got {inputs.options.cost_base!r}"
            )
        return cls()

    def check(self, inputs: PolicyInputs) -> None:
        super().check(inputs)
        self._base(inputs).check(inputs)

    def scores(self, inputs: PolicyInputs) -> np.ndarray:
        return cost_aware_priority(self._base(inputs).scores(inputs), inputs.data.costs())

    def order(self, inputs: PolicyInputs) -> np.ndarray:
        return order_by_score(self.scores(inputs))

    def block_scorer(self, inputs: PolicyInputs, access) -> BlockScorer:
        return CostAwareScorer(self._base(inputs).block_scorer(inputs, access))


def _scored_policies() -> dict:
    from raycompat.upgrade.policies.base import available_policies

    return {n: c for n, c in available_policies().items() if c.scored}
