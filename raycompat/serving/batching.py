"""Search batching: the requests that arrive together are answered by one search call.

docs/architecture.md, "Batching".  The router and every shard gather concurrent searches with a
:class:`Batcher`: while one batch is searched, the requests that arrive queue up, and the next
batch takes all of them (at most ``search_batch_size``), after waiting at most
``search_batch_wait_ms`` for more once its first request is there.  (Serve's ``@serve.batch``
forms a batch when its first request arrives, even while the previous one still runs, so
without a wait it makes batches of one.)  Requests with the same representations, k and
exactness are stacked row-wise into one search; each request gets back exactly its own rows.
Every query is ranked on its own (canonical scores, ties by id: docs/indexes.md), so a batched
answer is the answer the request gets alone.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Iterator

import numpy as np

__all__ = ["Batcher", "query_rows", "stacked_groups", "split_rows"]


class Batcher:
    """Gathers concurrent :meth:`submit` calls into one ``await handler(list of arguments)``
    (which returns one result per argument, in order); at most ``concurrency`` batches run at
    a time (the router overlaps two: one in the shards while the next one forms).  An
    exception of the handler goes to every call of its batch."""

    def __init__(
        self,
        handler: Callable[[list], Awaitable[list]],
        max_size: int,
        max_wait_s: float = 0.0,
        concurrency: int = 1,
    ):
        self.handler = handler
        self.max_size = int(max_size)
        self.max_wait_s = float(max_wait_s)
        self.concurrency = int(concurrency)
        self._queue: deque = deque()
        self._arrived: asyncio.Event | None = None
        self._workers: list[asyncio.Task] = []

    async def submit(self, argument):
        """The handler's result for ``argument``, computed in a batch."""
        if not self._workers or any(w.done() for w in self._workers):  # on the caller's loop
            loop = asyncio.get_running_loop()
            self._arrived = asyncio.Event()
            self._workers = [loop.create_task(self._run()) for _ in range(self.concurrency)]
        future = asyncio.get_running_loop().create_future()
        self._queue.append((argument, future))
        self._arrived.set()
        return await future

    async def _next_batch(self) -> list:
        while not self._queue:
            self._arrived.clear()
            await self._arrived.wait()
        if self.max_wait_s > 0 and len(self._queue) < self.max_size:
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._wait_full(), self.max_wait_s)
            except asyncio.TimeoutError:
                pass
        n = min(self.max_size, len(self._queue))
        return [self._queue.popleft() for _ in range(n)]

    async def _wait_full(self) -> None:
        while len(self._queue) < self.max_size:
            self._arrived.clear()
            await self._arrived.wait()

    async def _run(self) -> None:
        while True:
            batch = await self._next_batch()
            try:
                results = await self.handler([argument for argument, _ in batch])
            except Exception as exc:  # every caller of the batch gets it
                for _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                continue
            for (_, future), result in zip(batch, results, strict=True):
                if not future.done():
                    future.set_result(result)


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
