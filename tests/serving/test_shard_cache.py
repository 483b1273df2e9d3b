"""A shard's cache of the store and the store's write sequence, without Ray: a shard loads its
rows, follows the commits of another handle (as a replica on another node follows the
writer), sees every item exactly once while it moves, and reloads when the table goes back."""

import threading

import numpy as np
import pytest

from raycompat.index.search import l2_normalize
from raycompat.serving.placement import shard_of
from raycompat.serving.shard_cache import CacheRule, ShardCache
from raycompat.stores import GalleryBlock, ItemWrite, StoreError, create_store, open_store

DIMS = {"old": 8, "adapted": 12, "new": 12}
OLD, NEW = "0ld0ld0ld0ld0ld0", "5e5e5e5e5e5e5e5e"


@pytest.fixture
def gallery(tmp_path):
    """``(uri, ids, old, new)``: 200 items in a LanceDB table."""
    rng = np.random.default_rng(0)
    ids = np.arange(200, dtype=np.int64) * 3 + 1
    old = l2_normalize(rng.standard_normal((200, 8)))
    new = l2_normalize(rng.standard_normal((200, 12)))
    uri = f"lance://{tmp_path}/db/gallery"
    create_store(uri, GalleryBlock(ids, ids % 7, old), old_model=OLD, new_dim=12).close()
    return uri, ids, old, new


def _cache(uri, shard=0, shards=2, **kw):
    return ShardCache(open_store(uri), shard, shards, DIMS, CacheRule(**kw))


def test_placement_is_deterministic_and_balanced():
    from raycompat.serving.placement import split_by_shard

    ids = np.arange(100_000)
    s = shard_of(ids, 4)
    assert s.min() == 0 and s.max() == 3
    counts = np.bincount(s, minlength=4)
    assert counts.min() > 24_000
    assert (shard_of(ids, 4) == s).all()
    parts = split_by_shard(ids, 4)
    assert sum(p.size for p in parts) == ids.size
    with pytest.raises(ValueError, match="shards"):
        shard_of(ids, 0)


def test_the_write_sequence_numbers_every_commit_and_reads_what_changed(gallery):
    uri, ids, old, new = gallery
    st = open_store(uri)
    assert st.max_write_seq() == 0 and st.capabilities.write_sequence
    v0 = st.version()
    assert st.write_new(ids[:10], new[:10], NEW, np.arange(10)) == 10
    assert st.max_write_seq() == 1 and st.version() > v0
    n, seq = st.write_items(
        [ItemWrite(ids[5:7], "old", old[:2], OLD), ItemWrite(ids[20:21], "new", new[:1], NEW)]
    )
    assert (n, seq) == (3, 2)
    (block,) = st.read_changes(1, ["id", "upgraded", "position", "old_model"])
    order = np.argsort(block["id"])
    assert block["id"][order].tolist() == [ids[5], ids[6], ids[20]]
    assert block["upgraded"][order].tolist() == [False, False, True]
    assert block["position"][order].tolist() == [-1, -1, -1]
    assert block["write_seq"].tolist() == [2, 2, 2]
    assert st.revert_items(ids[:10]) == (8, 3)  # ids[5:7] were turned back already
    assert st.count_upgraded() == 1 and open_store(uri).max_write_seq() == 3
    with pytest.raises(StoreError, match="ids are not in the table"):
        st.write_items([ItemWrite(np.array([2]), "new", new[:1], NEW)])
    with pytest.raises(StoreError, match="must be 'old' or 'new'"):
        st.write_items([ItemWrite(ids[:1], "adapted", new[:1], NEW)])
    assert st.max_write_seq() == 3  # a refused write commits nothing


def test_a_cache_loads_its_shard_and_follows_another_handles_commits(gallery):
    uri, ids, old, new = gallery
    caches = [_cache(uri, s) for s in (0, 1)]
    mine = [ids[shard_of(ids, 2) == s] for s in (0, 1)]
    for c, m in zip(caches, mine, strict=True):
        assert c.counts() == {"old": m.size, "adapted": 0, "new": 0}
        assert c.items()[0].tolist() == m.tolist()
    writer = open_store(uri)
    writer.write_items([ItemWrite(ids[:30], "new", new[:30], NEW)])
    for c, m in zip(caches, mine, strict=True):
        up = np.isin(m, ids[:30]).sum()
        assert c.counts() == {"old": m.size - up, "adapted": 0, "new": up}
    i = int(ids[0])
    cache = caches[int(shard_of([i], 2)[0])]
    reps, vecs = cache.lookup([i])
    assert reps == ["new"] and np.array_equal(vecs[0], new[0])
    assert cache.models_of([i]) == [NEW]
    S, I, R = cache.search({"new": new[:1]}, 1)
    assert I[0, 0] == i and R[0, 0] == 2
    writer.revert_items(ids[:30])
    assert sum(c.counts()["new"] for c in caches) == 0
    assert sum(c.model_counts()[OLD] for c in caches) == 200
    again = _cache(uri, 0, 1)  # a restart with another number of shards: nothing to move
    assert again.counts() == {"old": 200, "adapted": 0, "new": 0}


def test_the_adapted_rule_and_rho_are_applied_to_what_the_store_holds(gallery):
    uri, ids, old, new = gallery
    adapted = {int(i): v for i, v in zip(ids, new[::-1], strict=True)}
    rule = dict(
        initial="adapted",
        adapted=lambda q: np.stack([adapted[int(i)] for i in q]),
        adapted_model="adadadadadadadad",
        new_map=lambda v: -v,
    )
    cache = _cache(uri, 0, 1, **rule)
    assert cache.counts() == {"old": 0, "adapted": 200, "new": 0}
    open_store(uri).write_items([ItemWrite(ids[:5], "new", new[:5], NEW)])
    reps, vecs = cache.lookup(ids[:6])
    assert reps == ["new"] * 5 + ["adapted"]
    assert np.array_equal(vecs[0], l2_normalize(-new[:1])[0])
    assert np.array_equal(vecs[5], adapted[int(ids[5])])
    assert cache.models_of(ids[4:6]) == [NEW, "adadadadadadadad"]


def test_concurrent_queries_never_see_an_item_missing_or_twice(gallery):
    uri, ids, old, new = gallery
    cache = _cache(uri, 0, 1)
    writer = open_store(uri)
    stop, seen = threading.Event(), []
    q = {"old": old[:3], "new": new[:3]}

    def search():
        while not stop.is_set():
            _, I, _ = cache.search(q, 200, exact=True)
            seen.append([sorted(row.tolist()) for row in I])

    t = threading.Thread(target=search)
    t.start()
    for start in range(0, 200, 20):
        writer.write_items(
            [ItemWrite(ids[start : start + 20], "new", new[start : start + 20], NEW)]
        )
    stop.set()
    t.join(30)
    assert seen and all(row == sorted(ids.tolist()) for rows in seen for row in rows)
    assert cache.counts()["new"] == 200


def test_a_restored_version_reloads_the_cache_and_a_lost_store_is_an_error(gallery, tmp_path):
    import shutil

    uri, ids, old, new = gallery
    cache = _cache(uri, 0, 1)
    writer = open_store(uri)
    writer.mark("before")
    writer.write_items([ItemWrite(ids[:10], "new", new[:10], NEW)])
    assert cache.counts()["new"] == 10
    writer.rollback("before")  # the table goes back to a version before those writes
    assert cache.counts()["new"] == 0 and cache.reloads == 1
    shutil.rmtree(tmp_path / "db")
    with pytest.raises(Exception):  # noqa: B017  (LanceDB's own error type)
        cache.counts()
    assert cache.follow_status()["error"]
