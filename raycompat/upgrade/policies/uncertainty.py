"""``uncertainty:<kind>``: "the poor first" -- the old gallery features the new classifier head
is least sure about are backfilled first (RACT Sec. 4.3, Eq.9-11).  Knows the old gallery
features and the new head, no image."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from raycompat.embeddings.gallery import BackfillInputError
from raycompat.models.uncertainty_head import UncertaintyHead
from raycompat.upgrade.policies.base import (
    BlockScorer,
    Policy,
    PolicyInputs,
    order_by_score,
    register_policy,
)

__all__ = [
    "UNCERTAINTY_KINDS",
    "UncertaintyPolicy",
    "class_probabilities",
    "uncertainty_scores",
    "uncertainty_order",
    "uncertainty_features",
    "gallery_uncertainty",
    "gallery_uncertainty_features",
    "UncertaintyScorer",
]

UNCERTAINTY_KINDS = ("least_confidence", "margin", "entropy")


def class_probabilities(features: np.ndarray, head: UncertaintyHead) -> np.ndarray:
    """``P = softmax(w_n(f))`` in float64 (RACT Sec. 4.3), ``[n, C]``."""
    z = head.logits(features)
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def uncertainty_scores(
    features: np.ndarray, head: UncertaintyHead, kind: str, chunk: int = 16384
) -> np.ndarray:
    """Per-item uncertainty of old gallery features under the new head (RACT Eq.9-11).

    With ``P`` sorted descending: least confidence ``1 - P1`` (Eq.9), margin
    ``1 - (P1 - P2)`` (Eq.10), entropy ``-sum_i P_i log P_i`` (Eq.11; ``0 log 0 = 0``).
    With a single class, margin uses ``P2 = 0``.
    """
    if kind not in UNCERTAINTY_KINDS:
        raise BackfillInputError(
            f"unknown uncertainty {kind!r}; allowed: {', '.join(UNCERTAINTY_KINDS)}"
        )
    f = np.asarray(features)
    out = np.empty(f.shape[0], dtype=np.float64)
    for s in range(0, f.shape[0], chunk):
        p = class_probabilities(f[s : s + chunk], head)
        if kind == "entropy":
            with np.errstate(divide="ignore", invalid="ignore"):
                out[s : s + chunk] = -np.where(p > 0, p * np.log(p), 0.0).sum(axis=1)
            continue
        top = -np.sort(-p, axis=1)[:, :2]
        p1 = top[:, 0]
        p2 = top[:, 1] if top.shape[1] > 1 else np.zeros_like(p1)
        out[s : s + chunk] = 1.0 - p1 if kind == "least_confidence" else 1.0 - (p1 - p2)
    return out


def uncertainty_features(features: np.ndarray, head: UncertaintyHead) -> np.ndarray:
    """``[n, 3]``: the three uncertainty scores (Eq.9, 10, 11) of every item, as columns."""
    return np.stack([uncertainty_scores(features, head, k) for k in UNCERTAINTY_KINDS], axis=1)


def gallery_uncertainty(data, head: UncertaintyHead | None, kind: str) -> np.ndarray:
    """The gallery's uncertainty of ``kind``: the stored column when the embeddings have it
    (``unc_<kind>``, written by the embed-gallery job with the same function), else computed
    from ``gallery_old`` with ``head``."""
    stored = data.extra.get("uncertainty", {}).get(kind)
    if stored is not None:
        return np.asarray(stored, dtype=np.float64)
    if head is None:
        raise BackfillInputError(
            f"uncertainty {kind!r} needs the new model's classifier head or stored "
            f"'unc_{kind}' columns"
        )
    return uncertainty_scores(data.gallery_old, head, kind)


def gallery_uncertainty_features(data, head: UncertaintyHead | None) -> np.ndarray | None:
    """``[n, 3]`` (:func:`gallery_uncertainty` of every kind), or ``None`` with neither a head
    nor stored columns."""
    stored = data.extra.get("uncertainty", {})
    if head is None and not all(k in stored for k in UNCERTAINTY_KINDS):
        return None
    return np.stack([gallery_uncertainty(data, head, k) for k in UNCERTAINTY_KINDS], axis=1)


def uncertainty_order(old_features: np.ndarray, head: UncertaintyHead, kind: str) -> np.ndarray:
    """Most uncertain old features first (RACT 4.3); ties by lower index."""
    return order_by_score(uncertainty_scores(old_features, head, kind))


@dataclass(frozen=True)
class UncertaintyScorer(BlockScorer):
    """:func:`gallery_uncertainty` of a block (stored column, or the head on its old rows)."""

    head: UncertaintyHead | None
    kind: str

    def scores(self, block, g0: int) -> np.ndarray:
        return gallery_uncertainty(block, self.head, self.kind)


class UncertaintyPolicy(Policy):
    """``uncertainty:<kind>``; one registered subclass per kind."""

    kind = ""
    knows = "the old gallery features and the new classifier head (RACT Eq.9-11), no image"
    needs_embeddings = True
    needs_head = True
    scored = True

    def check(self, inputs: PolicyInputs) -> None:
        if inputs.data is not None and self.kind in inputs.data.extra.get("uncertainty", {}):
            return  # the stored column is enough
        super().check(inputs)

    def scores(self, inputs: PolicyInputs) -> np.ndarray:
        return gallery_uncertainty(inputs.data, inputs.head, self.kind)

    def order(self, inputs: PolicyInputs) -> np.ndarray:
        return order_by_score(self.scores(inputs))

    def block_scorer(self, inputs: PolicyInputs, access) -> BlockScorer:
        return UncertaintyScorer(inputs.head, self.kind)


@register_policy
class LeastConfidencePolicy(UncertaintyPolicy):
    name, kind = "uncertainty:least_confidence", "least_confidence"


@register_policy
class MarginPolicy(UncertaintyPolicy):
    name, kind = "uncertainty:margin", "margin"


@register_policy
class EntropyPolicy(UncertaintyPolicy):
    name, kind = "uncertainty:entropy", "entropy"
