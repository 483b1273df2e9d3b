"""The canary's numbers without Ray: AP@k / NFR@1 against the reference, the guards judged by
their intervals, the exact mixed ranking, the canary file, and the offline curve."""

import numpy as np
import pytest
from serving_helpers import labelled_embeddings

from raycompat.embeddings.gallery import BackfillInputError
from raycompat.index.canonical import pair_scores
from raycompat.index.search import l2_normalize
from raycompat.upgrade.canary import (
    CanaryOptions,
    CanaryReference,
    CanarySet,
    canary_point,
    canary_positions,
    canary_terms,
    guard_trip,
    mixed_canonical_top_k,
    offline_canary_curve,
)


def _canary(relevant, groups=None):
    n = len(relevant)
    return CanarySet(np.ones((n, 4), np.float32), relevant, groups or [str(q) for q in range(n)])


def test_canary_terms_and_point_by_hand():
    canary = _canary([[1, 2], [3], [4, 5, 6], [7]])
    ids = np.array([[1, 9, 2], [9, 3, -1], [8, 9, 10], [7, 1, 2]])
    ap, correct = canary_terms(ids, canary, 3)
    # query 0: hits at ranks 1 and 3: (1 + 2/3) / 2; query 1: 1/2; query 2: 0; query 3: 1
    assert np.allclose(ap, [(1 + 2 / 3) / 2, 0.5, 0.0, 1.0])
    assert correct.tolist() == [True, False, False, True]
    ref = CanaryReference("old-old", np.array([1.0, 1.0, 0.5, 1.0]), np.array([1, 1, 1, 0], bool))
    opts = CanaryOptions(canary_k=3, canary_resamples=200)
    p = canary_point(40, ids, canary, ref, opts)
    assert p["position"] == 40 and p["reference"] == "old-old"
    assert p["map"] == pytest.approx(ap.mean()) and p["reference_map"] == pytest.approx(0.875)
    assert p["delta_map"] == pytest.approx(ap.mean() - 0.875)
    assert p["nfr"] == pytest.approx(2 / 3) and p["top1"] == 0.5  # queries 1, 2 flipped of 0-2
    assert p["map_low"] <= p["map"] <= p["map_high"] and p["nfr_low"] <= p["nfr"]
    assert canary_point(40, ids, canary, ref, opts) == p  # seeded: the same intervals


def test_guards_are_judged_by_the_interval():
    """One bad query of 40 moves the point past the margin, not the interval; 30 bad ones trip
    both guards."""
    n = 40
    canary = _canary([[q] for q in range(n)])
    ref = CanaryReference("old-old", np.ones(n), np.ones(n, bool))
    opts = CanaryOptions(canary_k=1, canary_map_margin=0.02, canary_max_nfr=0.1)
    one_bad = np.arange(n)[:, None].copy()
    one_bad[0, 0] = 99
    p = canary_point(0, one_bad, canary, ref, opts)
    assert p["delta_map"] == pytest.approx(-1 / n) and -1 / n < -0.02 and p["guard"] is None
    many_bad = np.where(np.arange(n)[:, None] < 30, 99, np.arange(n)[:, None])
    p = canary_point(0, many_bad, canary, ref, opts)
    assert p["guard"] == "map" and "by more than the margin 0.02" in p["reason"]
    assert guard_trip({**p, "delta_high": None}, opts)[0] == "nfr"
    assert guard_trip({**p, "delta_high": None, "nfr_low": None}, opts) is None


def test_mixed_canonical_top_k_is_the_exact_ranking_ties_by_id():
    rng = np.random.default_rng(0)
    g_old = l2_normalize(rng.standard_normal((300, 6)))
    g_new = l2_normalize(rng.standard_normal((300, 10)))
    g_new[10:20] = g_new[5]  # exact ties across ids
    q_old = l2_normalize(rng.standard_normal((12, 6)))
    q_new = l2_normalize(rng.standard_normal((12, 10)))
    q_new[0] = g_new[5]
    ids = rng.permutation(1000)[:300]
    is_new = rng.random(300) < 0.4
    is_new[5:20] = True
    parts = [(q_old, g_old, np.flatnonzero(~is_new)), (q_new, g_new, np.flatnonzero(is_new))]
    top = mixed_canonical_top_k(parts, ids, 15)
    for q in range(12):
        s_old = pair_scores(np.repeat(q_old[q : q + 1], 300, 0), g_old)
        s_new = pair_scores(np.repeat(q_new[q : q + 1], 300, 0), g_new)
        score = np.where(is_new, s_new, s_old)
        assert top[q].tolist() == ids[np.lexsort((ids, -score))[:15]].tolist()
    assert (top[0, :11] == np.sort(ids[[5, *range(10, 20)]])).all()  # the tie, by id
    assert mixed_canonical_top_k(parts, ids, 400)[:, 300:].max() == -1


def test_the_canary_file_round_trips_and_bad_files_are_named(tmp_path):
    canary = CanarySet(np.eye(3, 4, dtype=np.float32), [[1], [2, 3], [3]], ["a", "b", "b"])
    path = tmp_path / "canary.parquet"
    path.write_bytes(canary.to_bytes())
    back = CanarySet.read(str(path))
    assert np.array_equal(back.vectors, canary.vectors) and back.old_vectors is None
    assert [r.tolist() for r in back.relevant] == [[1], [2, 3], [3]]
    assert back.groups.tolist() == ["a", "b", "b"]
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"vector": [[1.0, 0.0]], "group": ["a"]}), str(path))
    with pytest.raises(BackfillInputError, match=f"canary {path}: column 'relevant' is missing"):
        CanarySet.read(str(path))
    with pytest.raises(BackfillInputError, match="canary query 1 has no relevant item"):
        CanarySet(np.eye(2, dtype=np.float32), [[1], []], ["a", "b"])


def test_offline_curve_walks_the_order_and_names_unknown_relevant_ids():
    data = labelled_embeddings(n_items=120, n_queries=12, classes=6)
    rel = [data.gallery_ids[data.gallery_labels == c] for c in data.query_labels]
    canary = CanarySet(data.query_new, rel, data.query_labels, data.query_old)
    order = np.random.default_rng(1).permutation(120)
    opts = CanaryOptions(canary_every=50, canary_k=5, canary_resamples=100)
    curve = offline_canary_curve(data, canary, order, "compatible", opts)
    positions = [p["position"] for p in curve["points"]]
    assert positions == canary_positions(120, 50) == [0, 50, 100, 120]
    assert curve["reference"] == "old-old"
    top = mixed_canonical_top_k(
        [(l2_normalize(data.query_new), l2_normalize(data.gallery_new), np.arange(120))],
        data.gallery_ids,
        5,
    )
    assert curve["points"][-1]["map"] == pytest.approx(np.mean(canary_terms(top, canary, 5)[0]))
    no_old = CanarySet(data.query_new, rel, data.query_labels)
    first = offline_canary_curve(data, no_old, order, "compatible", opts)["points"][0]
    assert first["delta_map"] == 0 and first["nfr"] == 0 and first["reference"] == "first point"
    bad = CanarySet(data.query_new[:1], [[123456]], ["x"])
    with pytest.raises(BackfillInputError, match=r"relevant item id\(s\) \[123456\]"):
        offline_canary_curve(data, bad, order, "compatible", opts)
