"""The old vectors of upgraded items, kept until the upgrade is finalized (docs/live-index.md,
"Upgrading a live gallery safely").

When an item moves from ``old`` (or ``adapted``) to ``new``, the shard keeps the vector it
held, the representation it held it in and the model that produced it, so that a rollback can
put the item back exactly as it was.  :class:`KeptVectors` holds them per representation
(the dimensions differ), in memory or -- ``directory`` given -- in an unlinked, memory-mapped
file there, so that a large gallery keeps them on disk only (the page cache may hold some;
the kernel reclaims those pages first).  The file is a cache: the kept vectors are durable in
the shard's snapshot and log, and a restarted replica rebuilds the file from them.
"""

from __future__ import annotations

import tempfile

import numpy as np

__all__ = ["KeptVectors"]


class _Store:
    """Kept vectors of one dimension: slots in a growing array (or memory-mapped file)."""

    def __init__(self, dim: int, directory: str | None):
        self.dim = int(dim)
        self.file = tempfile.TemporaryFile(dir=directory) if directory else None
        self.vecs = np.zeros((0, self.dim), np.float32)
        self.models = np.zeros(0, np.int32)
        self.slot: dict[int, int] = {}
        self.free: list[int] = []

    def _grow(self, need: int) -> None:
        cap = self.vecs.shape[0]
        new_cap = max(cap + need, 2 * cap, 1024)
        if self.file is None:
            self.vecs = np.concatenate([self.vecs, np.zeros((new_cap - cap, self.dim), np.float32)])
        else:
            self.file.truncate(new_cap * self.dim * 4)
            self.vecs = np.memmap(self.file, np.float32, mode="r+", shape=(new_cap, self.dim))
        self.models = np.concatenate([self.models, np.zeros(new_cap - cap, np.int32)])
        self.free.extend(range(new_cap - 1, cap - 1, -1))

    def add(self, ids: np.ndarray, vecs: np.ndarray, models: np.ndarray) -> None:
        if ids.size > len(self.free):
            self._grow(ids.size - len(self.free))
        slots = np.array([self.free.pop() for _ in range(ids.size)], np.int64)
        self.vecs[slots] = vecs
        self.models[slots] = models
        self.slot.update(zip(ids.tolist(), slots.tolist(), strict=True))

    def pop(self, ids: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        slots = np.array([self.slot.pop(i) for i in ids], np.int64)
        self.free.extend(slots.tolist())
        return np.asarray(ids, np.int64), np.array(self.vecs[slots]), self.models[slots].copy()

    def export(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        ids = np.fromiter(self.slot.keys(), np.int64, len(self.slot))
        slots = np.fromiter(self.slot.values(), np.int64, len(self.slot))
        o = np.argsort(ids, kind="stable")
        return ids[o], np.array(self.vecs[slots[o]]), self.models[slots[o]].copy()

    def nbytes(self) -> int:
        return int(self.vecs.shape[0]) * self.dim * 4

    def close(self) -> None:
        self.vecs = np.zeros((0, self.dim), np.float32)  # drops the mapping before the file
        if self.file is not None:
            self.file.close()
            self.file = None


class KeptVectors:
    """``id -> (representation code, vector, model code)`` of upgraded items (see the module
    docstring); ``dims``: the dimension of every representation (by code order)."""

    def __init__(self, dims: dict[int, int], directory: str | None = None):
        self.dims = dict(dims)
        self.directory = directory
        self.stores: dict[int, _Store] = {}
        self.code_of: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self.code_of)

    def __contains__(self, item_id: int) -> bool:
        return int(item_id) in self.code_of

    def add(self, code: int, ids: np.ndarray, vecs: np.ndarray, models: np.ndarray) -> None:
        """Keep ``vecs`` (representation ``code``, model codes ``models``) for new ``ids``."""
        ids = np.asarray(ids, np.int64)
        if not ids.size:
            return
        if code not in self.stores:
            self.stores[code] = _Store(self.dims[code], self.directory)
        self.stores[code].add(ids, np.asarray(vecs, np.float32), np.asarray(models, np.int32))
        self.code_of.update(dict.fromkeys(ids.tolist(), int(code)))

    def pop(self, ids) -> dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Remove the kept vectors of those ``ids`` that have one: ``{code: (ids, vectors,
        model codes)}``."""
        by_code: dict[int, list[int]] = {}
        for i in dict.fromkeys(np.asarray(ids, np.int64).tolist()):
            code = self.code_of.pop(i, None)
            if code is not None:
                by_code.setdefault(code, []).append(i)
        return {code: self.stores[code].pop(lst) for code, lst in by_code.items()}

    def clear(self) -> int:
        """Drop every kept vector (memory and file); returns how many there were."""
        n = len(self.code_of)
        for store in self.stores.values():
            store.close()
        self.stores, self.code_of = {}, {}
        return n

    def ids(self) -> np.ndarray:
        """The ids with a kept vector, ascending."""
        return np.sort(np.fromiter(self.code_of.keys(), np.int64, len(self.code_of)))

    def export(self) -> dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """``{code: (ids ascending, vectors, model codes)}`` (copies)."""
        return {code: store.export() for code, store in self.stores.items() if store.slot}

    def usage(self) -> dict:
        """``{"items", "memory_bytes", "disk_bytes"}``: what the kept vectors take (allocated
        slots, in memory or in the memory-mapped files)."""
        held = sum(s.nbytes() for s in self.stores.values())
        on_disk = self.directory is not None
        return {
            "items": len(self),
            "memory_bytes": 0 if on_disk else held,
            "disk_bytes": held if on_disk else 0,
            "on_disk": on_disk,
        }

    def close(self) -> None:
        self.clear()
