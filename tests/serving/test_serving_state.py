"""Shard state without Ray: one representation per item, atomic upserts, snapshot + log recovery."""

import os
import threading

import numpy as np
import pytest

from raycompat.index.ann import index_options
from raycompat.index.search import exact_search, l2_normalize
from raycompat.serving.durability import LOG_NAME
from raycompat.serving.placement import shard_of, split_by_shard
from raycompat.serving.state import ShardState, UnknownItemError

DIMS = {"old": 8, "adapted": 12, "new": 12}


def _state(tmp_path, n=200, index=None, seed=0, **kw):
    rng = np.random.default_rng(seed)
    st = ShardState(str(tmp_path / "s"), DIMS, index=index, **kw)
    ids = np.arange(n, dtype=np.int64) * 3 + 1
    st.load_initial("old", ids, l2_normalize(rng.standard_normal((n, 8))))
    st.snapshot()
    return st, ids, rng


def test_placement_is_deterministic_and_balanced():
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


def test_search_matches_exact_search_and_moves_items(tmp_path):
    st, ids, rng = _state(tmp_path)
    q = l2_normalize(rng.standard_normal((5, 8)))
    S, I, R = st.search({"old": q}, 10)
    es, ei = exact_search(q, st.reps["old"].export()[1], 10, normalize=False)
    exp_ids = st.reps["old"].export()[0][ei]
    assert (I == exp_ids).all() and np.allclose(S, es, atol=1e-6) and (R == 0).all()
    new = l2_normalize(rng.standard_normal((50, 12)))
    st.upsert(ids[:50], "new", new)
    assert st.counts() == {"old": 150, "adapted": 0, "new": 50}
    S, I, R = st.search({"old": q, "new": l2_normalize(rng.standard_normal((5, 12)))}, 300)
    got = I[I >= 0]
    assert got.size == 5 * 200 and all(
        np.unique(row[row >= 0]).size == 200 for row in I
    )  # every item exactly once
    assert set(I[R == 2].ravel().tolist()) == set(ids[:50].tolist())
    with pytest.raises(UnknownItemError, match="unknown item"):
        st.upsert(np.array([2]), "new", new[:1])
    with pytest.raises(ValueError, match="must be"):
        st.upsert(ids[:1], "new", np.zeros((1, 8), np.float32))
    assert st.counts()["new"] == 50


def test_concurrent_queries_never_see_an_item_missing_or_twice(tmp_path):
    st, ids, rng = _state(tmp_path, n=300, fsync=False)
    newv = l2_normalize(rng.standard_normal((300, 12)))
    q = {
        "old": l2_normalize(rng.standard_normal((3, 8))),
        "new": l2_normalize(rng.standard_normal((3, 12))),
    }
    bad = []
    stop = threading.Event()

    def reader():
        while not stop.is_set():
            _, I, _ = st.search(q, 300)
            for row in I:
                if np.unique(row).size != 300 or (row < 0).any():
                    bad.append(row)

    t = threading.Thread(target=reader)
    t.start()
    for s in range(0, 300, 7):
        st.upsert(ids[s : s + 7], "new", newv[s : s + 7])
    stop.set()
    t.join()
    assert not bad and st.counts()["new"] == 300


@pytest.mark.parametrize("kind", ["flat", "hnsw"])
def test_recovery_from_snapshot_and_log_with_torn_tail(tmp_path, kind):
    index = index_options(kind=kind)
    st, ids, rng = _state(tmp_path, index=index)
    newv = l2_normalize(rng.standard_normal((60, 12)))
    st.upsert(ids[:30], "new", newv[:30])
    st.upsert(ids[30:60], "adapted", newv[30:60])
    before = st.items()
    with open(
        os.path.join(st.directory, LOG_NAME), "ab"
    ) as fh:  # a crash in the middle of an append
        fh.write(b"RCUL\x00\x01garbage")
    st2 = ShardState(st.directory, DIMS, index=index)
    assert st2.recovery["replayed_records"] == 2 and st2.recovery["truncated_bytes"] > 0
    after = st2.items()
    assert (after[0] == before[0]).all() and (after[1] == before[1]).all()
    assert np.array_equal(st2.reps["new"].export()[1], st.reps["new"].export()[1])
    q = {
        "old": l2_normalize(rng.standard_normal((2, 8))),
        "new": l2_normalize(rng.standard_normal((2, 12))),
        "adapted": l2_normalize(rng.standard_normal((2, 12))),
    }
    a, b = st.search(q, 20), st2.search(q, 20)
    assert (a[1] == b[1]).all()
    # a snapshot folds the log in; recovery then replays nothing
    st2.snapshot()
    st3 = ShardState(st.directory, DIMS, index=index)
    assert st3.recovery["replayed_records"] == 0 and (st3.items()[1] == before[1]).all()


# ----------------------------------------------------------------------------- faults on disk
def test_failed_log_writes_leave_exactly_the_acknowledged_upserts(tiny_fs):
    """On a full disk, upserts of random sizes fail part-way through their record; after a
    restart the shard holds exactly the acknowledged ones (a failed record never comes back)."""
    from raycompat.serving.durability import StorageError

    fs = tiny_fs(256 << 10)
    rng = np.random.default_rng(7)
    n = 400
    st = ShardState(os.path.join(fs, "s"), DIMS, fsync=True, snapshot_every=10**9)
    ids = np.arange(n, dtype=np.int64)
    st.load_initial("old", ids, l2_normalize(rng.standard_normal((n, 8))))
    st.snapshot()
    expected = dict(zip(*st.items(), strict=True))
    vectors = {}
    acked = failed = 0
    tiny_fs.fill(fs, leave=24 << 10, spare=32 << 10)
    for step in range(120):
        if step == 60:  # space freed: later upserts succeed again
            os.unlink(os.path.join(fs, "spare"))
        k = int(rng.integers(1, 60))
        batch = rng.choice(ids, k, replace=False)
        vec = l2_normalize(rng.standard_normal((k, 12)))
        try:
            st.upsert(batch, "new", vec)
        except StorageError as exc:
            assert "no space left on device at" in str(exc) and "upserts.log" in str(exc)
            failed += 1
            continue
        acked += 1
        for i, v in zip(batch.tolist(), vec, strict=True):
            expected[i], vectors[i] = 2, v
    assert acked > 5 and failed > 5, (acked, failed)
    st.close()
    st2 = ShardState(st.directory, DIMS)
    got_ids, got_codes = st2.items()
    assert dict(zip(got_ids.tolist(), got_codes.tolist(), strict=True)) == expected
    new_ids, new_vecs = st2.reps["new"].export()
    assert np.array_equal(new_vecs, np.stack([vectors[i] for i in new_ids.tolist()]))
    assert st2.recovery["truncated_bytes"] == 0 and not st2.recovery["corrupt_records"]


def test_a_failed_snapshot_keeps_the_log_and_leaves_no_temp_file(tiny_fs):
    from raycompat.serving.durability import SNAPSHOT_NAME, StorageError
    from raycompat.serving.shared_log import rotated_logs

    fs = tiny_fs(512 << 10)
    rng = np.random.default_rng(3)
    st = ShardState(os.path.join(fs, "s"), DIMS, fsync=True)
    ids = np.arange(3000, dtype=np.int64)
    st.load_initial("old", ids[:300], l2_normalize(rng.standard_normal((300, 8))))
    st.snapshot()
    st.upsert(ids[:50], "new", l2_normalize(rng.standard_normal((50, 12))))
    st.reps["old"].add(ids[300:], l2_normalize(rng.standard_normal((2700, 8))))  # a big export
    tiny_fs.fill(fs)
    with pytest.raises(StorageError, match="no space left on device at .*snapshot.npz.tmp"):
        st.snapshot()
    files = sorted(os.listdir(st.directory))
    assert SNAPSHOT_NAME + ".tmp" not in files and SNAPSHOT_NAME in files
    (rotated,) = rotated_logs(st.directory)  # the rotated log is kept: nothing is lost
    assert rotated[0] == 1 and os.path.getsize(rotated[1]) > 0
    os.unlink(os.path.join(fs, "filler"))
    again = ShardState(st.directory, DIMS)
    assert again.counts()["new"] == 50 and again.recovery["replayed_records"] == 1


def _log_with_records(tmp_path, n_records=12):
    st, ids, rng = _state(tmp_path, fsync=False)
    vecs = {}
    for r in range(n_records):
        batch = ids[r * 5 : r * 5 + 5]
        v = l2_normalize(rng.standard_normal((5, 12)))
        st.upsert(batch, "new", v)
        vecs.update(zip(batch.tolist(), v, strict=True))
    st.close()
    return st, vecs


def _record_offsets(path):
    from raycompat.serving.durability import UpsertLog

    return [r.offset for r in UpsertLog(path).replay()]


@pytest.mark.parametrize("where", ["payload", "header"])
def test_a_flipped_byte_mid_log_keeps_every_later_record(tmp_path, where):
    """Corruption in the middle is not a torn tail: the records after it are kept, the damage
    is reported with the lost sequence number, and the damaged file is kept aside."""
    st, vecs = _log_with_records(tmp_path)
    log = os.path.join(st.directory, LOG_NAME)
    offsets = _record_offsets(log)
    bad = offsets[4]  # record seq 5 (items ids[20:25])
    with open(log, "r+b") as fh:
        fh.seek(bad + (40 if where == "payload" else 13))  # a vector byte, or the count n
        b = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([b[0] ^ 0x10]))
    st2 = ShardState(st.directory, DIMS)
    rec = st2.recovery
    assert rec["replayed_records"] == 11 and rec["truncated_bytes"] == 0
    (damage,) = rec["corrupt_records"]
    assert damage["offset"] == bad and damage["lost_seqs"] == [5]
    assert os.path.exists(rec["corrupt_log_kept_as"]) and st2.health()["corrupt_records"] == 1
    new_ids = set(st2.reps["new"].export()[0].tolist())
    expected_new = set(vecs) - {int(i) for i in (np.arange(200) * 3 + 1)[20:25]}  # seq 5's items
    assert new_ids == expected_new
    # the recovered state was folded into a snapshot: a restart replays nothing, loses nothing
    st2.close()
    st3 = ShardState(st.directory, DIMS)
    assert st3.recovery["replayed_records"] == 0 and not st3.recovery["corrupt_records"]
    assert set(st3.reps["new"].export()[0].tolist()) == expected_new


def test_a_corrupt_snapshot_is_named(tmp_path):
    from raycompat.serving.durability import SNAPSHOT_NAME, CorruptStateError

    st, _, _ = _state(tmp_path)
    st.close()
    path = os.path.join(st.directory, SNAPSHOT_NAME)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(path, "wb").write(bytes(data))
    with pytest.raises(CorruptStateError, match=f"snapshot {path} is corrupt"):
        ShardState(st.directory, DIMS)


@pytest.mark.subprocess
def test_reshard_cannot_take_a_shard_directory_a_replica_holds(tmp_path):
    import subprocess
    import sys

    from raycompat.serving.state import ShardLockedError

    st, _, _ = _state(tmp_path)
    code = (
        "import sys; from raycompat.serving.state import ShardState\n"
        f"ShardState({st.directory!r}, {DIMS!r}, exclusive=True)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode != 0 and "in use by another process" in r.stderr
    st.close()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert ShardLockedError.__doc__
