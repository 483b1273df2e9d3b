"""``demand``: the items users find most often first (docs/methods.md, "demand").

``pop_i = sum_q f_q * 1[i in top-k(q)]`` over a query log (``PolicyInputs.reads``): the top-k of
each of the log's queries in the mode's t=0 serving state (compatible: new queries against the
old gallery), ``f_q`` its count; or, for a log of returned item ids, their summed counts.  Most
popular first, ties by the base order (``PolicyInputs.order_base``, default ``random``).
Knows the log, the old state's search results, and what its base knows."""

from __future__ import annotations

import numpy as np

from raycompat.embeddings.gallery import BackfillInputError
from raycompat.upgrade.policies.base import (
    Policy,
    PolicyInputs,
    check_order,
    policy_class,
    policy_order,
    register_policy,
)

__all__ = ["DemandPolicy", "demand_order", "check_order_base"]


def demand_order(popularity: np.ndarray, base_order: np.ndarray) -> np.ndarray:
    """Items by descending ``popularity``, ties by their position in ``base_order``."""
    pop = np.asarray(popularity, dtype=np.float64)
    base = check_order(base_order, pop.size)
    rank = np.empty(pop.size, dtype=np.int64)
    rank[base] = np.arange(pop.size)
    return np.lexsort((rank, -pop)).astype(np.int64)


def check_order_base(name: str, inputs: PolicyInputs) -> Policy:
    """The base order's policy, checked: a policy that needs a query log itself is refused."""
    cls = policy_class(inputs.options.order_base)
    if cls.needs_query_log:
        raise BackfillInputError(
            f"policy {name!r} needs a base order (--order-base) that does not read the query log "
            f"itself; got {inputs.options.order_base!r}"
        )
    base = cls()
    base.check(inputs)
    return base


@register_policy
class DemandPolicy(Policy):
    name = "demand"
    knows = (
        "a query log (its queries' top-k in the t=0 serving state, or returned ids, with counts) "
        "and what its base order knows (--order-base)"
    )
    needs_query_log = True
    per_mode = True

    def check(self, inputs: PolicyInputs) -> None:
        super().check(inputs)
        check_order_base(self.name, inputs)

    def base_policy(self, inputs: PolicyInputs) -> str:
        return inputs.options.order_base

    def order_with_base(self, inputs: PolicyInputs, base_order: np.ndarray) -> np.ndarray:
        return demand_order(inputs.reads.popularity(inputs.mode, inputs.n_items), base_order)

    def order(self, inputs: PolicyInputs) -> np.ndarray:
        return self.order_with_base(inputs, policy_order(inputs.options.order_base, inputs))
