"""The backfill controller's guarded upgrade without Serve, over a real LanceDB store: its
commands through the upgrade state machine (the transitions the live index got wrong before),
the rollback plan, and the model fingerprint of every vector."""

import numpy as np
import pytest

from raycompat.upgrade.state_machine import State


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
# The controller's commands on a 40-item gallery in a LanceDB store, without Serve: a test
# subclass gates the store's rollback commits and finalize (``held`` cleared: they wait for it,
# ``entered`` says one came) and refuses ``fail_rollbacks`` of them.
def _gated_controller():
    import threading

    from raycompat.serving.backfill_controller import BackfillController

    class GatedController(BackfillController):
        def __init__(self, *a, **kw):
            self.held, self.entered = threading.Event(), threading.Event()
            self.held.set()
            self.fail_rollbacks = 0
            super().__init__(*a, **kw)

        def commit(self, writes, revert=None):
            if revert is not None:
                self.entered.set()
                self.held.wait(10)
                if self.fail_rollbacks:
                    self.fail_rollbacks -= 1
                    raise RuntimeError("refused by the test")
            return super().commit(writes, revert)

        def _finalize_store(self):
            self.entered.set()
            self.held.wait(10)
            return super()._finalize_store()

        def new(self) -> int:
            return self.store.count_upgraded()

        def kept(self) -> int:
            return int(self._kept_ids().size)

    return GatedController


@pytest.fixture
def controller(tmp_path):
    """``(controller, controller)``: a controller of a 40-item gallery in a LanceDB store (the
    second value, where the tests look at the store, is the same object)."""
    from raycompat.serving.config import serving_config
    from raycompat.serving.plan import build_plan
    from raycompat.serving.served_store import ensure_store

    cfg = serving_config(gallery="synthetic:40:8:12:0", state_dir=str(tmp_path / "s"),
                         num_shards=1, shard_timeout_s=1.5)  # fmt: skip
    plan = build_plan(cfg)
    ensure_store(cfg, plan.identities.default("old"), plan.query_dims.new)
    ctl = _gated_controller()([], plan)
    yield ctl, ctl
    ctl.pause()
    _close(ctl)


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
    assert shard.new() == n and shard.kept() == n


def test_a_rollback_whose_last_batch_lands_after_a_pause_ends_before_a_finalize(controller):
    """The last rollback batch in flight when the pause comes: finalize is refused naming the
    unfinished rollback; once the batch lands the rollback ends (paused at its first
    position, not where the backfill was), then finalize; after it, rollback names it."""
    ctl, shard = controller
    _paused_at(ctl, shard, 20)
    shard.held.clear()
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
    shard.held.set()
    st = _until(ctl, lambda s: s["rollback"]["state"] == "done", "the rollback's end")
    assert (st["state"], st["position"], st["in_flight"]) == ("paused", 10, None)
    assert shard.new() == 10
    assert ctl.finalize() == {"dropped": 10, "column_dropped": False, "position": 10}
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
    assert ctl.finalize() == {"dropped": 40, "column_dropped": True, "position": 40}
    assert ctl.store.old_dim is None  # every item upgraded: the old column is gone
    refused = ctl.rollback()
    assert refused["status"] == 409 and "finalized at position 40" in refused["error"]
    st = ctl.status()
    assert (st["state"], st["position"], st["rollback"]) == ("done", 40, None)


def test_while_a_finalize_runs_every_other_command_is_refused(controller):
    import threading

    ctl, shard = controller
    _paused_at(ctl, shard, 10)
    shard.held.clear()
    out = {}
    t = threading.Thread(target=lambda: out.update(ctl.finalize()))
    t.start()
    assert shard.entered.wait(5)
    assert ctl.status()["state"] == "finalizing" and ctl.pause()["state"] == "finalizing"
    for refused in (ctl.rollback(), ctl.resume(), ctl.start(restart=True), ctl.finalize()):
        assert refused["status"] == 409 and "a finalize is in progress" in refused["error"]
    shard.held.set()
    t.join(10)
    assert out == {"dropped": 10, "column_dropped": False, "position": 10}
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


def test_a_controller_killed_between_a_batch_and_its_record_writes_nothing_twice(
    controller, monkeypatch, capsys
):
    """The walk stops for good after a batch is committed and before the record
    says so (what a SIGKILL there leaves); a new controller on the same store finds the batch
    there (``recovered``), goes on after it, and every item is written exactly once; the
    record is the one ``backfill-store --status`` reads."""
    import json
    import threading
    import time
    from collections import Counter

    from raycompat.backfill_store.commands import main
    from raycompat.stores.lance import LanceStore

    ctl, _ = controller
    written: Counter = Counter()
    real = LanceStore.write_new

    def counted(store, ids, vectors, fingerprint, positions):
        out = real(store, ids, vectors, fingerprint, positions)
        written.update(np.asarray(ids).tolist())
        return out

    monkeypatch.setattr(LanceStore, "write_new", counted)
    killed, save, dead = threading.Event(), ctl._save_record, threading.Event()

    ctl.record_every_s = 0.0  # a record after every batch

    def save_or_die():  # the third batch's record is never saved: the walk stops there
        if sum(written.values()) >= 15:
            killed.set()
            dead.wait(60)  # until the test's end (a thread left waiting would hold the exit)
            raise RuntimeError("the killed controller")
        save()

    ctl._save_record = save_or_die
    ctl.start(policy="sequential", batch_size=5)
    assert killed.wait(10)
    assert ctl.up.records.load()["position"] == 10  # the record: two batches
    ctl.lease.__exit__(None, None, None)  # the dead controller's claim ends with it
    again = type(ctl)([], ctl.plan)
    st = again.status()
    assert st["recovered"]["from"] == 10 and st["recovered"]["to"] == 15, st
    assert st["resumed_from_checkpoint"] and st["state"] == "running"
    t0 = time.time()
    while again.status()["state"] != "done":
        assert time.time() - t0 < 10, again.status()
        time.sleep(0.01)
    assert sorted(written) == list(range(40)) and set(written.values()) == {1}, written
    assert main(["--store", again.store.uri.raw, "--status"]) == 0  # while the index serves
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (rec["position"], rec["total"], rec["state"]) == (40, 40, "done")
    assert rec["counts"]["upgraded"] == 40 and rec["driver"]["what"] == "live index"
    dead.set()
    _close(again)


# ----------------------------------------------------------------------------- the table
#: The live index's answer to each command in each state (a 40-item gallery; ``paused``: at 20;
#: ``rollback`` asks for ``to`` 10): the machine state after it, or ``409 <words of the
#: refusal>``.  Written out here, not read from raycompat.upgrade.state_machine: the controller
#: must give these answers, whatever the table module says.
LIVE_TABLE = {
    "idle": dict(start="running", restart="running", pause="idle",
                 resume="409 no backfill to resume", resume_override="409 no backfill to resume",
                 rollback="409 no backfill order: roll back without 'to'", finalize="idle"),
    "running": dict(start="409 already running", restart="running", pause="paused",
                    resume="running", resume_override="running",
                    rollback="409 while the backfill is running: pause it first",
                    finalize="409 while the backfill is running: pause it first"),
    "paused": dict(start="409 already paused", restart="running", pause="paused",
                   resume="running", resume_override="running", rollback="rolling_back",
                   finalize="paused"),
    "guard_paused": dict(start="409 already paused", restart="running", pause="guard_paused",
                         resume="409 paused by the canary guard map",
                         resume_override="running", rollback="rolling_back",
                         finalize="409 cannot finalize while the backfill is paused by the"),
    "rolling_back": dict(start="409 already rolling_back", restart="running",
                         pause="rollback_paused", resume="rolling_back",
                         resume_override="rolling_back",
                         rollback="409 while the backfill is rolling_back: pause it first",
                         finalize="409 while the backfill is rolling_back: pause it first"),
    "rollback_paused": dict(start="409 already paused", restart="running",
                            pause="rollback_paused", resume="rolling_back",
                            resume_override="rolling_back", rollback="rolling_back",
                            finalize="409 while a rollback is unfinished (paused after 5 of 10"),
    "done": dict(start="running", restart="running", pause="done", resume="done",
                 resume_override="done", rollback="rolling_back", finalize="done"),
    "error": dict(start="running", restart="running", pause="error", resume="rolling_back",
                  resume_override="rolling_back", rollback="rolling_back",
                  finalize="409 while a rollback is unfinished (stopped by an error after 5"),
    "finalizing": dict(start="409 while a finalize is in progress",
                       restart="409 while a finalize is in progress", pause="finalizing",
                       resume="409 while a finalize is in progress",
                       resume_override="409 while a finalize is in progress",
                       rollback="409 while a finalize is in progress",
                       finalize="409 while a finalize is in progress"),
}  # fmt: skip


def _command(ctl, name: str) -> dict:
    return {
        "start": lambda: ctl.start(policy="sequential", batch_size=5, rate=2),
        "restart": lambda: ctl.start(policy="sequential", batch_size=5, rate=2, restart=True),
        "pause": ctl.pause,
        "resume": lambda: ctl.resume(rate=2, clear_until=True),
        "resume_override": lambda: ctl.resume(rate=2, clear_until=True, override=True),
        "rollback": lambda: ctl.rollback(to=10, batch_size=5),
        "finalize": ctl.finalize,
    }[name]()


def _close(ctl) -> None:
    """End a controller of this process: its claim on the store, its walk's loop."""
    ctl.held.set()
    ctl.lease.__exit__(None, None, None)
    ctl._loop.call_soon_threadsafe(ctl._loop.stop)


def _stopped_states(root):
    """``{state: state dir}``: a controller's state dir (its LanceDB store) left in each state
    that a stopped controller can hold, built through its commands (``guard_paused``: the
    record a tripped guard writes; a canary needs the router)."""
    import shutil

    from raycompat.serving.config import serving_config
    from raycompat.serving.plan import build_plan
    from raycompat.serving.served_store import ensure_store

    cfg = serving_config(gallery="synthetic:40:8:12:0", state_dir=str(root / "base"),
                         num_shards=1, shard_timeout_s=1.5)  # fmt: skip
    plan = build_plan(cfg)
    ensure_store(cfg, plan.identities.default("old"), plan.query_dims.new)
    out = {}

    def keep(state, ctl):
        _close(ctl)
        shutil.copytree(root / "base", root / state)
        out[state] = root / state
        return _gated_controller()([], plan)

    ctl = keep("idle", _gated_controller()([], plan))
    ctl.start(policy="sequential", batch_size=5, until=20)
    _until(ctl, lambda s: s["state"] == "paused" and s["position"] == 20, "paused at 20")
    ctl = keep("paused", ctl)
    with ctl.lock:
        ctl.ck["paused_by"] = {"guard": "map", "position": 20, "reason": "map fell"}
        ctl._enter(State.GUARD_PAUSED)
        ctl._save_record()
    ctl = keep("guard_paused", ctl)
    ctl.ck["paused_by"] = None
    ctl._enter(State.PAUSED)
    ctl.held.clear()
    ctl.rollback(to=10, batch_size=5)
    assert ctl.entered.wait(5)
    ctl.pause()
    ctl.held.set()  # the first batch lands, the second waits for a resume
    _until(ctl, lambda s: s["rollback"]["done"] == 5 and not s["in_flight"], "5 rolled back")
    ctl = keep("rollback_paused", ctl)
    ctl.fail_rollbacks = 1
    ctl.resume()
    _until(ctl, lambda s: s["state"] == "error", "the failed rollback batch")
    ctl = keep("error", ctl)
    ctl.start(policy="sequential", batch_size=10, restart=True)
    _until(ctl, lambda s: s["state"] == "done", "the end")
    _close(keep("done", ctl))
    return out, plan


def test_every_command_in_every_state_answers_as_the_table(tmp_path):
    """The live index's state-machine table, cell by cell, on its controller (the answers its
    HTTP endpoints give: a 409 naming why, or the state after): each stopped state restored
    from a copy of its store (the record and order live there), ``running``, ``rolling_back``
    and ``finalizing`` entered from ``paused`` with the store's writes held; a refused command
    changes nothing, and the store's upgraded items agree with the position at rest."""
    import dataclasses
    import shutil
    import threading

    from raycompat.serving.config import serving_config

    stopped, plan = _stopped_states(tmp_path / "templates")
    cells = 0
    for state, row in LIVE_TABLE.items():
        for command, want in row.items():
            cell = tmp_path / f"{state}-{command}"
            shutil.copytree(stopped.get(state, stopped["paused"]), cell)
            cfg = serving_config(gallery="synthetic:40:8:12:0", state_dir=str(cell),
                                 num_shards=1, shard_timeout_s=1.5)  # fmt: skip
            ctl = _gated_controller()([], dataclasses.replace(plan, config=cfg))
            finalizing = None
            try:
                if state == "running":
                    ctl.resume(rate=2, clear_until=True)
                elif state == "rolling_back":
                    ctl.held.clear()
                    ctl.rollback(to=0, batch_size=5)
                    assert ctl.entered.wait(5)
                elif state == "finalizing":
                    ctl.held.clear()
                    finalizing = threading.Thread(target=ctl.finalize)
                    finalizing.start()
                    assert ctl.entered.wait(5)
                before = ctl._state().value
                assert before == state, (state, command, before)
                position = ctl.status()["position"]
                answer = _command(ctl, command)
                where = f"{command} in {state}: {answer}"
                if want.startswith("409 "):
                    assert answer.get("status") == 409 and want[4:] in answer["error"], where
                    assert ctl._state().value == state, where  # nothing changed
                    if state != "running":  # (a running walk moves on by itself)
                        assert ctl.status()["position"] == position, where
                else:
                    assert answer.get("status") is None, where
                    assert ctl._state().value == want, where
                ctl.held.set()
                if finalizing is not None:
                    finalizing.join(10)
                token = ctl.hold(lease_s=5, wait_s=5)["token"]  # what /status does
                at_rest = ctl._state().value in ("idle", "paused", "guard_paused", "done")
                if at_rest:
                    assert ctl.new() == ctl.status()["position"], where
                assert ctl.status(release=token)["counts_consistent"], where
            finally:
                _close(ctl)
            cells += 1
    assert cells == 9 * 7
