"""``hinge-benefit``: largest estimated benefit first, computed with the new embeddings of every
item and the queries (a reference that knows what a deployment cannot; not deployable).

The benefit is a per-item hinge proxy of the AP change (docs/methods.md, "hinge-benefit"),
summed over the queries as if every other item stayed old: a heuristic, *not* an upper bound.
Items interact (moving one changes the ranks another competes with), so another order can
beat it; the papers' "oracle" is therefore not what this is, and the policy was renamed from
``oracle``. Its order depends on the query mode."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from raycompat.upgrade.policies.base import (
    BlockScorer,
    Policy,
    PolicyInputs,
    order_by_score,
    register_policy,
)

__all__ = ["HingeBenefitPolicy", "HingeBenefitScorer", "hinge_benefit", "hinge_benefit_order"]


def hinge_benefit(
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
    from raycompat.metrics.rank_metrics import positive_pairs

    pq, pi, _ = positive_pairs(query_labels, gallery_labels)
    scorer = HingeBenefitScorer.from_pairs(
        old_side, new_side, pq, pi, old_side.gallery[pi], new_side.gallery[pi], block_bytes
    )
    return scorer.benefit(old_side, new_side, 0, device)


@dataclass(frozen=True)
class HingeBenefitScorer(BlockScorer):
    """:func:`hinge_benefit` one block at a time: ``tau`` per query and, per positive pair
    (gallery index ``pairs_i``), the correction that turns its negative term into its
    positive one; every block adds the negative terms of its items over every query."""

    mode: str
    rank_merge_distance: str
    tau: np.ndarray
    pairs_i: np.ndarray
    correction: np.ndarray
    block_bytes: int

    @classmethod
    def from_pairs(
        cls, old_side, new_side, pq, pi, old_rows, new_rows, block_bytes, mode="", distance=""
    ) -> HingeBenefitScorer:
        """From the positive pairs (query ``pq``, gallery index ``pi``) and the pairs' gallery
        rows on each side (``old_rows[p]`` the row of pair p's item)."""
        so, sn = (
            np.einsum("ij,ij->i", s.queries[pq].astype(np.float64), rows.astype(np.float64))
            for s, rows in ((old_side, old_rows), (new_side, new_rows))
        )
        tau = np.full(old_side.queries.shape[0], np.inf)
        np.minimum.at(tau, pq, np.minimum(so, sn))
        tp = tau[pq]
        corr = (sn - so) + (np.maximum(sn - tp, 0) - np.maximum(so - tp, 0))
        return cls(mode, distance, tau, np.asarray(pi, np.int64), corr, int(block_bytes))

    def benefit(self, old_side, new_side, g0: int, device=None) -> np.ndarray:
        """The benefit of gallery items ``g0:g0+n`` given their rows on both sides."""
        out = _negative_terms(old_side, new_side, self.tau, device, self.block_bytes)
        n = out.shape[0]
        sel = (self.pairs_i >= g0) & (self.pairs_i < g0 + n)
        # positive pairs: undo their negative term, add the positive term (in pair order)
        np.add.at(out, self.pairs_i[sel] - g0, self.correction[sel])
        return out

    def scores(self, block, g0: int) -> np.ndarray:
        from raycompat.upgrade.modes import SideBuilder

        _, old_side, new_side = SideBuilder(block).mode_sides(self.mode, self.rank_merge_distance)
        return self.benefit(old_side, new_side, g0)


def _negative_terms(old_side, new_side, tau: np.ndarray, device, block_bytes: int) -> np.ndarray:
    """``-sum_q (relu(s_n - tau_q) - relu(s_o - tau_q))`` per item, over every query (one pass)."""
    import torch

    from raycompat.index.blocks import fp32_matmul, iter_score_blocks, resolve_device

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


def hinge_benefit_order(old_side, new_side, query_labels, gallery_labels, **kw) -> np.ndarray:
    """Largest :func:`hinge_benefit` first (a heuristic that needs the new embeddings)."""
    return order_by_score(hinge_benefit(old_side, new_side, query_labels, gallery_labels, **kw))


@register_policy
class HingeBenefitPolicy(Policy):
    name = "hinge-benefit"
    knows = (
        "the new embeddings of every item and the queries "
        "(a heuristic reference, not deployable and not an upper bound)"
    )
    needs_embeddings = True
    per_mode = True
    scored = True

    def block_scorer(self, inputs: PolicyInputs, access) -> BlockScorer:
        from raycompat.index.blocks import ENGINE_BLOCK_BYTES
        from raycompat.metrics.rank_metrics import positive_pairs

        old_side, new_side = inputs.mode_sides()  # the queries and the positives' rows
        data = inputs.data
        pq, rows, _ = positive_pairs(data.query_labels, data.gallery_labels)
        return HingeBenefitScorer.from_pairs(
            old_side,
            new_side,
            pq,
            access.items[rows],
            old_side.gallery[rows],
            new_side.gallery[rows],
            ENGINE_BLOCK_BYTES if inputs.block_bytes is None else inputs.block_bytes,
            inputs.mode,
            inputs.rank_merge_distance,
        )

    def scores(self, inputs: PolicyInputs) -> np.ndarray:
        from raycompat.index.blocks import ENGINE_BLOCK_BYTES

        old_side, new_side = inputs.mode_sides()
        data = inputs.data
        block_bytes = ENGINE_BLOCK_BYTES if inputs.block_bytes is None else inputs.block_bytes
        return hinge_benefit(
            old_side,
            new_side,
            data.query_labels,
            data.gallery_labels,
            device=inputs.device,
            block_bytes=block_bytes,
        )

    def order(self, inputs: PolicyInputs) -> np.ndarray:
        return order_by_score(self.scores(inputs))
