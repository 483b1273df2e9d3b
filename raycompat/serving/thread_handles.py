"""Deployment handles that a plain thread can call, in every Serve mode.

Serve's throughput-optimized mode (``RAY_SERVE_THROUGHPUT_OPTIMIZED=1``) runs a handle's router
on the event loop of the thread that calls it, and refuses a call from a thread without a running
loop.  The backfill controller walks its order on a thread of its own and waits for each call,
so its handles go through :class:`ThreadHandle`: each call is awaited on one event loop that this
module runs on a daemon thread of the process, and the calling thread waits on a future
(docs/live-index.md, "Serve's throughput-optimized mode").  Default Serve accepts the same calls.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any

__all__ = ["ThreadHandle"]

_LOOP: asyncio.AbstractEventLoop | None = None
_LOCK = threading.Lock()


def _loop() -> asyncio.AbstractEventLoop:
    """The process's handle loop, started on first use."""
    global _LOOP
    with _LOCK:
        if _LOOP is None:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="handle-loop", daemon=True).start()
            _LOOP = loop
    return _LOOP


class ThreadHandle:
    """``handle`` (a Serve deployment handle) for a plain thread: ``h.method.remote(...)``
    returns a call whose ``result(timeout_s=None)`` waits for the answer, as Serve's own
    response does."""

    def __init__(self, handle):
        self._handle = handle

    def __getattr__(self, method: str) -> _Method:
        if method.startswith("_"):
            raise AttributeError(method)
        return _Method(self._handle, method)


class _Method:
    def __init__(self, handle, name: str):
        self._handle, self._name = handle, name

    def remote(self, *args, **kwargs) -> _Call:
        async def call():
            return await getattr(self._handle, self._name).remote(*args, **kwargs)

        return _Call(asyncio.run_coroutine_threadsafe(call(), _loop()))


class _Call:
    def __init__(self, future: concurrent.futures.Future):
        self._future = future

    def result(self, timeout_s: float | None = None) -> Any:
        """The answer; a replica's failure raises as Serve raises it, a wait past ``timeout_s``
        raises ``TimeoutError`` and cancels the request."""
        try:
            return self._future.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            self._future.cancel()
            raise
