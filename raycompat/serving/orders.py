"""Backfill orders for the live controller: a thin adapter from a served gallery source to
:func:`raycompat.backfill.policies.policy_order`, the simulator's own dispatch.

The order is over the gallery's rows exactly as :func:`raycompat.backfill.simulate_backfill`
computes it for the same data, policy, seed and mode (random / sequential need only N;
``uncertainty:*`` the new model's classifier head on the old features; ``learned`` old
features plus a revealed sample; ``hinge-benefit`` the queries and new embeddings), so the live
backfill walks the simulator's order item for item.
"""

from __future__ import annotations

import numpy as np

from raycompat.backfill.policies import PolicyInputs, UncertaintyHead, policy_order

__all__ = ["source_policy_inputs", "policy_order_ids"]


def source_policy_inputs(
    source,
    *,
    mode: str = "compatible",
    seed: int = 0,
    head: UncertaintyHead | None = None,
    learned_sample_fraction: float = 0.02,
) -> PolicyInputs:
    """What a policy may know about a :class:`raycompat.serving.gallery_source.GallerySource`:
    its embeddings when it holds them (``source.data``, a parquet gallery), else N only."""
    data = getattr(source, "data", None)
    return PolicyInputs(
        n_items=int(source.n_items if data is None else data.n_items),
        data=data,
        head=head,
        mode=mode,
        seed=seed,
        learned_sample_fraction=learned_sample_fraction,
    )


def policy_order_ids(policy: str, source, **kw) -> np.ndarray:
    """The order as item ids of ``source`` (keywords: those of :func:`source_policy_inputs`);
    an unknown policy or a missing input raises ``BackfillInputError`` (a ``ValueError``)."""
    rows = policy_order(policy, source_policy_inputs(source, **kw))
    return source.gallery_ids()[rows]
