"""One shard's cache of the store: the items placed on the shard, each held in exactly one
representation (old, adapted or new) with a search index per representation, following the
store's commits (docs/live-index.md, "Where the gallery lives").

The store is the gallery's one home; a replica keeps no file of its own.  At start it reads
every row of the store once (one consistent version) and keeps those whose id hashes to its
shard (:func:`raycompat.serving.placement.shard_of`); afterwards, before every read, it checks
the store's version (one manifest read) and, when a commit happened, reads the rows written
since its last sequence number (:meth:`raycompat.stores.VectorStore.read_changes`) and moves
them.  A write is acknowledged only after its commit, so every replica answers with every
acknowledged write applied, after any restart; resharding is a restart with another
``num_shards``.

What an item holds follows from its row (:class:`CacheRule`): an upgraded item its new vector
(``l2(rho(new))`` in the ``rank_merge`` mode); any other item its old vector, or in the
``adapted`` and ``fct`` modes the adapted vector of its id.  Moves and searches take the
cache's lock, so a concurrent query sees every item exactly once.  Scores and ranking are
:class:`~raycompat.serving.rep_index.RepIndex`'s: canonical scores, ties by ascending id.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from raycompat.serving.placement import shard_of
from raycompat.serving.rep_index import RepIndex, merge_topk

__all__ = ["REPRESENTATIONS", "CacheRule", "ShardCache", "rep_code"]

logger = logging.getLogger("raycompat.serving")

REPRESENTATIONS = ("old", "adapted", "new")
NEW = 2


def rep_code(name: str) -> int:
    if name not in REPRESENTATIONS:
        raise ValueError(f"unknown representation {name!r}; allowed: {', '.join(REPRESENTATIONS)}")
    return REPRESENTATIONS.index(name)


@dataclass
class CacheRule:
    """What a store row becomes in the cache. ``initial``: the representation of an item not
    upgraded (``old`` or ``adapted``); ``adapted``: ids -> their adapted vectors (needed when
    ``initial`` is ``adapted``), with ``adapted_model`` their fingerprint; ``new_map``: raw new
    vector -> stored (rho in the ``rank_merge`` mode)."""

    initial: str = "old"
    adapted: Callable[[np.ndarray], np.ndarray] | None = None
    adapted_model: str = ""
    new_map: Callable[[np.ndarray], np.ndarray] | None = None

    def columns(self, finalized: bool) -> list[str]:
        """The store columns a cache reads."""
        cols = ["id", "upgraded", "new", "new_model"]
        if not finalized:
            cols += ["old", "old_model"]
        return cols

    def held(self, block: dict[str, np.ndarray]) -> list[tuple[int, np.ndarray, np.ndarray, list]]:
        """``[(rep code, ids, vectors, models)]`` of a block's rows."""
        from raycompat.index.search import l2_normalize

        up = block["upgraded"]
        out = []
        if up.any():
            vecs = block["new"][up]
            if self.new_map is not None:
                vecs = l2_normalize(self.new_map(np.ascontiguousarray(vecs)))
            out.append((NEW, block["id"][up], vecs, block["new_model"][up].tolist()))
        rest = ~up
        if rest.any():
            ids = block["id"][rest]
            if self.initial == "adapted":
                vecs, models = self.adapted(ids), [self.adapted_model] * int(rest.sum())
            else:
                vecs, models = block["old"][rest], block["old_model"][rest].tolist()
            out.append((rep_code(self.initial), ids, vecs, models))
        return out


class _Models:
    """Fingerprint <-> small integer code, in the order first seen."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self._code: dict[str, int] = {}

    def code(self, name: str) -> int:
        if name not in self._code:
            self._code[name] = len(self.names)
            self.names.append(name)
        return self._code[name]


class ShardCache:
    """The items of shard ``shard`` of ``num_shards`` of ``store`` (an open
    :class:`~raycompat.stores.VectorStore` this cache owns); see the module docstring."""

    def __init__(
        self,
        store,
        shard: int,
        num_shards: int,
        dims: dict[str, int],
        rule: CacheRule,
        index=None,
        name: str = "",
    ) -> None:
        self.store = store
        self.shard, self.num_shards = int(shard), int(num_shards)
        self.dims = dict(dims)
        self.rule = rule
        self.index_options = index
        self.name = name or f"shard-{shard}"
        self.lock = threading.RLock()  # the in-memory items
        self._follow = threading.Lock()  # one reader of the store at a time
        self.reps = self._new_reps()
        self.rep_of: dict[int, int] = {}
        self.model_of: dict[int, int] = {}
        self.models = _Models()
        self.seq = 0  # the write sequence number applied
        self.version: int | None = None  # the store version last read
        self.generation = 0  # the store's generation (rollbacks to a mark) when loaded
        self.rows_followed = 0
        self.reloads = 0
        self.error: str | None = None  # the last failure to read the store
        self.load_s = 0.0
        self.load()

    def _new_reps(self) -> dict[str, RepIndex]:
        return {
            r: RepIndex(d, self.index_options, name=f"{self.name}/{r}")
            for r, d in self.dims.items()
        }

    # ------------------------------------------------------------------ following the store
    def load(self) -> None:
        """Read every row of the store (one version) and keep this shard's."""
        t0 = time.perf_counter()
        version, generation = self.store.version(), self.store.generation()
        seq = 0
        with self.lock:
            old = self.reps
            self.reps, self.rep_of, self.model_of = self._new_reps(), {}, {}
        for ix in old.values():
            ix.close()
        columns = [*self.rule.columns(self.store.finalized), "write_seq"]
        for block in self.store.scan_blocks(columns):
            seq = max(seq, int(block["write_seq"].max()))
            self._apply(block)
        self.seq, self.version, self.generation = seq, version, generation
        self.load_s = time.perf_counter() - t0

    def catch_up(self) -> int:
        """Apply the rows committed since the last read; returns how many rows of this shard
        moved. A failure to read the store is kept in :attr:`error` and raised."""
        with self._follow:
            try:
                return self._catch_up()
            except Exception as exc:
                self.error = f"{type(exc).__name__}: {exc}"
                raise

    def _catch_up(self) -> int:
        version = self.store.version()
        if version is not None and version == self.version:
            self.error = None
            return 0
        if self.store.generation() != self.generation:  # the table went back (a mark)
            self.reloads += 1
            self.load()
            return len(self.rep_of)
        moved, seq = 0, self.seq
        columns = self.rule.columns(self.store.finalized)
        for block in self.store.read_changes(self.seq, columns):
            seq = max(seq, int(block["write_seq"].max()))
            moved += self._apply(block)
        self.seq, self.version, self.error = seq, version, None
        self.rows_followed += moved
        return moved

    def _apply(self, block: dict[str, np.ndarray]) -> int:
        """Move this shard's rows of ``block`` to what they hold now."""
        mine = shard_of(block["id"], self.num_shards) == self.shard
        if not mine.any():
            return 0
        block = {k: v[mine] for k, v in block.items()}
        moves = self.rule.held(block)
        with self.lock:
            self._remove(block["id"])
            for code, ids, vecs, models in moves:
                self.reps[REPRESENTATIONS[code]].add(ids, np.ascontiguousarray(vecs, np.float32))
                for i, m in zip(ids.tolist(), models, strict=True):
                    self.rep_of[i] = code
                    self.model_of[i] = self.models.code(m)
        return int(mine.sum())

    def _remove(self, ids: np.ndarray) -> None:
        by_rep: dict[int, list[int]] = {}
        for i in ids.tolist():
            code = self.rep_of.pop(i, None)
            if code is not None:
                by_rep.setdefault(code, []).append(i)
        for code, lst in by_rep.items():
            self.reps[REPRESENTATIONS[code]].remove(np.asarray(lst, np.int64))

    # ------------------------------------------------------------------ reads
    def search(self, queries: dict[str, np.ndarray], k: int, exact: bool = False):
        """Top-k over every representation that has a query array: ``(scores, ids, rep
        codes)``, after catching up with the store; ``exact``: brute force whatever the index
        kind."""
        self.catch_up()
        with self.lock:
            S, I, R = [], [], []
            for name, q in queries.items():
                if name not in self.reps:
                    continue
                s, i = self.reps[name].search(q, k, exact=exact)
                S.append(s)
                I.append(i)
                R.append(np.full(i.shape, rep_code(name), np.int8))
            if not S:
                n_q = next(iter(queries.values())).shape[0] if queries else 0
                return (
                    np.full((n_q, k), -np.inf, np.float32),
                    np.full((n_q, k), -1, np.int64),
                    np.full((n_q, k), -1, np.int8),
                )
            return merge_topk(S, I, R, k)

    def unknown(self, ids) -> list[int]:
        self.catch_up()
        with self.lock:
            return [int(i) for i in np.asarray(ids).tolist() if int(i) not in self.rep_of]

    def representation_of(self, ids) -> list:
        self.catch_up()
        with self.lock:
            return [
                REPRESENTATIONS[self.rep_of[int(i)]] if int(i) in self.rep_of else None
                for i in np.asarray(ids).tolist()
            ]

    def lookup(self, ids) -> tuple[list, list]:
        """``(representation names, vectors)`` of ``ids`` (``None`` for an unknown id)."""
        self.catch_up()
        with self.lock:
            reps, vecs = [], []
            for i in np.asarray(ids, np.int64).tolist():
                code = self.rep_of.get(i)
                name = None if code is None else REPRESENTATIONS[code]
                reps.append(name)
                vecs.append(None if name is None else self.reps[name].vectors_of([i])[0].copy())
            return reps, vecs

    def models_of(self, ids) -> list:
        """The model fingerprint of each of ``ids``' vectors (``None`` for an unknown id)."""
        self.catch_up()
        with self.lock:
            return [
                self.models.names[self.model_of[i]] if i in self.model_of else None
                for i in np.asarray(ids, np.int64).tolist()
            ]

    def model_counts(self, follow: bool = True) -> dict[str, int]:
        """Items per model fingerprint (``follow``: after catching up with the store)."""
        if follow:
            self.catch_up()
        with self.lock:
            codes = np.fromiter(self.model_of.values(), np.int64, len(self.model_of))
            counts = np.bincount(codes, minlength=len(self.models.names))
        return {self.models.names[c]: int(n) for c, n in enumerate(counts.tolist()) if n}

    def counts(self, follow: bool = True) -> dict[str, int]:
        """Items per representation (``follow``: after catching up with the store)."""
        if follow:
            self.catch_up()
        with self.lock:
            return {r: len(ix) for r, ix in self.reps.items()}

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """All ``(ids, rep codes)``, sorted by id."""
        self.catch_up()
        with self.lock:
            ids = np.fromiter(self.rep_of.keys(), np.int64, len(self.rep_of))
            codes = np.fromiter(self.rep_of.values(), np.int8, len(self.rep_of))
        o = np.argsort(ids)
        return ids[o], codes[o]

    def follow_status(self) -> dict:
        """How this replica follows the store."""
        return {
            "seq": self.seq,
            "version": self.version,
            "rows_followed": self.rows_followed,
            "reloads": self.reloads,
            "load_s": self.load_s,
            "error": self.error,
        }

    def close(self) -> None:
        for ix in self.reps.values():
            ix.close()
        self.store.close()
