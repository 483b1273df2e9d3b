"""The items of one representation in one shard: their vectors and their search index.

docs/indexes.md.  :class:`RepIndex` keeps the (L2-normalised) float32 vectors of the items
currently in one representation and an index over them of the kind its
:class:`~raycompat.index.ann.IndexOptions` name, and answers top-k by canonical score
(:mod:`raycompat.index.canonical`).  :func:`merge_topk` merges per-source top-k lists in the
same order.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from raycompat.index.ann import (
    IndexOptions,
    bytes_per_item,
    create_kind,
    index_bytes,
    resolve_device,
)
from raycompat.index.canonical import rerank_top_k

__all__ = ["RepIndex", "TorchFlat", "merge_topk"]

logger = logging.getLogger("raycompat.serving")

#: removed items an index without ``remove_ids`` keeps (tombstones), as a fraction of the
#: live items, before a background rebuild drops them
TOMBSTONE_FRACTION = 0.25
#: items added during a background build that are applied to the new index outside the lock
#: in rounds; the last round (at most this many) is applied under the lock, with the swap
CATCH_UP_ITEMS = 1024
_SCORE_ELEMS = 1 << 24  # float32 scores per block of an exact numpy or torch search (64 MiB)
_GPU_MAX_K = 2048  # faiss GPU indexes return at most this many results


class RepIndex:
    """Vectors of the items currently in one representation, and their index.

    ``options``: the index kind and its parameters (default: exact flat).  ``name`` (e.g.
    ``"shard-0/new"``) prefixes log lines.  ``background=False`` (tests) builds indexes
    synchronously inside the :meth:`add` / :meth:`remove` call that triggers them.
    Thread-safe: every method takes the index's own lock; an index is built outside it
    (docs/indexes.md, "Training and retraining").
    """

    def __init__(
        self,
        dim: int,
        options: IndexOptions | None = None,
        name: str = "",
        background: bool = True,
    ):
        self.dim = int(dim)
        self.options = options if options is not None else IndexOptions()
        self.name = name or f"{self.options.kind}/{self.dim}d"
        self.kind = create_kind(self.options, self.dim)
        self.device = resolve_device(self.options, self.kind, self.name)
        self.background = background
        self.train_min = self.kind.train_min()
        self.lock = threading.RLock()
        self._idle = threading.Condition(self.lock)
        self.vecs = np.zeros((0, self.dim), np.float32)
        self.ids = np.zeros(0, np.int64)  # item id of each slot; -1: no live item
        self.slot: dict[int, int] = {}
        self.free: list = []  # slots no index holds
        self.held: set = set()  # removed slots an index may still hold (not reusable yet)
        self.norm_max = 0.0  # bound on the stored vectors' norms (error band)
        self.index = None  # a backend labelled by slots, or None: exact numpy search
        self.trainings = 0
        self.last_trained_items = 0
        self.error: str | None = None
        self._basis = 0  # live items the last build (attempt) started from
        self._job: _Job | None = None
        self._closed = False
        self._selector = None  # (bitmap, IDSelectorBitmap) of the live slots
        if self.train_min == 0:
            self.index = self._backend(self.kind.build(0))

    # ------------------------------------------------------------------ items
    def __len__(self) -> int:
        with self.lock:
            return len(self.slot)

    def add(self, ids: np.ndarray, vecs: np.ndarray) -> None:
        """Add new items (ids not in this representation, each once)."""
        ids = np.asarray(ids, np.int64).reshape(-1)
        vecs = np.ascontiguousarray(vecs, np.float32).reshape(ids.size, self.dim)
        with self.lock:
            present = [i for i in ids.tolist() if i in self.slot]
            if present or np.unique(ids).size != ids.size:
                raise ValueError(f"{self.name}: ids added twice: {present[:10] or 'repeated'}")
            if not ids.size:
                return
            slots = self._place(ids, vecs)
            if self.index is not None:
                self.index.add(slots, vecs)
            self._selector = None
            self._after_change()

    def remove(self, ids: np.ndarray) -> None:
        """Remove items; unknown or repeated ids raise (nothing removed)."""
        ids = np.asarray(ids, np.int64).reshape(-1)
        with self.lock:
            missing = [i for i in ids.tolist() if i not in self.slot]
            if missing:
                raise KeyError(f"{self.name}: unknown item id(s) {missing[:10]}")
            if np.unique(ids).size != ids.size:
                raise ValueError(f"{self.name}: repeated ids in one remove")
            slots = np.array([self.slot.pop(i) for i in ids.tolist()], np.int64)
            self.ids[slots] = -1
            self._selector = None
            removable = self.index is None or self.index.removable
            if self.index is not None and removable and slots.size:
                self.index.remove(slots)
            if self._job is not None or not removable:
                self.held.update(slots.tolist())
            else:
                self.free.extend(slots.tolist())
            self._after_change()

    def _place(self, ids: np.ndarray, vecs: np.ndarray) -> np.ndarray:
        norm = float(np.sqrt(np.einsum("ij,ij->i", vecs, vecs, dtype=np.float64).max()))
        self.norm_max = max(self.norm_max, norm * (1 + 1e-9))
        need = ids.size - len(self.free)
        if need > 0:
            cap = self.ids.size
            grow = max(need, cap // 2, 1024)
            self.vecs = np.concatenate([self.vecs, np.zeros((grow, self.dim), np.float32)])
            self.ids = np.concatenate([self.ids, np.full(grow, -1, np.int64)])
            self.free.extend(range(cap + grow - 1, cap - 1, -1))
        slots = np.array([self.free.pop() for _ in range(ids.size)], np.int64)
        self.vecs[slots] = vecs
        self.ids[slots] = ids
        self.slot.update(zip(ids.tolist(), slots.tolist(), strict=True))
        return slots

    def vectors_of(self, ids) -> np.ndarray:
        with self.lock:
            return self.vecs[[self.slot[int(i)] for i in np.asarray(ids).tolist()]]

    def export(self) -> tuple[np.ndarray, np.ndarray]:
        """``(ids ascending, vectors)`` of the live items."""
        with self.lock:
            live = np.flatnonzero(self.ids >= 0)
            order = live[np.argsort(self.ids[live], kind="stable")]
            return self.ids[order].copy(), self.vecs[order].copy()

    # ------------------------------------------------------------------ search
    def search(self, q: np.ndarray, k: int, exact: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Top-k ``(canonical scores float64, ids int64)`` ``[Q, k]`` (``-inf`` / ``-1``
        padded), ties by ascending id (docs/indexes.md, "Search and re-ranking").  An exact
        index (or numpy before an index is built, or ``exact=True`` whatever the kind)
        returns the canonical top-k; an approximate one re-ranks its candidates exactly."""
        q = np.ascontiguousarray(q, dtype=np.float32)
        n_q = q.shape[0]
        out_s = np.full((n_q, k), -np.inf)
        out_i = np.full((n_q, k), -1, np.int64)
        with self.lock:
            kk = min(k, len(self.slot))
            if kk == 0 or n_q == 0:
                return out_s, out_i
            backend = None if exact else self.index
            if backend is None or backend.exact:
                s, i = self._search_exact(q, kk, backend)
            else:
                s, i = self._search_approx(q, kk, backend)
        out_s[:, :kk] = s
        out_i[:, :kk] = i
        return out_s, out_i

    def _search_exact(self, q: np.ndarray, k: int, backend) -> tuple[np.ndarray, np.ndarray]:
        """The canonical top-k: float32 candidates re-ranked canonically; queries whose
        candidates could miss an item are searched again with 4x as many."""
        out_s = np.empty((q.shape[0], k))
        out_i = np.empty((q.shape[0], k), np.int64)
        sel, tombs = self._filter(backend)
        total = len(self.slot) + tombs
        fetch = min(total, k + 16)
        pending = np.arange(q.shape[0])
        while pending.size:
            S, I = self._candidates(q[pending], fetch, backend, sel)
            s, i, ok = rerank_top_k(
                q[pending], S, I, k, self._vectors, self.norm_max, complete=fetch >= total
            )
            out_s[pending[ok]] = s[ok]
            out_i[pending[ok]] = i[ok]
            pending = pending[~ok]
            fetch = min(total, fetch * 4)
        return out_s, out_i

    def _search_approx(self, q: np.ndarray, k: int, backend) -> tuple[np.ndarray, np.ndarray]:
        """``max(rerank k, k + 16)`` candidates from the index, re-ranked canonically; an
        index that cannot filter its tombstones proposes proportionally more."""
        sel, tombs = self._filter(backend)
        n = len(self.slot)
        fetch = max(self.options.rerank * k, k + 16)
        fetch = min(math.ceil(fetch * (n + tombs) / n), n + tombs, backend.max_k)
        S, I = self._candidates(q, fetch, backend, sel)
        s, i, _ = rerank_top_k(q, S, I, k, self._vectors, self.norm_max, complete=True)
        return s, i

    def _filter(self, backend) -> tuple[object, int]:
        """``(selector, tombstones)``: a CPU index without ``remove_ids`` skips removed items
        with an ``IDSelectorBitmap`` of the live slots; a GPU one returns them (as ``-1``
        after the id lookup) and the search fetches that many more."""
        if backend is None or backend.removable:
            return None, 0
        if not backend.filters:
            return None, len(self.held)
        if self._selector is None:
            import faiss

            bitmap = np.packbits(self.ids >= 0, bitorder="little")
            self._selector = (bitmap, faiss.IDSelectorBitmap(bitmap.size, faiss.swig_ptr(bitmap)))
        return self._selector[1], 0

    def _candidates(self, q: np.ndarray, fetch: int, backend, sel):
        """float32 ``(scores, ids)`` ``[Q, fetch]`` from the index, or from numpy over the
        live slots; removed items come back as ``-1``."""
        if backend is None:
            S, L = self._numpy_candidates(q, fetch)
        else:
            S, L = backend.search(q, fetch, sel)
        ids = np.where(L >= 0, self.ids[np.maximum(L, 0)], -1)
        return S, ids

    def _numpy_candidates(self, q: np.ndarray, fetch: int):
        live = self.ids >= 0
        cap = live.size
        rows = max(1, _SCORE_ELEMS // cap)
        S_out = np.empty((q.shape[0], fetch), np.float32)
        L_out = np.empty((q.shape[0], fetch), np.int64)
        for a in range(0, q.shape[0], rows):
            S = q[a : a + rows] @ self.vecs.T
            S[:, ~live] = -np.inf
            top = np.argpartition(S, cap - fetch, axis=1)[:, cap - fetch :]
            S_out[a : a + rows] = np.take_along_axis(S, top, axis=1)
            L_out[a : a + rows] = top
        return S_out, L_out

    def _vectors(self, ids: np.ndarray) -> np.ndarray:
        return self.vecs[[self.slot[i] for i in ids.tolist()]]

    # ------------------------------------------------------------------ (re)building
    def _after_change(self) -> None:
        """Start, retrain or drop the index as the live count asks (docs/indexes.md,
        "Training and retraining")."""
        if self._closed or self._job is not None:
            return
        n = len(self.slot)
        f = self.options.retrain_factor
        changed = self._basis == 0 or n >= f * self._basis or n * f <= self._basis
        if self.index is None:
            if n >= max(self.train_min, 1) and changed:
                self._start_build()
        elif n < self.train_min / f:
            self._drop()
        elif self.kind.trains and changed and n >= self.train_min:
            self._start_build()
        elif not self.index.removable and len(self.held) > TOMBSTONE_FRACTION * n:
            self._start_build()

    def _start_build(self) -> None:
        live = np.flatnonzero(self.ids >= 0)
        job = _Job(live, self.vecs, time.perf_counter())
        self._job = job
        self._basis = live.size
        logger.info(
            "%s: building the %s index on %d items%s",
            self.name,
            self.kind.name,
            live.size,
            " in the background" if self.background else "",
        )
        if self.background:
            threading.Thread(
                target=self._run, args=(job,), name=f"index-build {self.name}", daemon=True
            ).start()
        else:
            self._run(job)

    def _run(self, job: _Job) -> None:
        """Build from the job's copy of the live vectors (outside the lock), catch up with the
        items added meanwhile, and swap the new index in."""
        try:
            vecs = job.source[job.slots]
            index = self.kind.build(job.slots.size)
            if not index.is_trained:
                index.train(vecs)
            backend = self._backend(index)
            backend.add(job.slots, vecs)
            job.in_new[job.slots] = True
            while not self._catch_up(job, backend):
                pass
        except Exception as exc:  # a failed build leaves the current index in place
            logger.error("%s: building the %s index failed: %s", self.name, self.kind.name, exc)
            with self.lock:
                if job is self._job:
                    self.error = f"{type(exc).__name__}: {exc}"
                    self._job = None
                    self._idle.notify_all()

    def _catch_up(self, job: _Job, backend) -> bool:
        """Add the items added since the snapshot to the new index: outside the lock while
        more than :data:`CATCH_UP_ITEMS` remain, then under it with the swap.  ``True`` when
        done (swapped, or the job was cancelled)."""
        with self.lock:
            if job is not self._job:
                return True
            live = self.ids >= 0
            in_new = np.zeros(live.size, bool)
            in_new[: job.in_new.size] = job.in_new
            added = np.flatnonzero(live & ~in_new)
            if added.size <= CATCH_UP_ITEMS:
                self._swap(job, backend, added, np.flatnonzero(in_new & ~live))
                return True
            vecs = self.vecs[added]
        backend.add(added, vecs)
        job.in_new = in_new
        job.in_new[added] = True
        return False

    def _swap(self, job: _Job, backend, added: np.ndarray, gone: np.ndarray) -> None:
        """Apply the last adds and the removals made since the snapshot; swap (under the
        lock)."""
        if added.size:
            backend.add(added, self.vecs[added])
        if gone.size and backend.removable:
            backend.remove(gone)
        keep = set() if backend.removable else set(gone.tolist())
        self.free.extend(s for s in self.held if s not in keep)
        self.held = keep
        self.index = backend
        self._selector = None
        self.trainings += 1
        self.last_trained_items = job.slots.size
        self.error = None
        self._job = None
        logger.info(
            "%s: %s index on %d items swapped in after %.1f s (%s)",
            self.name,
            self.kind.name,
            job.slots.size,
            time.perf_counter() - job.t0,
            self._settings(),
        )
        self._after_change()
        self._idle.notify_all()

    def _drop(self) -> None:
        """Fewer than ``train_min / retrain_factor`` items: back to exact numpy search."""
        self.index = None
        self.free.extend(self.held)
        self.held = set()
        self._selector = None
        self._basis = 0
        logger.info(
            "%s: %d items, fewer than train_min / retrain_factor: %s index dropped, exact search",
            self.name,
            len(self.slot),
            self.kind.name,
        )

    def _backend(self, index):
        """The index on this RepIndex's device, labelled by slots."""
        if self.device == "cuda" and self.kind.name == "flat":
            return TorchFlat(self.dim, "cuda")
        if self.device == "cuda":
            try:
                return _FaissBackend(index, self.kind, gpu=True)
            except RuntimeError as exc:
                self.device = "cpu"
                logger.warning(
                    "%s: index %s on CPU: faiss cannot move it to the GPU (%s)",
                    self.name,
                    self.kind.name,
                    str(exc).strip().splitlines()[-1],
                )
        return _FaissBackend(index, self.kind)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no build is in flight; ``False`` on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._job is None, timeout)

    def close(self) -> None:
        """Stop background work: a build in flight is discarded, no new one starts."""
        with self.lock:
            self._closed = True
            self._job = None
            self._idle.notify_all()

    # ------------------------------------------------------------------ status
    def _settings(self) -> dict:
        if self.index is None or not hasattr(self.index, "index"):
            return {"nlist": None, "nprobe": None, "ef_search": None}
        return self.kind.settings(self.index.index)

    def describe(self) -> dict:
        """JSON-able state for ``/status`` and ``/metrics`` (docs/indexes.md, "Status")."""
        with self.lock:
            index_mem = self.index.memory_bytes() if self.index is not None else 0
            tombstones = self.index is not None and not self.index.removable
            return {
                "kind": self.kind.name,
                "device": self.device,
                "trained": self.index is not None,
                **self._settings(),
                "items": len(self.slot),
                "tombstones": len(self.held) if tombstones else 0,
                "train_min": self.train_min,
                "trainings": self.trainings,
                "last_trained_items": self.last_trained_items,
                "rebuilding": self._job is not None,
                "error": self.error,
                "memory_bytes": int(index_mem + self.vecs.nbytes + self.ids.nbytes),
            }


@dataclass
class _Job:
    """A build in flight: the live slots at its start and the array their vectors are in."""

    slots: np.ndarray
    source: np.ndarray
    t0: float
    in_new: np.ndarray = field(init=False)  # slots the new index holds

    def __post_init__(self):
        self.in_new = np.zeros(self.source.shape[0], bool)


class _FaissBackend:
    """A faiss index labelled by slots, on the CPU or (``gpu``) moved to GPU 0."""

    def __init__(self, index, kind, gpu: bool = False):
        import faiss

        self.kind = kind
        self.exact = kind.exact
        self.filters = not gpu  # faiss GPU indexes take no ID selector
        self.max_k = _GPU_MAX_K if gpu else np.iinfo(np.int64).max
        self._gpu_cost = (index_bytes(index), bytes_per_item(index)) if gpu else None
        ivf = None if gpu else faiss.try_extract_index_ivf(index)
        if ivf is not None:
            ivf.set_direct_map_type(faiss.DirectMap.Hashtable)  # remove_ids in O(removed)
        self.index = _to_gpu(index) if gpu else index
        self.removable = kind.removable and not gpu  # faiss GPU indexes have no remove_ids

    def add(self, slots: np.ndarray, vecs: np.ndarray) -> None:
        self.index.add_with_ids(np.ascontiguousarray(vecs, np.float32), slots)

    def remove(self, slots: np.ndarray) -> None:
        self.index.remove_ids(np.ascontiguousarray(slots, np.int64))

    def search(self, q: np.ndarray, fetch: int, sel=None):
        return self.index.search(q, fetch, params=self.kind.params(self.index, sel))

    def memory_bytes(self) -> int:
        """:func:`~raycompat.index.ann.index_bytes`; on a GPU, the trained empty index's
        bytes plus the per-item bytes of its CPU twin."""
        if self._gpu_cost is None:
            return index_bytes(self.index)
        fixed, per_item = self._gpu_cost
        return fixed + per_item * int(self.index.ntotal)


_GPU_RESOURCES: list = []


def _to_gpu(index):
    """``index`` on GPU 0 (one ``StandardGpuResources`` per process)."""
    import faiss

    if not _GPU_RESOURCES:
        _GPU_RESOURCES.append(faiss.StandardGpuResources())
    return faiss.index_cpu_to_gpu(_GPU_RESOURCES[0], 0, index)


class TorchFlat:
    """Exact flat search on a torch device (docs/indexes.md, "GPU"): the vectors in a
    ``[capacity, dim]`` matrix at their slots and a live mask, updated in place on add and
    remove; a search is a blockwise matrix product and top-k on the device, and the float32
    candidates go back to the CPU for the canonical re-rank."""

    exact = True
    removable = True

    def __init__(self, dim: int, device):
        import torch

        self.torch = torch
        self.device = torch.device(device)
        self.mat = torch.zeros((0, dim), dtype=torch.float32, device=self.device)
        self.live = torch.zeros(0, dtype=torch.bool, device=self.device)

    def add(self, slots: np.ndarray, vecs: np.ndarray) -> None:
        torch = self.torch
        need = int(slots.max()) + 1
        if need > self.live.numel():
            cap = max(need, 2 * self.live.numel(), 1024)
            mat = torch.zeros((cap, self.mat.shape[1]), dtype=torch.float32, device=self.device)
            live = torch.zeros(cap, dtype=torch.bool, device=self.device)
            mat[: self.mat.shape[0]] = self.mat
            live[: self.live.numel()] = self.live
            self.mat, self.live = mat, live
        at = torch.as_tensor(slots, device=self.device)
        self.mat[at] = torch.as_tensor(np.ascontiguousarray(vecs), device=self.device)
        self.live[at] = True

    def remove(self, slots: np.ndarray) -> None:
        self.live[self.torch.as_tensor(slots, device=self.device)] = False

    def search(self, q: np.ndarray, fetch: int, sel=None):
        """The float32 top-``fetch`` ``(scores, slots)`` of the live rows (``-1`` past them)."""
        torch = self.torch
        qt = torch.as_tensor(q, device=self.device)
        rows = max(1, _SCORE_ELEMS // max(q.shape[0], 1))
        best_s = torch.empty((q.shape[0], 0), dtype=torch.float32, device=self.device)
        best_i = torch.empty((q.shape[0], 0), dtype=torch.int64, device=self.device)
        for a in range(0, self.live.numel(), rows):
            S = qt @ self.mat[a : a + rows].T
            S.masked_fill_(~self.live[a : a + rows], -math.inf)
            s, i = torch.topk(S, min(fetch, S.shape[1]), dim=1)
            best_s, order = torch.topk(
                torch.cat([best_s, s], 1), min(fetch, best_s.shape[1] + s.shape[1]), dim=1
            )
            best_i = torch.gather(torch.cat([best_i, i + a], 1), 1, order)
        S, L = best_s.cpu().numpy(), best_i.cpu().numpy()
        return S, np.where(np.isfinite(S), L, -1)

    def memory_bytes(self) -> int:
        return int(self.mat.numel() * 4 + self.live.numel())


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
