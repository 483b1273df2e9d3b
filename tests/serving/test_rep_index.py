"""One representation's index without Ray (docs/indexes.md): every kind through a simulated
backfill, exact results for the exact kinds, training / retraining / background rebuilds,
HNSW tombstones, the torch flat backend, device fallbacks, options, the clustered synthetic
gallery and the recall metric."""

import logging
import threading

import numpy as np
import pytest

from raycompat.config import ConfigError
from raycompat.index.ann import IndexOptions, index_options, resolve_device
from raycompat.index.canonical import pair_scores
from raycompat.index.search import l2_normalize
from raycompat.metrics.recall import recall_at_k
from raycompat.serving import rep_index
from raycompat.serving.gallery_source import SyntheticGallery, open_gallery
from raycompat.serving.rep_index import RepIndex, TorchFlat

KINDS = ("flat", "ivf_flat", "ivf_pq", "hnsw")
# Measured on the seeded clustered gallery of the backfill test: the lowest recall@10 over its
# 22 searches is 0.96 for ivf_flat and ivf_pq (nprobe 8 of up to 38 lists) and 0.99 for hnsw
# (0.88 for both IVF kinds at nprobe 4); candidates at random would score ~0.01.  0.9 leaves
# room for other faiss builds and still fails an index that loses neighbours.
MIN_RECALL = 0.9


def _options(kind, **kw):
    base = dict(kind=kind, train_min=300, nprobe=8, ef_construction=40, ef_search=32, device="cpu")
    return index_options({**base, **kw})


def _check(rep, q, k, members, full=True):
    """Results are live members, never twice, scored canonically and ordered by (score desc,
    id asc); ``full``: as many as there can be."""
    S, I = rep.search(q, k)
    for r in range(q.shape[0]):
        valid = I[r] >= 0
        got = I[r][valid]
        assert valid[: got.size].all() and not valid[got.size :].any()
        assert set(got.tolist()) <= members and np.unique(got).size == got.size
        if got.size:
            c = pair_scores(np.repeat(q[r : r + 1], got.size, axis=0), rep.vectors_of(got))
            assert np.array_equal(S[r][valid], c)
            assert (np.lexsort((got, -c)) == np.arange(got.size)).all()
        assert got.size == min(k, len(members)) or not full
    return I


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_through_a_backfill(kind):
    """Items leave the 8-dim old representation and enter the 12-dim new one in batches (as a
    shard moves them), some are upserted again; at every step both indexes answer only their
    own items, canonically, with high recall against their exact search."""
    gal = SyntheticGallery(1500, 8, 12, seed=1, clusters=25)
    ids = np.arange(1500)
    old = RepIndex(8, _options(kind), "test/old", background=False)
    new = RepIndex(12, _options(kind), "test/new", background=False)
    old.add(ids, gal.vectors_of("old", ids))
    order = np.random.default_rng(0).permutation(ids)
    queries = {old: gal.query_vectors(40, 1, "old"), new: gal.query_vectors(40, 1, "new")}
    recalls = []
    for step in range(0, 1501, 150):
        batch = order[max(step - 150, 0) : step]
        old.remove(batch)
        new.add(batch, gal.vectors_of("new", batch))
        again = order[: step // 10]  # upserted again with other vectors
        new.remove(again)
        new.add(again, gal.vectors_of("adapted", again))
        members = {old: set(order[step:].tolist()), new: set(order[:step].tolist())}
        for rep, q in queries.items():
            served = _check(rep, q, 10, members[rep], full=kind == "flat")
            recalls.append(recall_at_k(served, rep.search(q, 10, exact=True)[1], 10)[0])
    assert min(recalls) == 1.0 if kind == "flat" else min(recalls) >= MIN_RECALL
    if kind in ("ivf_flat", "ivf_pq"):  # trained at 1500, 750, 375; dropped below 150
        assert old.trainings == 3 and not old.describe()["trained"]
        assert new.trainings == 3 and new.describe()["last_trained_items"] == 1200
    if kind == "hnsw":  # built once each; tombstones dropped by rebuilds
        assert new.describe()["tombstones"] <= 0.25 * len(new)


@pytest.mark.parametrize(
    "setup",
    ["flat", "numpy (untrained ivf_flat)", "faiss IDMap,Flat", "torch on cpu", "hnsw exact=True"],
)
def test_search_ranks_by_canonical_scores_with_near_ties(setup, monkeypatch):
    """Duplicated items and items one float32 step apart, some removed again: the top-k of
    an exact index (faiss Flat, numpy before an index is trained, torch, or any kind with
    ``exact=True``) equals the brute-force top-k of the canonical float64 scores, ties by
    ascending id, scores bit-identical."""
    monkeypatch.setattr(rep_index, "_SCORE_ELEMS", 30 * 700)  # several blocks per search
    rng = np.random.default_rng(len(setup))
    n, d = 3000, 24
    base = rng.standard_normal((n, d)).astype(np.float32)
    base[1000:1400] = base[:400]  # exact ties
    col = rng.integers(0, d, 300)
    base[1400:1700] = base[400:700]
    base[1400 + np.arange(300), col] = np.nextafter(
        base[1400 + np.arange(300), col], np.float32(np.inf)
    )
    vecs = l2_normalize(base)
    ids = rng.permutation(10 * n)[:n].astype(np.int64)  # ids not in vector order
    options = {
        "flat": _options("flat"),
        "numpy (untrained ivf_flat)": _options("ivf_flat", train_min=10**9),
        "faiss IDMap,Flat": _options("faiss", factory="IDMap,Flat"),
        "torch on cpu": _options("flat"),
        "hnsw exact=True": _options("hnsw", train_min=500),
    }[setup]
    rep = RepIndex(d, options, background=False)
    if setup == "torch on cpu":
        torch = pytest.importorskip("torch")
        rep.index = TorchFlat(d, torch.device("cpu"))
    rep.add(ids, vecs)
    gone = rng.choice(n, 200, replace=False)
    rep.remove(ids[gone])
    keep = np.setdiff1d(np.arange(n), gone)
    q = np.concatenate([vecs[:20], l2_normalize(rng.standard_normal((10, d)).astype(np.float32))])
    for k in (1, 10, 150):
        S, I = rep.search(q, k, exact=setup.endswith("exact=True"))
        for r in range(q.shape[0]):
            c = pair_scores(np.repeat(q[r : r + 1], keep.size, axis=0), vecs[keep])
            order = np.lexsort((ids[keep], -c))[:k]
            assert I[r].tolist() == ids[keep][order].tolist(), (k, r)
            assert np.array_equal(S[r], c[order]), (k, r)


def test_torch_flat_on_cpu_equals_faiss_flat(monkeypatch):
    """The torch backend (blockwise product + top-k, updated on add and remove) answers
    exactly what faiss Flat answers, padding included."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(rep_index, "_SCORE_ELEMS", 8 * 256)
    gal = SyntheticGallery(2000, 8, 12, seed=4, clusters=10)
    faiss_rep = RepIndex(12, _options("flat"))
    torch_rep = RepIndex(12, _options("flat"))
    torch_rep.index = TorchFlat(12, torch.device("cpu"))
    q = gal.query_vectors(8, 2, "new")
    for lo in range(0, 2000, 500):
        batch = np.arange(lo, lo + 500)
        for rep in (faiss_rep, torch_rep):
            rep.add(batch, gal.vectors_of("new", batch))
            rep.remove(batch[::3])
        for k in (5, 50, 2000):
            a, b = faiss_rep.search(q, k), torch_rep.search(q, k)
            assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])


def test_training_at_train_min_and_retraining_by_factor():
    """Exact numpy search until train_min items; trained then; retrained (nlist re-chosen)
    whenever the count doubled or halved since the last training; dropped back to exact
    search below train_min / retrain_factor, and trained again from train_min."""
    gal = SyntheticGallery(1000, 8, 12, seed=2, clusters=10)
    vec = lambda ids: gal.vectors_of("new", ids)  # noqa: E731
    rep = RepIndex(12, _options("ivf_flat", train_min=200, retrain_factor=2.0), background=False)
    state = lambda: (rep.trainings, rep.describe()["nlist"], rep.describe()["trained"])  # noqa: E731
    rep.add(np.arange(199), vec(np.arange(199)))
    assert state() == (0, None, False)
    rep.add([199], vec([199]))
    assert state() == (1, 5, True)  # nlist = min(round(4 sqrt(200)), 200 // 39) = 5
    rep.add(np.arange(200, 399), vec(np.arange(200, 399)))
    assert state() == (1, 5, True)
    rep.add([399], vec([399]))
    assert state() == (2, 10, True) and rep.last_trained_items == 400
    rep.remove(np.arange(199))
    assert state() == (2, 10, True)  # 201 left: not halved yet
    rep.remove([199])
    assert state() == (3, 5, True) and rep.last_trained_items == 200
    rep.remove(np.arange(200, 300))
    assert state() == (3, 5, True)  # 100 left: kept (no training below train_min)
    rep.remove([300])
    assert state() == (3, None, False)  # 99 < 200 / 2: exact search
    rep.add(np.arange(101), vec(np.arange(101)))
    assert state() == (4, 5, True)


def test_background_rebuild_keeps_the_changes_made_meanwhile(monkeypatch):
    """While a background build is held inside faiss, searches answer (exact numpy search),
    and adds and removes go on; the new index is swapped in with all of them (the adds
    applied in several rounds outside the lock), and then searches exhaustively like the
    exact search."""
    monkeypatch.setattr(rep_index, "CATCH_UP_ITEMS", 8)
    gal = SyntheticGallery(600, 8, 12, seed=3, clusters=6)
    vec = lambda ids: gal.vectors_of("new", ids)  # noqa: E731
    rep = RepIndex(12, _options("ivf_flat", nprobe=64), "test/background")
    gate, entered = threading.Event(), threading.Event()
    build = rep.kind.build

    def held_build(n):
        entered.set()
        assert gate.wait(30)
        return build(n)

    rep.kind.build = held_build
    rep.add(np.arange(300), vec(np.arange(300)))
    assert entered.wait(30)
    q = gal.query_vectors(12, 5, "new")
    assert rep.describe()["rebuilding"] and not rep.describe()["trained"]
    _check(rep, q, 10, set(range(300)))
    rep.add(np.arange(300, 400), vec(np.arange(300, 400)))
    rep.remove(np.arange(0, 50))
    rep.remove(np.arange(300, 320))
    rep.add(np.arange(10), vec(np.arange(10)))  # re-added while its slot is held
    gate.set()
    assert rep.wait_idle(30)
    d = rep.describe()
    assert d["trained"] and d["trainings"] == 1 and d["last_trained_items"] == 300
    assert d["items"] == len(rep) == 340 and rep.index.index.ntotal == 340
    members = set(range(10)) | set(range(50, 300)) | set(range(320, 400))
    served = _check(rep, q, 20, members)
    assert np.array_equal(served, rep.search(q, 20, exact=True)[1])


def test_close_discards_a_build_in_flight():
    gal = SyntheticGallery(400, 8, 12, seed=3, clusters=4)
    rep = RepIndex(12, _options("ivf_flat"), "test/close")
    gate = threading.Event()
    build = rep.kind.build
    rep.kind.build = lambda n: (gate.wait(30), build(n))[1]
    rep.add(np.arange(300), gal.vectors_of("new", np.arange(300)))
    rep.close()
    gate.set()
    assert rep.wait_idle(30)
    rep.add(np.arange(300, 400), gal.vectors_of("new", np.arange(300, 400)))
    assert not rep.describe()["trained"] and rep.trainings == 0


def test_hnsw_tombstones_are_filtered_and_dropped_by_a_rebuild():
    """HNSW has no remove_ids: removed items stay in the graph as tombstones that a search
    never returns (an ID selector of the live slots), and a rebuild drops them once they
    pass a quarter of the live items; a re-added id gets a fresh slot meanwhile."""
    gal = SyntheticGallery(400, 8, 12, seed=5, clusters=8)
    ids = np.arange(400)
    rep = RepIndex(8, _options("hnsw", train_min=200), "test/hnsw", background=False)
    rep.add(ids, gal.vectors_of("old", ids))
    assert rep.trainings == 1
    rep.remove(ids[:80])
    rep.add(ids[:5], l2_normalize(gal.vectors_of("adapted", ids[:5])[:, :8]))
    d = rep.describe()
    assert d["tombstones"] == 80 and d["trainings"] == 1 and d["items"] == 325
    q = np.concatenate([gal.vectors_of("old", ids[:40]), gal.query_vectors(20, 1, "old")])
    members = set(range(5)) | set(range(80, 400))
    _check(rep, q, 10, members)
    selector, extra = rep._filter(rep.index)  # the graph itself returns no tombstone
    labels = rep.index.search(q, 40, selector)[1]
    assert extra == 0 and (rep.ids[labels[labels >= 0]] >= 0).all()
    rep.remove(ids[80:110])  # 110 tombstones > 295 / 4: rebuilt
    d = rep.describe()
    assert d["tombstones"] == 0 and d["trainings"] == 2 and d["last_trained_items"] == 295
    _check(rep, q, 10, members - set(range(80, 110)))


def test_gpu_ivf_logic_on_a_cpu_stand_in(monkeypatch):
    """The faiss-GPU path without a GPU: ``index_cpu_to_gpu`` replaced by the identity, so
    the index is handled as a GPU one (no remove_ids, no ID selector).  Removed items stay as
    tombstones, a search proposes proportionally more candidates, answers stay exact with
    every list probed, and a rebuild drops the tombstones past a quarter of the items."""
    monkeypatch.setattr(rep_index, "_to_gpu", lambda index: index)
    gal = SyntheticGallery(800, 8, 12, seed=6, clusters=8)
    ids = np.arange(800)
    rep = RepIndex(12, _options("ivf_flat", nprobe=64), "test/gpu", background=False)
    rep.device = "cuda"
    rep.add(ids, gal.vectors_of("new", ids))
    rep.remove(ids[::5])  # 160 tombstones <= 640 / 4
    d = rep.describe()
    assert d["device"] == "cuda" and d["tombstones"] == 160 and d["trainings"] == 1
    q = gal.query_vectors(30, 2, "new")
    served = _check(rep, q, 10, set(ids.tolist()) - set(ids[::5].tolist()))
    assert np.array_equal(served, rep.search(q, 10, exact=True)[1])
    rep.remove(ids[1::5][:10])
    assert rep.describe()["tombstones"] == 0 and rep.trainings == 2


def test_device_auto_falls_back_to_cpu_with_one_log_line(caplog):
    from raycompat.index.ann import cuda_visible

    if cuda_visible()[0]:
        pytest.skip("a CUDA device is visible here")
    with caplog.at_level(logging.INFO, logger="raycompat.serving"):
        rep = RepIndex(8, _options("ivf_flat", device="auto"), "shard-0/old")
    assert rep.device == "cpu"
    lines = [r.getMessage() for r in caplog.records if r.name == "raycompat.serving"]
    assert lines == ["shard-0/old: index ivf_flat on CPU: no CUDA device is visible "
                     "(torch.cuda.is_available() is False)"]  # fmt: skip
    with pytest.raises(ConfigError, match="'device'.*'cuda' but no CUDA device is visible"):
        RepIndex(8, _options("flat", device="cuda"), "shard-0/old")


def test_device_fallbacks_with_cuda_visible(monkeypatch, caplog):
    """With a CUDA device: flat goes to the GPU (torch); IVF stays on the CPU, saying why,
    with a faiss lacking GPU support; HNSW always stays on the CPU, saying why."""
    from raycompat.index import ann

    monkeypatch.setattr(ann, "cuda_visible", lambda: (True, ""))
    monkeypatch.setattr(ann, "faiss_gpus", lambda: 0)
    opts = {k: _options(k, device="auto") for k in KINDS}
    with caplog.at_level(logging.INFO, logger="raycompat.serving"):
        devices = {k: resolve_device(o, ann.create_kind(o, 8), f"s/{k}") for k, o in opts.items()}
    assert devices == {"flat": "cuda", "ivf_flat": "cpu", "ivf_pq": "cpu", "hnsw": "cpu"}
    lines = sorted(r.getMessage() for r in caplog.records)
    assert lines == [
        "s/hnsw: index hnsw on CPU: HNSW has no GPU index in faiss",
        "s/ivf_flat: index ivf_flat on CPU: the installed faiss has no GPU support "
        "(faiss.get_num_gpus() is 0; install faiss-gpu)",
        "s/ivf_pq: index ivf_pq on CPU: the installed faiss has no GPU support "
        "(faiss.get_num_gpus() is 0; install faiss-gpu)",
    ]


@pytest.mark.parametrize(
    "values,field",
    [
        ({"kind": "annoy"}, "'kind'"),
        ({"factory": "IVF8,Flat"}, "'factory'"),
        ({"kind": "hnsw", "factory": "HNSW32"}, "'factory'"),
        ({"retrain_factor": 1}, "'retrain_factor'"),
        ({"pq_bits": 17}, "'pq_bits'"),
        ({"nprobe": 0}, "'nprobe'"),
        ({"nlist": "many"}, "'nlist'"),
        ({"device": "gpu"}, "'device'"),
        ({"kind": "ivf_flat", "nlist": 64, "train_min": 10}, "'train_min'"),
        ({"kind": "ivf_pq", "train_min": 100}, "'train_min'"),
    ],
)
def test_index_options_errors_name_the_field(values, field):
    with pytest.raises(ConfigError, match=field):
        index_options(values)


def test_index_options_flags_and_dimension_checks():
    from raycompat.config import add_options, make_parser, options_from_args

    parser = make_parser()
    add_options(parser, IndexOptions)
    args = parser.parse_args(["--index", "hnsw", "--ef-search", "32", "--index-device", "cpu"])
    assert options_from_args(IndexOptions, args) == IndexOptions(
        kind="hnsw", ef_search=32, device="cpu"
    )
    assert index_options(kind="ivf_pq", train_min=256).train_min == 256
    with pytest.raises(ConfigError, match="'pq_m' = 5 must divide the dimension 12"):
        RepIndex(12, _options("ivf_pq", pq_m=5))
    with pytest.raises(ConfigError, match="'factory' = 'NoSuchIndex'"):
        RepIndex(12, _options("faiss", factory="NoSuchIndex"))
    assert RepIndex(12, _options("ivf_pq")).kind.pq_m == 3  # the divisor of 12 nearest 3


def test_synthetic_gallery_without_clusters_is_unchanged():
    """Values computed before the clusters field existed."""
    gal = open_gallery("synthetic:1000:8:12:5")
    ids = [0, 257, 999]
    expected = {
        "old": ([-0.41146349906921387, 0.26971739530563354, -0.714778482913971],
                [-0.14508938789367676, -0.10834440588951111, -0.4986039102077484]),
        "adapted": ([0.5616694092750549, -0.19543994963169098, 0.07823874056339264],
                    [-0.13275939226150513, -0.2559184432029724, -0.21798156201839447]),
        "new": ([0.06625630706548691, -0.3939323425292969, 0.17546170949935913],
                [0.17362770438194275, -0.10295663774013519, 0.3184015452861786]),
    }  # fmt: skip
    for rep, (first, last) in expected.items():
        v = gal.vectors_of(rep, ids)
        assert v[:, 0].tolist() == first and v[:, -1].tolist() == last


def test_clustered_synthetic_gallery_is_reproducible_and_clustered():
    a = open_gallery("synthetic:3000:8:12:7:30")
    b = open_gallery("synthetic:3000:8:12:7:30")
    ids = np.arange(3000)
    for rep in ("old", "adapted", "new"):
        v = a.vectors_of(rep, ids)
        assert np.array_equal(v, b.vectors_of(rep, ids))
        assert np.array_equal(v[[2999, 5, 700]], b.vectors_of(rep, [2999, 5, 700]))
        assert np.allclose(np.linalg.norm(v, axis=1), 1, atol=1e-6)
    v, c = a.vectors_of("new", ids), a.cluster_of(ids)
    same = c[:, None] == c[None, :]
    cos = v @ v.T
    assert cos[same & ~np.eye(3000, dtype=bool)].mean() > 0.4  # ~0.5: one cloud per cluster
    assert abs(cos[~same].mean()) < 0.1
    assert np.bincount(c, minlength=30).min() > 50
    q = a.query_vectors(16, seed=3, rep="old")
    assert q.shape == (16, 8) and np.array_equal(q, b.query_vectors(16, seed=3, rep="old"))
    assert (q @ a.vectors_of("old", ids).T).max(axis=1).min() > 0.8  # near its source item
    assert not np.array_equal(
        open_gallery("synthetic:3000:8:12:7").vectors_of("new", ids[:10]), v[:10]
    )


@pytest.mark.parametrize(
    "spec,message",
    [
        ("synthetic:10:8:12:0:-2", "clusters = -2 must be >= 0"),
        ("synthetic:0", "N = 0 must be >= 1"),
        ("synthetic:10:8:12:0:3:9", r"expected synthetic:N\[:D_old\[:D_new\[:seed\[:clusters"),
        ("synthetic:10:eight", "integers"),
    ],
)
def test_synthetic_gallery_spec_errors(spec, message):
    with pytest.raises(ConfigError, match=message):
        open_gallery(spec)


def test_recall_at_k_hand_worked():
    served = np.array([[1, 2, 3], [4, 5, 6], [7, -1, -1], [9, 8, -1]])
    exact = np.array([[3, 2, 1], [4, 9, 10], [7, 11, -1], [-1, -1, -1]])
    mean, per_query = recall_at_k(served, exact, 3)
    # 3/3 (order does not matter); 1/3; 1/2 (two valid exact ids); 1 (nothing to find)
    assert per_query.tolist() == [1.0, 1 / 3, 0.5, 1.0]
    assert mean == pytest.approx((1 + 1 / 3 + 0.5 + 1) / 4)
    assert recall_at_k(served, exact, 1)[1].tolist() == [0.0, 1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="rows"):
        recall_at_k(served[:2], exact, 3)


def test_recall_interval_resamples_queries():
    from raycompat.metrics.recall import recall_interval

    perfect = recall_interval(np.ones(50))
    assert (perfect.estimate, perfect.low, perfect.high) == (1.0, 1.0, 1.0)
    values = np.r_[np.ones(30), np.zeros(10), np.full(10, 0.5)]
    iv = recall_interval(values)
    assert iv.estimate == pytest.approx(0.7) and iv.low < 0.7 < iv.high and iv.queries == 50
    assert recall_interval(values) == iv  # seeded
    grouped = recall_interval(values, groups=np.repeat(np.arange(5), 10))
    assert grouped.classes == 5 and grouped.high - grouped.low > iv.high - iv.low
