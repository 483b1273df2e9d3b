"""One report, one ranking: static evaluations rank by the canonical score (float64 over the
float32 vectors, ties by gallery index), like the backfill simulator, so that a float32 tie
cannot make the same metric two numbers."""

from __future__ import annotations

import numpy as np
import pytest

from raycompat.evaluation import evaluate_pair, pair_samples
from raycompat.index.canonical import pair_scores
from raycompat.index.canonical_ranking import canonical_ranking
from raycompat.index.search import exact_search, l2_normalize


def _tied_in_float32():
    """A query and a gallery whose first two items have the same float32 score and different
    canonical scores: item 0 (another class) scores 0.6, item 1 (the query's class) 0.6 +
    0.8 * 2^-30, less than half a float32 ulp above it, whatever the summation order."""
    query = np.array([[1.0, 2.0**-30, 0.0]], np.float32)
    gallery = np.array(
        [[0.6, 0.0, 0.8], [0.6, 0.8, 0.0], [0.0, 0.6, 0.8], [0.0, 0.8, 0.6], [-1.0, 0.0, 0.0]],
        np.float32,
    )
    return query, gallery, np.array([1]), np.array([0, 1, 2, 2, 3])


def test_float32_tie_is_ranked_by_the_canonical_score():
    query, gallery, q_labels, g_labels = _tied_in_float32()
    q, g = l2_normalize(query), l2_normalize(gallery)
    scores32, ids32 = exact_search(q, g, 2, normalize=False)
    assert scores32[0, 0] == scores32[0, 1] and ids32[0].tolist() == [0, 1]  # faiss: a tie
    canon = pair_scores(np.repeat(q, 2, axis=0), g[:2])
    assert canon[1] > canon[0]
    assert canonical_ranking(q, g)[0, :2].tolist() == [1, 0]
    metrics = evaluate_pair(query, gallery, q_labels, g_labels)
    assert metrics["mAP@100"] == 1.0 and metrics["top1"] == 1.0 and metrics["mAP"] == 1.0
    assert list(metrics) == [
        "mAP@100",
        "top1",
        "top5",
        "top10",
        "mAP",
        "num_queries",
        "num_valid_queries",
    ]
    _, samples = pair_samples(query, gallery, q_labels, g_labels)
    assert samples["mAP@100"].value().tolist() == [1.0]


def test_static_evaluation_equals_the_simulator_on_ties():
    """Old-old mAP@100 of the static evaluation is the simulator's old-old reference, value
    for value, on a gallery full of exact float32 ties."""
    from raycompat.embeddings.gallery import GalleryEmbeddings
    from raycompat.simulator.memory_engine import simulate_backfill

    query, gallery, q_labels, g_labels = _tied_in_float32()
    rng = np.random.default_rng(0)
    queries = np.concatenate([query, rng.normal(size=(6, 3)).astype(np.float32)])
    ql = np.concatenate([q_labels, rng.integers(0, 4, 6)])
    data = GalleryEmbeddings(
        gallery_labels=g_labels,
        gallery_old=gallery,
        gallery_new=gallery,
        query_labels=ql,
        query_old=queries,
        query_new=queries,
        compatible_dim=3,
    )
    result = simulate_backfill(data, ("random",), ("compatible",), k=100)
    static = evaluate_pair(queries, gallery, ql, g_labels)
    for metric in ("mAP@100", "mAP", "top1"):
        assert static[metric] == pytest.approx(result.references["old-old"][metric], abs=1e-12)


@pytest.mark.parametrize("spread", [0.3, 1e-7])
def test_canonical_ranking_is_the_sorted_canonical_scores(spread):
    """Blockwise, with exact duplicates and a nearly collapsed gallery: the ranking is the
    lexicographic sort by (canonical score desc, index) of every pair's canonical score."""
    rng = np.random.default_rng(1)
    centres = rng.normal(size=(4, 16))
    g = centres[rng.integers(0, 4, 200)] + spread * rng.normal(size=(200, 16))
    g[::9] = g[0]
    q, g = l2_normalize(rng.normal(size=(30, 16))), l2_normalize(g)
    rows, cols = np.meshgrid(np.arange(30), np.arange(200), indexing="ij")
    canon = pair_scores(q[rows.ravel()], g[cols.ravel()]).reshape(30, 200)
    want = np.lexsort((cols, -canon), axis=-1)
    assert np.array_equal(canonical_ranking(q, g, max_bytes=24 * 200 * 7), want)


def test_canonical_ranking_rejects_bad_input():
    with pytest.raises(ValueError, match="same dim"):
        canonical_ranking(np.ones((2, 3)), np.ones((4, 2)))
    with pytest.raises(ValueError, match="gallery is empty"):
        canonical_ranking(np.ones((2, 3)), np.ones((0, 3)))
    with pytest.raises(ValueError, match="NaN or inf"):
        canonical_ranking(np.array([[np.nan, 1.0]]), np.ones((2, 2)))
