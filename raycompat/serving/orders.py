"""Backfill orders for the live controller: a thin adapter from a served gallery source to
:func:`raycompat.upgrade.policies.policy_order`, the simulator's own dispatch.

The order is over the gallery's rows exactly as
:func:`raycompat.simulator.memory_engine.simulate_backfill` computes it for the same data,
policy, seed and mode (random / sequential need only N;
``uncertainty:*`` the new model's classifier head on the old features; ``learned`` old
features plus a revealed sample; ``hinge-benefit`` the queries and new embeddings;
``cost-aware`` its base and the cost column; ``demand`` and ``upgrade-on-read`` a query log),
so the live backfill walks the simulator's order item for item.

Upgrade on read (docs/live-index.md): :func:`reorder_on_read` is what the controller applies
before each batch, the simulator's own :func:`~raycompat.upgrade.policies.read_reorder` on the
part of the order not backfilled yet.
"""

from __future__ import annotations

import numpy as np

from raycompat.models.uncertainty_head import UncertaintyHead
from raycompat.upgrade.policies import PolicyInputs, PolicyOptions, policy_order, read_reorder

__all__ = ["source_policy_inputs", "policy_order_ids", "reorder_on_read"]


def source_policy_inputs(
    source,
    *,
    mode: str = "compatible",
    seed: int = 0,
    head: UncertaintyHead | None = None,
    learned_sample_fraction: float = 0.02,
    options: PolicyOptions | None = None,
    cost_column: str | None = None,
    query_log: str | None = None,
) -> PolicyInputs:
    """What a policy may know about a :class:`raycompat.serving.gallery_source.GallerySource`:
    its embeddings when it holds them (``source.data``, a parquet gallery), else N only; with
    ``cost_column`` the items' costs from the source's parquet, with ``query_log`` the log's
    searches (:mod:`raycompat.upgrade.query_log`)."""
    data = getattr(source, "data", None)
    options = options or PolicyOptions()
    if cost_column:
        from raycompat.embeddings.gallery import BackfillInputError, load_item_costs

        if data is None:
            raise BackfillInputError(f"cost column {cost_column!r} needs a parquet gallery")
        costs = load_item_costs(source.path, cost_column, data.gallery_ids)
        data = data.with_arrays(item_costs=costs)
    reads = None
    if query_log:
        from raycompat.upgrade.query_log import (
            log_searches,
            memory_log_searches,
            read_query_log,
        )

        log = read_query_log(query_log)
        if data is None:
            reads = log_searches(log, None, source.gallery_ids(), options.demand_k, None)
        else:
            reads = memory_log_searches(log, data, k=options.demand_k)
    return PolicyInputs(
        n_items=int(source.n_items if data is None else data.n_items),
        data=data,
        head=head,
        mode=mode,
        seed=seed,
        learned_sample_fraction=learned_sample_fraction,
        options=options,
        reads=reads,
    )


def policy_order_ids(policy: str, source, **kw) -> np.ndarray:
    """The order as item ids of ``source`` (keywords: those of :func:`source_policy_inputs`);
    an unknown policy or a missing input raises ``BackfillInputError`` (a ``ValueError``)."""
    rows = policy_order(policy, source_policy_inputs(source, **kw))
    return source.gallery_ids()[rows]


def reorder_on_read(order: np.ndarray, position: int, window_ids) -> np.ndarray:
    """Upgrade on read: ``order`` (item ids) with its first ``position`` items (backfilled)
    unchanged and the rest reordered by :func:`~raycompat.upgrade.policies.read_reorder`:
    the ids of ``window_ids`` (the window of recent searches' results, most recent search
    first) that are still waiting move to the front."""
    out = np.asarray(order, dtype=np.int64).copy()
    out[position:] = read_reorder(out[position:], window_ids)
    return out
