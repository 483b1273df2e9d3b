"""Backfill orders for the live controller: the simulator's policies
(:mod:`raycompat.backfill.policies`) applied to the served gallery, returned as item ids.

The order is over the gallery's rows exactly as :func:`raycompat.backfill.simulate_backfill`
computes it for the same data, policy, seed and mode (random / sequential need only N;
``uncertainty:*`` the new model's classifier head on the old features; ``learned`` old
features plus a revealed sample; ``oracle`` the queries and new embeddings), so the live
backfill walks the simulator's order item for item.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from raycompat.backfill.policies import (
    POLICIES,
    UncertaintyHead,
    check_order,
    learned_order,
    oracle_order,
    random_order,
    sequential_order,
    uncertainty_order,
    uncertainty_scores,
)
from raycompat.config import ConfigError

__all__ = ["policy_order", "policy_order_ids"]


def policy_order(policy: str, data, *, mode: str = "compatible", seed: int = 0,
                 head: Optional[UncertaintyHead] = None, n_items: Optional[int] = None,
                 learned_sample_fraction: float = 0.02) -> np.ndarray:
    """Permutation of gallery rows for ``policy`` (``data``: a GalleryEmbeddings, or ``None``
    with ``n_items`` for the policies that need nothing but N)."""
    if policy not in POLICIES:
        raise ConfigError(f"unknown policy {policy!r}; allowed: {', '.join(POLICIES)}")
    n = int(n_items if data is None else data.n_items)
    if policy == "random":
        return random_order(n, seed)
    if policy == "sequential":
        return sequential_order(n)
    if data is None:
        raise ConfigError(f"policy {policy!r} needs the gallery's embeddings (a parquet gallery)")
    if policy.startswith("uncertainty:"):
        if head is None:
            raise ConfigError(f"policy {policy!r} needs the new model's classifier head (option new_model)")
        return check_order(uncertainty_order(data.gallery_old, head, policy.split(":", 1)[1]), n)
    if policy == "learned":
        from raycompat.backfill.simulator import _learned_target

        extra = None
        if head is not None:
            extra = np.stack([uncertainty_scores(data.gallery_old, head, k)
                              for k in ("least_confidence", "margin", "entropy")], axis=1)
        return check_order(learned_order(data.gallery_old, _learned_target(data), seed=seed,
                                         sample_fraction=learned_sample_fraction, extra_features=extra), n)
    # oracle
    from raycompat.backfill.modes import SideBuilder

    _, old_side, new_side = SideBuilder(data).mode_sides(mode)
    return check_order(oracle_order(old_side, new_side, data.query_labels, data.gallery_labels), n)


def policy_order_ids(policy: str, source, **kw) -> np.ndarray:
    """The order as item ids of a :class:`raycompat.serving.gallery_source.GallerySource`."""
    data = getattr(source, "data", None)
    rows = policy_order(policy, data, n_items=source.n_items, **kw)
    return source.gallery_ids()[rows]
