"""Tests for raycompat.index.search: exact search with a deterministic tie order."""

import math

import numpy as np
import pytest

from raycompat.index.search import exact_search, full_ranking, iter_full_ranking, l2_normalize


# ----------------------------------------------------------------- brute force (plain python)
def brute_rank(q_row, gallery, normalize):
    """All gallery indices by (-score, index); scores in float64 with plain loops."""

    def norm(v):
        n = math.sqrt(sum(float(x) * float(x) for x in v))
        return [float(x) / n for x in v] if normalize else [float(x) for x in v]

    qv = norm(q_row)
    scores = []
    for _j, g in enumerate(gallery):
        gv = norm(g)
        scores.append(sum(a * b for a, b in zip(qv, gv, strict=False)))
    order = sorted(range(len(gallery)), key=lambda j: (-scores[j], j))
    return order, [scores[j] for j in order]


def int_data(rng, n_q, n_g, dim, lo=-1, hi=2):
    """Small integer vectors: float32 inner products are exact and ties abound."""
    q = rng.integers(lo, hi, size=(n_q, dim)).astype(np.float32)
    g = rng.integers(lo, hi, size=(n_g, dim)).astype(np.float32)
    return q, g


# ----------------------------------------------------------------- hand-worked
def test_hand_worked_inner_product_ties_by_index():
    # gallery rows and their inner product with q = (1, 1):
    #   g0 = (1, 0) -> 1 ; g1 = (0, 2) -> 2 ; g2 = (2, 0) -> 2 ; g3 = (1, 0) -> 1 ;
    #   g4 = (-1, 0) -> -1
    # ranking by (-score, index): g1 (2), g2 (2), g0 (1), g3 (1), g4 (-1)
    g = np.array([[1, 0], [0, 2], [2, 0], [1, 0], [-1, 0]], dtype=np.float32)
    q = np.array([[1, 1]], dtype=np.float32)
    s, i = exact_search(q, g, 4, normalize=False)
    assert i.tolist() == [[1, 2, 0, 3]]
    assert s.tolist() == [[2.0, 2.0, 1.0, 1.0]]
    # tie straddling the k boundary: k=3 must pick g0 (index 0) before g3
    s, i = exact_search(q, g, 3, normalize=False, extra=1)
    assert i.tolist() == [[1, 2, 0]]


def test_hand_worked_cosine():
    # cosine with q = (1, 0): g0 = (0, 3) -> 0 ; g1 = (3, 4) -> 3/5 = 0.6 ; g2 = (2, 0) -> 1 ;
    # g3 = (6, 8) -> 0.6 (same direction as g1: exact tie, but float rounding after
    # normalisation may or may not keep it; only the order g2 first, g0 last is asserted)
    g = np.array([[0, 3], [3, 4], [2, 0], [6, 8]], dtype=np.float32)
    s, i = exact_search(np.array([[1.0, 0.0]]), g, 4)
    assert i[0, 0] == 2 and i[0, 3] == 0
    np.testing.assert_allclose(s[0], [1.0, 0.6, 0.6, 0.0], atol=1e-6)


def test_k_larger_than_gallery_pads():
    g = np.array([[1, 0], [0, 1]], dtype=np.float32)
    s, i = exact_search(np.array([[0.0, 1.0]]), g, 5)
    assert i.tolist() == [[1, 0, -1, -1, -1]]
    assert s[0, :2].tolist() == [1.0, 0.0]
    assert np.isneginf(s[0, 2:]).all()
    assert s.dtype == np.float32 and i.dtype == np.int64


def test_empty_queries():
    s, i = exact_search(np.zeros((0, 3), np.float32), np.eye(3, dtype=np.float32), 2)
    assert s.shape == (0, 2) and i.shape == (0, 2)


# ----------------------------------------------------------------- vs brute force, many ties
@pytest.mark.parametrize("n_q", [7, 45])  # faiss uses a SIMD path below 20 queries, BLAS above
@pytest.mark.parametrize("k", [1, 5, 17, 60, 200])
def test_exact_search_matches_brute_force_integer_ties(n_q, k):
    rng = np.random.default_rng(1000 * n_q + k)
    q, g = int_data(rng, n_q, 120, 3)  # values in {-1,0,1}^3: only 7 distinct scores
    s, i = exact_search(q, g, k, normalize=False, extra=2)  # tiny extra: forces re-search
    for r in range(n_q):
        order, scores = brute_rank(q[r], g, normalize=False)
        kk = min(k, len(g))
        assert i[r, :kk].tolist() == order[:kk]
        assert s[r, :kk].tolist() == scores[:kk]
        assert (i[r, kk:] == -1).all() and np.isneginf(s[r, kk:]).all()


@pytest.mark.parametrize("k", [1, 3, 10, 50])
def test_exact_search_cosine_duplicate_rows_match_brute_force(k):
    # Gallery = 12 random Gaussian directions, each repeated at random positions, so
    # ties are bit-exact duplicates; distinct directions are far apart in cosine.
    rng = np.random.default_rng(k)
    base = rng.normal(size=(12, 8)).astype(np.float32)
    g = base[rng.integers(0, 12, size=90)]
    q = rng.normal(size=(25, 8)).astype(np.float32)
    s, i = exact_search(q, g, k)
    for r in range(len(q)):
        order, scores = brute_rank(q[r], g, normalize=True)
        distinct = sorted(set(round(x, 9) for x in scores))
        assert min(np.diff(distinct)) > 1e-5  # no near-ties: float32 order == exact order
        assert i[r].tolist() == order[:k]
        np.testing.assert_allclose(s[r], scores[:k], atol=1e-6)


def test_exact_search_ties_numpy_stable_argsort():
    # the brief's reference: numpy stable argsort on -scores (exact for integers)
    rng = np.random.default_rng(7)
    q, g = int_data(rng, 60, 500, 4, lo=-2, hi=3)
    scores = q.astype(np.float64) @ g.T.astype(np.float64)
    ref = np.argsort(-scores, axis=1, kind="stable")
    for k in (1, 10, 100, 499, 500, 600):
        _, i = exact_search(q, g, k, normalize=False)
        kk = min(k, 500)
        np.testing.assert_array_equal(i[:, :kk], ref[:, :kk])


def test_exact_search_query_chunking_same_result():
    rng = np.random.default_rng(3)
    q, g = int_data(rng, 50, 80, 3)
    a = exact_search(q, g, 9, normalize=False)
    b = exact_search(q, g, 9, normalize=False, max_bytes=1)  # one query per chunk
    np.testing.assert_array_equal(a[1], b[1])
    np.testing.assert_array_equal(a[0], b[0])


# ----------------------------------------------------------------- full ranking
@pytest.mark.parametrize("chunk", [None, 1, 4])
def test_full_ranking_matches_brute_force(chunk):
    rng = np.random.default_rng(11)
    q, g = int_data(rng, 9, 40, 3)
    r, s = full_ranking(q, g, normalize=False, chunk_size=chunk, return_scores=True)
    assert r.shape == (9, 40) and r.dtype == np.int64
    for row in range(len(q)):
        order, scores = brute_rank(q[row], g, normalize=False)
        assert r[row].tolist() == order
        assert s[row].tolist() == scores


def test_iter_full_ranking_chunks_cover_all():
    rng = np.random.default_rng(12)
    q, g = int_data(rng, 10, 30, 3)
    full = full_ranking(q, g, normalize=False)
    parts = list(iter_full_ranking(q, g, normalize=False, chunk_size=3))
    assert [p[0] for p in parts] == [0, 3, 6, 9]
    np.testing.assert_array_equal(np.concatenate([p[1] for p in parts]), full)


def test_full_ranking_agrees_with_exact_search_on_ties():
    rng = np.random.default_rng(5)
    q, g = int_data(rng, 30, 70, 3)
    full = full_ranking(q, g, normalize=False)
    _, top = exact_search(q, g, 25, normalize=False)
    np.testing.assert_array_equal(full[:, :25], top)


# ----------------------------------------------------------------- normalisation
def test_l2_normalize():
    x = np.array([[3, 4], [0, 2]], dtype=np.float64)
    y = l2_normalize(x)
    assert y.dtype == np.float32
    np.testing.assert_allclose(y, [[0.6, 0.8], [0.0, 1.0]], rtol=1e-7)
    np.testing.assert_allclose(l2_normalize(np.array([0.0, 5.0])), [0.0, 1.0])
    # identical rows stay bit-identical
    z = l2_normalize(np.array([[1.0, 2.0, 3.0]] * 3))
    assert (z == z[0]).all()
    # huge values do not overflow the norm
    np.testing.assert_allclose(
        l2_normalize(np.array([[3e30, 4e30]], np.float32)), [[0.6, 0.8]], rtol=1e-6
    )


def test_l2_normalize_zero_rows():
    x = np.array([[1, 0], [0, 0], [0, 0]], dtype=np.float32)
    with pytest.raises(ValueError, match="2 row"):
        l2_normalize(x)
    y = l2_normalize(x, zero="keep")
    assert y.tolist() == [[1, 0], [0, 0], [0, 0]]
    with pytest.raises(ValueError):
        l2_normalize(x, zero="bogus")


# ----------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "q, g, k, match",
    [
        (np.ones((2, 3)), np.ones((4, 5)), 2, "dimension mismatch"),
        (np.ones((2, 3)), np.ones((0, 3)), 2, "gallery is empty"),
        (np.array([[1.0, np.nan, 0.0]]), np.ones((4, 3)), 2, "NaN"),
        (np.ones((2, 3)), np.array([[1.0, np.inf, 0.0]]), 1, "NaN or inf"),
        (np.ones((2, 3)), np.ones((4, 3)), 0, "k must be a positive"),
        (np.ones((2, 3)), np.ones((4, 3)), -3, "k must be a positive"),
        (np.ones((2, 3)), np.ones((4, 3)), 2.5, "k must be a positive"),
        (np.ones(3), np.ones((4, 3)), 2, "2-D"),
        (np.zeros((1, 3)), np.ones((4, 3)), 2, "zero norm"),
    ],
)
def test_exact_search_validation(q, g, k, match):
    with pytest.raises(ValueError, match=match):
        exact_search(q, g, k)


def test_full_ranking_validation():
    with pytest.raises(ValueError, match="dimension mismatch"):
        full_ranking(np.ones((2, 3)), np.ones((4, 2)))
    with pytest.raises(ValueError, match="gallery is empty"):
        full_ranking(np.ones((2, 3)), np.ones((0, 3)))
    with pytest.raises(ValueError, match="chunk_size"):
        full_ranking(np.ones((2, 3)), np.ones((4, 3)), chunk_size=0)


def test_overflow_without_normalisation_is_an_error():
    big = np.full((2, 4), 3e38, dtype=np.float32)
    with pytest.raises(ValueError, match="overflow"):
        exact_search(big, big, 1, normalize=False)
