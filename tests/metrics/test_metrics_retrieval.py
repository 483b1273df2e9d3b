"""Tests for raycompat.metrics.retrieval: hand-worked examples and plain-loop brute force."""

import math

import numpy as np
import pytest

from raycompat.index.search import full_ranking, iter_full_ranking
from raycompat.metrics import (
    average_precision_at_k,
    average_precision_from_ranks,
    cmc_top_k,
    correct_at_k,
    evaluate_ranking,
    evaluate_retrieval,
    map_full,
    mean_average_precision_at_k,
    negative_flip_rate,
    negative_flips,
    num_relevant_from_labels,
    recall_at_k,
    relevance_from_labels,
    revisited_average_precision,
    revisited_easy_medium_hard,
    revisited_map,
)


# ================================================================= brute force (plain loops)
def bf_ranking(q, g):
    """Ranking by (-inner product, index); integer inputs -> exact float64 scores."""
    out = []
    for qi in q:
        s = [sum(float(a) * float(b) for a, b in zip(qi, gj, strict=False)) for gj in g]
        out.append(sorted(range(len(g)), key=lambda j: (-s[j], j)))
    return out


def bf_ap_at_k(ranked, qlabel, glabels, k):
    m = sum(1 for x in glabels if x == qlabel)
    if m == 0:
        return None
    hits, total = 0, 0.0
    for i, idx in enumerate(ranked[:k]):
        if idx >= 0 and glabels[idx] == qlabel:
            hits += 1
            total += hits / (i + 1)
    return total / min(m, k)


def bf_revisited_ap(ranked, positives, junk):
    """revisited protocol, written as the paper's code does it: shift ranks by junk."""
    positives, junk = set(positives) - set(junk), set(junk)
    npos = len(positives)
    if npos == 0:
        return None
    pos_ranks = []
    n_junk_before = 0
    for r, idx in enumerate(ranked):
        if idx in junk:
            n_junk_before += 1
        elif idx in positives:
            pos_ranks.append(r - n_junk_before)
    ap = 0.0
    for j, rank in enumerate(pos_ranks):
        prec0 = 1.0 if rank == 0 else j / rank
        prec1 = (j + 1) / (rank + 1)
        ap += (prec0 + prec1) / 2 / npos
    return ap


def bf_mean(values):
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else float("nan")


def bf_correct(ranked, qlabel, glabels, k):
    return any(idx >= 0 and glabels[idx] == qlabel for idx in ranked[:k])


# ================================================================= hand-worked
def test_ap_at_k_hand_worked():
    rel = np.array(
        [
            [1, 0, 1, 0, 0],  # m=3: P(1)=1, P(3)=2/3 -> (1 + 2/3) / min(3,5) = 5/9
            [1, 1, 0, 0, 0],  # m=10 > k: (1 + 1) / min(10,5) = 2/5
            [0, 0, 0, 0, 1],  # m=1: P(5)=1/5 -> 0.2
            [0, 0, 0, 0, 0],  # m=0: undefined -> nan, excluded
            [0, 0, 0, 0, 0],  # m=2, nothing found -> 0
        ],
        dtype=bool,
    )
    m = np.array([3, 10, 1, 0, 2])
    ap = average_precision_at_k(rel, m)
    np.testing.assert_allclose(ap[[0, 1, 2, 4]], [5 / 9, 2 / 5, 0.2, 0.0])
    assert np.isnan(ap[3])
    # mean over the 4 defined queries: (5/9 + 0.4 + 0.2 + 0) / 4
    assert mean_average_precision_at_k(rel, m) == pytest.approx((5 / 9 + 0.6) / 4)
    # explicit smaller k: k=2 -> row0: 1/min(3,2)=0.5 ; row2: 0
    ap2 = average_precision_at_k(rel, m, k=2)
    assert ap2[0] == pytest.approx(0.5) and ap2[2] == 0.0
    # k larger than the list (gallery of 5 items, k=100): normaliser min(m, 100)
    assert average_precision_at_k(rel[:1], m[:1], k=100)[0] == pytest.approx(5 / 9)
    assert math.isnan(mean_average_precision_at_k(rel[3:4], m[3:4]))


def test_ap_at_k_inconsistent_inputs():
    with pytest.raises(ValueError, match="num_relevant"):
        average_precision_at_k(np.array([[1, 1, 0]], bool), np.array([1]))
    with pytest.raises(ValueError, match="shape"):
        average_precision_at_k(np.array([[1, 1, 0]], bool), np.array([1, 2]))


def test_revisited_ap_hand_worked():
    # positives at ranks 0 and 2, npos=3 (one positive never retrieved):
    # j=0, rank=0: prec0=1, prec1=1/1 -> 1 ; j=1, rank=2: prec0=1/2, prec1=2/3 -> 7/12
    # AP = (1 + 7/12) / 3 = 19/36
    assert average_precision_from_ranks([0, 2], 3) == pytest.approx(19 / 36)
    assert math.isnan(average_precision_from_ranks([], 0))
    # with junk: ranking [5, 3, 7, 1, 2], positives {3, 2}, junk {7}
    # junk removed -> [5, 3, 1, 2]: positives at ranks 1 and 3
    # j=0, r=1: (0/1 + 1/2)/2 = 1/4 ; j=1, r=3: (1/3 + 2/4)/2 = 5/12 ; AP = (1/4 + 5/12)/2 = 1/3
    aps = revisited_average_precision(np.array([[5, 3, 7, 1, 2]]), [[3, 2]], [[7]])
    assert aps[0] == pytest.approx(1 / 3)
    m, aps = revisited_map(np.array([[5, 3, 7, 1, 2], [0, 1, 2, 3, 4]]), [[3, 2], []], [[7], []])
    assert m == pytest.approx(1 / 3) and np.isnan(aps[1])  # query without positives excluded


def test_revisited_easy_medium_hard_hand_worked():
    # ranking [0..5], easy={1}, hard={3}, junk={2}
    # Easy:   pos {1},   junk {2,3} -> list [0,1,4,5]: rank 1 -> (0 + 1/2)/2 = 1/4
    # Medium: pos {1,3}, junk {2}   -> list [0,1,3,4,5]: ranks 1,2 -> (1/4 + (1/2+2/3)/2) / 2 = 5/12
    # Hard:   pos {3},   junk {2,1} -> list [0,3,4,5]: rank 1 -> 1/4
    res = revisited_easy_medium_hard(np.array([[0, 1, 2, 3, 4, 5]]), [[1]], [[3]], [[2]])
    assert res == pytest.approx({"easy": 0.25, "medium": 5 / 12, "hard": 0.25})


def test_map_full_hand_worked_with_junk_mask():
    # gallery labels: [a, b, a, c, a]; query label a; junk = item 2 (e.g. the query itself)
    # ranking [2, 1, 0, 4, 3] -> remove junk item 2 -> [1, 0, 4, 3]; positives {0, 4} at ranks 1, 2
    # j=0, r=1: (0 + 1/2)/2 = 1/4 ; j=1, r=2: (1/2 + 2/3)/2 = 7/12 ; AP = (1/4 + 7/12)/2 = 5/12
    gl = np.array(["a", "b", "a", "c", "a"])
    ql = np.array(["a", "z"])  # second query has no positive -> excluded
    ranking = np.array([[2, 1, 0, 4, 3], [0, 1, 2, 3, 4]])
    junk = np.zeros((2, 5), bool)
    junk[0, 2] = True
    m, aps = map_full(ranking, ql, gl, junk, return_per_query=True)
    assert m == pytest.approx(5 / 12) and np.isnan(aps[1])
    # without junk: positives {2, 0, 4} at ranks 0, 2, 3:
    # 1 + (1/2 + 2/3)/2 + (2/3 + 3/4)/2 = 1 + 7/12 + 17/24 = 55/24 ; / 3 = 55/72
    assert map_full(ranking, ql, gl) == pytest.approx(55 / 72)
    # shared [N] junk mask works too
    assert map_full(ranking, ql, gl, junk[0]) == pytest.approx(5 / 12)


def test_cmc_and_nfr_hand_worked():
    rel = np.array([[0, 1, 0], [0, 0, 0], [1, 0, 0], [0, 0, 1]], bool)
    assert correct_at_k(rel, 1).tolist() == [False, False, True, False]
    assert correct_at_k(rel, 2).tolist() == [True, False, True, False]
    assert correct_at_k(rel, 10).tolist() == [True, False, True, True]  # k > list length
    # top1 = 1/4, top2 = 2/4, top3 = 3/4
    assert cmc_top_k(rel, ks=(1, 2, 3)) == {1: 0.25, 2: 0.5, 3: 0.75}
    # excluding query 1 (m=0): top1 = 1/3
    assert recall_at_k(rel, 1, num_relevant=np.array([1, 0, 1, 1])) == pytest.approx(1 / 3)
    # NFR: old-old correct {0,1,3}, now wrong {1,2,3}: flips {1,3} -> 2/3
    old = np.array([True, True, False, True])
    now = np.array([True, False, False, False])
    assert negative_flips(old, now).tolist() == [False, True, False, True]
    assert negative_flip_rate(old, now) == pytest.approx(2 / 3)
    assert negative_flip_rate(np.zeros(4, bool), now) == 0.0  # |Q+| = 0 -> 0 by definition
    with pytest.raises(ValueError):
        negative_flip_rate(old, now[:3])


def test_relevance_from_labels_padding_and_counts():
    gl = np.array([1, 2, 1])
    ql = np.array([1, 3])
    rel = relevance_from_labels(np.array([[2, 0, -1], [1, -1, -1]]), ql, gl)
    assert rel.tolist() == [[True, True, False], [False, False, False]]
    assert num_relevant_from_labels(ql, gl).tolist() == [2, 0]
    assert num_relevant_from_labels(ql, gl, np.array([True, False, False])).tolist() == [1, 0]
    with pytest.raises(ValueError, match="out of range"):
        relevance_from_labels(np.array([[3]]), ql[:1], gl)


# ================================================================= random vs brute force
def random_problem(seed, n_q=25, n_g=40, dim=3, n_labels=6):
    rng = np.random.default_rng(seed)
    q = rng.integers(-1, 2, size=(n_q, dim)).astype(np.float32)
    g = rng.integers(-1, 2, size=(n_g, dim)).astype(np.float32)
    ql = rng.integers(0, n_labels + 2, size=n_q)  # labels >= n_labels: no positives
    gl = rng.integers(0, n_labels, size=n_g)
    return rng, q, g, ql, gl


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("k", [1, 5, 40, 100])
def test_ap_at_k_vs_brute_force(seed, k):
    rng, q, g, ql, gl = random_problem(seed)
    ranking = np.array(bf_ranking(q, g))
    padded = np.full((len(q), max(k, len(g))), -1)
    padded[:, : len(g)] = ranking
    padded = padded[:, :k] if k <= len(g) else padded
    rel = relevance_from_labels(padded, ql, gl)
    m = num_relevant_from_labels(ql, gl)
    ap = average_precision_at_k(rel, m, k)
    for i in range(len(q)):
        ref = bf_ap_at_k(list(padded[i]), ql[i], list(gl), k)
        if ref is None:
            assert np.isnan(ap[i])
        else:
            assert ap[i] == pytest.approx(ref, abs=1e-12)
    ref_mean = bf_mean([bf_ap_at_k(list(padded[i]), ql[i], list(gl), k) for i in range(len(q))])
    assert mean_average_precision_at_k(rel, m, k) == pytest.approx(ref_mean, abs=1e-12)
    for kk in (1, 2, 7):
        c = correct_at_k(rel, kk)
        assert c.tolist() == [
            bf_correct(list(padded[i]), ql[i], list(gl), kk) for i in range(len(q))
        ]


@pytest.mark.parametrize("seed", range(4))
def test_revisited_map_vs_brute_force(seed):
    rng = np.random.default_rng(100 + seed)
    n_q, n_g = 12, 50
    ranking = np.array([rng.permutation(n_g) for _ in range(n_q)])
    easy, hard, junk = [], [], []
    for i in range(n_q):
        perm = rng.permutation(n_g)
        ne, nh, nj = rng.integers(0, 5, size=3)
        if i == 0:
            ne = nh = 0  # a query with no positives at all
        easy.append(perm[:ne])
        hard.append(perm[ne : ne + nh])
        junk.append(perm[ne + nh : ne + nh + nj])
    got = revisited_easy_medium_hard(ranking, easy, hard, junk)
    setups = {
        "easy": (easy, [np.concatenate([j, h]) for j, h in zip(junk, hard, strict=False)]),
        "medium": ([np.concatenate([e, h]) for e, h in zip(easy, hard, strict=False)], junk),
        "hard": (hard, [np.concatenate([j, e]) for j, e in zip(junk, easy, strict=False)]),
    }
    for name, (pos, jk) in setups.items():
        ref = bf_mean(
            [bf_revisited_ap(list(ranking[i]), list(pos[i]), list(jk[i])) for i in range(n_q)]
        )
        if math.isnan(ref):
            assert math.isnan(got[name])
        else:
            assert got[name] == pytest.approx(ref, abs=1e-12), name
    # partial ranking (top 20): positives beyond it count as not retrieved (npos is the
    # full positive count; the brute force computes npos from the sets, not the list)
    m_part, _ = revisited_map(ranking[:, :20], easy, junk)
    ref = bf_mean(
        [bf_revisited_ap(list(ranking[i, :20]), list(easy[i]), list(junk[i])) for i in range(n_q)]
    )
    assert m_part == pytest.approx(ref, abs=1e-12) if not math.isnan(ref) else math.isnan(m_part)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("junk_kind", [None, "shared", "per_query"])
def test_map_full_vs_brute_force(seed, junk_kind):
    rng, q, g, ql, gl = random_problem(seed, n_q=20, n_g=35)
    ranking = full_ranking(q + 0.0, g, normalize=False)
    assert ranking.tolist() == bf_ranking(q, g)  # ties by index, as the brute force
    if junk_kind is None:
        junk = None
    elif junk_kind == "shared":
        junk = rng.random(len(g)) < 0.2
    else:
        junk = rng.random((len(q), len(g))) < 0.2
    m, aps = map_full(ranking, ql, gl, junk, return_per_query=True)
    ref_aps = []
    for i in range(len(q)):
        if junk is None:
            jset = []
        elif junk.ndim == 1:
            jset = list(np.flatnonzero(junk))
        else:
            jset = list(np.flatnonzero(junk[i]))
        pos = [j for j in range(len(g)) if gl[j] == ql[i]]
        ref_aps.append(bf_revisited_ap(list(ranking[i]), pos, jset))
    for a, r in zip(aps, ref_aps, strict=False):
        if r is None:
            assert np.isnan(a)
        else:
            assert a == pytest.approx(r, abs=1e-12)
    ref = bf_mean(ref_aps)
    assert m == pytest.approx(ref, abs=1e-12)
    # chunked input (as yielded by iter_full_ranking) gives the same value
    m_chunks = map_full(iter_full_ranking(q, g, normalize=False, chunk_size=3), ql, gl, junk)
    assert m_chunks == pytest.approx(m, abs=1e-15)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("k", [10, 100])  # k=100 > gallery of 30
def test_evaluate_retrieval_vs_brute_force(seed, k):
    rng, q, g, ql, gl = random_problem(seed, n_q=18, n_g=30)
    res, per = evaluate_retrieval(
        q, g, ql, gl, k=k, ks=(1, 5, 10), normalize=False, return_per_query=True
    )
    assert all(isinstance(v, float) for v in res.values())
    rankings = bf_ranking(q, g)
    valid = [i for i in range(len(q)) if any(x == ql[i] for x in gl)]
    ref_apk = bf_mean([bf_ap_at_k(rankings[i], ql[i], list(gl), k) for i in range(len(q))])
    ref_map = bf_mean(
        [
            bf_revisited_ap(rankings[i], [j for j in range(len(g)) if gl[j] == ql[i]], [])
            for i in range(len(q))
        ]
    )
    assert res[f"mAP@{k}"] == pytest.approx(ref_apk, abs=1e-12)
    assert res["mAP"] == pytest.approx(ref_map, abs=1e-12)
    for kk in (1, 5, 10):
        ref = sum(bf_correct(rankings[i], ql[i], list(gl), kk) for i in valid) / len(valid)
        assert res[f"top{kk}"] == pytest.approx(ref, abs=1e-12)
        assert per[f"correct@{kk}"].tolist() == [
            bf_correct(rankings[i], ql[i], list(gl), kk) for i in range(len(q))
        ]
    assert res["num_queries"] == len(q) and res["num_valid_queries"] == len(valid)


def test_evaluate_retrieval_cosine_smoke_and_errors():
    rng = np.random.default_rng(0)
    g = rng.normal(size=(50, 8)).astype(np.float32)
    gl = np.arange(50) % 5
    q = g[:10] + 0.01 * rng.normal(size=(10, 8)).astype(np.float32)
    res = evaluate_retrieval(q, g, gl[:10], gl, k=20)
    assert res["top1"] == 1.0  # every query's nearest item is its own source (same label)
    assert set(res) == {
        "mAP@20",
        "mAP",
        "top1",
        "top5",
        "top10",
        "num_queries",
        "num_valid_queries",
    }
    res2 = evaluate_retrieval(q, g, gl[:10], gl, k=20, full_map=False)
    assert "mAP" not in res2 and res2["mAP@20"] == res["mAP@20"]
    with pytest.raises(ValueError, match="query labels"):
        evaluate_retrieval(q, g, gl[:9], gl)
    with pytest.raises(ValueError, match="k must be"):
        evaluate_retrieval(q, g, gl[:10], gl, k=0)
    with pytest.raises(ValueError, match="columns"):
        evaluate_ranking(np.zeros((10, 3), np.int64), gl[:10], gl, k=5)
