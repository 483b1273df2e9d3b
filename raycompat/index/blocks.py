"""Blockwise float32 scoring with torch, on CPU or GPU, with bounded memory.

Every score in the backfill simulator is an inner product ``<q, g>`` of two
float32 vectors computed by a float32 matrix product of a query chunk with a
gallery block (:func:`iter_score_blocks`).  Each (query, item) score is
computed exactly once per pass, so comparisons between scores of one pass are
self-consistent.  TF32 / reduced-precision matmul is switched off for the
duration of a pass (:func:`fp32_matmul`), so every score is a true float32
dot product whose rounding error is bounded by ``gamma_D * sum|q_k g_k|``
(:func:`raycompat.index.canonical.dot_error_bound`) -- the engine relies on this bound.

:func:`exact_topk` is a blockwise exact top-k search with the same tie order
as :func:`raycompat.index.exact_search` (descending score, ties by ascending
gallery index).  The benchmark uses it as "one exact full-gallery search" with
the same code path as the curve engine.

:func:`map_score_blocks` hands every block of a pass to a callback; on CPU it
spreads the blocks over worker threads that each run their matrix products
with one intra-op thread, so the callback's bookkeeping on one core overlaps
the matrix product on the other instead of idling it.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator

import numpy as np
import torch

from raycompat.index.canonical import dot_error_bound  # noqa: F401  (re-exported: the pass's error bound)

__all__ = [
    "resolve_device",
    "fp32_matmul",
    "dot_error_bound",
    "block_rows",
    "iter_score_blocks",
    "exact_topk",
    "release_memory",
    "nonzero_2d",
    "rows_at_least",
    "map_score_blocks",
    "default_workers",
    "intra_op_threads",
]

#: default memory budget (bytes) of one score block [query chunk, gallery block] of the
#: top-k search (about 2048 gallery rows for 1,000 queries: the matmul's sweet spot)
DEFAULT_BLOCK_BYTES = 8 * 1024 * 1024
#: the same for the curve engine, whose per-block bookkeeping favours larger blocks
ENGINE_BLOCK_BYTES = 16 * 1024 * 1024


_LIBC = None


def release_memory() -> None:
    """Return freed heap memory to the OS: glibc's (``malloc_trim``; a no-op elsewhere) and,
    where pyarrow is loaded, its memory pool's (``release_unused``).

    The passes allocate and free many medium-sized temporaries per block; glibc
    keeps them in its heap, so without trimming the resident size creeps up by
    hundreds of MB over a pass although nothing is live.  Called every few blocks.
    Pyarrow's default pool (mimalloc) likewise keeps a read row group's buffers,
    about twice the row group's decoded size, until told to release them.
    """
    arrow = sys.modules.get("pyarrow")
    if arrow is not None:
        arrow.default_memory_pool().release_unused()
    global _LIBC
    if _LIBC is None:
        try:
            import ctypes

            _LIBC = ctypes.CDLL("libc.so.6")
            _LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


def nonzero_2d(mask: torch.Tensor, with_flat: bool = False):
    """``(rows, cols)`` (and the flat row-major indices with ``with_flat``) of the True
    entries of a 2-D bool tensor, in row-major order.

    On CPU through ``numpy.flatnonzero`` on the flat mask, several times faster
    than ``torch.nonzero`` on sparse masks; on other devices ``torch.nonzero``.
    """
    width = mask.shape[1]
    if mask.device.type == "cpu":
        flat_np = np.flatnonzero(mask.contiguous().numpy())
        rows_np = flat_np // width  # numpy's integer division is the faster one
        rows, cols = torch.from_numpy(rows_np), torch.from_numpy(flat_np - rows_np * width)
        flat = torch.from_numpy(flat_np)
    else:
        flat = torch.nonzero(mask.reshape(-1)).squeeze(1)
        rows = torch.div(flat, width, rounding_mode="floor")
        cols = flat - rows * width
    return (rows, cols, flat) if with_flat else (rows, cols)


def rows_at_least(S: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """Bool mask ``S[r, c] >= bound[r]`` of a 2-D block.

    On CPU through numpy (one vectorised pass, faster than torch's broadcast compare
    there); on other devices ``torch.ge``.
    """
    if S.device.type == "cpu":
        return torch.from_numpy(np.greater_equal(S.numpy(), bound.numpy()[:, None]))
    return torch.ge(S, bound[:, None])


def resolve_device(device=None) -> torch.device:
    """``None``/``"auto"``: CUDA when available, else CPU; otherwise ``torch.device(device)``."""
    if device is None or (isinstance(device, str) and device == "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


@contextlib.contextmanager
def fp32_matmul():
    """Force true float32 matrix products (no TF32 on GPU, no bf16 on CPU) inside the block."""
    prev_prec = torch.get_float32_matmul_precision()
    prev_cuda = torch.backends.cuda.matmul.allow_tf32
    prev_cudnn = torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("highest")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(prev_prec)
        torch.backends.cuda.matmul.allow_tf32 = prev_cuda
        torch.backends.cudnn.allow_tf32 = prev_cudnn


def block_rows(
    n_queries: int, n_items: int, block_bytes: int = DEFAULT_BLOCK_BYTES
) -> tuple[int, int]:
    """(query chunk rows, gallery block rows) such that one float32 score block fits
    ``block_bytes``.

    All queries go in one chunk when at least 512 gallery rows still fit; the
    gallery block is then as large as the budget allows.
    """
    elems = max(1, int(block_bytes) // 4)
    q = max(1, n_queries)
    if elems // q >= 512:
        qc = q
    else:
        qc = max(1, elems // 512)
    gb = max(1, min(max(n_items, 1), elems // qc))
    if gb > 512:
        gb -= gb % 256  # whole tiles, and sizes the matmul kernels like
    return qc, gb


def _to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    a = np.ascontiguousarray(a, dtype=np.float32)
    t = torch.from_numpy(a if a.flags.writeable else a.copy())  # read-only: shared memory
    return t if device.type == "cpu" else t.to(device)


def iter_score_blocks(
    queries: np.ndarray,
    gallery: np.ndarray,
    *,
    device=None,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    query_rows: int | None = None,
    gallery_rows: int | None = None,
    reuse: bool = True,
) -> Iterator[tuple[int, int, int, int, torch.Tensor]]:
    """Yield ``(q0, q1, g0, g1, S)`` with ``S = queries[q0:q1] @ gallery[g0:g1].T`` (float32,
    on device).

    Query chunks are the outer loop (each chunk is moved to the device once),
    gallery blocks the inner loop.  Call inside :func:`fp32_matmul`.  With
    ``reuse`` (default) full-size blocks are written into one buffer: ``S`` is
    only valid until the next iteration (copy what must be kept).
    """
    dev = resolve_device(device)
    n_q, n_g = queries.shape[0], gallery.shape[0]
    qc, gb = block_rows(n_q, n_g, block_bytes)
    qc = query_rows or qc
    gb = gallery_rows or gb
    buf = None
    for q0 in range(0, n_q, qc):
        q1 = min(n_q, q0 + qc)
        qt = _to_device(queries[q0:q1], dev)
        for g0 in range(0, n_g, gb):
            g1 = min(n_g, g0 + gb)
            gt = _to_device(gallery[g0:g1], dev)
            if reuse and g1 - g0 == gb:
                # one output buffer for every full block: no fresh pages to fault in
                if buf is None or buf.shape != (q1 - q0, gb):
                    buf = torch.empty((q1 - q0, gb), dtype=torch.float32, device=dev)
                yield q0, q1, g0, g1, torch.matmul(qt, gt.T, out=buf)
            else:
                yield q0, q1, g0, g1, torch.matmul(qt, gt.T)


def default_workers(device) -> int:
    """Worker threads of :func:`map_score_blocks`: torch's intra-op thread count on CPU,
    1 elsewhere."""
    return max(1, torch.get_num_threads()) if resolve_device(device).type == "cpu" else 1


@contextlib.contextmanager
def intra_op_threads(n: int):
    """torch's intra-op thread count set to ``n`` inside the block (restored afterwards)."""
    prev = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(prev)


def map_score_blocks(
    queries: np.ndarray,
    gallery: np.ndarray,
    fn: Callable[[int, int, int, int, int, torch.Tensor], None],
    *,
    device=None,
    query_rows: int,
    gallery_rows: int,
    workers: int | None = None,
) -> None:
    """Call ``fn(slot, q0, q1, g0, g1, S)`` once for every score block
    ``S = queries[q0:q1] @ gallery[g0:g1].T`` (float32, on device).  Call inside
    :func:`fp32_matmul`.

    ``S`` is a per-worker buffer, valid only during the call.  ``slot`` (in
    ``[0, workers)``) names the calling worker, so ``fn`` can keep per-worker
    state (accumulators) without locks.  With one worker (the default on GPU)
    blocks run in order in the calling thread.  With several (CPU), blocks are
    handed out dynamically to ``workers`` threads that each compute their matrix
    products with one intra-op thread: the per-block work of ``fn`` on one core
    overlaps the matrix product of another block instead of idling it.  An
    exception in a worker stops the others and is re-raised here.
    """
    dev = resolve_device(device)
    workers = default_workers(dev) if workers is None else max(1, int(workers))
    if dev.type != "cpu":
        workers = 1
    if workers == 1:
        for q0, q1, g0, g1, S in iter_score_blocks(
            queries, gallery, device=dev, query_rows=query_rows, gallery_rows=gallery_rows
        ):
            fn(0, q0, q1, g0, g1, S)
        return
    n_q, n_g = queries.shape[0], gallery.shape[0]
    todo = iter(
        [
            (q0, min(n_q, q0 + query_rows), g0, min(n_g, g0 + gallery_rows))
            for q0 in range(0, n_q, query_rows)
            for g0 in range(0, n_g, gallery_rows)
        ]
    )
    _run_block_workers(queries, gallery, fn, todo, dev, workers)


def _run_block_workers(
    queries: np.ndarray, gallery: np.ndarray, fn, todo: Iterator, dev: torch.device, workers: int
) -> None:
    """:func:`map_score_blocks` on ``workers`` threads (one intra-op thread each) that take
    the blocks of ``todo`` one at a time; the first exception stops them and is re-raised."""
    lock = threading.Lock()
    errors: list = []

    def work(slot: int) -> None:
        buf = None
        try:
            torch.set_grad_enabled(False)  # grad mode is per thread
            while not errors:
                with lock:
                    blk = next(todo, None)
                if blk is None:
                    return
                q0, q1, g0, g1 = blk
                qt = _to_device(queries[q0:q1], dev)
                gt = _to_device(gallery[g0:g1], dev)
                if buf is None or buf.shape != (q1 - q0, g1 - g0):
                    buf = torch.empty((q1 - q0, g1 - g0), dtype=torch.float32, device=dev)
                fn(slot, q0, q1, g0, g1, torch.matmul(qt, gt.T, out=buf))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the calling thread
            errors.append(exc)

    with intra_op_threads(1):
        threads = [threading.Thread(target=work, args=(w,), daemon=True) for w in range(workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if errors:
        raise errors[0]


def _sorted_candidates(scores: torch.Tensor, ids: torch.Tensor):
    """Sort rows by (-score, id) given rows already ordered by ascending id (stable sort)."""
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices
    return torch.gather(scores, 1, order), torch.gather(ids, 1, order)


#: columns per tile of the candidate filter of :func:`exact_topk`
TOPK_TILE = 128


def _block_candidates_full(sub: torch.Tensor, kk: int):
    """Every entry of each row scoring at least the row's kk-th value (ties included),
    ordered by column: ``(scores, cols)`` padded with -inf."""
    kb = min(kk, sub.shape[1])
    vk = torch.topk(sub, kb, dim=1, sorted=False).values.amin(dim=1, keepdim=True)
    keep = sub >= vk
    width = int(keep.sum(dim=1).max().item())
    masked = torch.where(keep, sub, torch.full_like(sub, -float("inf")))
    cand_s, cand_c = torch.topk(masked, width, dim=1, sorted=False)
    cand_c, perm = torch.sort(cand_c, dim=1)
    return torch.gather(cand_s, 1, perm), cand_c


def _entries_above(S: torch.Tensor, kth: torch.Tensor, use_tiles: bool = True):
    """Entries strictly above the row's k-th score: ``(rows, cols, values, tile_fraction)``.

    With ``use_tiles`` they are found through tile maxima (only touched tiles are
    scanned); otherwise the block is scanned directly.  Row-major order, ascending
    column within a row.  ``tile_fraction`` is ``None`` without tiles.
    """
    R, B = S.shape
    bt = (B // TOPK_TILE) * TOPK_TILE if use_tiles else 0
    rr, cc, vv = [], [], []
    frac = None
    if bt:
        tiles = S[:, :bt].reshape(R, bt // TOPK_TILE, TOPK_TILE)
        tr, tc = nonzero_2d(tiles.amax(dim=2) > kth[:, None])
        frac = tr.numel() / float(R * (bt // TOPK_TILE))
        if tr.numel():
            sel = tiles[tr, tc]
            a, b = nonzero_2d(sel > kth.index_select(0, tr)[:, None])
            rr.append(tr.index_select(0, a))
            cc.append(tc.index_select(0, a) * TOPK_TILE + b)
            vv.append(sel.reshape(-1).index_select(0, a * TOPK_TILE + b))
    if bt < B:
        rest = S[:, bt:]
        a, b = nonzero_2d(rest > kth[:, None])
        if a.numel():
            rr.append(a)
            cc.append(b + bt)
            vv.append(rest.reshape(-1).index_select(0, a * (B - bt) + b))
    if not rr:
        return None, frac
    if len(rr) == 1:
        return (rr[0], cc[0], vv[0]), frac
    r, c, v = torch.cat(rr), torch.cat(cc), torch.cat(vv)
    o = torch.sort(r * B + c).indices  # tiles + the last partial tile: row-major again
    return (r.index_select(0, o), c.index_select(0, o), v.index_select(0, o)), frac


def _pad_by_row(r: torch.Tensor, ids: torch.Tensor, v: torch.Tensor):
    """Flat entries grouped by row (rows ascending, ids ascending within a row) ->
    ``(rows, scores [n, w], ids [n, w])`` padded with -inf."""
    dev = v.device
    rows, counts = torch.unique_consecutive(r, return_counts=True)
    width = int(counts.max().item())
    start = torch.cumsum(counts, 0) - counts
    slot = torch.arange(r.numel(), device=dev) - torch.repeat_interleave(start, counts)
    ridx = torch.repeat_interleave(torch.arange(rows.numel(), device=dev), counts)
    cs = torch.full((rows.numel(), width), -float("inf"), dtype=v.dtype, device=dev)
    ci = torch.full((rows.numel(), width), -1, dtype=torch.int64, device=dev)
    cs[ridx, slot] = v
    ci[ridx, slot] = ids
    return rows, cs, ci


def exact_topk(
    queries: np.ndarray,
    gallery: np.ndarray,
    k: int,
    *,
    device=None,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-k inner-product search, blockwise with torch (no normalisation here).

    Same result contract as :func:`raycompat.index.exact_search` with
    ``normalize=False``: float32 scores ``[Q, k]`` and int64 indices ``[Q, k]``,
    descending score, ties by ascending gallery index, padded with ``-inf`` /
    ``-1`` when ``k > N``.

    Until a query's list holds k items, a block contributes every entry scoring at
    least the block's own k-th value (ties included), merged by a stable sort.
    Afterwards only entries strictly above the list's k-th score can enter (an
    equal score has a larger index).  They are found through per-tile maxima
    (``TOPK_TILE`` columns; the block is scanned directly while candidates are
    dense), buffered, and merged every few blocks by insertion: a candidate goes
    after every list entry scoring at least as much (list entries come from
    earlier, lower-index blocks), list entries after every candidate scoring
    strictly more.  A stale k-th score only admits more candidates, never fewer.
    So the cost of a block is the matrix product plus about one max-reduction.
    """
    if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or k <= 0:
        raise ValueError(f"k must be a positive integer, got {k!r}")
    k = int(k)
    dev = resolve_device(device)
    n_q, n_g = queries.shape[0], gallery.shape[0]
    kk = min(k, n_g)
    lists = _TopKLists(n_q, kk, dev)
    tile_frac = 1.0
    n_blocks = 0
    with fp32_matmul(), torch.no_grad():
        for q0, q1, g0, _g1, S in iter_score_blocks(
            queries, gallery, device=dev, block_bytes=block_bytes
        ):
            S, rows_all = lists.fill(q0, g0, S)
            if S is None:
                continue
            # tiles while candidates are sparse; scan directly while they are dense (retry every 8)
            use_tiles = tile_frac <= 0.25 or n_blocks % 8 == 0
            n_blocks += 1
            if n_blocks % 32 == 0:
                release_memory()
            # threshold: the k-th score at the last merge (stale thresholds only admit more)
            kth = lists.best_s[q0:q1, -1] if rows_all is None else lists.best_s[q0 + rows_all, -1]
            found, frac = _entries_above(S, kth, use_tiles)
            if frac is not None:
                tile_frac = frac
            if found is None:
                continue
            lists.add(q0, rows_all, g0, found)
            # merge every few blocks, or sooner when many candidates wait
            if n_blocks % 8 == 0 or lists.n_pending >= 2 * kk * (q1 - q0) or q1 < n_q:
                lists.flush()
        lists.flush()
    return lists.result(k)


class _TopKLists:
    """The running top-``kk`` lists of :func:`exact_topk` (descending score, ties by index)
    and the candidates not merged into them yet."""

    def __init__(self, n_q: int, kk: int, dev: torch.device):
        self.kk = kk
        self.best_s = torch.full((n_q, kk), -float("inf"), dtype=torch.float32, device=dev)
        self.best_i = torch.full((n_q, kk), -1, dtype=torch.int64, device=dev)
        self.filled = torch.zeros(n_q, dtype=torch.int64, device=dev)  # real entries in the list
        self.pending: list = []  # candidates not merged yet: (query rows, ids, scores)
        self.n_pending = 0

    def fill(self, q0: int, g0: int, S: torch.Tensor):
        """Merge block ``S`` into the lists of its rows that are not full yet; returns the
        rest of the block and its rows (``(S, None)``: every row full; ``(None, _)``: none)."""
        full = self.filled[q0 : q0 + S.shape[0]] >= self.kk
        if bool(full.all()):
            return S, None
        self.flush()
        rows = torch.nonzero(~full).squeeze(1)
        cs, cc = _block_candidates_full(S.index_select(0, rows), self.kk)
        self.filled[q0 + rows] += (cs > -float("inf")).sum(dim=1)
        _merge(self.best_s, self.best_i, q0, (rows, cs, cc), g0, self.kk)
        rows_all = torch.nonzero(full).squeeze(1)
        if rows_all.numel() == 0:
            return None, rows_all
        return S.index_select(0, rows_all), rows_all

    def add(self, q0: int, rows_all, g0: int, found) -> None:
        """Buffer the entries ``found`` above the k-th scores (rows of the block ``S`` that
        :meth:`fill` returned)."""
        r, c, v = found
        r = q0 + (r if rows_all is None else rows_all.index_select(0, r))
        self.pending.append((r, c + g0, v))
        self.n_pending += r.numel()

    def flush(self) -> None:
        """Merge the buffered candidates into the lists."""
        if not self.pending:
            return
        pending = self.pending
        r = torch.cat([p[0] for p in pending])
        ids = torch.cat([p[1] for p in pending])
        v = torch.cat([p[2] for p in pending])
        o = torch.sort(r, stable=True).indices  # by row; blocks were appended in index order
        rows, cs, ci = _pad_by_row(
            r.index_select(0, o), ids.index_select(0, o), v.index_select(0, o)
        )
        _merge(self.best_s, self.best_i, 0, (rows, cs, ci), 0, self.kk)
        self.pending, self.n_pending = [], 0

    def result(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """float32 scores and int64 indices ``[Q, k]``, padded with ``-inf`` / ``-1``."""
        n_q, kk = self.best_s.shape
        out_s = np.full((n_q, k), -np.inf, dtype=np.float32)
        out_i = np.full((n_q, k), -1, dtype=np.int64)
        out_s[:, :kk] = self.best_s.cpu().numpy()
        out_i[:, :kk] = self.best_i.cpu().numpy()
        return out_s, out_i


def _merge(best_s, best_i, q0, cand, g0, kk):
    """Merge block candidates (ascending index within a row, -inf padded) into the running
    top-k lists of their rows.

    Rows whose list is not full yet (the first block) are merged by a stable sort of
    the concatenation.  Full rows are merged by insertion: a candidate goes after
    every list entry scoring at least as much (list entries come from earlier
    blocks, so they win ties), a list entry after every candidate scoring strictly
    more; both positions come from batched sorted searches.
    """
    rows, cs, cc = cand
    g = q0 + rows
    cur_s, cur_i = best_s[g], best_i[g]
    ids = cc + g0
    if bool(torch.isinf(cur_s[:, -1]).any()):
        all_s, all_i = _sorted_candidates(
            torch.cat([cur_s, cs], dim=1), torch.cat([cur_i, ids], dim=1)
        )
        best_s[g] = all_s[:, :kk]
        best_i[g] = all_i[:, :kk]
        return
    w = cs.shape[1]
    order = torch.sort(cs, dim=1, descending=True, stable=True).indices  # ties keep index order
    c_s, c_i = torch.gather(cs, 1, order), torch.gather(ids, 1, order)
    dev = cs.device
    pos_c = torch.searchsorted(-cur_s, -c_s, right=True) + torch.arange(w, device=dev)
    pos_b = torch.searchsorted(-c_s, -cur_s, right=False) + torch.arange(kk, device=dev)
    out_s = torch.empty((rows.numel(), kk + w), dtype=cs.dtype, device=dev)
    out_i = torch.empty((rows.numel(), kk + w), dtype=torch.int64, device=dev)
    out_s.scatter_(1, pos_b, cur_s)
    out_s.scatter_(1, pos_c, c_s)
    out_i.scatter_(1, pos_b, cur_i)
    out_i.scatter_(1, pos_c, c_i)
    best_s[g] = out_s[:, :kk]
    best_i[g] = out_i[:, :kk]
