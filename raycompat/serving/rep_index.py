"""The items of one representation in one shard: their vectors and their search index.

docs/architecture.md, "Serving".  :class:`RepIndex` keeps the (L2-normalised) vectors of the
items currently in one representation and a faiss index over them, and answers top-k by
canonical score (:mod:`raycompat.index.canonical`).  :func:`merge_topk` merges per-source
top-k lists in the same order.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["RepIndex", "merge_topk"]


class RepIndex:
    """Vectors of the items currently in one representation, and their faiss index."""

    def __init__(self, dim: int, factory: str = "Flat", train_min: int = 4096):
        self.dim = int(dim)
        self.factory = factory
        self.train_min = int(train_min)
        self.vecs = np.zeros((0, self.dim), np.float32)
        self.ids = np.zeros(0, np.int64)  # -1 marks a free slot
        self.slot: dict[int, int] = {}
        self.free: list = []
        self.index = None  # faiss index (IDs = item ids) or None: numpy search
        self.exact = True  # the faiss index returns the true float32 top-n
        self.norm_max = 0.0  # bound on the stored vectors' norms (error band)
        self.tombstones: set = set()
        self.removable = True
        self._next_train = self.train_min
        self._build()

    # ------------------------------------------------------------------ faiss
    def _new_faiss(self):
        import faiss

        inner = faiss.index_factory(self.dim, self.factory, faiss.METRIC_INNER_PRODUCT)
        core = faiss.downcast_index(inner)
        if isinstance(core, (faiss.IndexIDMap, faiss.IndexIDMap2)):
            core = faiss.downcast_index(core.index)
        self.exact = isinstance(core, faiss.IndexFlat)
        if isinstance(inner, (faiss.IndexIDMap, faiss.IndexIDMap2)):
            return inner
        return faiss.IndexIDMap2(inner)

    def _build(self):
        """(Re)build the faiss index from the live vectors (training it if needed)."""
        idx = self._new_faiss()
        live = np.flatnonzero(self.ids >= 0)
        if not idx.is_trained:
            if live.size < max(self._next_train, 1):
                self.index = None
                return
            try:
                idx.train(np.ascontiguousarray(self.vecs[live]))
            except RuntimeError:
                self._next_train = 2 * max(live.size, 1)
                self.index = None
                return
        if live.size:
            idx.add_with_ids(np.ascontiguousarray(self.vecs[live]), self.ids[live])
        self.index = idx
        self.tombstones = set()

    def __len__(self) -> int:
        return len(self.slot)

    def add(self, ids: np.ndarray, vecs: np.ndarray) -> None:
        ids = np.asarray(ids, np.int64)
        if any(int(i) in self.tombstones for i in ids):
            self._place(ids, vecs)
            self._build()
            return
        self._place(ids, vecs)
        if self.index is None:
            if len(self.slot) >= self._next_train:
                self._build()
        else:
            self.index.add_with_ids(np.ascontiguousarray(vecs, dtype=np.float32), ids)

    def _place(self, ids: np.ndarray, vecs: np.ndarray) -> None:
        if len(vecs):
            v = np.asarray(vecs, np.float64)
            self.norm_max = max(
                self.norm_max, float(np.sqrt(np.einsum("ij,ij->i", v, v).max())) * (1 + 1e-9)
            )
        need = len(ids) - len(self.free)
        if need > 0:
            cap = self.ids.size
            grow = max(need, cap // 2, 1024)
            self.vecs = np.concatenate([self.vecs, np.zeros((grow, self.dim), np.float32)])
            self.ids = np.concatenate([self.ids, np.full(grow, -1, np.int64)])
            self.free.extend(range(cap + grow - 1, cap - 1, -1))
        for i, v in zip(ids.tolist(), vecs, strict=False):
            s = self.free.pop()
            self.vecs[s] = v
            self.ids[s] = i
            self.slot[i] = s

    def remove(self, ids: np.ndarray) -> None:
        ids = np.asarray(ids, np.int64)
        for i in ids.tolist():
            s = self.slot.pop(i)
            self.ids[s] = -1
            self.free.append(s)
        if self.index is None or not ids.size:
            return
        if self.removable:
            try:
                self.index.remove_ids(ids)
                return
            except RuntimeError:
                self.removable = False
        self.tombstones.update(ids.tolist())
        if len(self.tombstones) > max(1024, len(self.slot) // 5):
            self._build()

    def vectors_of(self, ids: np.ndarray) -> np.ndarray:
        return self.vecs[[self.slot[int(i)] for i in ids]]

    def export(self) -> tuple[np.ndarray, np.ndarray]:
        live = np.flatnonzero(self.ids >= 0)
        order = live[np.argsort(self.ids[live], kind="stable")]
        return self.ids[order].copy(), self.vecs[order].copy()

    def search(self, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Top-k ``(canonical scores float64, ids)`` ``[Q, k]`` of this representation
        (``-inf``/``-1`` padded), by :func:`raycompat.index.canonical.rerank_top_k`: float32
        candidates re-ranked by canonical score, ties by ascending id; with an exact index,
        queries whose candidates could miss an item are searched again with 4x as many."""
        from raycompat.index.canonical import rerank_top_k

        n_q = q.shape[0]
        kk = min(k, len(self.slot))
        out_s = np.full((n_q, k), -np.inf)
        out_i = np.full((n_q, k), -1, np.int64)
        if kk == 0 or n_q == 0:
            return out_s, out_i
        q = np.ascontiguousarray(q, dtype=np.float32)
        total = len(self.slot) + (len(self.tombstones) if self.index is not None else 0)
        fetch = min(total, kk + 16 + len(self.tombstones))
        pending = np.arange(n_q)
        while pending.size:
            S, I = self._candidates(q[pending], fetch)
            s, i, ok = rerank_top_k(
                q[pending], S, I, kk, self.vectors_of, self.norm_max, complete=fetch >= total
            )
            if not (self.exact or self.index is None):
                ok[:] = True  # an approximate index: its candidates are the answer
            out_s[pending[ok], :kk] = s[ok]
            out_i[pending[ok], :kk] = i[ok]
            pending = pending[~ok]
            fetch = min(total, fetch * 4)
        return out_s, out_i

    def _candidates(self, q: np.ndarray, fetch: int) -> tuple[np.ndarray, np.ndarray]:
        """float32 ``(scores, ids)`` ``[Q, fetch]`` from faiss, or from numpy before an index
        that needs training is trained; removed items (tombstones) become ``-1``."""
        if self.index is None:
            live = np.flatnonzero(self.ids >= 0)
            S = q @ self.vecs[live].T
            if fetch < live.size:
                top = np.argpartition(-S, fetch - 1, axis=1)[:, :fetch]
                return np.take_along_axis(S, top, axis=1), self.ids[live][top]
            return S, np.broadcast_to(self.ids[live], S.shape).copy()
        S, I = self.index.search(q, fetch)
        if self.tombstones:
            dead = np.isin(I, np.fromiter(self.tombstones, np.int64))
            S = np.where(dead, -np.inf, S)
            I = np.where(dead, -1, I)
        return S, I


def merge_topk(
    scores: Sequence[np.ndarray], ids: Sequence[np.ndarray], reps: Sequence[np.ndarray], k: int
):
    """Merge per-source top-k lists ``[Q, k_i]`` into one ``[Q, k]`` (descending canonical
    score, ascending id: the order each source already has)."""
    S = np.concatenate(scores, axis=1)
    I = np.concatenate(ids, axis=1)
    R = np.concatenate(reps, axis=1)
    key = np.where(I < 0, np.iinfo(np.int64).max, I)
    order = np.lexsort((key, -S), axis=-1)[:, :k]
    return (
        np.take_along_axis(S, order, axis=1),
        np.take_along_axis(I, order, axis=1),
        np.take_along_axis(R, order, axis=1),
    )
