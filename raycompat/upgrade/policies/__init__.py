"""Backfill policies: the order in which gallery items get the new model's embedding.

docs/methods.md, "Backfill policies".  A policy returns an *order*: a permutation of
the item indices ``0..N-1``; at backfill fraction ``t`` the first ``n(t)`` items
of the order hold their new vector (rounding rule in
:mod:`raycompat.upgrade.grid`).  Each policy is a pure, seeded function of what
is known at that point of the upgrade, and receives nothing else:

========================================  =================================================
policy (module)                           knows
========================================  =================================================
``random`` (random)                       N, seed (``numpy.random.default_rng(seed)``)
``sequential`` (sequential)               N (item order = ingestion order)
``uncertainty:least_confidence``,         the old gallery features and the new classifier
``uncertainty:margin``,                   head (RACT Eq.9-11), no image
``uncertainty:entropy`` (uncertainty)
``hinge-benefit`` (benefit)               the new embeddings of every item and the queries
                                          (a heuristic reference, not deployable; not an
                                          upper bound: renamed from ``oracle``)
``learned`` (learned)                     old features (+ uncertainty), and the new
                                          embeddings of a held-out sample only
``cost-aware`` (cost_aware)               a scored base policy's knowledge and every item's
                                          cost: ``b_i / c_i``
``demand`` (demand)                       a query log: how often each item is in the top-k
                                          of its queries (t=0 state); ties by a base order
``upgrade-on-read`` (read)                the searches so far, in time order: their results
                                          move to the front of a base order's queue
========================================  =================================================

One module per policy, each registering a :class:`~raycompat.upgrade.policies.base.Policy`
subclass; :func:`policy_order` (name + :class:`PolicyInputs`) is the one dispatch, used by
the simulator and by the live backfill controller (``raycompat.serving.orders``), so both
walk the same order item for item.  Adding a policy: one module here with a registered
class, plus its import below.

Ordering rule for scored policies: highest score first, ties by lower item index
(a stable sort of ``-score``).
"""

from __future__ import annotations

from raycompat.embeddings.gallery import BackfillInputError

# The imports register the policies; their order is the order of POLICIES (isort keeps it).
# isort: off
from raycompat.upgrade.policies import random, sequential, uncertainty, benefit, learned  # noqa: F401
from raycompat.upgrade.policies import cost_aware, demand, read  # noqa: F401

# isort: on
from raycompat.upgrade.policies.base import (
    Policy,
    PolicyInputs,
    PolicyOptions,
    available_policies,
    check_order,
    check_policy_inputs,
    order_by_score,
    policy_class,
    policy_order,
    register_policy,
)
from raycompat.upgrade.policies.benefit import hinge_benefit, hinge_benefit_order
from raycompat.upgrade.policies.cost_aware import cost_aware_priority
from raycompat.upgrade.policies.demand import demand_order
from raycompat.upgrade.policies.learned import (
    LearnedPredictor,
    disagreement,
    learned_order,
    learned_target,
)
from raycompat.upgrade.policies.random import random_order
from raycompat.upgrade.policies.read import (
    read_reorder,
    read_window_ids,
    searches_before,
    upgrade_on_read_order,
)
from raycompat.upgrade.policies.sequential import sequential_order
from raycompat.upgrade.policies.uncertainty import (
    UNCERTAINTY_KINDS,
    class_probabilities,
    uncertainty_features,
    uncertainty_order,
    uncertainty_scores,
)

__all__ = [
    "POLICIES",
    "UNCERTAINTY_KINDS",
    "parse_policies",
    "Policy",
    "PolicyInputs",
    "PolicyOptions",
    "available_policies",
    "check_policy_inputs",
    "policy_class",
    "policy_order",
    "register_policy",
    "class_probabilities",
    "uncertainty_features",
    "uncertainty_scores",
    "order_by_score",
    "random_order",
    "sequential_order",
    "uncertainty_order",
    "hinge_benefit",
    "hinge_benefit_order",
    "disagreement",
    "LearnedPredictor",
    "learned_order",
    "learned_target",
    "check_order",
    "cost_aware_priority",
    "demand_order",
    "read_reorder",
    "read_window_ids",
    "searches_before",
    "upgrade_on_read_order",
]

#: every registered policy name, in registration order
POLICIES = tuple(available_policies())


def parse_policies(names) -> tuple[str, ...]:
    """Comma string or sequence -> validated tuple (unknown names raise, listing the allowed)."""
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    out = []
    for n in names:
        policy_class(n)
        if n not in out:
            out.append(n)
    if not out:
        raise BackfillInputError(f"no policy given; allowed: {', '.join(available_policies())}")
    return tuple(out)
