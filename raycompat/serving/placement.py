"""Which shard holds an item: a fixed 64-bit mix (splitmix64 finaliser) of its id, modulo the
number of shards. Deterministic across processes and runs (no Python ``hash``), so a router,
the shards and the backfill controller agree without talking to each other."""

from __future__ import annotations

import numpy as np

__all__ = ["shard_of", "split_by_shard"]

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(ids) -> np.ndarray:
    x = np.asarray(ids, dtype=np.int64).astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * _M1
        x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def shard_of(ids, n_shards: int) -> np.ndarray:
    """int64 shard index in ``[0, n_shards)`` of every id (int64 ids)."""
    if int(n_shards) < 1:
        raise ValueError(f"the number of shards must be >= 1, got {n_shards}")
    return (_mix(ids) % np.uint64(int(n_shards))).astype(np.int64)


def split_by_shard(ids, n_shards: int) -> list:
    """``[positions of the ids placed on shard s for s in range(n_shards)]`` (each ascending)."""
    s = shard_of(ids, n_shards)
    return [np.flatnonzero(s == i) for i in range(int(n_shards))]
