"""``learned``: a predictor of per-item old/new disagreement (FastFill-style).  Knows the old
features (+ uncertainty under the new head, when given) and the new embeddings of a held-out
sample only."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from raycompat.embeddings.gallery import BackfillInputError, GalleryEmbeddings
from raycompat.models.uncertainty_head import UncertaintyHead
from raycompat.upgrade.policies.base import (
    BlockScorer,
    Policy,
    PolicyInputs,
    order_by_score,
    register_policy,
)
from raycompat.upgrade.policies.uncertainty import gallery_uncertainty_features

__all__ = [
    "LearnedPolicy",
    "LearnedPredictor",
    "LearnedScorer",
    "disagreement",
    "learned_order",
    "learned_sample",
    "learned_scores",
    "learned_target",
]


def disagreement(new_rows: np.ndarray, old_state_rows: np.ndarray) -> np.ndarray:
    """``1 - cos(new vector, old-state vector mapped into the new space)`` per item.

    The old-state vector is ``psi(phi_o(g))`` when available, else ``phi_o(g)``
    compared with the compatible subspace ``phi_n(g)[:D_old]`` (pass the cut rows).
    """
    a = np.asarray(new_rows, dtype=np.float64)
    b = np.asarray(old_state_rows, dtype=np.float64)
    if a.shape != b.shape:
        raise BackfillInputError(
            f"dimension mismatch: {a.shape} vs {b.shape} for the disagreement target"
        )
    na = np.maximum(np.linalg.norm(a, axis=1), 1e-12)
    nb = np.maximum(np.linalg.norm(b, axis=1), 1e-12)
    return 1.0 - np.einsum("ij,ij->i", a, b) / (na * nb)


def learned_target(data: GalleryEmbeddings) -> Callable[[np.ndarray], np.ndarray]:
    """``reveal(ids)``: :func:`disagreement` of the new and old-state vectors of the sample items
    only (``psi(old)`` when ``gallery_adapted`` exists, else the compatible subspace)."""

    def reveal(ids: np.ndarray) -> np.ndarray:
        new = data.gallery_new[ids]
        if data.gallery_adapted is not None:
            return disagreement(new, data.gallery_adapted[ids])
        return disagreement(new[:, : data.old_dim], data.gallery_old[ids])

    return reveal


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
        self.coef: tuple[np.ndarray, float] | None = None
        self.lam: float | None = None
        self.mu: np.ndarray | None = None
        self.sd: np.ndarray | None = None

    @staticmethod
    def features(old_features: np.ndarray, extra: np.ndarray | None = None) -> np.ndarray:
        f = np.asarray(old_features, dtype=np.float64)
        f = f / np.maximum(np.linalg.norm(f, axis=1, keepdims=True), 1e-12)
        cols = [f, f * f]
        if extra is not None:
            cols.append(np.asarray(extra, dtype=np.float64).reshape(f.shape[0], -1))
        return np.concatenate(cols, axis=1)

    def fit(self, X: np.ndarray, y: np.ndarray) -> LearnedPredictor:
        X = np.asarray(X, dtype=np.float64)
        y = np.asarray(y, dtype=np.float64)
        self.mu = X.mean(axis=0)
        self.sd = np.where(X.std(axis=0) > 0, X.std(axis=0), 1.0)
        Z = (X - self.mu) / self.sd
        self.lam = self._cross_validated_lambda(Z, y)
        self.coef = self._fit_ridge(Z, y, self.lam)
        return self

    def _cross_validated_lambda(self, Z: np.ndarray, y: np.ndarray) -> float:
        """The lambda of lowest 5-fold squared error (the smallest one with fewer than 10
        samples)."""
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
        return best[1]

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
            out[s : s + chunk] = (
                (np.asarray(X[s : s + chunk], dtype=np.float64) - self.mu) / self.sd
            ) @ w + b
        return out


def learned_sample(n: int, seed: int, sample_fraction: float, min_sample: int = 32) -> np.ndarray:
    """The held-out sample of :func:`learned_order`: sorted item indices from
    ``numpy.random.default_rng(seed)``."""
    m = int(min(n, max(min_sample, int(np.ceil(sample_fraction * n)))))
    return np.sort(np.random.default_rng(seed).choice(n, size=m, replace=False))


def learned_scores(
    old_features: np.ndarray,
    reveal: Callable[[np.ndarray], np.ndarray],
    *,
    seed: int = 0,
    sample_fraction: float = 0.02,
    min_sample: int = 32,
    extra_features: np.ndarray | None = None,
):
    """``(scores, model, sample_ids)`` of :func:`learned_order`: ``+inf`` for the sample, the
    predicted disagreement for every other item."""
    f = np.asarray(old_features)
    sample = learned_sample(f.shape[0], seed, sample_fraction, min_sample)
    extra = None if extra_features is None else extra_features[sample]
    model = _fit(f[sample], extra, reveal(sample), seed)
    return LearnedScorer(model, sample, None).predict(f, extra_features, 0), model, sample


def learned_order(
    old_features: np.ndarray,
    reveal: Callable[[np.ndarray], np.ndarray],
    *,
    seed: int = 0,
    sample_fraction: float = 0.02,
    min_sample: int = 32,
    extra_features: np.ndarray | None = None,
    return_model: bool = False,
):
    """The ``learned`` order.

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
    scores, model, sample = learned_scores(
        old_features,
        reveal,
        seed=seed,
        sample_fraction=sample_fraction,
        min_sample=min_sample,
        extra_features=extra_features,
    )
    order = order_by_score(scores)
    return (order, model, sample) if return_model else order


def _fit(old_rows, extra, target, seed: int) -> LearnedPredictor:
    y = np.asarray(target, dtype=np.float64)
    if y.shape != (old_rows.shape[0],):
        raise ValueError(f"reveal() must return one target per sample item, got shape {y.shape}")
    return LearnedPredictor(seed=seed).fit(LearnedPredictor.features(old_rows, extra), y)


@dataclass(frozen=True)
class LearnedScorer(BlockScorer):
    """The learned priority of a block: ``+inf`` for the held-out sample (backfilled first, in
    index order), the predicted disagreement for every other item."""

    model: LearnedPredictor
    sample: np.ndarray  # sorted gallery indices
    head: UncertaintyHead | None

    def predict(self, old_rows: np.ndarray, extra: np.ndarray | None, g0: int) -> np.ndarray:
        n = old_rows.shape[0]
        out = np.empty(n)
        for s in range(0, n, 65536):
            e = None if extra is None else extra[s : s + 65536]
            out[s : s + 65536] = self.model.predict(
                LearnedPredictor.features(old_rows[s : s + 65536], e)
            )
        lo, hi = np.searchsorted(self.sample, [g0, g0 + n])
        out[self.sample[lo:hi] - g0] = np.inf
        return out

    def scores(self, block, g0: int) -> np.ndarray:
        return self.predict(block.gallery_old, gallery_uncertainty_features(block, self.head), g0)


@register_policy
class LearnedPolicy(Policy):
    name = "learned"
    knows = "old features (+ uncertainty), and the new embeddings of a held-out sample only"
    needs_embeddings = True
    scored = True

    def check(self, inputs: PolicyInputs) -> None:
        super().check(inputs)
        data = inputs.data
        if data.gallery_new is None:
            raise BackfillInputError("policy 'learned' needs gallery_new (its training target)")
        if data.gallery_adapted is None and data.compat_dim != data.old_dim:
            raise BackfillInputError(
                "policy 'learned' needs psi(old) ('adapted') or a compatible subspace "
                "of D_old dims "
                "to measure old/new disagreement"
            )

    def scores(self, inputs: PolicyInputs) -> np.ndarray:
        data = inputs.data
        return learned_scores(
            data.gallery_old,
            learned_target(data),
            seed=inputs.seed,
            sample_fraction=inputs.learned_sample_fraction,
            extra_features=gallery_uncertainty_features(data, inputs.head),
        )[0]

    def order(self, inputs: PolicyInputs) -> np.ndarray:
        return order_by_score(self.scores(inputs))

    def block_scorer(self, inputs: PolicyInputs, access) -> BlockScorer:
        sample = learned_sample(access.n_items, inputs.seed, inputs.learned_sample_fraction)
        rows = access.gather(sample)  # the sample's embeddings, read once
        everything = np.arange(sample.size)
        model = _fit(
            rows.gallery_old,
            gallery_uncertainty_features(rows, inputs.head),
            learned_target(rows)(everything),
            inputs.seed,
        )
        return LearnedScorer(model, sample, inputs.head)
