"""The fused survivor kernel: filter and count a CPU score block in one pass (numba).

A score block's survivors (scores at or above their query's lowest threshold edge) are
located among the query's merged thresholds and counted into the histograms in the same
pass that finds them, with one read of each score; the near-ties come out for the exact
resolution after the pass (docs/simulator.md, "The fused survivor kernel"). The loop is
compiled by numba (its own LLVM, no system compiler) on first use, with its argument types
checked, cached on disk (numba's ``cache=True``, next to this file or in
``NUMBA_CACHE_DIR``) and run without the GIL, so the block pass's worker threads count in
parallel. ``RAYCOMPAT_FUSED_KERNEL=0`` keeps the torch filter and count instead.
"""

from __future__ import annotations

import logging
import os
import threading

import numpy as np
import torch

__all__ = ["fused_enabled", "load_kernel", "BandBuffer", "count_block"]

log = logging.getLogger(__name__)

_lock = threading.Lock()
_loaded: dict[str, object] = {}


def fused_enabled() -> bool:
    """Whether the passes use the kernel by default (``RAYCOMPAT_FUSED_KERNEL=0`` turns it
    off, e.g. to time the torch filter and count against it)."""
    return os.environ.get("RAYCOMPAT_FUSED_KERNEL", "1") != "0"


def _count_below(edges, first, n, v, strict):
    """How many of the sorted ``edges[first:first + n]`` are below ``v`` (``< v`` if
    ``strict``, else ``<= v``): a binary search without branches on the comparisons (each
    step halves the range and moves its start by a conditional add), on unsigned indices."""
    if n == 0:
        return 0
    start = np.uint64(first)
    size = np.uint64(n)
    one = np.uint64(1)
    while size > one:
        half = size >> one
        e = edges[start + half - one]
        below = (e < v) if strict else (e <= v)
        start += half * np.uint64(below)
        size -= half
    e = edges[start]
    below = (e < v) if strict else (e <= v)
    return np.int64(start) - first + np.int64(below)


#: scores tested per step: one 64-bit mask, bit ``k`` set when score ``c + k`` survives
CHUNK = 64


def _survivor_count(
    S, n_cols, q0, lo_min, off, lo, hi, seg, base, width, acc, count,
    band_col, band_val, band_hi, band_lo,
):  # fmt: skip
    """Every score ``S[r, j]`` (``j < n_cols``) at or above query ``q0 + r``'s lowest edge is
    located among the query's thresholds (``hi`` edges, strictly below), added to one
    histogram bucket per segmentation ``s`` (``acc[seg[s, j] * width + base[s] + first + q +
    b]`` when ``count``), and kept as a near-tie when the next threshold's band (``lo`` edge)
    holds it -- the decisions of ``MergedThresholds.locate`` (docs/simulator.md). The filter
    tests :data:`CHUNK` scores at a time into a bit mask (a loop of constant length, which LLVM
    turns into vector compares) and visits only the set bits. Indices are unsigned wherever
    the loop reads or writes an array (no wraparound test, contiguous vector loads). Returns
    ``(survivors, near-ties)``; near-ties past the buffers' length are counted, not stored."""
    cap = band_col.shape[0]
    survivors = 0
    n_band = 0
    full = n_cols - n_cols % CHUNK
    for r in range(S.shape[0]):
        q = q0 + r
        first = off[q]
        cnt = off[q + 1] - first
        if cnt == 0:  # no thresholds: nothing survives
            continue
        t = lo_min[q]
        bucket0 = first + q
        row = S[r]
        for c in range(0, n_cols, CHUNK):
            # unsigned indices: numba adds no negative-index wraparound, so LLVM loads the
            # chunk's scores as contiguous vectors instead of gathering them one by one
            mask = np.uint64(0)
            cu = np.uint64(c)
            if c < full:
                for k in range(CHUNK):
                    ku = np.uint64(k)
                    mask |= np.uint64(row[cu + ku] >= t) << ku
            else:
                for ku in range(np.uint64(n_cols - c)):
                    mask |= np.uint64(row[cu + ku] >= t) << ku
            while mask:
                ju = cu + np.uint64(_trailing_zeros(mask))
                mask &= mask - np.uint64(1)
                v = row[ju]
                survivors += 1
                b = (
                    _count_below(hi, first, cnt, v, True)
                    if cnt > 16
                    else _count_less(hi, first, cnt, v)
                )
                if count:
                    slot = np.uint64(bucket0 + b)
                    for s in range(seg.shape[0]):
                        acc[np.uint64(seg[s][ju] * width + base[s]) + slot] += 1
                j = np.int64(ju)
                if b < cnt and lo[np.uint64(first + b)] <= v:  # the next band holds v
                    if n_band < cap:
                        band_col[n_band] = j
                        band_val[n_band] = v
                        band_hi[n_band] = first + b
                        band_lo[n_band] = first + _count_below(lo, first, cnt, v, False)
                    n_band += 1
    return survivors, n_band


def _count_less(edges, first, n, v):
    """How many of ``edges[first:first + n]`` are below ``v``: the count of
    :func:`_count_below` (``strict``) as one linear pass, for a query's few thresholds."""
    b = 0
    start = np.uint64(first)
    for i in range(np.uint64(n)):
        b += edges[start + i] < v
    return b


def _trailing_zeros(x):  # replaced by numba's intrinsic when the kernel is compiled
    return (int(x) & -int(x)).bit_length() - 1


def load_kernel():
    """The compiled kernel (numba ``njit``: ``cache=True, nogil=True``, compiled at its first
    call for the argument types given), or ``None`` (with one warning) where numba cannot be
    imported."""
    global _count_below, _count_less, _trailing_zeros
    with _lock:
        if "fn" not in _loaded:
            try:
                import numba
                from numba.cpython.unsafe.numbers import trailing_zeros
            except ImportError as exc:  # pragma: no cover - numba is a dependency
                log.warning("fused survivor kernel unavailable (%s); using the torch filter", exc)
                _loaded["fn"] = None
            else:
                # the kernel calls compiled helpers: numba reads the module's globals
                inline = numba.njit(cache=True, nogil=True, inline="always")
                _count_below = inline(getattr(_count_below, "py_func", _count_below))
                _count_less = inline(getattr(_count_less, "py_func", _count_less))
                _trailing_zeros = trailing_zeros
                _loaded["fn"] = numba.njit(cache=True, nogil=True)(_survivor_count)
        return _loaded["fn"]


class BandBuffer:
    """A worker's output buffers for the near-ties of one block (grown when a block has more)."""

    def __init__(self, cap: int = 4096):
        self.resize(cap)

    def resize(self, cap: int) -> None:
        self.cap = int(cap)
        self.col = np.empty(self.cap, dtype=np.int64)
        self.val = np.empty(self.cap, dtype=np.float32)
        self.hi = np.empty(self.cap, dtype=np.int64)
        self.lo = np.empty(self.cap, dtype=np.int64)


def count_block(
    fn,
    S: torch.Tensor,
    q0: int,
    tables: dict,
    seg_cols: list[torch.Tensor],
    bases: np.ndarray,
    acc: torch.Tensor,
    buf: BandBuffer,
) -> tuple[int, tuple[np.ndarray, ...] | None]:
    """Count the survivors of CPU float32 block ``S`` (rows: queries ``q0:``) into ``acc``:
    ``(survivors, band)`` with ``band = (block column, score, b_hi, b_lo)`` of the near-ties
    (``None`` when there are none). ``tables``: the thresholds' ``lo_min``, ``off``, ``lo``,
    ``hi`` arrays; ``seg_cols``: per counted segmentation, the segment of each block column
    (int64); ``bases``: their offsets in ``acc``."""
    if S.dtype != torch.float32 or S.device.type != "cpu" or S.stride(1) != 1:
        raise ValueError("the fused kernel takes a CPU float32 block with unit column stride")
    scores = S.numpy()
    n_rows, n_cols = scores.shape
    ld = scores.strides[0] // scores.itemsize if n_rows > 1 else n_cols
    if ld != n_cols:
        # rows of a wider buffer: seen as rows of ld scores (of which the kernel reads the
        # first n_cols), so that the compiled loop knows the scores of a row are contiguous
        scores = np.lib.stride_tricks.as_strided(
            scores, shape=(n_rows, ld), strides=(ld * scores.itemsize, scores.itemsize)
        )
    seg = np.empty((len(seg_cols), n_cols), dtype=np.int64)
    for s, col in enumerate(seg_cols):
        seg[s] = col.numpy()
    args = (tables["lo_min"], tables["off"], tables["lo"], tables["hi"], seg, bases)
    width, counts = int(tables["width"]), acc.numpy()

    def call(count: bool) -> tuple[int, int]:
        return fn(scores, n_cols, int(q0), *args, width, counts, count, *buf_arrays())

    def buf_arrays():
        return buf.col, buf.val, buf.hi, buf.lo

    survivors, n = call(True)
    if n > buf.cap:  # rerun for the near-ties only, into buffers that hold them all
        buf.resize(max(n, 2 * buf.cap))
        call(False)
    if n == 0:
        return int(survivors), None
    return int(survivors), tuple(a[:n].copy() for a in (buf.col, buf.val, buf.hi, buf.lo))
