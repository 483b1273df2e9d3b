"""The store layer without a database: URIs, column maps, the registry, errors and the top-k
primitives (docs/stores.md)."""

from __future__ import annotations

import dataclasses
import sys

import numpy as np
import pytest

from raycompat.stores import (
    Capabilities,
    ColumnMap,
    MissingBackendError,
    StoreError,
    StoreURIError,
    list_backends,
    open_store,
    register_backend,
)
from raycompat.stores import base as store_base
from raycompat.stores.base import CAPABILITY_NOTES
from raycompat.stores.checks import check_ids, check_labels
from raycompat.stores.topk import (
    SearchResult,
    brute_force_topk,
    merge_topk,
    resolve_topk,
    scores_topk,
)
from raycompat.stores.uri import parse_store_uri


# -- URIs ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("uri", "target", "name"),
    [
        ("lance:///data/db/gallery", "/data/db", "gallery"),
        ("lance://rel/db/g-1.v2", "rel/db", "g-1.v2"),
        ("lance://s3://bucket/path/db/gallery", "s3://bucket/path/db", "gallery"),
        ("milvus:///data/m.db/gallery", "/data/m.db", "gallery"),
        ("milvus://./m.db/_g2", "./m.db", "_g2"),
        ("milvus://milvus.internal:19530/gallery", "milvus.internal:19530", "gallery"),
    ],
)
def test_uris_parse(uri, target, name):
    parsed = parse_store_uri(uri)
    assert (parsed.target, parsed.name, parsed.raw) == (target, name, uri)


def test_milvus_uri_tells_lite_from_server():
    lite = parse_store_uri("milvus:///tmp/m.db/c")
    server = parse_store_uri("milvus://localhost:19530/c")
    assert lite.is_local_file and lite.server_uri == "/tmp/m.db"
    assert not server.is_local_file and server.server_uri == "http://localhost:19530"


@pytest.mark.parametrize(
    ("uri", "why"),
    [
        ("gallery", "no scheme"),
        ("lance://gallery", "names no database"),
        ("lance:///data/db/", "names no database"),
        ("lance://s3://gallery", "the database s3://gallery is named, but no table"),
        ("lance://s3:/bucket/db/gallery", "looks like a URI with one '/' after its scheme"),
        ("lance:///db/bad name", "table name"),
        ("milvus://localhost/gallery", "neither a file ending .db nor host:port"),
        ("milvus:///tmp/m.db/bad-name", "collection name"),
    ],
)
def test_bad_uris_name_the_uri_and_the_expected_form(uri, why):
    with pytest.raises(StoreURIError, match=why) as info:
        parse_store_uri(uri)
    assert repr(uri) in str(info.value) and "expected" in str(info.value)


def test_unknown_scheme_lists_the_known_ones():
    with pytest.raises(StoreURIError, match="'faiss'.*lance, milvus"):
        open_store("faiss:///data/index/gallery")


# -- column map ----------------------------------------------------------------------------
def test_column_map_defaults_and_checks():
    cols = ColumnMap()
    assert (cols.id, cols.old, cols.new, cols.label, cols.image_uri) == (
        "item_id",
        "old",
        "new",
        "label",
        None,
    )
    assert (cols.old_model, cols.new_model, cols.upgraded, cols.position) == (
        "old_model",
        "new_model",
        "upgraded",
        "upgrade_position",
    )
    assert cols.physical("position") == "upgrade_position"
    with pytest.raises(dataclasses.FrozenInstanceError):
        cols.old = "x"
    with pytest.raises(StoreError, match="must differ"):
        ColumnMap(old="v", new="v")
    with pytest.raises(StoreError, match="ColumnMap.label.*'class name'"):
        ColumnMap(label="class name")
    with pytest.raises(StoreError, match="cannot both be None"):
        ColumnMap(upgraded=None, position=None)
    with pytest.raises(StoreError, match="'image_uri' is not mapped"):
        cols.physical("image_uri")


def test_checks_name_the_column():
    with pytest.raises(StoreError, match="column 'pid' of T: ids must be unique.*\\[3\\]"):
        check_ids([1, 3, 3], "pid", "T")
    with pytest.raises(StoreError, match="column 'pid' of T: ids must be integers"):
        check_ids([1.5, 2.0], "pid", "T")
    assert check_labels(np.array(["a", "b"]), 2, None, "cls", "T")[1] == "string"
    with pytest.raises(StoreError, match="column 'cls' of T: labels must be int64"):
        check_labels(np.array(["a", "b"]), 2, "int64", "cls", "T")


# -- registry and extras -------------------------------------------------------------------
def test_registry_lists_builtins_and_refuses_non_stores():
    assert {"lance", "milvus"} <= set(list_backends())
    with pytest.raises(StoreError, match="not a VectorStore subclass"):
        register_backend("mystore")(dict)
    with pytest.raises(StoreError, match="lower-case"):
        register_backend("My Store")


def test_registered_backend_serves_its_scheme(monkeypatch, tmp_path):
    pytest.importorskip("lancedb")
    from raycompat.stores import lance

    monkeypatch.setitem(store_base._REGISTRY, "lancecopy", store_base._REGISTRY["lance"])
    register_backend("lancecopy")(lance.LanceStore)
    assert "lancecopy" in list_backends()
    with pytest.raises(StoreError, match="'gallery'.*does not exist"):
        open_store(f"lancecopy://{tmp_path}/db/gallery")


def test_missing_extra_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "pymilvus", None)
    monkeypatch.delitem(sys.modules, "raycompat.stores.milvus", raising=False)
    with pytest.raises(MissingBackendError, match=r"pip install raycompat\[milvus\]") as info:
        open_store("milvus:///tmp/raycompat-none.db/gallery")
    assert isinstance(info.value, ImportError) and isinstance(info.value, StoreError)


def test_missing_lancedb_names_the_package_not_an_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "lancedb", None)
    monkeypatch.delitem(sys.modules, "raycompat.stores.lance", raising=False)
    with pytest.raises(MissingBackendError, match=r"pip install lancedb \(a dependency") as info:
        open_store("lance:///tmp/raycompat-none/gallery")
    assert "raycompat[" not in str(info.value)


def test_missing_milvus_lite_says_what_to_install(monkeypatch, tmp_path):
    pytest.importorskip("pymilvus")
    monkeypatch.setitem(sys.modules, "milvus_lite", None)
    with pytest.raises(MissingBackendError, match=r"milvus-lite.*raycompat\[milvus\]"):
        open_store(f"milvus://{tmp_path}/m.db/gallery")


def test_capabilities_document_every_workaround():
    caps = Capabilities(*([False] * len(dataclasses.fields(Capabilities))))
    assert set(caps.missing()) == set(CAPABILITY_NOTES)
    assert Capabilities(*([True] * len(CAPABILITY_NOTES))).missing() == {}


# -- top-k primitives ----------------------------------------------------------------------
class TieShufflingEngine:
    """A stand-in engine: its exact top-``limit`` by score, ties in arbitrary order."""

    def __init__(self, queries, vectors, ids, seed=0):
        self.sims = queries @ vectors.T
        self.ids = ids
        self.rng = np.random.default_rng(seed)
        self.limits = []

    def __call__(self, rows, limit):
        self.limits.append(limit)
        out = []
        for row in rows:
            perm = self.rng.permutation(len(self.ids))
            top = perm[np.argsort(-self.sims[row][perm], kind="stable")[:limit]]
            out.append((self.ids[top], self.sims[row][top].astype(np.float32)))
        return out


def test_resolve_topk_breaks_large_ties_by_id():
    rng = np.random.default_rng(1)
    vectors = rng.standard_normal((200, 4)).astype(np.float32)
    vectors[50:120] = vectors[7]  # 71 items tie for every query
    ids = rng.choice(10_000, size=200, replace=False)
    queries = vectors[[7, 3]]
    engine = TieShufflingEngine(queries, vectors, ids)
    got = resolve_topk(engine, 2, 10, cap=1000, where="T")
    want = brute_force_topk(queries, vectors, ids, 10)
    np.testing.assert_array_equal(got.ids, want.ids)
    assert max(engine.limits) > 71  # fetched again until the tie fitted
    with pytest.raises(StoreError, match="T: more than 40 items tie"):
        resolve_topk(TieShufflingEngine(queries, vectors, ids), 2, 10, cap=40, where="T")


def test_resolve_topk_pads_short_results():
    ids = np.array([5, 9])
    vectors = np.eye(2, dtype=np.float32)
    got = resolve_topk(TieShufflingEngine(vectors[:1], vectors, ids), 1, 4, cap=100, where="T")
    assert got.ids.tolist() == [[5, 9, -1, -1]]
    assert np.isneginf(got.scores[0, 2:]).all()


def test_merge_topk_orders_by_score_then_id():
    a = SearchResult(np.array([[4, 8, -1]]), np.array([[0.9, 0.5, -np.inf]], np.float32))
    b = SearchResult(np.array([[3, 2, 7]]), np.array([[0.9, 0.5, 0.1]], np.float32))
    got = merge_topk(a, b, 4)
    assert got.ids.tolist() == [[3, 4, 2, 8]]
    np.testing.assert_array_equal(got.scores, np.float32([[0.9, 0.9, 0.5, 0.5]]))


def test_scores_topk_equals_a_full_sort_with_ties_and_nan():
    """scores_topk sorts only the items at or above each row's k-th score: the same answer as
    ranking every item by score then id, ties at the k-th score and NaN scores included."""
    rng = np.random.default_rng(3)
    for trial in range(400):
        n, k = int(rng.integers(0, 50)), int(rng.integers(1, 15))
        sims = rng.integers(0, 4, (3, n)).astype(np.float32) / 3  # many ties
        if trial % 3 == 0:
            sims = rng.standard_normal((3, n)).astype(np.float32)
        if trial % 5 == 0 and n:
            sims[0, rng.integers(0, n, 3)] = np.nan
        ids = rng.permutation(10 * n + 1)[:n].astype(np.int64)
        got = scores_topk(sims, ids, k)
        for row in range(3):
            order = np.lexsort((ids, -sims[row].astype(np.float64)))[:k]
            want_ids = np.full(k, -1, np.int64)
            want_scores = np.full(k, -np.inf, np.float32)
            want_ids[: len(order)], want_scores[: len(order)] = ids[order], sims[row][order]
            np.testing.assert_array_equal(got.ids[row], want_ids)
            np.testing.assert_array_equal(got.scores[row], want_scores)
