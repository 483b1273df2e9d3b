"""A shard's guarded-upgrade state without Ray: old vectors kept until finalize, per-item
rollback records, the model fingerprint of every vector, and state directories of the first
format."""

import json
import os
import struct
import zlib

import numpy as np
import pytest

from raycompat.index.search import l2_normalize
from raycompat.serving.durability import LOG_NAME, SNAPSHOT_NAME, write_snapshot
from raycompat.serving.state import ShardState

DIMS = {"old": 8, "adapted": 12, "new": 12}
MODELS = {"old": "0ld0ld0ld0ld0ld0", "adapted": "adadadadadadadad", "new": "5e5e5e5e5e5e5e5e"}


def _state(path, n=200, fsync=False, **kw):
    rng = np.random.default_rng(0)
    st = ShardState(str(path), DIMS, fsync=fsync, default_models=MODELS, **kw)
    ids = np.arange(n, dtype=np.int64) * 3 + 1
    old = l2_normalize(rng.standard_normal((n, 8)))
    st.load_initial("old", ids, old)
    st.snapshot()
    return st, ids, old, l2_normalize(rng.standard_normal((n, 12)))


def _reps(st, ids):
    return st.representation_of(ids)


@pytest.mark.parametrize("on_disk", [False, True])
def test_an_upgraded_item_keeps_its_old_vector_until_finalize(tmp_path, on_disk):
    st, ids, old, new = _state(tmp_path / "s", kept_on_disk=on_disk)
    st.upsert(ids[:60], "new", new[:60], model=MODELS["new"])
    assert st.kept_ids().tolist() == ids[:60].tolist()
    usage = st.kept_usage()
    assert usage["items"] == 60 and usage["on_disk"] is on_disk
    assert (usage["disk_bytes"] if on_disk else usage["memory_bytes"]) >= 60 * 8 * 4
    assert (usage["memory_bytes"] if on_disk else usage["disk_bytes"]) == 0
    st.upsert(ids[:10], "new", new[100:110])  # again: the first old vector stays kept
    st.upsert(ids[20:21], "old", old[199:200])  # back to old by hand: nothing kept for it
    assert 20 * 3 + 1 not in st.kept_ids().tolist() and len(st.kept_ids()) == 59
    res = st.rollback(ids[:80])
    assert sorted(res["rolled_back"]) == sorted(set(ids[:60].tolist()) - {ids[20]})
    assert res["not_new"] == [ids[20]] + ids[60:80].tolist()  # nothing kept, not new
    assert _reps(st, ids[:80]) == ["old"] * 80
    reps, vecs = st.lookup(ids[:60])
    expected = [old[199] if i == 20 else old[i] for i in range(60)]
    assert np.array_equal(np.stack(vecs), np.stack(expected))
    assert st.model_counts() == {MODELS["old"]: 200}
    again = st.rollback(ids[:80])  # idempotent; a retry counts not_new (the controller)
    assert again["rolled_back"] == [] and again["not_new"] == ids[:80].tolist()
    st.upsert(ids[:50], "new", new[:50], model=MODELS["new"])
    st.rollback(ids[40:45])
    before = (st.items(), st.model_counts(), st.kept_ids().tolist())
    st.close()
    if on_disk:  # the memory-mapped file is unlinked: nothing is left behind
        assert sorted(os.listdir(st.directory)) == sorted(
            ["LOCK", "WRITE.lock", "SNAPSHOT.lock", LOG_NAME, SNAPSHOT_NAME]
        )
    again = ShardState(st.directory, DIMS, fsync=False, kept_on_disk=on_disk)  # log replay
    assert again.model_counts() == {MODELS["old"]: 155, MODELS["new"]: 45} == before[1]
    assert again.kept_ids().tolist() == before[2] and np.array_equal(again.items()[1], before[0][1])
    again.snapshot()
    again.close()
    third = ShardState(st.directory, DIMS, fsync=False)  # from the snapshot's arrays
    assert third.recovery["replayed_records"] == 0 and third.kept_ids().tolist() == before[2]
    res = third.finalize()
    assert res["dropped"] == 45 and third.kept_usage()["items"] == 0
    with np.load(os.path.join(st.directory, SNAPSHOT_NAME)) as z:
        assert not [k for k in z.files if k.startswith("kept_")]
        names = json.loads(bytes(z["meta"]).decode())["models"]
        assert [names[c] for c in z["model_new"]] == [MODELS["new"]] * 45
    assert third.rollback(ids)["rolled_back"] == []
    third.close()
    assert ShardState(st.directory, DIMS, fsync=False).model_counts()[MODELS["new"]] == 45


def test_a_state_directory_of_the_first_format_loads_with_default_models(tmp_path):
    """A snapshot without model arrays and log records of the first format (written before
    model identity) load; their vectors get the representation's default model."""
    d = str(tmp_path / "s")
    rng = np.random.default_rng(1)
    ids = np.arange(40, dtype=np.int64)
    parts = {r: (np.zeros(0, np.int64), np.zeros((0, n), np.float32)) for r, n in DIMS.items()}
    parts["old"] = (ids, l2_normalize(rng.standard_normal((40, 8))))
    write_snapshot(d, 0, parts, DIMS)
    new = l2_normalize(rng.standard_normal((5, 12)))
    payload = ids[:5].astype("<i8").tobytes() + new.astype("<f4").tobytes()
    head = struct.pack("<4sQIIBI", b"RCUL", 1, 5, 12, 2, zlib.crc32(payload))
    with open(os.path.join(d, LOG_NAME), "wb") as fh:
        fh.write(head + payload)
    st = ShardState(d, DIMS, fsync=False, default_models=MODELS)
    assert st.recovery["replayed_records"] == 1
    assert st.model_counts() == {MODELS["old"]: 35, MODELS["new"]: 5}
    assert st.kept_ids().tolist() == [0, 1, 2, 3, 4]  # upgraded by a first-format record
    st.upsert(ids[5:7], "new", new[:2], model="f00df00df00df00d")
    st.close()
    st = ShardState(d, DIMS, fsync=False, default_models=MODELS)
    assert st.models_of([0, 5, 7]) == [MODELS["new"], "f00df00df00df00d", MODELS["old"]]


def test_failed_rollback_records_leave_exactly_the_acknowledged_rollbacks(tiny_fs):
    """On a full disk, upserts and rollbacks fail part-way through their record; after a
    restart every item is in exactly one representation and the rolled-back set is the
    acknowledged one."""
    from raycompat.serving.durability import StorageError

    fs = tiny_fs(256 << 10)
    st, ids, old, new = _state(os.path.join(fs, "s"), n=300, snapshot_every=10**9, fsync=True)
    rng = np.random.default_rng(2)
    rep = dict.fromkeys(ids.tolist(), "old")
    outcomes = {"acked": 0, "failed": 0}
    tiny_fs.fill(fs, leave=24 << 10, spare=32 << 10)
    for step in range(120):
        if step == 70:
            os.unlink(os.path.join(fs, "spare"))
        batch = rng.choice(ids, int(rng.integers(1, 40)), replace=False)
        try:
            if step % 3:
                st.upsert(batch, "new", new[(batch - 1) // 3], model=MODELS["new"])
                rep.update(dict.fromkeys(batch.tolist(), "new"))
            else:
                back = st.rollback(batch)["rolled_back"]
                assert set(back) == {i for i in batch.tolist() if rep[i] == "new"}
                rep.update(dict.fromkeys(back, "old"))
        except StorageError as exc:
            assert "no space left on device at" in str(exc)
            outcomes["failed"] += 1
            continue
        outcomes["acked"] += 1
    assert outcomes["acked"] > 5 and outcomes["failed"] > 5, outcomes
    st.close()
    again = ShardState(st.directory, DIMS, default_models=MODELS)
    got = dict(zip(ids.tolist(), again.representation_of(ids), strict=True))
    assert got == rep and sum(again.counts().values()) == ids.size
    back_to_old = [i for i in ids.tolist() if rep[i] == "old"]
    _, vecs = again.lookup(back_to_old)
    assert np.array_equal(np.stack(vecs), old[(np.asarray(back_to_old) - 1) // 3])


def test_reshard_moves_models_and_kept_vectors(tmp_path):
    from raycompat.serving.layout import read_layout
    from raycompat.serving.placement import split_by_shard
    from raycompat.serving.reshard import reshard

    root = tmp_path / "state"
    rng = np.random.default_rng(3)
    ids = np.arange(90, dtype=np.int64)
    old = l2_normalize(rng.standard_normal((90, 8)))
    new = l2_normalize(rng.standard_normal((90, 12)))
    for s, p in enumerate(split_by_shard(ids, 2)):
        st = ShardState(str(root / f"shard-{s}"), DIMS, fsync=False, default_models=MODELS)
        st.load_initial("old", ids[p], old[p])
        st.snapshot()
        up = p[p < 60]
        st.upsert(ids[up], "new", new[up], model=MODELS["new"])
        st.rollback(ids[up[ids[up] >= 50]])
        st.close()
    reshard(str(root), 3, fsync=False)
    layout = read_layout(str(root))
    counts, kept = {}, []
    for s in range(3):
        st = ShardState(layout.shard_dir(str(root), s), DIMS, fsync=False)
        for fp, n in st.model_counts().items():
            counts[fp] = counts.get(fp, 0) + n
        kept += st.kept_ids().tolist()
        back = st.rollback(st.kept_ids())["rolled_back"]
        _, vecs = st.lookup(back)
        assert np.array_equal(np.stack(vecs).reshape(-1, 8), old[back])
    assert counts == {MODELS["old"]: 40, MODELS["new"]: 50} and sorted(kept) == list(range(50))


def test_rollback_plan_takes_the_kept_ids_from_a_position_latest_first():
    from raycompat.serving.upgrade import rollback_plan

    order = np.array([50, 10, 40, 20, 30, 60])
    kept = np.array([10, 20, 30, 40, 50, 99])  # 99: upgraded by hand, not in the order
    ids, first = rollback_plan(kept, order, to=2)
    assert ids.tolist() == [30, 20, 40] and first == 2
    ids, first = rollback_plan(kept, order, to=None)
    assert ids.tolist() == [30, 20, 40, 10, 50, 99] and first == 0
    assert rollback_plan(kept, None, None)[0].tolist() == sorted(kept.tolist())
    assert rollback_plan(np.zeros(0, np.int64), order, 0)[0].size == 0


def test_model_identities_and_the_default_router_replicas(tmp_path):
    from raycompat.serving.app import router_replicas
    from raycompat.serving.config import serving_config
    from raycompat.serving.identity import derived_fingerprint
    from raycompat.serving.plan import build_plan

    cfg = serving_config(gallery="synthetic:50:8:12:0", state_dir=str(tmp_path / "s"))
    ids = build_plan(cfg).identities
    old = derived_fingerprint("gallery", "synthetic:50:8:12:0", "old")
    assert ids.default("old") == old and len(ids.defaults()) == 3
    assert ids.refusal(old, "old", 8) is None
    assert "unknown model fingerprint 'x'" in ids.refusal("x", "old", 8)
    assert "embeds to 8 dims, the vector has 12" in ids.refusal(old, "old", 12)
    assert "produces 'old' vectors" in ids.refusal(old, "new", 8)
    assert [router_replicas(cfg, cpus) for cpus in (1, 2, 16)] == [1, 2, 2]
    assert router_replicas(serving_config(gallery="synthetic:5", router_replicas=3), 1) == 3


# ----------------------------------------------------------------------------- the controller
# The backfill controller's commands through the upgrade state machine, on one in-memory shard
# reached as a Serve handle is (no Ray): the transitions the live index got wrong before.
class _Method:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args, **kw):
        import asyncio

        async def run():
            return await asyncio.to_thread(self.fn, *args, **kw)

        return run()


class FakeShard:
    """Representations and kept old vectors of every item; ``gate`` cleared: rollback and
    finalize calls wait for it (``entered`` says one came); ``fail_rollbacks``: refuse so
    many rollback calls."""

    def __init__(self):
        import threading

        self.rep: dict[int, str] = {}
        self.kept: set[int] = set()
        self.gate, self.entered = threading.Event(), threading.Event()
        self.gate.set()
        self.fail_rollbacks = 0

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return _Method(getattr(self, "do_" + name))

    def new(self) -> int:
        return sum(r == "new" for r in self.rep.values())

    def do_upsert(self, ids, rep, vectors, model=""):
        for i in np.asarray(ids).tolist():
            if self.rep[i] == "old" and rep == "new":
                self.kept.add(i)
            self.rep[i] = rep
        return {"applied": len(ids)}

    def do_rollback(self, ids):
        self.entered.set()
        self.gate.wait(10)
        if self.fail_rollbacks:
            self.fail_rollbacks -= 1
            return {"error": "refused by the test"}
        back = [i for i in np.asarray(ids).tolist() if i in self.kept]
        for i in back:
            self.rep[i] = "old"
            self.kept.discard(i)
        return {"rolled_back": back, "not_new": []}

    def do_kept_ids(self):
        return np.asarray(sorted(self.kept), np.int64)

    def do_finalize(self):
        self.entered.set()
        self.gate.wait(10)
        dropped = len(self.kept)
        self.kept.clear()
        return {"dropped": dropped}

    def do_counts(self):
        return {"old": len(self.rep) - self.new(), "new": self.new()}


@pytest.fixture
def controller(tmp_path):
    """``(controller, shard)``: a controller over one fake shard of a 40-item gallery."""
    from raycompat.serving.backfill_controller import BackfillController
    from raycompat.serving.config import serving_config
    from raycompat.serving.plan import build_plan

    cfg = serving_config(gallery="synthetic:40:8:12:0", state_dir=str(tmp_path / "s"),
                         num_shards=1, shard_timeout_s=1.5)  # fmt: skip
    shard = FakeShard()
    ctl = BackfillController([shard], build_plan(cfg))
    shard.rep = dict.fromkeys(ctl.gallery().gallery_ids().tolist(), "old")
    return ctl, shard


def _until(ctl, check, what, timeout=10.0):
    import time

    t0 = time.time()
    while not check(st := ctl.status()):
        assert time.time() - t0 < timeout, f"timed out waiting for {what}: {st}"
        time.sleep(0.01)
    return st


def _paused_at(ctl, shard, n):
    ctl.start(policy="sequential", batch_size=5, until=n)
    _until(ctl, lambda s: s["state"] == "paused" and s["position"] == n, f"paused at {n}")
    assert shard.new() == n and len(shard.kept) == n


def test_a_rollback_whose_last_batch_lands_after_a_pause_ends_before_a_finalize(controller):
    """The last rollback batch in flight when the pause comes: finalize is refused naming the
    unfinished rollback; once the batch lands the rollback ends (paused at its first
    position, not where the backfill was), then finalize; after it, rollback names it."""
    ctl, shard = controller
    _paused_at(ctl, shard, 20)
    shard.gate.clear()
    assert ctl.rollback(to=10, batch_size=10)["state"] == "rolling_back"
    assert shard.entered.wait(5)
    st = ctl.pause()
    assert st["state"] == "paused" and st["rollback"]["state"] == "paused"
    assert st["in_flight"] == {"kind": "rollback", "from": 0, "items": 10}
    refused = ctl.finalize()
    assert (
        refused["status"] == 409
        and "rollback is unfinished (paused after 0 of 10" in (refused["error"])
    )
    shard.gate.set()
    st = _until(ctl, lambda s: s["rollback"]["state"] == "done", "the rollback's end")
    assert (st["state"], st["position"], st["in_flight"]) == ("paused", 10, None)
    assert shard.new() == 10
    assert ctl.finalize() == {"dropped": 10, "per_shard": [10], "position": 10}
    for to, named in ((None, "finalized at position 10 (10 old vector(s) dropped)"),
                      (5, "roll back with 'to' >= 10")):  # fmt: skip
        refused = ctl.rollback(to=to)
        assert refused["status"] == 409 and named in refused["error"], refused
    assert ctl.status()["state"] == "paused" and shard.new() == 10


def test_a_rollback_after_finalizing_a_done_backfill_is_refused_and_it_stays_done(controller):
    ctl, shard = controller
    ctl.start(policy="sequential", batch_size=8)
    _until(ctl, lambda s: s["state"] == "done", "the end")
    refused = ctl.rollback(to=40)  # nothing at or after the end: it used to end paused
    assert refused["status"] == 409 and "nothing to roll back" in refused["error"]
    assert ctl.status()["state"] == "done"
    assert ctl.finalize()["dropped"] == 40
    refused = ctl.rollback()
    assert refused["status"] == 409 and "finalized at position 40" in refused["error"]
    st = ctl.status()
    assert (st["state"], st["position"], st["rollback"]) == ("done", 40, None)


def test_while_a_finalize_runs_every_other_command_is_refused(controller):
    import threading

    ctl, shard = controller
    _paused_at(ctl, shard, 10)
    shard.gate.clear()
    out = {}
    t = threading.Thread(target=lambda: out.update(ctl.finalize()))
    t.start()
    assert shard.entered.wait(5)
    assert ctl.status()["state"] == "finalizing" and ctl.pause()["state"] == "finalizing"
    for refused in (ctl.rollback(), ctl.resume(), ctl.start(restart=True), ctl.finalize()):
        assert refused["status"] == 409 and "a finalize is in progress" in refused["error"]
    shard.gate.set()
    t.join(10)
    assert out == {"dropped": 10, "per_shard": [10], "position": 10}
    st = ctl.status()
    assert st["state"] == "paused" and st["finalized"]["position"] == 10


def test_a_failed_rollback_batch_is_an_error_that_resume_continues(controller):
    ctl, shard = controller
    _paused_at(ctl, shard, 20)
    shard.fail_rollbacks = 1
    ctl.rollback(to=0, batch_size=5)
    st = _until(ctl, lambda s: s["state"] == "error", "the failure")
    assert st["rollback"]["state"] == "paused" and "refused by the test" in st["error"]
    refused = ctl.finalize()
    assert refused["status"] == 409 and "stopped by an error after 0 of 20" in refused["error"]
    assert ctl.resume()["state"] == "rolling_back"
    st = _until(ctl, lambda s: s["rollback"]["state"] == "done", "the rollback's end")
    assert (st["state"], st["position"], st["error"], shard.new()) == ("paused", 0, None, 0)


def test_a_status_hold_stops_the_walk_between_batches(controller):
    """What /status does: hold, read the shards, release; no batch moves meanwhile, so the
    shard's count equals the position (counts_consistent)."""
    import time

    ctl, shard = controller
    ctl.start(policy="sequential", batch_size=2, rate=40)  # a batch every 50 ms
    _until(ctl, lambda s: s["position"] >= 4, "a few batches")
    token = ctl.hold(lease_s=5)["token"]
    pos = ctl.status()["position"]
    time.sleep(0.3)
    assert ctl.status()["position"] == pos == shard.new()
    st = ctl.status(release=token)
    assert st["counts_consistent"] is True and st["in_flight"] is None
    _until(ctl, lambda s: s["position"] > pos, "the walk after the hold")
    token = ctl.hold(lease_s=0.05)["token"]  # a lease that ends before the release
    time.sleep(0.2)
    assert ctl.status(release=token)["counts_consistent"] is False
    assert ctl.status()["counts_consistent"] is None  # no hold: no counts to agree with
    ctl.pause()
