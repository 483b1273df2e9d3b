"""Search batching: the requests that arrive together are answered by one search call.

docs/architecture.md, "Batching".  The router and every shard gather concurrent searches with
Serve's ``@serve.batch`` (at most ``search_batch_size`` requests, waiting at most
``search_batch_wait_ms`` for more).  Requests with the same representations, k and exactness
are stacked row-wise into one search; each request gets back exactly its own rows.  Every
query is ranked on its own (canonical scores, ties by id: docs/indexes.md), so a batched
answer is the answer the request gets alone.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

__all__ = ["query_rows", "stacked_groups", "split_rows"]


def query_rows(sides: dict[str, np.ndarray]) -> int:
    """Queries in one request (rows of any of its representation arrays)."""
    return next(iter(sides.values())).shape[0] if sides else 0


def stacked_groups(
    sides: list[dict[str, np.ndarray]], k: list[int], exact: list[bool]
) -> Iterator[tuple[list[int], dict[str, np.ndarray], int, bool]]:
    """``(members, stacked sides, k, exact)`` per group of requests that can share a search:
    the same representations, k and exactness; rows stacked in member order."""
    groups: dict[tuple, list[int]] = {}
    for j, (s, kk, ex) in enumerate(zip(sides, k, exact, strict=True)):
        groups.setdefault((tuple(sorted(s)), int(kk), bool(ex)), []).append(j)
    for (names, kk, ex), members in groups.items():
        stacked = {n: np.concatenate([sides[j][n] for j in members]) for n in names}
        yield members, stacked, kk, ex


def split_rows(arrays: tuple, sizes: list[int]) -> list[tuple]:
    """The row blocks of ``arrays`` (each ``[sum(sizes), ...]``), one tuple per size."""
    out, start = [], 0
    for n in sizes:
        out.append(tuple(a[start : start + n] for a in arrays))
        start += n
    return out
