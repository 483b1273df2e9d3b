"""The store layer's behaviour, the same tests for every backend: real LanceDB and real
Milvus Lite, small galleries (docs/stores.md)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from raycompat.stores import (
    ColumnMap,
    Filter,
    GalleryBlock,
    StoreError,
    StoreExistsError,
    StoreNotFoundError,
    create_store,
    open_store,
)
from raycompat.stores.topk import brute_force_topk, compatible_brute_force


def _backend(name: str, *packages: str):
    missing = [p for p in packages if importlib.util.find_spec(p) is None]
    return pytest.param(
        name,
        marks=pytest.mark.skipif(bool(missing), reason=f"{name} store needs {', '.join(missing)}"),
    )


#: Every backend, each skipped where its packages are not installed.
BACKENDS = [_backend("lance", "lancedb"), _backend("milvus", "pymilvus", "milvus_lite")]
ALL_COLUMNS = ("id", "label", "old", "new", "old_model", "new_model", "upgraded", "position")


def _unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


class Gallery:
    """A small gallery: shuffled sparse ids, exact duplicate vectors (ties), 6 labels."""

    def __init__(self, n: int = 240, d_old: int = 16, d_new: int = 24, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.ids = rng.choice(10 * n, size=n, replace=False).astype(np.int64)
        self.labels = self.ids % 6
        self.old = _unit(rng.standard_normal((n, d_old)))
        self.new = _unit(rng.standard_normal((n, d_new)))
        for a, b in ((1, 2), (1, 3), (10, 11), (20, 21)):  # ties for every query near them
            self.old[b] = self.old[a]
            self.new[b] = self.new[a]
        self.order = np.argsort(self.ids)

    def blocks(self, parts: int = 2) -> list[GalleryBlock]:
        cuts = np.array_split(np.arange(len(self.ids)), parts)
        return [GalleryBlock(self.ids[c], self.labels[c], self.old[c]) for c in cuts]

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """Indexes of ``ids`` in this gallery."""
        where = {int(i): k for k, i in enumerate(self.ids)}
        return np.asarray([where[int(i)] for i in ids])


def uri_of(backend: str, tmp_path, name: str = "gallery") -> str:
    if backend == "lance":
        return f"lance://{tmp_path}/lancedb/{name}"
    return f"milvus://{tmp_path}/milvus.db/{name}"


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    return request.param


@pytest.fixture
def gal() -> Gallery:
    return Gallery()


@pytest.fixture
def store(backend, tmp_path, gal):
    s = create_store(
        uri_of(backend, tmp_path), gal.blocks(), old_model="old-m0", new_dim=gal.new.shape[1]
    )
    yield s
    s.close()


def upgrade(store, gal: Gallery, rows: np.ndarray, fingerprint: str, start: int) -> None:
    store.write_new(gal.ids[rows], gal.new[rows], fingerprint, np.arange(start, start + len(rows)))


def read_all(store, columns=ALL_COLUMNS, **kw) -> dict[str, np.ndarray]:
    blocks = list(store.read_blocks(columns, **kw))
    return {k: np.concatenate([b[k] for b in blocks]) for k in blocks[0]}


# -- create and open -----------------------------------------------------------------------
def test_create_refuses_an_existing_non_empty_store(backend, tmp_path, gal):
    uri = uri_of(backend, tmp_path)
    create_store(uri, gal.blocks(), old_model="m0", new_dim=24).close()
    with pytest.raises(StoreExistsError, match="'gallery'.*overwrite=True"):
        create_store(uri, gal.blocks(), old_model="m0", new_dim=24)
    small = Gallery(n=30, seed=1)
    with create_store(uri, small.blocks(1), old_model="m1", new_dim=24, overwrite=True) as s:
        assert s.count() == 30
        assert s.counts_by_model().old == {"m1": 30}
        assert s.read_state() == {}


def test_a_failed_overwrite_keeps_the_old_table_or_collection(backend, tmp_path, gal):
    """A gallery that fails its checks part-way through an overwrite leaves the old table or
    collection and its records as they were: LanceDB replaces a table with one commit at the
    end, Milvus loads the new gallery into a collection of its own that takes the name only
    once loaded (docs/stores.md, "Create")."""
    uri = uri_of(backend, tmp_path)
    with create_store(uri, gal.blocks(), old_model="m0", new_dim=24) as s:
        s.write_state({"note": "kept"})
        before = read_all(s)

    def blocks():
        yield gal.blocks()[0]
        yield GalleryBlock(gal.ids[:3], gal.labels[:3], gal.old[:3, :5])  # wrong dimension

    with pytest.raises(StoreError, match="column 'old'.*dimension 16"):
        create_store(uri, blocks(), old_model="m1", new_dim=24, overwrite=True)
    with open_store(uri) as s:
        assert s.counts_by_model().old == {"m0": len(gal.ids)}
        assert s.read_state() == {"note": "kept"}
        after = read_all(s)
    assert after.keys() == before.keys()
    for key in before:
        np.testing.assert_array_equal(after[key], before[key])


def test_open_names_a_missing_table_or_collection(backend, tmp_path, gal):
    create_store(uri_of(backend, tmp_path), gal.blocks(), old_model="m0", new_dim=24).close()
    with pytest.raises(StoreNotFoundError, match="'nothing_here'"):
        open_store(uri_of(backend, tmp_path, "nothing_here"))
    # a database folder or file that does not exist is not created by opening it
    with pytest.raises(StoreNotFoundError, match="does not exist"):
        open_store(uri_of(backend, tmp_path / "nowhere"))
    assert not (tmp_path / "nowhere").exists()


def test_a_failed_load_leaves_no_usable_store(backend, tmp_path, gal):
    uri = uri_of(backend, tmp_path)

    def blocks():
        yield gal.blocks()[0]
        yield GalleryBlock(gal.ids[:3], gal.labels[:3], gal.old[:3, :5])  # wrong dimension

    with pytest.raises(StoreError, match="column 'old'.*dimension 16"):
        create_store(uri, blocks(), old_model="m0", new_dim=24)
    with pytest.raises(StoreError, match="'gallery'"):
        open_store(uri)


def test_describe_reports_rows_dims_and_capabilities(store, backend):
    info = store.describe()
    assert (info.rows, info.upgraded, info.old_dim, info.new_dim) == (240, 0, 16, 24)
    assert info.backend == backend and info.metric == "ip" and info.label_type == "int64"
    assert not info.finalized
    missing = info.capabilities.missing()
    if backend == "lance":
        assert set(missing) == {"hybrid_search_raw_scores"}
    else:
        assert {
            "drop_field",
            "null_vectors",
            "snapshots",
            "partial_update",
            "concurrent_writers",
        } <= set(missing)
    assert all(len(text) > 40 for text in missing.values())


# -- read ----------------------------------------------------------------------------------
def test_vectors_are_stored_unit_length(backend, tmp_path, gal):
    """A store scores by inner product (the cosine for unit vectors): create and write_new
    store every vector L2-normalised, unit rows bit for bit; a zero vector is refused."""
    block = GalleryBlock(gal.ids[:8], gal.labels[:8], gal.old[:8] * 5.0)
    block.old[0] = gal.old[0]  # already unit: kept as it is
    with create_store(uri_of(backend, tmp_path), block, old_model="m0", new_dim=24) as store:
        store.write_new(gal.ids[:2], gal.new[:2] * 0.5, "m1", np.arange(2))
        got = next(iter(store.read_blocks(("id", "old", "new"))))
        rows = gal.rows(got["id"])
        np.testing.assert_allclose(got["old"], gal.old[rows], rtol=0, atol=1e-6)
        first = got["id"] == gal.ids[0]
        np.testing.assert_array_equal(got["old"][first], gal.old[:1])
        upgraded = np.isin(got["id"], gal.ids[:2])
        np.testing.assert_allclose(got["new"][upgraded], gal.new[rows[upgraded]], atol=1e-6)
        with pytest.raises(StoreError, match="column 'new' of .*zero vectors .* rows \\[1\\]"):
            store.write_new(gal.ids[2:4], np.eye(2, 24, dtype=np.float32) * [[1], [0]], "m1",
                            np.arange(2, 4))  # fmt: skip


def test_read_blocks_in_id_order_with_content(store, gal):
    blocks = list(store.read_blocks(ALL_COLUMNS, block_rows=50))
    assert [len(b["id"]) for b in blocks] == [50, 50, 50, 50, 40]
    got = {k: np.concatenate([b[k] for b in blocks]) for k in ALL_COLUMNS}
    o = gal.order
    np.testing.assert_array_equal(got["id"], gal.ids[o])
    np.testing.assert_array_equal(got["label"], gal.labels[o])
    np.testing.assert_array_equal(got["old"], gal.old[o])
    assert got["old"].dtype == np.float32 and got["old"].shape == (240, 16)
    assert got["new"].shape == (240, 24) and np.isnan(got["new"]).all()
    assert set(got["old_model"]) == {"old-m0"} and set(got["new_model"]) == {""}
    assert not got["upgraded"].any() and (got["position"] == -1).all()
    np.testing.assert_array_equal(store.read_ids(), gal.ids[o])
    assert store.count() == 240


def test_filters_select_labels_ids_and_upgraded(store, gal):
    upgrade(store, gal, gal.order[:40], "new-m1", 0)
    labels = read_all(store, ("id", "label"), filter=Filter(labels=(1, 4)))
    want = np.sort(gal.ids[np.isin(gal.labels, [1, 4])])
    np.testing.assert_array_equal(labels["id"], want)
    assert store.count(Filter(labels=(1, 4))) == len(want)
    assert store.count(Filter(upgraded=True)) == 40 == store.count_upgraded()
    assert store.count(Filter(upgraded=False, labels=(2,))) == int(
        np.sum((gal.labels == 2) & ~np.isin(gal.ids, gal.ids[gal.order[:40]]))
    )
    picked = tuple(int(i) for i in gal.ids[:5])
    np.testing.assert_array_equal(store.read_ids(Filter(ids=picked)), np.sort(picked))
    # blocks of a filter on ids and the flag (Milvus gets them by primary key): the rows of a
    # full read that pass it, in id order, an unknown id and a repeated one ignored
    everything = read_all(store, ("id", "label", "old", "new"))
    some = tuple(int(i) for i in gal.ids[gal.order[30:60]]) + (10**9, int(gal.ids[gal.order[31]]))
    for up in (True, False):
        got = read_all(
            store,
            ("id", "label", "old", "new"),
            filter=Filter(ids=some).and_upgraded(up),
            block_rows=7,
        )
        keep = np.isin(everything["id"], some) & (~np.isnan(everything["new"][:, 0]) == up)
        assert len(got["id"]) == (10 if up else 20)
        for name in ("id", "label", "old", "new"):
            np.testing.assert_array_equal(got[name], everything[name][keep])


def test_scan_blocks_give_the_rows_of_read_blocks_in_any_order(store, gal, backend):
    upgrade(store, gal, gal.order[:70], "new-m1", 0)
    columns = ("id", "label", "old", "new", "new_model")
    for flt in (None, Filter(upgraded=True), Filter(upgraded=False, labels=(1, 4))):
        want = read_all(store, columns, filter=flt)
        blocks = list(store.scan_blocks(columns, block_rows=32, filter=flt))
        assert blocks and all(0 < len(b["id"]) <= 32 for b in blocks)
        got = {k: np.concatenate([b[k] for b in blocks]) for k in columns}
        order = np.argsort(got["id"])
        for name in columns:
            np.testing.assert_array_equal(got[name][order], want[name])
    with pytest.raises(StoreError, match="block_rows"):
        store.scan_blocks(("id",), block_rows=0)
    with pytest.raises(StoreError, match="unknown column 'vector'"):
        store.scan_blocks(("id", "vector"))


# -- write ---------------------------------------------------------------------------------
def test_write_new_changes_only_the_new_model_fields(store, gal):
    before = read_all(store)
    first, second = gal.order[:30], gal.order[30:50]
    upgrade(store, gal, first, "new-m1", 0)
    upgrade(store, gal, second, "new-m2", 30)
    after = read_all(store)
    for name in ("id", "label", "old", "old_model"):
        np.testing.assert_array_equal(after[name], before[name])
    np.testing.assert_array_equal(after["new"][:50], gal.new[gal.order[:50]])
    assert np.isnan(after["new"][50:]).all()
    assert list(after["new_model"][:50]) == ["new-m1"] * 30 + ["new-m2"] * 20
    np.testing.assert_array_equal(after["position"][:50], np.arange(50))
    assert after["upgraded"][:50].all() and not after["upgraded"][50:].any()
    counts = store.counts_by_model()
    assert counts.old == {"old-m0": 240} and counts.new == {"new-m1": 30, "new-m2": 20}
    assert (counts.rows, counts.upgraded) == (240, 50)


def test_write_new_refuses_a_bad_batch_whole(store, gal):
    rows = gal.order[:10]
    unknown = gal.ids[rows].copy()
    unknown[-1] = 10**9
    with pytest.raises(StoreError, match=r"column 'item_id'.*not in the .*1000000000"):
        store.write_new(unknown, gal.new[rows], "m1", np.arange(10))
    with pytest.raises(StoreError, match="column 'new'.*dimension 24"):
        store.write_new(gal.ids[rows], gal.new[rows, :20], "m1", np.arange(10))
    bad = gal.new[rows].copy()
    bad[3, 2] = np.nan
    with pytest.raises(StoreError, match="column 'new'.*finite"):
        store.write_new(gal.ids[rows], bad, "m1", np.arange(10))
    with pytest.raises(StoreError, match="column 'upgrade_position'"):
        store.write_new(gal.ids[rows], gal.new[rows], "m1", np.arange(-1, 9))
    with pytest.raises(StoreError, match="column 'new_model'"):
        store.write_new(gal.ids[rows], gal.new[rows], "", np.arange(10))
    assert store.count_upgraded() == 0


# -- search --------------------------------------------------------------------------------
def test_exact_search_equals_numpy_with_filter_and_ties(store, gal):
    queries = np.concatenate(
        [gal.old[[1, 10, 20]], _unit(np.random.default_rng(5).standard_normal((5, 16)))]
    )
    flt = Filter(labels=(1, 3, 4))
    got = store.search("old", queries, 12, filter=flt)
    keep = np.isin(gal.labels, [1, 3, 4])
    want = brute_force_topk(queries, gal.old[keep], gal.ids[keep], 12)
    np.testing.assert_array_equal(got.ids, want.ids)
    np.testing.assert_allclose(got.scores, want.scores, atol=1e-5)
    full = store.search("old", gal.old[[1, 10]], 5)
    assert full.ids[0, :3].tolist() == sorted(gal.ids[[1, 2, 3]].tolist())  # ties by id
    assert full.ids.dtype == np.int64 and full.scores.dtype == np.float32


def test_new_field_search_sees_upgraded_items_only(store, gal):
    rows = gal.order[:60]
    upgrade(store, gal, rows, "new-m1", 0)
    queries = gal.new[[1, 10, 100, 200]]
    got = store.search("new", queries, 10)
    want = brute_force_topk(queries, gal.new[rows], gal.ids[rows], 10)
    np.testing.assert_array_equal(got.ids, want.ids)
    np.testing.assert_allclose(got.scores, want.scores, atol=1e-5)
    few = store.search("new", queries[:1], 10, filter=Filter(ids=tuple(gal.ids[rows[:3]])))
    assert (few.ids[0, 3:] == -1).all() and np.isneginf(few.scores[0, 3:]).all()
    with pytest.raises(StoreError, match="contradicts"):
        store.search("new", queries, 5, filter=Filter(upgraded=False))


def test_compatible_search_equals_numpy_brute_force(store, gal):
    rng = np.random.default_rng(7)
    rows = rng.choice(240, size=120, replace=False)
    upgrade(store, gal, rows, "new-m1", 0)
    up = np.isin(gal.ids, gal.ids[rows])
    pick = [1, 2, 10, 20, 50, 51]
    new_q = np.concatenate([gal.new[pick], _unit(rng.standard_normal((4, 24)))])
    old_q = np.concatenate([gal.old[pick], _unit(rng.standard_normal((4, 16)))])
    for k in (1, 7, 25):
        got = store.search_compatible(new_q, old_q, k)
        want = compatible_brute_force(new_q, old_q, gal.new, gal.old, up, gal.ids, k)
        np.testing.assert_array_equal(got.ids, want.ids)
        np.testing.assert_allclose(got.scores, want.scores, atol=1e-5)
    flt = Filter(labels=(0, 5))
    got = store.search_compatible(new_q, old_q, 9, filter=flt)
    keep = np.isin(gal.labels, [0, 5])
    want = compatible_brute_force(
        new_q, old_q, gal.new[keep], gal.old[keep], up[keep], gal.ids[keep], 9
    )
    np.testing.assert_array_equal(got.ids, want.ids)


def test_compatible_search_breaks_ties_across_old_and_new_by_id(backend, tmp_path):
    gal = Gallery(n=60, d_old=16, d_new=16, seed=3)
    a, b, c = gal.order[[4, 9, 40]]  # a, c upgraded; b not: all three score 1 on query v
    gal.new[a] = gal.old[b]
    gal.new[c] = gal.old[b]
    with create_store(uri_of(backend, tmp_path), gal.blocks(), old_model="m0", new_dim=16) as s:
        rows = gal.order[::2]
        upgrade(s, gal, rows, "m1", 0)
        up = np.isin(gal.ids, gal.ids[rows])
        assert up[a] and up[c] and not up[b]
        q = gal.old[[b]]
        got = s.search_compatible(q, q, 3)
        assert sorted(got.ids[0].tolist()) == got.ids[0].tolist()
        assert set(got.ids[0].tolist()) == set(gal.ids[[a, b, c]].tolist())
        want = compatible_brute_force(q, q, gal.new, gal.old, up, gal.ids, 3)
        np.testing.assert_array_equal(got.ids, want.ids)


def test_approximate_index_is_used_when_asked(store, gal, backend):
    queries = gal.old[:8]
    want = brute_force_topk(queries, gal.old, gal.ids, 10)
    store.build_index("old", "ivf")
    assert store.describe().indexes["old"] in ("IvfFlat", "IVF_FLAT")
    approx = store.search("old", queries, 10, exact=False)
    recall = np.mean([len(set(g) & set(w)) / 10 for g, w in zip(approx.ids, want.ids, strict=True)])
    assert recall >= 0.8
    if backend == "lance":
        np.testing.assert_array_equal(store.search("old", queries, 10).ids, want.ids)
    else:
        with pytest.raises(StoreError, match="field 'old'.*exact search needs FLAT"):
            store.search("old", queries, 10)
    store.build_index("old", "flat")
    np.testing.assert_array_equal(store.search("old", queries, 10).ids, want.ids)


def test_an_unknown_index_kind_is_refused_and_keeps_the_index(store, gal):
    store.build_index("old", "ivf")
    before = store.describe().indexes["old"]
    with pytest.raises(StoreError, match="index kind must be.*'ivfpq'"):
        store.build_index("old", "ivfpq")
    assert store.describe().indexes["old"] == before


# -- rollback ------------------------------------------------------------------------------
def test_rollback_to_a_mark(store, gal):
    upgrade(store, gal, gal.order[:40], "new-m1", 0)
    before = read_all(store)
    mark = store.mark("before-batch-2")
    assert mark.position == 40
    upgrade(store, gal, gal.order[40:90], "new-m2", 40)
    assert store.count_upgraded() == 90
    store.rollback("before-batch-2")
    after = read_all(store)
    for name in ALL_COLUMNS:
        np.testing.assert_array_equal(after[name], before[name])
    assert store.counts_by_model().new == {"new-m1": 40}
    assert set(store.marks()) == {"before-batch-2"}
    with pytest.raises(StoreError, match="exists already"):
        store.mark("before-batch-2")
    with pytest.raises(StoreError, match="no rollback mark 'nope'"):
        store.rollback("nope")
    queries = gal.new[:4]
    want = brute_force_topk(queries, gal.new[gal.order[:40]], gal.ids[gal.order[:40]], 8)
    np.testing.assert_array_equal(store.search("new", queries, 8).ids, want.ids)


def test_rollback_to_a_position(store, gal):
    upgrade(store, gal, gal.order[:100], "new-m1", 0)
    assert store.rollback_to_position(70) == 30
    got = read_all(store)
    assert got["upgraded"][:70].all() and not got["upgraded"][70:].any()
    assert (got["position"][70:] == -1).all() and np.isnan(got["new"][70:]).all()
    assert store.counts_by_model().new == {"new-m1": 70}
    assert store.rollback_to_position(70) == 0
    upgrade(store, gal, gal.order[70:80], "new-m2", 70)
    assert store.counts_by_model().new == {"new-m1": 70, "new-m2": 10}
    with pytest.raises(StoreError, match="column 'upgrade_position'.*>= 0"):
        store.rollback_to_position(-3)


def test_positions_must_grow_and_a_batch_may_be_written_again(store, gal):
    upgrade(store, gal, gal.order[:20], "new-m1", 0)
    upgrade(store, gal, gal.order[:20], "new-m1", 0)  # a retry of the batch: the same positions
    with pytest.raises(StoreError, match="positions must grow: the largest written is 19, this"):
        upgrade(store, gal, gal.order[20:30], "new-m1", 15)
    with pytest.raises(StoreError, match="positions must grow"):  # the same items, moved
        upgrade(store, gal, gal.order[:20], "new-m1", 1)
    with pytest.raises(StoreError, match="a position appears twice"):
        store.write_new(
            gal.ids[gal.order[20:22]], gal.new[gal.order[20:22]], "m", np.array([30, 30])
        )
    assert store.count_upgraded() == 20  # nothing of a refused batch written
    store.rollback_to_position(10)  # then positions from 10 on are free again
    upgrade(store, gal, gal.order[30:40], "new-m2", 10)
    assert store.counts_by_model().new == {"new-m1": 10, "new-m2": 10}


# -- finalize and state --------------------------------------------------------------------
def test_finalize_needs_every_item_upgraded(store, gal, backend):
    upgrade(store, gal, gal.order[:200], "new-m1", 0)
    with pytest.raises(StoreError, match="'gallery'.*200 of 240"):
        store.finalize()
    upgrade(store, gal, gal.order[200:], "new-m1", 200)
    store.finalize()
    info = store.describe()
    assert info.finalized and info.old_dim == (None if backend == "lance" else 16)
    with pytest.raises(StoreError, match="column 'old'.*finalized"):
        store.search("old", gal.old[:2], 3)
    with pytest.raises(StoreError, match="column 'old'.*finalized"):
        store.read_blocks(("id", "old"))
    got = store.search("new", gal.new[:3], 5)
    np.testing.assert_array_equal(got.ids, brute_force_topk(gal.new[:3], gal.new, gal.ids, 5).ids)
    store.close()
    with open_store(store.uri.raw) as again:
        assert again.finalized
        assert again.counts_by_model().new == {"new-m1": 240}


def test_rollback_to_a_mark_taken_before_finalize_undoes_it(store, gal):
    upgrade(store, gal, gal.order[:200], "new-m1", 0)
    store.mark("pre-final")
    upgrade(store, gal, gal.order[200:], "new-m1", 200)
    store.finalize()
    store.rollback("pre-final")
    assert not store.finalized and store.count_upgraded() == 200
    keep = ~np.isin(gal.ids, gal.ids[gal.order[:200]])
    got = store.search("old", gal.old[:3], 4, filter=Filter(upgraded=False))
    want = brute_force_topk(gal.old[:3], gal.old[keep], gal.ids[keep], 4)
    np.testing.assert_array_equal(got.ids, want.ids)


def test_a_handle_opened_finalized_searches_old_after_a_rollback_to_a_mark(store, gal):
    upgrade(store, gal, gal.order[:200], "new-m1", 0)
    store.mark("pre-final")
    upgrade(store, gal, gal.order[200:], "new-m1", 200)
    store.finalize()
    with open_store(store.uri.raw) as again:  # opened while finalized
        again.rollback("pre-final")
        assert not again.finalized and again.describe().old_dim == 16
        got = again.search("old", gal.old[:2], 3, filter=Filter(upgraded=False))
        keep = ~np.isin(gal.ids, gal.ids[gal.order[:200]])
        want = brute_force_topk(gal.old[:2], gal.old[keep], gal.ids[keep], 3)
        np.testing.assert_array_equal(got.ids, want.ids)
    with open_store(store.uri.raw) as again:
        assert not again.finalized


def test_rollback_to_a_position_is_refused_after_finalize(store, gal):
    """On both backends: the finalize marker stays (Milvus used to remove it)."""
    upgrade(store, gal, gal.order, "new-m1", 0)
    store.finalize()
    with pytest.raises(StoreError, match="column 'old'.*finalize"):
        store.rollback_to_position(100)
    assert store.finalized and store.count_upgraded() == len(gal.ids)


def test_state_record_round_trip(store, tmp_path, backend):
    assert store.read_state() == {}
    store.write_state({"done": 3, "order": "uncertainty", "batches": [1, 2, 3]})
    store.write_state({"done": 4, "order": "uncertainty", "batches": [1, 2, 3, 4]})
    store.close()
    with open_store(uri_of(backend, tmp_path)) as again:
        assert again.read_state() == {"done": 4, "order": "uncertainty", "batches": [1, 2, 3, 4]}
        with pytest.raises(StoreError, match="state record.*'gallery'.*JSON"):
            again.write_state({"bad": object()})
        with pytest.raises(StoreError, match="state record.*'gallery'.*NaN|state record"):
            again.write_state({"x": float("nan")})
        assert again.read_state()["done"] == 4


# -- errors and column maps ----------------------------------------------------------------
def test_errors_name_the_column(backend, tmp_path, gal):
    uri = uri_of(backend, tmp_path)
    with pytest.raises(StoreError, match="column 'label'.*integers or strings"):
        create_store(
            uri, GalleryBlock(gal.ids, gal.labels * 0.5, gal.old), old_model="m0", new_dim=24
        )
    with pytest.raises(StoreError, match="column 'label'.*240 labels"):
        create_store(
            uri, GalleryBlock(gal.ids, gal.labels[:5], gal.old), old_model="m0", new_dim=24
        )
    with pytest.raises(StoreError, match="column 'item_id'.*unique"):
        create_store(
            uri,
            GalleryBlock(np.zeros(240, np.int64), gal.labels, gal.old),
            old_model="m0",
            new_dim=24,
        )
    with pytest.raises(StoreError, match="column 'new'.*new_dim"):
        create_store(uri, gal.blocks(), old_model="m0")
    with pytest.raises(StoreError, match="column 'new_model'.*new_model"):
        create_store(uri, GalleryBlock(gal.ids, gal.labels, gal.old, new=gal.new), old_model="m0")
    with create_store(uri, gal.blocks(), old_model="m0", new_dim=24) as s:
        with pytest.raises(StoreError, match="column 'label'.*int64"):
            s.search("old", gal.old[:1], 3, filter=Filter(labels=("a",)))
        with pytest.raises(StoreError, match="column 'old'.*dimension 16"):
            s.search("old", gal.new[:1], 3)
        with pytest.raises(StoreError, match="unknown column 'vector'"):
            s.read_blocks(("id", "vector"))
        with pytest.raises(StoreError, match="'image_uri' is not mapped"):
            s.read_blocks(("id", "image_uri"))
    with pytest.raises(StoreError, match="'emb'.*missing from"):
        open_store(uri, ColumnMap(old="emb"))


def test_custom_columns_string_labels_and_image_uris(backend, tmp_path, gal):
    cols = ColumnMap(
        id="pid",
        old="v_old",
        new="v_new",
        label="cls",
        image_uri="uri",
        old_model="fp_old",
        new_model="fp_new",
        upgraded="done",
        position="step",
    )
    names = np.asarray([f"class-{v}" for v in gal.labels], dtype=object)
    uris = [f"s3://bucket/img/{i}.jpg" for i in gal.ids]
    block = GalleryBlock(gal.ids, names, gal.old, new=gal.new, image_uris=uris)
    with create_store(
        uri_of(backend, tmp_path), block, old_model="m0", new_model="m1", columns=cols
    ) as s:
        assert s.describe().label_type == "string" and s.count_upgraded() == 240
        got = read_all(s, ("id", "label", "image_uri", "new", "position"))
        np.testing.assert_array_equal(got["id"], gal.ids[gal.order])
        assert list(got["label"]) == list(names[gal.order])
        assert list(got["image_uri"]) == [uris[i] for i in gal.order]
        np.testing.assert_array_equal(got["new"], gal.new[gal.order])
        assert sorted(got["position"]) == list(range(240))
        hit = s.search("old", gal.old[:2], 4, filter=Filter(labels=("class-1", "class-2")))
        keep = np.isin(gal.labels, [1, 2])
        want = brute_force_topk(gal.old[:2], gal.old[keep], gal.ids[keep], 4)
        np.testing.assert_array_equal(hit.ids, want.ids)
        with pytest.raises(StoreError, match="column 'step'"):
            s.write_new(gal.ids[:2], gal.new[:2], "m2", None)
    with pytest.raises(StoreError, match="'item_id'.*missing from"):
        open_store(uri_of(backend, tmp_path))


def test_position_alone_can_mark_upgraded_items(backend, tmp_path, gal):
    cols = ColumnMap(upgraded=None)
    with create_store(
        uri_of(backend, tmp_path), gal.blocks(), old_model="m0", new_dim=24, columns=cols
    ) as s:
        upgrade(s, gal, gal.order[:50], "m1", 0)
        assert s.count_upgraded() == 50 and s.counts_by_model().new == {"m1": 50}
        got = read_all(s, ("id", "new", "position"))
        assert np.isnan(got["new"][50:]).all() and (got["position"][50:] == -1).all()
        rows = gal.order[:50]
        want = brute_force_topk(gal.new[:2], gal.new[rows], gal.ids[rows], 6)
        np.testing.assert_array_equal(s.search("new", gal.new[:2], 6).ids, want.ids)
        assert s.rollback_to_position(20) == 30 and s.count_upgraded() == 20


def test_flag_alone_works_on_lance_and_milvus_needs_positions(backend, tmp_path, gal):
    cols = ColumnMap(position=None)
    uri = uri_of(backend, tmp_path)
    if backend == "milvus":
        with pytest.raises(StoreError, match="needs a position column"):
            create_store(uri, gal.blocks(), old_model="m0", new_dim=24, columns=cols)
        return
    with create_store(uri, gal.blocks(), old_model="m0", new_dim=24, columns=cols) as s:
        s.write_new(gal.ids[:10], gal.new[:10], "m1", None)
        assert s.count_upgraded() == 10
        with pytest.raises(StoreError, match="positions were given"):
            s.write_new(gal.ids[:10], gal.new[:10], "m1", np.arange(10))
        with pytest.raises(StoreError, match="needs a position column"):
            s.rollback_to_position(0)
