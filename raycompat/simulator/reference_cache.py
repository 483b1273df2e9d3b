"""The old-old reference, computed once and reused (docs/simulator.md, "The reference cache").

Every simulation of an upgrade of one old gallery scores the same old-old search: old queries
against old gallery vectors.  Its ranks (and so its mAP, top-1 and the per-query top-1
successes NFR@1 counts against) depend only on the old gallery vectors, the old query vectors,
the labels of both and the ranking rule -- not on the candidate model.  :class:`ReferenceCache`
stores them in a folder, one ``old-old-<key>.npz`` per distinct input, keyed by
:func:`reference_key`: a SHA-256 digest of all of those (the vectors' bytes, not the file
names) and of ``k``.  A later run on the same inputs loads the ranks instead of scoring them.

A cache file is never trusted blindly: its recorded key, shapes and a digest of its arrays are
checked on load, and a file that fails (truncated, edited, another run's) is named in the
progress output and recomputed, the file then replaced.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from raycompat.simulator.assembly import CurveRanks
from raycompat.upgrade.grid import segments

__all__ = [
    "REFERENCE_FORMAT",
    "ReferenceCache",
    "CachedReference",
    "array_digest",
    "reference_key",
    "with_reference",
]

OLD_OLD = ("reference", "old-old")

#: bumped when the ranking rule or this file format changes (old files then miss)
REFERENCE_FORMAT = 1
_CHUNK = 64 << 20


def array_digest(arrays: Iterable[np.ndarray]) -> str:
    """SHA-256 over the dtype, shape and C-order bytes of each array, in order (the bytes in
    64 MiB chunks hashed on all cores, their digests hashed in order)."""
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(f"{a.dtype.str}{a.shape}".encode())
        data = memoryview(a).cast("B")
        chunks = [data[i : i + _CHUNK] for i in range(0, len(data), _CHUNK)]
        with ThreadPoolExecutor(max_workers=min(len(chunks), os.cpu_count() or 1) or 1) as pool:
            for d in pool.map(lambda c: hashlib.sha256(c).digest(), chunks):
                h.update(d)
    return h.hexdigest()


def reference_key(
    gallery_old_digest: str,
    gallery_labels: np.ndarray,
    query_old: np.ndarray,
    query_labels: np.ndarray,
    k: int,
) -> str:
    """The key of an old-old reference: the old gallery vectors (``gallery_old_digest``, from
    :func:`array_digest` over them in gallery order, or the distributed engine's digest of its
    row groups), the old queries, both sides' labels, ``k`` and :data:`REFERENCE_FORMAT`."""
    h = hashlib.sha256()
    h.update(f"raycompat old-old reference v{REFERENCE_FORMAT} k={int(k)}".encode())
    h.update(gallery_old_digest.encode())
    h.update(array_digest([np.asarray(gallery_labels), np.asarray(query_old, np.float32)]).encode())
    h.update(array_digest([np.asarray(query_labels)]).encode())
    return h.hexdigest()


@dataclass(frozen=True)
class CachedReference:
    """The old-old ranks of every positive pair (``[1, P]``), as the engine computes them."""

    key: str
    ranks: np.ndarray
    path: str


class ReferenceCache:
    """A folder of old-old references (see the module docstring); ``say`` gets one line when
    a reference is reused, stored or found damaged."""

    def __init__(self, directory: str, say: Callable[[str], None] | None = None):
        self.directory = directory
        self.say = say or (lambda msg: None)
        #: what happened on the last lookup: "hit", "miss" or "damaged"
        self.last: str | None = None

    def path(self, key: str) -> str:
        return os.path.join(self.directory, f"old-old-{key[:40]}.npz")

    def report(self, key: str) -> dict:
        """What the run's stats record: the last lookup's outcome and the file."""
        return {"state": self.last, "path": self.path(key)}

    def lookup(self, key: str, n_pairs: int) -> CachedReference | None:
        """The stored reference for ``key`` with ``n_pairs`` positive pairs, or None (missing,
        or damaged: named, and recomputed by the caller)."""
        path = self.path(key)
        if not os.path.exists(path):
            self.last = "miss"
            return None
        try:
            ranks = _read(path, key, n_pairs)
        except Exception as exc:  # whatever is wrong with it, it is not trusted
            self.last = "damaged"
            self.say(
                f"reference cache {path} is damaged ({type(exc).__name__}: {exc}); "
                "recomputing the old-old reference"
            )
            return None
        self.last = "hit"
        self.say(f"old-old reference reused from {path}")
        return CachedReference(key, ranks, path)

    def store(self, key: str, ranks: np.ndarray, info: dict) -> str:
        """Write the reference for ``key`` (atomically: a temporary file renamed over it)."""
        ranks = np.ascontiguousarray(ranks, np.int64)
        meta = dict(info, key=key, format=REFERENCE_FORMAT, digest=array_digest([ranks]))
        buf = io.BytesIO()
        np.savez(buf, ranks=ranks, info=np.frombuffer(json.dumps(meta).encode(), np.uint8))
        os.makedirs(self.directory, exist_ok=True)
        path = self.path(key)
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "wb") as fh:
            fh.write(buf.getvalue())
        os.replace(tmp, path)
        self.say(f"old-old reference stored in {path}")
        return path


def _read(path: str, key: str, n_pairs: int) -> np.ndarray:
    """The ranks stored in ``path``, after every check (raises ValueError naming the failed one)."""
    with np.load(path, allow_pickle=False) as z:
        ranks = np.asarray(z["ranks"])
        info = json.loads(bytes(np.asarray(z["info"], np.uint8)).decode())
    if info.get("format") != REFERENCE_FORMAT:
        raise ValueError(f"format {info.get('format')}, expected {REFERENCE_FORMAT}")
    if info.get("key") != key:
        raise ValueError("its recorded key is not the key of these inputs")
    if ranks.dtype != np.int64 or ranks.shape != (1, n_pairs):
        raise ValueError(f"ranks {ranks.dtype} {list(ranks.shape)}, expected int64 [1, {n_pairs}]")
    if array_digest([ranks]) != info.get("digest"):
        raise ValueError("the ranks do not match their recorded digest")
    return ranks


def with_reference(
    cache: ReferenceCache,
    key: str,
    cached: CachedReference | None,
    res,
    static: dict,
    derived: list,
    info: dict,
) -> dict:
    """After the engine ran: the cached old-old ranks added to ``res`` (an
    :class:`~raycompat.simulator.assembly.EngineResult`) with the ``derived`` cold curves
    (old-old while nothing is re-embedded, new-new once everything is), or else the old-old
    ranks it computed stored; returns the static references, ``old-old`` first as the engine
    orders them."""
    if cached is None:
        if "old-old" in static:
            ranks = res.curve(OLD_OLD).ranks
            cache.store(key, ranks, dict(info, pairs=int(ranks.shape[1])))
        return static
    n = int(res.n_items)
    if "old-old" not in static:
        seg = segments(None, np.array([0]), n)
        res.curves.append(CurveRanks(OLD_OLD, np.array([0], np.int64), seg, cached.ranks))
        static = {"old-old": "old-old", **static}
    if not derived:
        return static
    old_old, new_new = cached.ranks[0], res.curve(("reference", "new-new")).ranks[0]
    for c in derived:
        counts = np.asarray(c.counts, np.int64)
        if not np.isin(counts, (0, n)).all():
            raise ValueError(f"curve {c.key}: a cold curve re-embeds none or all items")
        ranks = np.where((counts == n)[:, None], new_new[None, :], old_old[None, :])
        res.curves.append(CurveRanks(c.key, counts, segments(None, counts, n), ranks))
    return static
