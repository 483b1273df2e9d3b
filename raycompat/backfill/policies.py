"""Backfill policies: the order in which gallery items get the new model's embedding.

METHODS.md, "Backfill policies".  A policy returns an *order*: a permutation of
the item indices ``0..N-1``; at backfill fraction ``t`` the first ``n(t)`` items
of the order hold their new vector (rounding rule in
:mod:`raycompat.backfill.grid`).  Each policy is a pure, seeded function of what
is known at that point of the upgrade, and receives nothing else:

========================================  =================================================
policy                                    knows
========================================  =================================================
``random``                                N, seed (``numpy.random.default_rng(seed)``)
``sequential``                            N (item order = ingestion order)
``uncertainty:least_confidence``,         the old gallery features and the new classifier
``uncertainty:margin``,                   head (RACT Eq.9-11), no image
``uncertainty:entropy``
``oracle``                                the new embeddings of every item and the queries
                                          (an upper-bound reference, not deployable)
``learned``                               old features (+ uncertainty), and the new
                                          embeddings of a held-out sample only
========================================  =================================================

Ordering rule for scored policies: highest score first, ties by lower item index
(a stable sort of ``-score``).  ``cost_aware`` ordering is not implemented.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import numpy as np

from raycompat.backfill.gallery import BackfillInputError

__all__ = [
    "POLICIES",
    "UNCERTAINTY_KINDS",
    "parse_policies",
    "UncertaintyHead",
    "class_probabilities",
    "uncertainty_scores",
    "order_by_score",
    "random_order",
    "sequential_order",
    "uncertainty_order",
    "oracle_benefit",
    "oracle_order",
    "disagreement",
    "LearnedPredictor",
    "learned_order",
    "check_order",
]

UNCERTAINTY_KINDS = ("least_confidence", "margin", "entropy")
POLICIES = ("random", "sequential") + tuple(f"uncertainty:{k}" for k in UNCERTAINTY_KINDS) + (
    "oracle", "learned")


def parse_policies(names) -> Tuple[str, ...]:
    """Comma string or sequence -> validated tuple (unknown names raise, listing the allowed)."""
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    out = []
    for n in names:
        if n not in POLICIES:
            raise BackfillInputError(f"unknown policy {n!r}; allowed: {', '.join(POLICIES)}")
        if n not in out:
            out.append(n)
    if not out:
        raise BackfillInputError(f"no policy given; allowed: {', '.join(POLICIES)}")
    return tuple(out)


def check_order(order: np.ndarray, n: int) -> np.ndarray:
    """Validate that ``order`` is a permutation of ``0..n-1``; returns it as int64."""
    o = np.asarray(order, dtype=np.int64)
    if o.shape != (n,) or (n and (o.min() < 0 or o.max() >= n)) or \
            (np.bincount(o, minlength=n) != 1).any():
        raise ValueError(f"a policy order must be a permutation of {n} items")
    return o


def order_by_score(scores) -> np.ndarray:
    """Indices by descending score, ties by ascending index (stable sort of ``-score``)."""
    s = np.asarray(scores, dtype=np.float64)
    if np.isnan(s).any():
        raise ValueError("policy scores contain NaN")
    return np.argsort(-s, kind="stable").astype(np.int64)


def random_order(n: int, seed: int = 0) -> np.ndarray:
    """``random``: a uniformly random permutation from ``numpy.random.default_rng(seed)``."""
    return np.random.default_rng(seed).permutation(n).astype(np.int64)


def sequential_order(n: int) -> np.ndarray:
    """``sequential``: the gallery's own order (ingestion order); deterministic."""
    return np.arange(n, dtype=np.int64)


# ----------------------------------------------------------------------------- uncertainty
@dataclass
class UncertaintyHead:
    """The new classifier ``w_n`` as plain arrays, applied to old gallery features.

    ``kind``: ``softmax`` (logits ``f W^T + b``) or a cosine head ``cosface`` /
    ``arcface`` (margin-free inference logits ``scale * cos(f, w)``), as
    :meth:`raycompat.models.ClassifierHead.inference_logits`.

    Dimension change: the old feature has ``D_old`` dims and the head expects
    ``D_new >= D_old``.  The old feature is compatible with the first ``D_old``
    dims of the new space (BCT), so the logits use the first ``D_old`` columns of
    ``W`` (for cosine heads the truncated rows are re-normalised).
    """

    weight: np.ndarray
    bias: Optional[np.ndarray] = None
    kind: str = "softmax"
    scale: float = 1.0

    @classmethod
    def from_classifier_head(cls, head) -> "UncertaintyHead":
        w = head.weight.detach().cpu().numpy().astype(np.float64)
        b = head.bias.detach().cpu().numpy().astype(np.float64) if getattr(head, "bias", None) is not None else None
        return cls(weight=w, bias=b, kind=head.kind, scale=float(getattr(head, "scale", 1.0)))

    def logits(self, features: np.ndarray) -> np.ndarray:
        """float64 inference logits ``[n, C]`` of (old) features ``[n, D_old]``."""
        f = np.asarray(features, dtype=np.float64)
        d = f.shape[1]
        if d > self.weight.shape[1]:
            raise BackfillInputError(
                f"dimension mismatch: old features have {d} dims, the new head only {self.weight.shape[1]}")
        w = self.weight[:, :d]
        if self.kind == "softmax":
            out = f @ w.T
            return out + self.bias[None, :] if self.bias is not None else out
        fn = f / np.maximum(np.linalg.norm(f, axis=1, keepdims=True), 1e-12)
        wn = w / np.maximum(np.linalg.norm(w, axis=1, keepdims=True), 1e-12)
        return self.scale * (fn @ wn.T)


def class_probabilities(features: np.ndarray, head: UncertaintyHead) -> np.ndarray:
    """``P = softmax(w_n(f))`` in float64 (RACT Sec. 4.3), ``[n, C]``."""
    z = head.logits(features)
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def uncertainty_scores(features: np.ndarray, head: UncertaintyHead, kind: str,
                       chunk: int = 16384) -> np.ndarray:
    """Per-item uncertainty of old gallery features under the new head (RACT Eq.9-11).

    With ``P`` sorted descending: least confidence ``1 - P1`` (Eq.9), margin
    ``1 - (P1 - P2)`` (Eq.10), entropy ``-sum_i P_i log P_i`` (Eq.11; ``0 log 0 = 0``).
    With a single class, margin uses ``P2 = 0``.
    """
    if kind not in UNCERTAINTY_KINDS:
        raise BackfillInputError(f"unknown uncertainty {kind!r}; allowed: {', '.join(UNCERTAINTY_KINDS)}")
    f = np.asarray(features)
    out = np.empty(f.shape[0], dtype=np.float64)
    for s in range(0, f.shape[0], chunk):
        p = class_probabilities(f[s:s + chunk], head)
        if kind == "entropy":
            with np.errstate(divide="ignore", invalid="ignore"):
                out[s:s + chunk] = -np.where(p > 0, p * np.log(p), 0.0).sum(axis=1)
            continue
        top = -np.sort(-p, axis=1)[:, :2]
        p1 = top[:, 0]
        p2 = top[:, 1] if top.shape[1] > 1 else np.zeros_like(p1)
        out[s:s + chunk] = 1.0 - p1 if kind == "least_confidence" else 1.0 - (p1 - p2)
    return out


def uncertainty_order(old_features: np.ndarray, head: UncertaintyHead, kind: str) -> np.ndarray:
    """``uncertainty:<kind>``: "the poor first" -- most uncertain old features first (RACT 4.3)."""
    return order_by_score(uncertainty_scores(old_features, head, kind))


# ----------------------------------------------------------------------------- oracle
def oracle_benefit(old_side, new_side, query_labels, gallery_labels, *, device=None,
                   block_bytes: int = 8 * 1024 * 1024) -> np.ndarray:
    """Per-item benefit of backfilling, computed with the true new embeddings and the queries.

    For query q let ``tau_q`` be the lowest score any of its positives can have
    (min over positives of min(old-state, new-state score)).  Backfilling item x
    moves its score from ``s_o(q, x)`` to ``s_n(q, x)``; the benefit is

        sum_{q: x positive} (s_n - s_o)  -  sum_{q: x negative} (relu(s_n - tau_q) - relu(s_o - tau_q)),

    i.e. raising a positive helps, raising a negative above the query's positives
    hurts and lowering it helps (a hinge proxy of the AP change).  Costs one
    blockwise scoring pass of both sides.
    """
    import torch

    from raycompat.backfill.blocks import fp32_matmul, iter_score_blocks, resolve_device
    from raycompat.backfill.engine import positive_pairs

    dev = resolve_device(device)
    pq, pi, npos = positive_pairs(query_labels, gallery_labels)
    n_q, n = old_side.queries.shape[0], old_side.gallery.shape[0]
    so = np.einsum("ij,ij->i", old_side.queries[pq].astype(np.float64), old_side.gallery[pi].astype(np.float64))
    sn = np.einsum("ij,ij->i", new_side.queries[pq].astype(np.float64), new_side.gallery[pi].astype(np.float64))
    tau = np.full(n_q, np.inf)
    np.minimum.at(tau, pq, np.minimum(so, sn))
    tau_t = torch.from_numpy(tau.astype(np.float32)).to(dev)
    neg = np.zeros(n, dtype=np.float64)
    with fp32_matmul(), torch.no_grad():
        it_o = iter_score_blocks(old_side.queries, old_side.gallery, device=dev, block_bytes=block_bytes)
        it_n = iter_score_blocks(new_side.queries, new_side.gallery, device=dev, block_bytes=block_bytes)
        for (q0, q1, g0, g1, S_o), (_, _, _, _, S_n) in zip(it_o, it_n):
            t = tau_t[q0:q1, None]
            d = torch.relu(S_n - t) - torch.relu(S_o - t)       # tau = +inf: no positives, 0
            neg[g0:g1] -= d.sum(dim=0, dtype=torch.float64).cpu().numpy()
    # positive pairs: undo their negative term, add the positive term
    tp = tau[pq]
    corr = (sn - so) + (np.maximum(sn - tp, 0) - np.maximum(so - tp, 0))
    np.add.at(neg, pi, corr)
    return neg


def oracle_order(old_side, new_side, query_labels, gallery_labels, **kw) -> np.ndarray:
    """``oracle``: largest :func:`oracle_benefit` first (upper bound; needs the new embeddings)."""
    return order_by_score(oracle_benefit(old_side, new_side, query_labels, gallery_labels, **kw))


# ----------------------------------------------------------------------------- learned
def disagreement(new_rows: np.ndarray, old_state_rows: np.ndarray) -> np.ndarray:
    """``1 - cos(new vector, old-state vector mapped into the new space)`` per item.

    The old-state vector is ``psi(phi_o(g))`` when available, else ``phi_o(g)``
    compared with the compatible subspace ``phi_n(g)[:D_old]`` (pass the cut rows).
    """
    a = np.asarray(new_rows, dtype=np.float64)
    b = np.asarray(old_state_rows, dtype=np.float64)
    if a.shape != b.shape:
        raise BackfillInputError(f"dimension mismatch: {a.shape} vs {b.shape} for the disagreement target")
    na = np.maximum(np.linalg.norm(a, axis=1), 1e-12)
    nb = np.maximum(np.linalg.norm(b, axis=1), 1e-12)
    return 1.0 - np.einsum("ij,ij->i", a, b) / (na * nb)


class LearnedPredictor:
    """Ridge regression from per-item features to the disagreement target (float64, closed form).

    Features: the L2-normalised old feature, its elementwise square (a cheap
    non-linearity), optional extra columns (the uncertainty scores), and a bias.
    The ridge strength is chosen by 5-fold cross-validation on the training
    sample (folds from ``numpy.random.default_rng(seed)``), from
    ``lambda * trace(X^T X) / p`` with lambda in 1e-4 .. 10.
    """

    LAMBDAS = (1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0)

    def __init__(self, seed: int = 0):
        self.seed = seed
        self.coef: Optional[np.ndarray] = None
        self.lam: Optional[float] = None
        self.mu: Optional[np.ndarray] = None
        self.sd: Optional[np.ndarray] = None

    @staticmethod
    def features(old_features: np.ndarray, extra: Optional[np.ndarray] = None) -> np.ndarray:
        f = np.asarray(old_features, dtype=np.float64)
        f = f / np.maximum(np.linalg.norm(f, axis=1, keepdims=True), 1e-12)
        cols = [f, f * f]
        if extra is not None:
            cols.append(np.asarray(extra, dtype=np.float64).reshape(f.shape[0], -1))
        return np.concatenate(cols, axis=1)

    def fit(self, X: np.ndarray, y: np.ndarray) -> "LearnedPredictor":
        X = np.asarray(X, dtype=np.float64)
        y = np.asarray(y, dtype=np.float64)
        self.mu = X.mean(axis=0)
        self.sd = np.where(X.std(axis=0) > 0, X.std(axis=0), 1.0)
        Z = (X - self.mu) / self.sd
        n = Z.shape[0]
        best = (np.inf, self.LAMBDAS[0])
        if n >= 10:
            folds = np.random.default_rng(self.seed).permutation(n) % 5
            for lam in self.LAMBDAS:
                err = 0.0
                for f in range(5):
                    tr, te = folds != f, folds == f
                    w, b = self._fit_ridge(Z[tr], y[tr], lam)
                    err += float(((Z[te] @ w + b - y[te]) ** 2).sum())
                if err < best[0]:
                    best = (err, lam)
        self.lam = best[1]
        self.coef = self._fit_ridge(Z, y, self.lam)
        return self

    @staticmethod
    def _fit_ridge(Z, y, lam):
        p = Z.shape[1]
        zm, ym = Z.mean(axis=0), y.mean()
        Zc, yc = Z - zm, y - ym
        A = Zc.T @ Zc
        A[np.diag_indices(p)] += lam * max(np.trace(A) / max(p, 1), 1e-12)
        w = np.linalg.solve(A, Zc.T @ yc)
        return w, ym - zm @ w

    def predict(self, X: np.ndarray, chunk: int = 65536) -> np.ndarray:
        w, b = self.coef
        out = np.empty(X.shape[0])
        for s in range(0, X.shape[0], chunk):
            out[s:s + chunk] = ((np.asarray(X[s:s + chunk], dtype=np.float64) - self.mu) / self.sd) @ w + b
        return out


def learned_order(
    old_features: np.ndarray,
    reveal: Callable[[np.ndarray], np.ndarray],
    *,
    seed: int = 0,
    sample_fraction: float = 0.02,
    min_sample: int = 32,
    extra_features: Optional[np.ndarray] = None,
    return_model: bool = False,
):
    """``learned``: a predictor of per-item old/new disagreement (FastFill-style).

    1. A held-out sample of items (``sample_fraction`` of the gallery, at least
       ``min_sample``; chosen by ``numpy.random.default_rng(seed)``) is embedded
       first: ``reveal(sample_ids)`` returns its disagreement target (e.g.
       :func:`disagreement` of the new vector and the old-state vector) -- the
       only new-model information the policy sees.
    2. A :class:`LearnedPredictor` is fit on the sample (old features + optional
       ``extra_features`` such as uncertainty scores -> target).
    3. Order: the sample first, in index order (its new embeddings already
       exist), then every other item by predicted disagreement, highest first,
       ties by lower index.

    With ``return_model`` returns ``(order, model, sample_ids)``.
    """
    f = np.asarray(old_features)
    n = f.shape[0]
    m = int(min(n, max(min_sample, int(np.ceil(sample_fraction * n)))))
    sample = np.sort(np.random.default_rng(seed).choice(n, size=m, replace=False))
    y = np.asarray(reveal(sample), dtype=np.float64)
    if y.shape != (m,):
        raise ValueError(f"reveal() must return one target per sample item, got shape {y.shape}")
    X_s = LearnedPredictor.features(f[sample], None if extra_features is None else extra_features[sample])
    model = LearnedPredictor(seed=seed).fit(X_s, y)
    rest = np.setdiff1d(np.arange(n), sample)
    pred = np.empty(rest.size)
    for s in range(0, rest.size, 65536):
        idx = rest[s:s + 65536]
        X = LearnedPredictor.features(f[idx], None if extra_features is None else extra_features[idx])
        pred[s:s + 65536] = model.predict(X)
    order = np.concatenate([sample, rest[order_by_score(pred)]])
    return (order, model, sample) if return_model else order
