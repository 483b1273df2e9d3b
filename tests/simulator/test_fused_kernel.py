"""The fused survivor kernel (numba) counts exactly what the torch filter and count do."""

from __future__ import annotations

import logging

import numpy as np
import pytest

import raycompat.simulator.fused_kernel as fused_kernel
import raycompat.simulator.side_pass as side_pass_mod
import raycompat.simulator.thresholds as thresholds_mod
from raycompat.simulator.assembly import ranks_from_counts, threshold_counts_by_role
from raycompat.simulator.block_pass import block_pass
from raycompat.simulator.rank_plan import CurveSpec, plan_ranks
from raycompat.upgrade.grid import backfill_counts
from raycompat.upgrade.score_sides import Side


def integer_instance(seed: int, points: int = 4):
    """Integer sides (ties everywhere), three curves, a random backfill order; the backfill
    curve at ``points`` grid points (more than 16 thresholds a query: the binary search)."""
    rng = np.random.default_rng(seed)
    n, n_q = int(rng.integers(80, 400)), int(rng.integers(4, 30))
    gl, ql = rng.integers(0, 4, n), rng.integers(0, 5, n_q)
    qo, go = (rng.integers(-2, 3, (m, 3)).astype(np.float32) for m in (n_q, n))
    qn, gn = (rng.integers(-2, 3, (m, 9)).astype(np.float32) for m in (n_q, n))
    grid = np.array([0.0, 0.2, 0.5, 1.0]) if points == 4 else np.linspace(0.0, 1.0, points)
    counts = backfill_counts(grid, n)
    sides = {"o": Side(qo, go), "n": Side(qn, gn)}
    curves = [
        CurveSpec("c", "o", "n", counts, rng.permutation(n)),
        CurveSpec("ref", "o", None, np.array([0])),
        CurveSpec("new", "n", None, np.array([0])),
    ]
    return rng, sides, curves, ql, gl


def counts_of(plan, block) -> dict:
    """Per (curve, role): items of each segment preceding each merged threshold, near-ties
    resolved (what the ranks are summed from)."""
    hist = {x: block.sides[x].histograms for x in plan.used}
    ties = {x: [(block.sides[x].tie_items, block.sides[x].tie_thresholds)] for x in plan.used}
    return threshold_counts_by_role(plan, hist, ties)


@pytest.mark.parametrize("seed, points", [(s, 4) for s in range(6)] + [(6, 41), (7, 41)])
def test_fused_counts_equal_the_torch_filter_and_count(seed, points, monkeypatch):
    """Same counts per threshold, same ranks: thresholds in per-query tables or on float64
    keys, a normal or a huge error band (every survivor a near-tie), the debug sentinel,
    one or two worker threads, small and large blocks."""
    rng, sides, curves, ql, gl = integer_instance(300 + seed, points)
    monkeypatch.setattr(thresholds_mod, "TABLE_MAX", int(rng.choice([0, 32])))
    n = sides["o"].gallery.shape[0]
    for band, debug in ((1.0, False), (1e9, False), (1.0, True)):
        kw = dict(
            band_scale=band,
            debug=debug,
            block_bytes=int(rng.choice([512, 1 << 20])),
            workers=int(rng.choice([1, 2])),
        )
        plan = plan_ranks(sides, curves, ql, gl, **kw)
        g0 = int(rng.integers(0, n // 2))
        fused = block_pass(plan, sides, g0, n, fused=True)
        plain = block_pass(plan, sides, g0, n, fused=False)
        got, want = counts_of(plan, fused), counts_of(plan, plain)
        assert got.keys() == want.keys()
        for key in want:
            assert np.array_equal(got[key], want[key]), (band, debug, key)
        for x in plan.used:
            assert fused.sides[x].stats["fused"] and not plain.sides[x].stats["fused"]
            assert fused.sides[x].stats["survivors"] == plain.sides[x].stats["survivors"]
        if band > 1:
            assert sum(fused.sides[x].tie_items.size for x in plan.used) > 0
        whole = [block_pass(plan, sides, 0, g0, fused=True), fused] if g0 else [fused]
        ranks = ranks_from_counts(plan, whole)
        ranks_plain = ranks_from_counts(plan, [block_pass(plan, sides, 0, n, fused=False)])
        for c in ranks_plain.curves:
            assert np.array_equal(ranks.curve(c.key).ranks, c.ranks), (band, debug, c.key)


def test_near_ties_beyond_the_buffer_are_all_kept(monkeypatch):
    """A block with more near-ties than the worker's buffer holds: the kernel reruns for the
    near-ties alone, and nothing is counted twice."""
    _, sides, curves, ql, gl = integer_instance(7)
    plan = plan_ranks(sides, curves, ql, gl, band_scale=1e9, workers=1)
    want = counts_of(plan, block_pass(plan, sides, fused=False))
    monkeypatch.setattr(side_pass_mod, "BandBuffer", lambda: fused_kernel.BandBuffer(cap=3))
    got_block = block_pass(plan, sides, fused=True)
    assert sum(got_block.sides[x].stats["band_entries"] for x in plan.used) > 3
    got = counts_of(plan, got_block)
    for key in want:
        assert np.array_equal(got[key], want[key]), key


def test_without_numba_the_torch_filter_runs(monkeypatch, caplog):
    """numba missing: one warning, the passes keep the torch filter and count (same counts);
    a pass that requires the kernel fails with the reason."""
    import sys

    _, sides, curves, ql, gl = integer_instance(11)
    plan = plan_ranks(sides, curves, ql, gl, workers=1)
    want = counts_of(plan, block_pass(plan, sides, fused=False))
    monkeypatch.setitem(sys.modules, "numba", None)  # import numba raises ImportError
    monkeypatch.setattr(fused_kernel, "_loaded", {})
    with caplog.at_level(logging.WARNING, logger=fused_kernel.__name__):
        block = block_pass(plan, sides)
    assert "fused survivor kernel unavailable" in caplog.text
    assert not any(block.sides[x].stats["fused"] for x in plan.used)
    got = counts_of(plan, block)
    for key in want:
        assert np.array_equal(got[key], want[key]), key
    with pytest.raises(RuntimeError, match="unavailable: numba did not import"):
        block_pass(plan, sides, fused=True)


def test_the_kernel_is_compiled_once_for_its_types_without_the_gil():
    """numba compiles the kernel at its first call for the argument types (checked, not raw
    pointers), once: later blocks reuse it; it runs without the GIL (the pass's threads count in
    parallel) and is cached on disk."""
    _, sides, curves, ql, gl = integer_instance(5)
    plan = plan_ranks(sides, curves, ql, gl, workers=2, block_bytes=512)
    block_pass(plan, sides, fused=True)
    fn = fused_kernel.load_kernel()
    assert len(fn.signatures) == 1
    block_pass(plan, sides, fused=True)
    assert len(fn.signatures) == 1 and fn is fused_kernel.load_kernel()
    assert fn.targetoptions["nogil"] is True and fn._cache.__class__.__name__ == "FunctionCache"


def test_the_kernels_searches_count_edges_below_a_value_as_numpy_does():
    """The kernel's branch-free binary search (more than 16 thresholds) and its linear count
    (up to 16), compiled, against ``np.searchsorted`` on sorted edges with ties, at values on
    and between the edges, for every length up to 40 and an offset into a longer array."""
    assert fused_kernel.load_kernel() is not None
    rng = np.random.default_rng(5)
    for n in range(41):
        edges = np.sort(rng.integers(0, 12, n).astype(np.float32))
        padded = np.concatenate([np.full(3, -1.0, np.float32), edges, np.full(2, 99.0, np.float32)])
        for v in np.arange(-1.0, 13.0, 0.5, dtype=np.float32):
            below = int(np.searchsorted(edges, v, side="left"))
            at_or_below = int(np.searchsorted(edges, v, side="right"))
            assert fused_kernel._count_below(padded, 3, n, v, True) == below, (n, v)
            assert fused_kernel._count_below(padded, 3, n, v, False) == at_or_below, (n, v)
            assert fused_kernel._count_less(padded, 3, n, v) == below, (n, v)
