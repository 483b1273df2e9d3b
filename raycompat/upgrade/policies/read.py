"""``upgrade-on-read``: a base order whose items move to the front of the queue when searches
return them (docs/methods.md, "Upgrade on read").

The live controller keeps the results of the last ``W`` searches (the window) and, before each
batch, moves the items they returned that are still waiting to the front of its remaining
queue (:func:`read_reorder`, which it calls too: ``raycompat.serving.orders``).  The simulator
models the same with the query log's searches in time order (``QueryLog.stream``) arriving at
``q`` searches per backfilled item: before the item at position ``m`` is backfilled, the first
``a(m) = min(E, floor(m * q))`` searches have happened (:func:`searches_before`), and when that
number grew, the remaining queue is reordered with the window of the last ``W`` of them.  A
search returns its query's top-k in the mode's t=0 serving state (the ``demand`` policy's
results): the model leaves out that a search of the mixed index may return other items.  Knows
the searches so far, and what its base order knows."""

from __future__ import annotations

import numpy as np

from raycompat.upgrade.policies.base import (
    Policy,
    PolicyInputs,
    check_order,
    policy_order,
    register_policy,
)
from raycompat.upgrade.policies.demand import check_order_base

__all__ = [
    "UpgradeOnReadPolicy",
    "read_reorder",
    "read_window_ids",
    "searches_before",
    "upgrade_on_read_order",
]


def read_reorder(remaining: np.ndarray, window_ids) -> np.ndarray:
    """The remaining queue after the items of ``window_ids`` (most recent search first, each
    search's results in rank order; ``-1`` ignored) that are still in it move to its front, in
    the window's order (first occurrence), the others keeping their order.  Pure, the same
    result for the same window (applying it twice changes nothing)."""
    rem = np.asarray(remaining, dtype=np.int64)
    w = np.asarray(window_ids, dtype=np.int64).ravel()
    w = w[w >= 0]
    if not w.size or not rem.size:
        return rem.copy()
    _, first = np.unique(w, return_index=True)
    w = w[np.sort(first)]
    front = w[np.isin(w, rem)]
    if not front.size:
        return rem.copy()
    return np.concatenate([front, rem[~np.isin(rem, front)]])


def read_window_ids(results: np.ndarray, events: np.ndarray, arrived: int, window: int):
    """The ids the last ``window`` of the first ``arrived`` searches returned, most recent
    first: ``results[events[arrived - 1]], results[events[arrived - 2]], ...``."""
    last = events[max(0, arrived - int(window)) : arrived][::-1]
    return np.asarray(results)[last].ravel()


def searches_before(position: int, queries_per_item: float, n_searches: int) -> int:
    """Searches that happened before the item at ``position`` is backfilled:
    ``min(E, floor(position * q))``."""
    return int(min(n_searches, np.floor(position * float(queries_per_item))))


def upgrade_on_read_order(
    queue: np.ndarray,
    results: np.ndarray,
    events: np.ndarray,
    queries_per_item: float,
    window: int,
) -> np.ndarray:
    """The backfill order of ``queue`` under a stream of searches (module docstring):
    ``results[u]`` the items search ``u`` returns, ``events`` the searches in time order."""
    order = np.asarray(queue, dtype=np.int64).copy()
    n, total = order.size, int(np.asarray(events).size)
    arrived = 0
    q = float(queries_per_item)
    for m in range(min(n, int(np.ceil(total / q)) + 1)):  # no search arrives after that
        now = searches_before(m, q, total)
        if now > arrived:
            arrived = now
            order[m:] = read_reorder(order[m:], read_window_ids(results, events, now, window))
    return order


@register_policy
class UpgradeOnReadPolicy(Policy):
    name = "upgrade-on-read"
    knows = (
        "the searches so far (a query log in time order, --queries-per-item, --read-window) "
        "and what its base order knows (--order-base)"
    )
    needs_query_log = True
    per_mode = True

    def check(self, inputs: PolicyInputs) -> None:
        from raycompat.embeddings.gallery import BackfillInputError

        super().check(inputs)
        check_order_base(self.name, inputs)
        if not inputs.options.queries_per_item > 0 or int(inputs.options.read_window) < 1:
            raise BackfillInputError(
                "upgrade-on-read needs queries_per_item > 0 and read_window >= 1, got "
                f"{inputs.options.queries_per_item!r} and {inputs.options.read_window!r}"
            )

    def base_policy(self, inputs: PolicyInputs) -> str:
        return inputs.options.order_base

    def order_with_base(self, inputs: PolicyInputs, base_order: np.ndarray) -> np.ndarray:
        reads = inputs.reads
        queue = check_order(base_order, inputs.n_items)
        return upgrade_on_read_order(
            queue,
            reads.results(inputs.mode),
            reads.log.stream(inputs.seed),
            inputs.options.queries_per_item,
            inputs.options.read_window,
        )

    def order(self, inputs: PolicyInputs) -> np.ndarray:
        return self.order_with_base(inputs, policy_order(inputs.options.order_base, inputs))
