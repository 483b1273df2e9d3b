"""One side's scoring pass over gallery rows: the survivor filter and the per-segment histograms.

Only scores at or above a query's lowest threshold ("survivors") can precede a positive.  A
score block (:func:`raycompat.index.blocks.map_score_blocks`) is filtered with one
max-reduction per tile of ``SURVIVOR_TILE`` columns (or, while survivors are dense, one compare
and one scan of the block); each survivor is located among its query's merged thresholds
(:meth:`raycompat.simulator.thresholds.MergedThresholds.locate`) and added to one histogram
``[segment, bucket]`` per distinct segmentation; survivors within the error band of a threshold
are kept for the exact resolution after the pass (docs/methods.md, "Ranking rule and the
canonical score").  A pass costs the matrix product, about one read of each score block and a
few tens of nanoseconds per survivor; on CPU each worker thread of the pass runs its matrix
products with one intra-op thread and has its own histogram, summed after the pass, so the
bookkeeping on one core overlaps a matrix product on another.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from raycompat.index.blocks import nonzero_2d, release_memory, rows_at_least
from raycompat.simulator.fused_kernel import BandBuffer, count_block, fused_enabled, load_kernel
from raycompat.simulator.rank_plan import Segmentations
from raycompat.simulator.thresholds import MergedThresholds

__all__ = ["SURVIVOR_TILE", "PASS_STAT_KEYS", "SidePass"]

#: columns per tile of the survivor filter (a tile is skipped when its max is below the
#: query's lowest threshold)
SURVIVOR_TILE = 128
#: per-pass counters of :meth:`SidePass.stats` (summed over workers, and over blocks)
PASS_STAT_KEYS = ("survivors", "band_entries", "seconds_matmul", "seconds_filter", "seconds_count")


def _survivors(S: torch.Tensor, lm: torch.Tensor, use_tiles: bool = True):
    """Entries with ``S[r, c] >= lm[r]``: ``(rows, cols, values, tile_fraction)`` or ``None``.

    With ``use_tiles``, tiles of ``SURVIVOR_TILE`` columns whose maximum is below the row's
    bound are skipped (one max-reduction over the block) and only the others are
    compared and scanned; when most tiles are touched the whole block is scanned
    directly.  ``tile_fraction`` (the share of touched tiles, or ``None`` without
    tiles) lets the caller skip the tile pass on dense data.  Entries come out in
    row-major order.
    """
    R, B = S.shape
    bt = (B // SURVIVOR_TILE) * SURVIVOR_TILE if use_tiles else 0
    frac = None
    if bt:
        nt = bt // SURVIVOR_TILE
        tiles = S[:, :bt].reshape(R, nt, SURVIVOR_TILE)
        hit = tiles.amax(dim=2) >= lm[:, None]
        tr, tc = nonzero_2d(hit)
        frac = tr.numel() / float(R * nt)
        if frac <= 0.25:
            parts = []
            if tr.numel():
                sel = tiles[tr, tc]  # [n, TILE] copy
                a, b = nonzero_2d(sel >= lm.index_select(0, tr)[:, None])
                parts.append(
                    (
                        tr.index_select(0, a),
                        tc.index_select(0, a) * SURVIVOR_TILE + b,
                        sel.view(-1).index_select(0, a * SURVIVOR_TILE + b),
                    )
                )
            if bt < B:
                rest = S[:, bt:]
                rr, cc = nonzero_2d(rest >= lm[:, None])
                if rr.numel():
                    parts.append((rr, cc + bt, rest[rr, cc]))
            if not parts:
                return None
            if len(parts) == 1:
                r, c, v = parts[0]
            else:
                r, c, v = (torch.cat([p[i] for p in parts]) for i in range(3))
            return (r, c, v, frac) if r.numel() else None
    r, c, flat = nonzero_2d(rows_at_least(S, lm), with_flat=True)
    if r.numel() == 0:
        return None
    return r, c, S.reshape(-1).index_select(0, flat), frac


class SidePass:
    """The scoring pass over one side X and gallery rows ``g0:g1``: per score block, the
    survivors and their histogram.

    One histogram ``[segment, bucket]`` (int64, ``bucket`` as in :meth:`MergedThresholds.locate`)
    per distinct *non-constant* segmentation of the curves X serves; a constant
    segmentation (a static curve: every item in one segment) is the segment sum of
    any other one, so it is counted only when it is alone.  Each worker of
    :func:`raycompat.index.blocks.map_score_blocks` owns an accumulator
    (``slot``), summed after the pass.
    """

    def __init__(
        self,
        mx: MergedThresholds,
        seg_ids: list[int],
        segs: Segmentations,
        seg_rows: Sequence[np.ndarray],
        workers: int,
        device: torch.device,
        g0: int = 0,
        fused: bool | None = None,
    ):
        self.mx = mx
        self.n_segs = segs.sizes
        self.constant = {si: segs.constant[si] for si in seg_ids if segs.constant[si] is not None}
        counted = [si for si in seg_ids if si not in self.constant] or seg_ids[:1]
        # the block's own rows of each counted segmentation, int64 on the pass device
        self.seg_t = {
            si: torch.from_numpy(seg_rows[si].astype(np.int64)).to(device) for si in counted
        }
        self.base: dict[int, int] = {}
        size = 0
        for si in counted:
            self.base[si] = size
            size += self.n_segs[si] * mx.width
        self.size = size
        self.offset = int(g0)
        self.total = float(mx.lo_min.size * len(seg_rows[0]))
        self.workers = workers if device.type == "cpu" else 1
        self.acc = [
            torch.zeros(size, dtype=torch.int64, device=device) for _ in range(self.workers)
        ]
        self.ones = torch.ones(1, dtype=torch.int64, device=device)
        self.lo_min = torch.from_numpy(mx.lo_min.copy()).to(device)
        self.device = device
        self.band: list[tuple[np.ndarray, ...]] = []
        self.progress = None
        self._lock = threading.Lock()
        self._done = 0
        self._set_kernel(fused)
        self._w = [
            {
                "survivors": 0,
                "band_entries": 0,
                "blocks": 0,
                "tile_frac": 0.0,
                "seconds_matmul": 0.0,
                "seconds_filter": 0.0,
                "seconds_count": 0.0,
                "t_end": 0.0,
            }
            for _ in range(self.workers)
        ]

    def _set_kernel(self, fused: bool | None) -> None:
        """The fused filter-and-count kernel on CPU (:mod:`raycompat.simulator.fused_kernel`):
        ``fused=None`` uses it where numba imports (unless ``RAYCOMPAT_FUSED_KERNEL=0``),
        ``False`` keeps the torch filter and count, ``True`` requires it."""
        self.kernel = None
        if self.device.type != "cpu" or fused is False or (fused is None and not fused_enabled()):
            return
        self.kernel = load_kernel()
        if self.kernel is None and fused:
            raise RuntimeError("the fused survivor kernel is unavailable: numba did not import")
        if self.kernel is None:
            return
        mx = self.mx
        self.tables = {
            "lo_min": mx.lo_min,
            "off": mx.off,
            "lo": mx.lo_edges,
            "hi": mx.hi_edges,
            "width": mx.width,
        }
        self.bases = np.array(list(self.base.values()), dtype=np.int64)
        self.buffers = [BandBuffer() for _ in range(self.workers)]

    def begin(self) -> None:
        """Start the stage clocks (a worker's matrix-product time runs until its block arrives)."""
        now = time.perf_counter()
        for w in self._w:
            w["t_end"] = now

    def block(self, slot: int, q0: int, q1: int, g0: int, g1: int, S: torch.Tensor) -> None:
        """Histogram the survivors of score block ``S`` (rows ``q0:q1``, items ``g0:g1`` of
        the pass's rows, i.e. ``offset + g0 : offset + g1`` of the gallery)."""
        w = self._w[slot]
        tb = time.perf_counter()
        w["seconds_matmul"] += tb - w["t_end"]
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        # tile filter unless the last blocks were dense (then scan directly; retry every 8)
        use_tiles = w["tile_frac"] <= 0.25 or w["blocks"] % 8 == 0
        if w["blocks"] % 4 == 3:
            release_memory()
        w["blocks"] += 1
        if self.kernel is not None:
            self._fused_block(slot, q0, g0, g1, S)
            w["seconds_count"] += time.perf_counter() - tb
            self._report(q1 - q0, g1 - g0)
            w["t_end"] = time.perf_counter()
            return
        found = _survivors(S, self.lo_min[q0:q1], use_tiles)
        tc = time.perf_counter()
        w["seconds_filter"] += tc - tb
        if found is None:
            w["tile_frac"] = 0.0 if use_tiles else w["tile_frac"]
        else:
            r, col, vals, frac = found
            if frac is not None:
                w["tile_frac"] = frac
            w["survivors"] += int(r.numel())
            self._count(slot, r + q0, col, g0, g1, vals)  # rows of the block, not global
        w["seconds_count"] += time.perf_counter() - tc
        self._report(q1 - q0, g1 - g0)
        w["t_end"] = time.perf_counter()

    def _report(self, rows: int, cols: int) -> None:
        if self.progress is not None:
            with self._lock:
                self._done += rows * cols
                self.progress(self._done / self.total)

    def _fused_block(self, slot: int, q0: int, g0: int, g1: int, S: torch.Tensor) -> None:
        """:meth:`block` through the fused kernel: filter, locate and count in one pass."""
        seg_cols = [self.seg_t[si][g0:g1] for si in self.base]
        acc, buf, kernel = self.acc[slot], self.buffers[slot], self.kernel
        survivors, band = count_block(kernel, S, q0, self.tables, seg_cols, self.bases, acc, buf)
        w = self._w[slot]
        w["survivors"] += survivors
        if band is not None:
            col, vals, b_hi, b_lo = band
            w["band_entries"] += int(col.size)
            self.band.append((col + (g0 + self.offset), vals, b_hi, b_lo))

    def _count(
        self, slot: int, qg: torch.Tensor, col: torch.Tensor, g0: int, g1: int, vals: torch.Tensor
    ):
        """Add survivors (query ``qg``, item ``g0 + col`` of the block, score ``vals``) to the
        histograms; keep the ambiguous ones (as gallery indices) for the exact resolution after
        the pass."""
        mx = self.mx
        bucket, amb, b_hi, b_lo = mx.locate(qg, vals)
        acc = self.acc[slot]
        for si, base in self.base.items():
            # the score block's segments (a small array) gathered per survivor
            flat = (self.seg_t[si][g0:g1] * mx.width + base).index_select(0, col) + bucket
            acc.index_add_(0, flat, self.ones.expand(flat.numel()))
        if amb is not None:
            self._w[slot]["band_entries"] += int(amb.numel())
            first = g0 + self.offset
            self.band.append(
                tuple(
                    z.cpu().numpy()
                    for z in (
                        col.index_select(0, amb) + first,
                        vals.index_select(0, amb),
                        b_hi,
                        b_lo,
                    )
                )
            )

    def histogram(self, si: int) -> np.ndarray:
        """int64 ``[segments, width]`` histogram of segmentation ``si`` (summed over workers)."""
        if si in self.base:
            nseg = self.n_segs[si]
            tot = self.acc[0][self.base[si] : self.base[si] + nseg * self.mx.width].clone()
            for acc in self.acc[1:]:
                tot += acc[self.base[si] : self.base[si] + nseg * self.mx.width]
            return tot.cpu().numpy().reshape(nseg, self.mx.width)
        other = next(iter(self.base))
        c0 = self.constant[si]
        H = np.zeros((self.n_segs[si], self.mx.width), dtype=np.int64)
        H[c0] = self.histogram(other).sum(axis=0)
        return H

    def stats(self) -> dict[str, Any]:
        """Survivors, band entries and stage seconds (summed over workers)."""
        return {k: sum(w[k] for w in self._w) for k in PASS_STAT_KEYS}
