"""``oracle``: largest benefit first, computed with the new embeddings of every item and the
queries (an upper-bound reference, not deployable).  Its order depends on the query mode."""

from __future__ import annotations

import numpy as np

from raycompat.backfill.policies.base import Policy, PolicyInputs, order_by_score, register_policy

__all__ = ["OraclePolicy", "oracle_benefit", "oracle_order"]


def oracle_benefit(
    old_side,
    new_side,
    query_labels,
    gallery_labels,
    *,
    device=None,
    block_bytes: int = 8 * 1024 * 1024,
) -> np.ndarray:
    """Per-item benefit of backfilling, computed with the true new embeddings and the queries.

    For query q let ``tau_q`` be the lowest score any of its positives can have
    (min over positives of min(old-state, new-state score)).  Backfilling item x
    moves its score from ``s_o(q, x)`` to ``s_n(q, x)``; the benefit is

        sum_{q: x positive} (s_n - s_o)
          -  sum_{q: x negative} (relu(s_n - tau_q) - relu(s_o - tau_q)),

    i.e. raising a positive helps, raising a negative above the query's positives
    hurts and lowering it helps (a hinge proxy of the AP change).  Costs one
    blockwise scoring pass of both sides.
    """
    from raycompat.backfill.engine import positive_pairs

    pq, pi, _ = positive_pairs(query_labels, gallery_labels)
    so, sn = (
        np.einsum("ij,ij->i", s.queries[pq].astype(np.float64), s.gallery[pi].astype(np.float64))
        for s in (old_side, new_side)
    )
    tau = np.full(old_side.queries.shape[0], np.inf)
    np.minimum.at(tau, pq, np.minimum(so, sn))
    benefit = _negative_terms(old_side, new_side, tau, device, block_bytes)
    # positive pairs: undo their negative term, add the positive term
    tp = tau[pq]
    corr = (sn - so) + (np.maximum(sn - tp, 0) - np.maximum(so - tp, 0))
    np.add.at(benefit, pi, corr)
    return benefit


def _negative_terms(old_side, new_side, tau: np.ndarray, device, block_bytes: int) -> np.ndarray:
    """``-sum_q (relu(s_n - tau_q) - relu(s_o - tau_q))`` per item, over every query (one pass)."""
    import torch

    from raycompat.backfill.blocks import fp32_matmul, iter_score_blocks, resolve_device

    dev = resolve_device(device)
    tau_t = torch.from_numpy(tau.astype(np.float32)).to(dev)
    neg = np.zeros(old_side.gallery.shape[0], dtype=np.float64)
    with fp32_matmul(), torch.no_grad():
        it_o = iter_score_blocks(
            old_side.queries, old_side.gallery, device=dev, block_bytes=block_bytes
        )
        it_n = iter_score_blocks(
            new_side.queries, new_side.gallery, device=dev, block_bytes=block_bytes
        )
        for (q0, q1, g0, g1, S_o), (_, _, _, _, S_n) in zip(it_o, it_n, strict=False):
            t = tau_t[q0:q1, None]
            d = torch.relu(S_n - t) - torch.relu(S_o - t)  # tau = +inf: no positives, 0
            neg[g0:g1] -= d.sum(dim=0, dtype=torch.float64).cpu().numpy()
    return neg


def oracle_order(old_side, new_side, query_labels, gallery_labels, **kw) -> np.ndarray:
    """Largest :func:`oracle_benefit` first (upper bound; needs the new embeddings)."""
    return order_by_score(oracle_benefit(old_side, new_side, query_labels, gallery_labels, **kw))


@register_policy
class OraclePolicy(Policy):
    name = "oracle"
    knows = (
        "the new embeddings of every item and the queries "
        "(an upper-bound reference, not deployable)"
    )
    needs_embeddings = True
    per_mode = True

    def order(self, inputs: PolicyInputs) -> np.ndarray:
        from raycompat.backfill.blocks import ENGINE_BLOCK_BYTES

        old_side, new_side = inputs.mode_sides()
        data = inputs.data
        block_bytes = ENGINE_BLOCK_BYTES if inputs.block_bytes is None else inputs.block_bytes
        return oracle_order(
            old_side,
            new_side,
            data.query_labels,
            data.gallery_labels,
            device=inputs.device,
            block_bytes=block_bytes,
        )
