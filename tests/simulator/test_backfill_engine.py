"""The fast backfill-curve engine equals a brute-force masked exact search at every grid point.

The brute force here is written independently and simply: at every grid point it builds the
mixed gallery (one vector per item: old-state or new-state), scores every item with the
mode's query vector for that state (docs/methods.md, Query strategies), ranks all items by
(-score, index) and computes the metrics from that full ranking with raycompat.metrics.

Vectors are quantised so that float32 scores are exact whatever the summation order: each
vector has entries in {-1, 0, +1} with 4 or 16 non-zeros (norm 2 or 4, so L2-normalisation
is exact too) and few dimensions, so ties are everywhere.
"""

from __future__ import annotations

import numpy as np
import pytest

import raycompat.simulator.side_pass as side_pass_mod
import raycompat.simulator.thresholds as thresholds_mod
from raycompat.embeddings.gallery import GalleryEmbeddings
from raycompat.index import exact_search
from raycompat.index.blocks import exact_topk
from raycompat.metrics import (
    average_precision_from_ranks,
    map_full,
    mean_average_precision_at_k,
    negative_flip_rate,
    relevance_from_labels,
)
from raycompat.metrics.rank_metrics import full_ap_from_ranks, metrics_from_ranks, positive_pairs
from raycompat.models.uncertainty_head import UncertaintyHead
from raycompat.simulator.assembly import compute_ranks, ranks_from_counts
from raycompat.simulator.block_pass import block_pass
from raycompat.simulator.memory_engine import simulate_backfill
from raycompat.simulator.rank_plan import CurveSpec, plan_ranks
from raycompat.upgrade.grid import backfill_counts, cold_counts, default_grid, segments
from raycompat.upgrade.score_sides import Side


# ----------------------------------------------------------------------------- data
def quant(rng, n, blocks):
    """Rows made of blocks (dim, nonzeros): entries +-1 at `nonzeros` random places per block."""
    parts = []
    for dim, nnz in blocks:
        a = np.zeros((n, dim), np.float32)
        for r in range(n):
            a[r, rng.choice(dim, nnz, replace=False)] = rng.choice([-1.0, 1.0], nnz)
        parts.append(a)
    return np.concatenate(parts, axis=1)


def unit(a):
    """Exact here: every row norm is a power of two."""
    n = np.sqrt((a.astype(np.float64) ** 2).sum(axis=1, keepdims=True))
    return (a / n).astype(np.float32)


def make_instance(rng, n_items, n_queries, n_labels, d_old=6):
    gl = rng.integers(0, n_labels, n_items)
    ql = rng.integers(0, n_labels + 2, n_queries)  # some queries have no positive
    new_blocks = [(d_old, 4), (14, 12)]  # norm 4; first d_old dims: norm 2
    data = GalleryEmbeddings(
        gallery_labels=gl,
        query_labels=ql,
        gallery_old=quant(rng, n_items, [(d_old, 4)]),
        query_old=quant(rng, n_queries, [(d_old, 4)]),
        gallery_new=quant(rng, n_items, new_blocks),
        query_new=quant(rng, n_queries, new_blocks),
        gallery_adapted=quant(rng, n_items, new_blocks),
        gallery_rho=quant(rng, n_items, [(5, 4)]),
        query_rho=quant(rng, n_queries, [(5, 4)]),
        query_rev=quant(rng, n_queries, [(d_old, 4)]),
    )
    return data


# ----------------------------------------------------------------------------- brute force
def mode_scores(data, mode):
    """(old-state scores, new-state scores) [Q, N] in float64, straight from the query-mode table
    (docs/methods.md, Query strategies)."""
    qo, qn = unit(data.query_old), unit(data.query_new)
    go, gn = unit(data.gallery_old), unit(data.gallery_new)
    d = data.old_dim
    if mode == "compatible":
        return unit(data.query_new[:, :d]) @ go.T.astype(np.float64), qn @ gn.T.astype(np.float64)
    if mode == "adapted":
        return qn @ unit(data.gallery_adapted).T.astype(np.float64), qn @ gn.T.astype(np.float64)
    if mode == "rank_merge":  # -d, squared L2 between normalised vectors
        rev, rq, rg = unit(data.query_rev), unit(data.query_rho), unit(data.gallery_rho)
        neg_d_old = -((rev[:, None, :].astype(np.float64) - go[None]) ** 2).sum(-1)
        neg_d_new = -((rq[:, None, :].astype(np.float64) - rg[None]) ** 2).sum(-1)
        return neg_d_old, neg_d_new
    if mode in ("naive_merge", "cold"):
        return qo @ go.T.astype(np.float64), qn @ gn.T.astype(np.float64)
    raise KeyError(mode)


def brute_force_curve(s_old, s_new, new_items_at, ql, gl, k, ref_correct):
    """Metrics at each grid point from a full masked exact ranking of the mixed gallery."""
    n_q, n = s_old.shape
    m = np.array([(gl == x).sum() for x in ql])
    valid = m > 0
    out = {"mAP@k": [], "mAP": [], "top1": [], "NFR@1": []}
    for new_items in new_items_at:
        state_new = np.zeros(n, dtype=bool)
        state_new[new_items] = True  # exactly one vector per item
        s = np.where(state_new[None, :], s_new, s_old)
        ranking = np.lexsort((np.broadcast_to(np.arange(n), s.shape), -s), axis=-1)
        aps = np.full(n_q, np.nan)
        for q in range(n_q):
            if m[q]:
                aps[q] = average_precision_from_ranks(
                    np.flatnonzero(gl[ranking[q]] == ql[q]), int(m[q])
                )
        # the full ranking agrees with the library's full mAP (up to summation order)
        full = map_full(ranking, ql, gl)
        if valid.any():
            assert abs(full - aps[valid].mean()) < 1e-12
        top = np.full((n_q, k), -1)
        top[:, : min(k, n)] = ranking[:, :k]
        rel = relevance_from_labels(top, ql, gl)
        out["mAP@k"].append(mean_average_precision_at_k(rel, m, k))
        out["mAP"].append(float(aps[valid].mean()) if valid.any() else np.nan)
        out["top1"].append(float(rel[valid, 0].mean()) if valid.any() else np.nan)
        out["NFR@1"].append(negative_flip_rate(ref_correct, rel[:, 0]))
    return {key: np.array(v) for key, v in out.items()}


def brute_old_old_top1(data):
    s = unit(data.query_old) @ unit(data.gallery_old).T.astype(np.float64)
    ranking = np.lexsort((np.broadcast_to(np.arange(s.shape[1]), s.shape), -s), axis=-1)
    return data.gallery_labels[ranking[:, 0]] == data.query_labels


def masked_search_top1(data, mode, new_items):
    """Second brute force through raycompat.index.exact_search (faiss) on the two masked
    sub-galleries."""
    s_old, s_new = mode_scores(data, mode)
    n = data.n_items
    state_new = np.zeros(n, bool)
    state_new[new_items] = True
    best = []
    for q in range(data.n_queries):
        cands = []
        for scores, mask in ((s_old, ~state_new), (s_new, state_new)):
            idx = np.flatnonzero(mask)
            if idx.size:
                j = int(np.argmax(scores[q, idx]))  # first max = lowest index among ties
                cands.append((-scores[q, idx[j]], idx[j]))
        best.append(min(cands)[1])
    return data.gallery_labels[np.array(best)] == data.query_labels


# ----------------------------------------------------------------------------- tests
def head_for(rng, data):
    return UncertaintyHead(weight=rng.standard_normal((7, data.new_dim)), kind="cosface", scale=8.0)


@pytest.mark.parametrize("seed", range(6))
def test_every_mode_and_policy_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(40, 300))
    data = make_instance(rng, n, int(rng.integers(5, 30)), int(rng.integers(2, 7)))
    k = int(rng.choice([1, 5, 100, 1000]))  # 1000 > N: padded top-k
    step = float(rng.choice([5.0, 10.0, 25.0]))
    policies = [
        "random",
        "sequential",
        "uncertainty:least_confidence",
        "uncertainty:margin",
        "uncertainty:entropy",
        "hinge-benefit",
        "learned",
    ]
    modes = ["compatible", "adapted", "rank_merge", "naive_merge", "cold"]
    res = simulate_backfill(
        data,
        policies,
        modes,
        grid_step=step,
        k=k,
        seed=seed,
        head=head_for(rng, data),
        block_bytes=int(rng.choice([256, 4096, 1 << 20])),
        debug=(seed % 2 == 0),
    )
    ref = brute_old_old_top1(data)
    grid = default_grid(step)
    for c in res.curves:
        s_old, s_new = mode_scores(data, c.mode)
        pols = policies if c.mode == "cold" else [c.policy]
        order = res.orders.get((c.policy, c.mode), np.arange(n))
        counts = cold_counts(grid, n) if c.mode == "cold" else backfill_counts(grid, n)
        assert np.array_equal(c.counts, counts)
        want = brute_force_curve(
            s_old,
            s_new,
            [order[:cnt] for cnt in counts],
            data.query_labels,
            data.gallery_labels,
            k,
            ref,
        )
        for name, key in (
            ("mAP@k", f"mAP@{k}"),
            ("mAP", "mAP"),
            ("top1", "top1"),
            ("NFR@1", "NFR@1"),
        ):
            assert np.array_equal(c.metrics[key], want[name], equal_nan=True), (pols, c.mode, name)
        # one vector per item at every point, and the count follows the rounding rule
        for j in range(len(grid)):
            st = res.states(c.policy, c.mode, j)
            assert set(np.unique(st)) <= {0, 1} and int(st.sum()) == counts[j]
    # the top-1 of one point cross-checked through faiss-free masked argmax
    c = res.curve("random", "compatible")
    j = len(grid) // 2
    new_items = res.orders[("random", "compatible")][: c.counts[j]]
    top1 = masked_search_top1(data, "compatible", new_items)
    valid = np.array([(data.gallery_labels == x).any() for x in data.query_labels])
    if valid.any():
        assert c.metrics["top1"][j] == top1[valid].mean()


@pytest.mark.parametrize("seed", range(8))
def test_engine_paths_ties_band_and_tiles(seed, monkeypatch):
    """Engine alone on raw integer sides: tiny tiles (tile filter on), huge error band (every
    survivor resolved after the pass), small blocks, debug sentinel, both ways of locating
    survivors among thresholds, one to three worker threads; all equal brute force."""
    rng = np.random.default_rng(100 + seed)
    n, n_q = int(rng.integers(30, 260)), int(rng.integers(3, 25))
    d_old, d_new = int(rng.integers(2, 6)), int(rng.integers(2, 40))  # sides of different dims
    gl = rng.integers(0, int(rng.integers(1, 6)), n)
    ql = rng.integers(0, 7, n_q)
    # power-of-two scales: scores stay exact, error bands differ a lot between the sides
    so_, sn_ = 2.0 ** int(rng.integers(-3, 4)), 2.0 ** int(rng.integers(-3, 4))
    qo = rng.integers(-2, 3, (n_q, d_old)).astype(np.float32) * np.float32(so_)
    go = rng.integers(-2, 3, (n, d_old)).astype(np.float32)
    qn = rng.integers(-2, 3, (n_q, d_new)).astype(np.float32) * np.float32(sn_)
    gn = rng.integers(-2, 3, (n, d_new)).astype(np.float32)
    s_old = qo.astype(np.float64) @ go.T
    s_new = qn.astype(np.float64) @ gn.T
    order = rng.permutation(n)
    grid = np.sort(np.unique(np.concatenate([[0.0, 1.0], rng.random(int(rng.integers(1, 12)))])))
    counts = backfill_counts(grid, n)
    k = int(rng.choice([1, 3, 10, 400]))
    sides = {"o": Side(qo, go), "n": Side(qn, gn)}
    curves = [CurveSpec("c", "o", "n", counts, order), CurveSpec("ref", "o", None, np.array([0]))]
    monkeypatch.setattr(side_pass_mod, "SURVIVOR_TILE", int(rng.choice([1, 2, 4, 8])))
    # survivors located in per-query tables (a few thresholds) or by float64 keys (many)
    monkeypatch.setattr(thresholds_mod, "TABLE_MAX", int(rng.choice([0, 2, 32])))
    # the fused survivor kernel (compiled C) or the torch filter and count
    monkeypatch.setenv("RAYCOMPAT_FUSED_KERNEL", "1" if seed % 2 else "0")
    workers = int(rng.choice([1, 2, 3]))  # threads of a pass (per-worker histograms)
    ranking0 = np.lexsort((np.broadcast_to(np.arange(n), s_old.shape), -s_old), axis=-1)
    ref = gl[ranking0[:, 0]] == ql
    want = brute_force_curve(s_old, s_new, [order[:c] for c in counts], ql, gl, k, ref)
    for band, debug, bb in (
        (1.0, False, 64),
        (3e4, False, 256),
        (1e9, False, 1 << 12),
        (1.0, True, 1 << 20),
    ):
        res = compute_ranks(
            sides, curves, ql, gl, debug=debug, band_scale=band, block_bytes=bb, workers=workers
        )
        ref_c = metrics_from_ranks(
            res.curve("ref").ranks, res.pairs_q, res.npos, 1, return_per_query=True
        )[1]["correct1"][0]
        assert np.array_equal(ref_c, ref)
        got = metrics_from_ranks(res.curve("c").ranks, res.pairs_q, res.npos, k, ref_c)
        for name, key in (
            ("mAP@k", f"mAP@{k}"),
            ("mAP", "mAP"),
            ("top1", "top1"),
            ("NFR@1", "NFR@1"),
        ):
            assert np.array_equal(got[key], want[name], equal_nan=True), (band, debug, name)
        if debug:  # sentinel threshold: every item counted exactly once at every grid point
            assert (res.debug["items_counted"]["c"] == n).all()
        if band > 1:
            assert sum(s["band_entries"] for s in res.stats["sides"].values()) > 0


@pytest.mark.parametrize("seed", range(4))
def test_block_passes_one_at_a_time_add_up_to_compute_ranks(seed, monkeypatch):
    """The gallery cut into blocks, each scored by its own block pass and the histograms and
    resolved ties added: the ranks equal compute_ranks bit for bit, ties and near-ties included
    (integer sides: ties everywhere; a huge band sends every survivor through the exact step)."""
    rng = np.random.default_rng(900 + seed)
    n, n_q = int(rng.integers(60, 200)), int(rng.integers(4, 20))
    gl, ql = rng.integers(0, 4, n), rng.integers(0, 5, n_q)
    qo, go = (rng.integers(-2, 3, (m, 3)).astype(np.float32) for m in (n_q, n))
    qn, gn = (rng.integers(-2, 3, (m, 7)).astype(np.float32) for m in (n_q, n))
    counts = backfill_counts(np.array([0.0, 0.25, 0.6, 1.0]), n)
    sides = {"o": Side(qo, go), "n": Side(qn, gn)}
    curves = [
        CurveSpec("c", "o", "n", counts, rng.permutation(n)),
        CurveSpec("ref", "o", None, np.array([0])),
        CurveSpec("new", "n", None, np.array([0])),
    ]
    monkeypatch.setattr(thresholds_mod, "TABLE_MAX", int(rng.choice([0, 32])))
    monkeypatch.setenv("RAYCOMPAT_FUSED_KERNEL", "1" if seed % 2 else "0")
    cuts = np.unique(np.concatenate([[0, n], rng.integers(1, n, int(rng.integers(1, 6)))]))
    for band, debug in ((1.0, False), (1e9, False), (1.0, True)):
        kw = dict(
            band_scale=band,
            debug=debug,
            block_bytes=int(rng.choice([256, 1 << 20])),
            workers=int(rng.choice([1, 2])),
        )
        want = compute_ranks(sides, curves, ql, gl, **kw)
        plan = plan_ranks(sides, curves, ql, gl, **kw)
        blocks = [
            block_pass(plan, sides, int(a), int(b))
            for a, b in zip(cuts[:-1], cuts[1:], strict=False)
        ]
        got = ranks_from_counts(plan, blocks[::-1])  # the order of blocks is free
        assert np.array_equal(got.pairs_i, want.pairs_i) and np.array_equal(got.npos, want.npos)
        for c in want.curves:
            assert np.array_equal(got.curve(c.key).ranks, c.ranks), (band, debug, c.key)
        ties = sum(b.sides[x].tie_items.size for b in blocks for x in b.sides)
        if band > 1:
            assert ties > 0
    with pytest.raises(ValueError, match="cover"):
        ranks_from_counts(plan, blocks[:-1])
    for twice in (blocks[-1], block_pass(plan, sides, 0, n)):  # the same rows counted again
        with pytest.raises(ValueError, match="overlap"):
            ranks_from_counts(plan, blocks[::-1] + [twice])


def test_ranks_match_full_ranking_positions():
    rng = np.random.default_rng(7)
    n, n_q = 120, 9
    q = rng.integers(-1, 2, (n_q, 3)).astype(np.float32)
    g = rng.integers(-1, 2, (n, 3)).astype(np.float32)
    gl, ql = rng.integers(0, 3, n), rng.integers(0, 3, n_q)
    res = compute_ranks({"s": Side(q, g)}, [CurveSpec("r", "s", None, np.array([0]))], ql, gl)
    s = q.astype(np.float64) @ g.T
    ranking = np.lexsort((np.broadcast_to(np.arange(n), s.shape), -s), axis=-1)
    pos = np.argsort(ranking, axis=1)  # rank of every item
    assert np.array_equal(res.curve("r").ranks[0], pos[res.pairs_q, res.pairs_i])


def test_full_ap_is_bit_identical_to_the_metric_function():
    rng = np.random.default_rng(3)
    for npos in (1, 2, 7, 8, 9, 16, 130, 300):
        nq = 4
        counts = np.array([npos] * nq + [0])
        ranks = np.stack(
            [
                np.concatenate([rng.choice(5000, npos, replace=False) for _ in range(nq)])
                for _ in range(3)
            ]
        )
        pq = np.repeat(np.arange(nq + 1), counts)
        got = full_ap_from_ranks(ranks, pq, counts)
        for j in range(3):
            for qq in range(nq):
                assert got[j, qq] == average_precision_from_ranks(
                    ranks[j, qq * npos : (qq + 1) * npos], npos
                )
            assert np.isnan(got[j, nq])


def test_positive_pairs_and_segments():
    pq, pi, npos = positive_pairs(np.array([2, 5, 1]), np.array([1, 2, 2, 1, 3]))
    assert (
        pq.tolist() == [0, 0, 2, 2] and pi.tolist() == [1, 2, 0, 3] and npos.tolist() == [2, 0, 2]
    )
    order = np.array([3, 0, 2, 1])
    counts = np.array([0, 1, 3, 4])
    seg = segments(order, counts, 4)
    # item 3 is first in the order: new from grid point 1 on, i.e. seg <= 1
    assert seg.tolist() == [2, 3, 2, 1]
    with pytest.raises(ValueError):
        segments(order, np.array([2, 1]), 4)


def test_rounding_rule():
    assert backfill_counts([0, 0.05, 0.5, 1.0], 10).tolist() == [0, 1, 5, 10]  # 0.5 rounds up
    assert backfill_counts([0.25, 0.35], 2).tolist() == [1, 1]
    assert cold_counts(default_grid(25), 7).tolist() == [0, 0, 0, 0, 7]
    assert len(default_grid(5)) == 21 and len(default_grid(1)) == 101
    with pytest.raises(ValueError):
        default_grid(7)


@pytest.mark.parametrize("seed", range(3))
def test_blockwise_topk_equals_exact_search(seed, monkeypatch):
    import raycompat.index.blocks as blocks_mod

    rng = np.random.default_rng(seed)
    monkeypatch.setattr(blocks_mod, "TOPK_TILE", int(rng.choice([4, 16, 128])))
    q = rng.integers(-1, 2, (11, 4)).astype(np.float32)
    for n in (300, 2000):
        g = rng.integers(-1, 2, (n, 4)).astype(np.float32)
        for k in (1, 7, 50, 400):
            for bb in (11 * 4 * 64, 11 * 4 * 700, 1 << 22):
                s1, i1 = exact_topk(q, g, k, block_bytes=bb)
                s2, i2 = exact_search(q, g, k, normalize=False)
                assert np.array_equal(i1, i2) and np.array_equal(s1, s2), (n, k, bb)


def test_rank_merge_with_raw_squared_l2_equals_brute_force():
    rng = np.random.default_rng(11)
    data = make_instance(rng, 120, 12, 4)
    # integer vectors of different norms: -||a - b||^2 is exact in float32 and float64
    data = data.with_arrays(
        query_rev=data.query_rev * rng.integers(1, 4, (12, 1)).astype(np.float32),
        gallery_rho=data.gallery_rho * rng.integers(1, 4, (120, 1)).astype(np.float32),
    )
    res = simulate_backfill(
        data, ["random"], ["rank_merge"], grid_step=10, k=7, rank_merge_distance="sq_l2_raw"
    )
    rev, go = data.query_rev.astype(np.float64), data.gallery_old.astype(np.float64)
    rq, rg = data.query_rho.astype(np.float64), data.gallery_rho.astype(np.float64)
    s_old = -((rev[:, None] - go[None]) ** 2).sum(-1)
    s_new = -((rq[:, None] - rg[None]) ** 2).sum(-1)
    c = res.curves[0]
    order = res.orders[("random", "rank_merge")]
    want = brute_force_curve(
        s_old,
        s_new,
        [order[:n] for n in c.counts],
        data.query_labels,
        data.gallery_labels,
        7,
        brute_old_old_top1(data),
    )
    for name, key in (("mAP@k", "mAP@7"), ("mAP", "mAP"), ("top1", "top1"), ("NFR@1", "NFR@1")):
        assert np.array_equal(c.metrics[key], want[name], equal_nan=True), name


def test_scores_that_may_overflow_float32_are_rejected():
    q = np.full((2, 3), 1e20, dtype=np.float32)
    g = np.full((4, 3), 1e20, dtype=np.float32)
    with pytest.raises(ValueError, match="overflow"):
        compute_ranks(
            {"s": Side(q, g)}, [CurveSpec("r", "s", None, np.array([0]))], [0, 1], [0, 1, 0, 1]
        )


def canonical_matrix(q, g):
    """[Q, N] canonical scores, every pair through raycompat.index.canonical.pair_scores."""
    from raycompat.index.canonical import pair_scores

    qi, gi = np.meshgrid(np.arange(q.shape[0]), np.arange(g.shape[0]), indexing="ij")
    return pair_scores(q[qi.ravel()], g[gi.ravel()]).reshape(q.shape[0], g.shape[0])


@pytest.mark.parametrize("seed", range(4))
def test_near_ties_rank_by_canonical_scores(seed, monkeypatch):
    """Unit-norm float32 embeddings (not exactly representable scores) with duplicated items
    and items one float32 step away from others: the engine's ranks equal a brute force on
    the canonical float64 scores, for every block size, worker count, locating path and
    error band, so the float32 summation order of the pass never shows in the result."""
    from raycompat.index.search import l2_normalize

    rng = np.random.default_rng(500 + seed)
    n, n_q, d = 240, 12, int(rng.choice([16, 48, 100]))
    gl = rng.integers(0, 4, n)
    ql = rng.integers(0, 5, n_q)
    base = rng.standard_normal((n, d)).astype(np.float32)
    dup = rng.choice(n, 60, replace=False)
    base[dup[:30]] = base[dup[30:]]  # exact duplicates: ties
    nudge = rng.choice(n, 40, replace=False)
    base[nudge[:20]] = base[nudge[20:]]
    base[nudge[:20], rng.integers(0, d, 20)] = np.nextafter(
        base[nudge[:20], rng.integers(0, d, 20)], np.float32(np.inf)
    )  # near-ties
    go, gn = l2_normalize(base), l2_normalize(base[:, ::-1].copy())
    qo = l2_normalize(rng.standard_normal((n_q, d)).astype(np.float32))
    qo[:4] = go[dup[:4]]  # queries equal to items
    qn = l2_normalize(qo[:, ::-1].copy())
    s_old, s_new = canonical_matrix(qo, go), canonical_matrix(qn, gn)
    order = rng.permutation(n)
    counts = backfill_counts(np.array([0.0, 0.3, 0.7, 1.0]), n)
    k = 10
    ranking0 = np.lexsort((np.broadcast_to(np.arange(n), s_old.shape), -s_old), axis=-1)
    ref = gl[ranking0[:, 0]] == ql
    want = brute_force_curve(s_old, s_new, [order[:c] for c in counts], ql, gl, k, ref)
    sides = {"o": Side(qo, go), "n": Side(qn, gn)}
    curves = [CurveSpec("c", "o", "n", counts, order), CurveSpec("ref", "o", None, np.array([0]))]
    monkeypatch.setattr(thresholds_mod, "TABLE_MAX", int(rng.choice([0, 32])))
    for band, bb, workers in ((1.0, 1 << 20, 1), (1.0, 4 * n_q * 64, 2), (1e6, 1 << 12, 3)):
        res = compute_ranks(sides, curves, ql, gl, band_scale=band, block_bytes=bb, workers=workers)
        ref_c = metrics_from_ranks(
            res.curve("ref").ranks, res.pairs_q, res.npos, 1, return_per_query=True
        )[1]["correct1"][0]
        assert np.array_equal(ref_c, ref)
        got = metrics_from_ranks(res.curve("c").ranks, res.pairs_q, res.npos, k, ref_c)
        for name, key in (
            ("mAP@k", f"mAP@{k}"),
            ("mAP", "mAP"),
            ("top1", "top1"),
            ("NFR@1", "NFR@1"),
        ):
            assert np.array_equal(got[key], want[name], equal_nan=True), (band, bb, name)
        assert (
            sum(s["band_entries"] for s in res.stats["sides"].values()) > 0
        )  # ties went through the band


def test_pair_scores_do_not_depend_on_the_other_rows():
    """The canonical score of a pair is bit-identical whatever rows come with it."""
    from raycompat.index.canonical import pair_scores

    rng = np.random.default_rng(0)
    a = rng.standard_normal((500, 77)).astype(np.float32)
    b = rng.standard_normal((500, 77)).astype(np.float32)
    full = pair_scores(a, b)
    perm = rng.permutation(500)
    assert np.array_equal(pair_scores(a[perm], b[perm]), full[perm])
    assert np.array_equal(
        np.concatenate([pair_scores(a[i : i + 7], b[i : i + 7]) for i in range(0, 500, 7)]), full
    )
    odd = np.zeros((500, 78), np.float32)[:, 1:]  # a non-contiguous view
    odd[:] = a
    assert np.array_equal(pair_scores(odd, b), full)
    with pytest.raises(ValueError, match="same shape"):
        pair_scores(a, b[:, :5])
