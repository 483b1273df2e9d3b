"""Synthetic galleries shared by the simulator's report tests."""

from __future__ import annotations

import numpy as np

from raycompat.embeddings.gallery import GalleryEmbeddings


def unit(a):
    return (a / np.linalg.norm(a, axis=1, keepdims=True)).astype(np.float32)


def clustered_gallery(seed: int, n: int, n_q: int, d: int, classes: int) -> GalleryEmbeddings:
    """``classes`` class centres; old vectors noisy (sigma 1), new ones sharper (sigma 0.4)."""
    rng = np.random.default_rng(seed)
    mu = unit(rng.standard_normal((classes, d)))
    gl, ql = rng.integers(0, classes, n), rng.integers(0, classes, n_q)
    return GalleryEmbeddings(
        gallery_labels=gl,
        query_labels=ql,
        gallery_old=unit(mu[gl] + rng.standard_normal((n, d))),
        query_old=unit(mu[ql] + rng.standard_normal((n_q, d))),
        gallery_new=unit(mu[gl] + 0.4 * rng.standard_normal((n, d))),
        query_new=unit(mu[ql] + 0.4 * rng.standard_normal((n_q, d))),
    )
