"""Blockwise float32 scoring with torch, on CPU or GPU, with bounded memory.

Every score in the backfill simulator is an inner product ``<q, g>`` of two
float32 vectors computed by a float32 matrix product of a query chunk with a
gallery block (:func:`iter_score_blocks`).  Each (query, item) score is
computed exactly once per pass, so comparisons between scores of one pass are
self-consistent.  TF32 / reduced-precision matmul is switched off for the
duration of a pass (:func:`fp32_matmul`), so every score is a true float32
dot product whose rounding error is bounded by ``gamma_D * sum|q_k g_k|``
(:func:`dot_error_bound`) -- the engine relies on this bound.

:func:`exact_topk` is a blockwise exact top-k search with the same tie order
as :func:`raycompat.index.exact_search` (descending score, ties by ascending
gallery index).  The benchmark uses it as "one exact full-gallery search" with
the same code path as the curve engine.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Tuple

import numpy as np
import torch

__all__ = [
    "resolve_device",
    "fp32_matmul",
    "dot_error_bound",
    "block_rows",
    "iter_score_blocks",
    "exact_topk",
]

#: default memory budget (bytes) of one score block [query chunk, gallery block]
DEFAULT_BLOCK_BYTES = 32 * 1024 * 1024
_U32 = 2.0 ** -24  # unit roundoff of float32


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


def dot_error_bound(dim: int) -> float:
    """``gamma_D = D*u / (1 - D*u)`` (u = 2^-24): for any summation order (FMA or not),
    ``|fl(<a,b>) - <a,b>| <= gamma_D * sum_k |a_k b_k|`` for float32 inputs
    (Higham, Accuracy and Stability of Numerical Algorithms, Sec. 3.1)."""
    du = max(int(dim), 1) * _U32
    if du >= 0.5:
        raise ValueError(f"dimension {dim} too large for a float32 error bound")
    return du / (1.0 - du)


def block_rows(n_queries: int, n_items: int, block_bytes: int = DEFAULT_BLOCK_BYTES) -> Tuple[int, int]:
    """(query chunk rows, gallery block rows) such that one float32 score block fits ``block_bytes``.

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
    return qc, gb


def _to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))
    return t if device.type == "cpu" else t.to(device)


def iter_score_blocks(
    queries: np.ndarray,
    gallery: np.ndarray,
    *,
    device=None,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    query_rows: Optional[int] = None,
    gallery_rows: Optional[int] = None,
) -> Iterator[Tuple[int, int, int, int, torch.Tensor]]:
    """Yield ``(q0, q1, g0, g1, S)`` with ``S = queries[q0:q1] @ gallery[g0:g1].T`` (float32, on device).

    Query chunks are the outer loop (each chunk is moved to the device once),
    gallery blocks the inner loop.  Call inside :func:`fp32_matmul`.
    """
    dev = resolve_device(device)
    n_q, n_g = queries.shape[0], gallery.shape[0]
    qc, gb = block_rows(n_q, n_g, block_bytes)
    qc = query_rows or qc
    gb = gallery_rows or gb
    for q0 in range(0, n_q, qc):
        q1 = min(n_q, q0 + qc)
        qt = _to_device(queries[q0:q1], dev)
        for g0 in range(0, n_g, gb):
            g1 = min(n_g, g0 + gb)
            gt = _to_device(gallery[g0:g1], dev)
            yield q0, q1, g0, g1, torch.matmul(qt, gt.T)


def _sorted_candidates(scores: torch.Tensor, ids: torch.Tensor):
    """Sort rows by (-score, id) given rows already ordered by ascending id (stable sort)."""
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices
    return torch.gather(scores, 1, order), torch.gather(ids, 1, order)


def exact_topk(
    queries: np.ndarray,
    gallery: np.ndarray,
    k: int,
    *,
    device=None,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
) -> Tuple[np.ndarray, np.ndarray]:
    """Exact top-k inner-product search, blockwise with torch (no normalisation here).

    Same result contract as :func:`raycompat.index.exact_search` with
    ``normalize=False``: float32 scores ``[Q, k]`` and int64 indices ``[Q, k]``,
    descending score, ties by ascending gallery index, padded with ``-inf`` /
    ``-1`` when ``k > N``.

    Per block only the query rows whose block maximum beats their current k-th
    score are touched (a score equal to the current k-th cannot enter: its index
    is larger), so after the first blocks the cost is the matrix product plus
    one max-reduction.  Block candidates are every item scoring at least the
    block's k-th value (ties included), ordered by index, and merged with the
    running list by a stable sort -- which keeps ties in index order because
    the running list holds only items of earlier (lower-index) blocks.
    """
    if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or k <= 0:
        raise ValueError(f"k must be a positive integer, got {k!r}")
    k = int(k)
    dev = resolve_device(device)
    n_q, n_g = queries.shape[0], gallery.shape[0]
    kk = min(k, n_g)
    best_s = torch.full((n_q, kk), -float("inf"), dtype=torch.float32, device=dev)
    best_i = torch.full((n_q, kk), -1, dtype=torch.int64, device=dev)
    with fp32_matmul(), torch.no_grad():
        for q0, q1, g0, g1, S in iter_score_blocks(queries, gallery, device=dev, block_bytes=block_bytes):
            kth = best_s[q0:q1, -1]
            rows = torch.nonzero(S.amax(dim=1) > kth).squeeze(1)
            if rows.numel() == 0:
                continue
            sub = S.index_select(0, rows)
            kb = min(kk, g1 - g0)
            vk = torch.topk(sub, kb, dim=1, sorted=False).values.amin(dim=1, keepdim=True)
            masked = torch.where(sub >= vk, sub, torch.full_like(sub, -float("inf")))
            width = int((sub >= vk).sum(dim=1).max().item())
            cand_s, cand_c = torch.topk(masked, width, dim=1, sorted=False)
            # order the block candidates by index, then merge (stable) after the running list
            cand_c, perm = torch.sort(cand_c, dim=1)
            cand_s = torch.gather(cand_s, 1, perm)
            cand_i = cand_c + g0
            all_s = torch.cat([best_s[q0 + rows], cand_s], dim=1)
            all_i = torch.cat([best_i[q0 + rows], cand_i], dim=1)
            all_s, all_i = _sorted_candidates(all_s, all_i)
            best_s[q0 + rows] = all_s[:, :kk]
            best_i[q0 + rows] = all_i[:, :kk]
    out_s = np.full((n_q, k), -np.inf, dtype=np.float32)
    out_i = np.full((n_q, k), -1, dtype=np.int64)
    out_s[:, :kk] = best_s.cpu().numpy()
    out_i[:, :kk] = best_i.cpu().numpy()
    # -inf entries of a not-yet-filled list are padding (can only happen when kk > N, excluded)
    return out_s, out_i
