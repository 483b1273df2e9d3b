"""The backfill controller: walks a policy's order, writing each item's new-model vector to the
served store, at a given rate, pausable, resumable, and crash-safe; it is also the store's one
writer for the router's upserts (:meth:`BackfillController.upsert_items`, concurrent requests
grouped into one commit).

Its record is the store's upgrade record, the one ``raycompat backfill-store`` keeps
(:class:`raycompat.upgrade.store_record.StoreUpgrade`: the record and the order are records in
the store; ``backfill-store --status`` reads it).  Every batch is one commit of the store that
writes the items' new vectors with their positions in the order, then the record is saved, so:

* a controller killed between the two finds the batch in the store when it starts again (its
  items at their positions, with the model's fingerprint) and goes on after it: nothing is
  written twice (:func:`raycompat.stores.backfill.reconciled_position`);
* an item upgraded before a crash stays upgraded (nothing but a rollback moves an item back);
* the shards are caches of the store: a shard replica that dies takes no write with it.

New vectors come from the gallery source (the embeddings parquet's ``new`` column, or the
synthetic generator), the Ray Data pipeline's parquet output, or the embedder actor pool.

Upgrade on read (``upgrade_on_read`` at start; docs/live-index.md): the router reports the ids
every search returned (:meth:`BackfillController.note_reads`); the controller keeps the last
``read_window`` searches and, before a batch, when searches came in since the last batch,
moves the items they returned that are still waiting to the front of the rest of the order
(:func:`raycompat.serving.orders.reorder_on_read`, the simulator's ``upgrade-on-read`` rule)
and saves the order in the store before the batch.  Only the part after ``position`` moves, so the
backfilled prefix, exactly-once and the crash resume are as before.

Every command and every event of the walk is decided by the upgrade state machine
(:mod:`raycompat.upgrade.state_machine`, docs/live-index.md "The upgrade state machine"):
:meth:`BackfillController._decide` asks it with the record's facts, :meth:`_enter` writes
the state it answers back into the record.

A consistent ``/status`` (the router's ``gather_status``): :meth:`BackfillController.hold`
waits (at most ``wait_s``) for the batch in flight to be acknowledged and then lets no new
batch, backfill or rollback, be sent until ``status(release=token)`` or the lease ends; the
router reads the shards in between, so their counts and the controller's position and
rollback progress are of one moment (``counts_consistent``; ``in_flight`` names a batch sent
and not acknowledged).
"""

from __future__ import annotations

import asyncio
import collections
import os
import threading
import time

import numpy as np

from raycompat.serving.plan import ServingPlan
from raycompat.serving.upgrade import UpgradeCommands
from raycompat.storage import StorageError
from raycompat.upgrade.state_machine import (
    LIVE_INDEX,
    Answer,
    Command,
    Facts,
    State,
    enter_state,
    state_of,
)
from raycompat.upgrade.store_record import StoreUpgrade

__all__ = ["BackfillController"]

#: what the store's driver record calls a live index (``backfill-store`` names it)
LIVE_DRIVER = "live index"


def claim_store(store):
    """Claim the upgrade of ``store`` for this live index and keep the claim fresh (a
    heartbeat thread); ``ConfigError`` naming the driver that holds it (a ``backfill-store``
    job, or another index), which fails the controller's start."""
    from raycompat.config import ConfigError
    from raycompat.stores.backfill import BackfillRecords, DriverHeld, Heartbeat

    try:
        return Heartbeat(BackfillRecords(store), None, LIVE_DRIVER).__enter__()
    except DriverHeld as exc:
        raise ConfigError(f"serving: {exc}") from None


#: seconds between two saves of the record while batches go on (every other change of the
#: record is saved at once): the store's positions say where the order stands after a crash
RECORD_EVERY_S = 1.0
#: most upsert requests grouped into one commit of the store
UPSERT_GROUP = 64
#: commits of the store between two compactions
COMPACT_EVERY = 64


class BackfillController(UpgradeCommands):
    """Serve deployment class (one replica); ``shards``: the shard deployment handles.  The
    canary gate, rollback, finalize and the stale listing: :class:`UpgradeCommands`."""

    def __init__(self, shards: list, plan: ServingPlan):
        from raycompat.serving.served_store import open_served_store

        self.shards = list(shards)  # deployment handles, awaited on the replica's event loop
        self.plan = plan
        self.cfg = plan.config
        self.store = open_served_store(self.cfg)
        self.store_lock = threading.Lock()  # one commit at a time: the write sequence grows
        self.lease = claim_store(self.store)  # the one driver of the store's upgrade
        self._upserts = None  # the Batcher of the router's upserts, made on the event loop
        self._known: np.ndarray | None = None  # the store's ids, read at the first upsert
        self._commits = 0  # commits since the last compaction
        self.compact_error: str | None = None
        self.lock = threading.RLock()
        self.wake = threading.Condition(self.lock)
        self.up = StoreUpgrade(self.store)  # the record, kept in the store
        self._record_saved = -float("inf")
        self.record_every_s = RECORD_EVERY_S
        self.resumed = False
        self.error: str | None = None
        self._sources = {}
        self._gallery = None
        self.upsert_retries = 0
        self.errors = 0
        self.generation = 0
        self._rate_t0 = time.perf_counter()
        self._rate_p0 = 0
        self.reads: collections.deque = collections.deque(maxlen=1)  # recent searches' ids
        self.reads_seen = 0  # searches reported by the router
        self._reads_applied = 0  # ... of which the order has been reordered with
        self._in_flight: dict | None = None  # a batch sent to the shards, not acknowledged
        self._holds: dict[int, list] = {}  # /status holds: token -> [lease end, at rest]
        self._hold_seq = 0
        self._send_waiting = False  # a batch waits for the holds to end (it goes first)
        self._finalizing_from: State | None = None  # while a finalize runs: where it began
        self._load_record()
        self._init_upgrade()
        self._task: asyncio.Task | None = None  # the walk
        self._walk_wake: asyncio.Event | None = None
        self.worker_restarts = 0
        self._loop = _event_loop()
        self._ensure_worker()

    def _ensure_worker(self) -> None:
        """Start the walk (an asyncio task on the replica's event loop), or a new one if the
        last one ended; from a command's thread it is started on that loop."""
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        if here is self._loop:
            self._spawn()
        else:
            asyncio.run_coroutine_threadsafe(self._aspawn(), self._loop).result(timeout=30)

    async def _aspawn(self) -> None:
        self._spawn()

    def _spawn(self) -> None:
        """(on the loop) The walk's task, unless it runs."""
        if self._task is not None and not self._task.done():
            return
        if self._task is not None:
            self.worker_restarts += 1
        if self._walk_wake is None:
            self._walk_wake = asyncio.Event()
        self._task = self._loop.create_task(self._walk(), name="backfill")

    def _notify(self) -> None:
        """(lock held) Wake what waits for the controller: the walk and the threads of
        commands (a hold, a command waiting for the batch in flight)."""
        self.wake.notify_all()
        if self._walk_wake is not None:
            self._loop.call_soon_threadsafe(self._walk_wake.set)

    # ------------------------------------------------------------------ the record
    @property
    def ck(self) -> dict:
        """The upgrade's record (the store's; ``{"state": "idle", ...}`` before any backfill)."""
        return self.up.rec

    @property
    def order(self) -> np.ndarray | None:
        """The backfill's order (item ids), read from the store once; ``None`` without one."""
        return self.up.order if self.ck.get("order") else None

    def _load_record(self) -> None:
        """The store's record; a batch written after it was saved (the controller killed in
        between) is found in the store and the position moved past it."""
        from raycompat.stores.backfill import reconciled_position
        from raycompat.stores.errors import StoreError

        rec = self.up.rec
        if not rec.get("state"):
            rec.update(state="idle", position=0, total=0)
            return
        if rec["state"] == State.FINALIZING.public:  # never saved; for safety
            rec["state"] = State.PAUSED.public
        rec.setdefault("source", "gallery")  # a record that backfill-store began
        rec.setdefault("batch_size", 256)
        st = self._state()
        if rec.get("order") and st not in (State.ROLLING_BACK, State.ROLLBACK_PAUSED):
            pos = int(rec.get("position") or 0)
            base = int(rec.get("position_base") or 0)
            try:
                new = reconciled_position(self.store, self.up.order, pos, rec["new_model"], base)
            except StoreError as exc:  # the store changed outside the upgrade: say so
                self.error = rec["error"] = str(exc)
                self._enter(self._decide(Command.FAILURE).state)
                return
            if new != pos:
                rec["position"] = new
                rec["recovered"] = {"from": pos, "to": new, "at": round(time.time(), 3)}
        self.resumed = rec["state"] == "running"
        self._rate_p0 = int(rec["position"])
        self.reads = collections.deque(maxlen=int(rec.get("read_window") or 1))

    def _save_record(self) -> None:
        """Save the record in the store (while a finalize runs: the state it began in)."""
        self._record_saved = time.monotonic()
        rec = self.up.rec
        if self._finalizing_from is not None:
            self.up.records.save({**rec, "state": self._finalizing_from.public})
            return
        try:
            self.up.records.save(rec)
        except Exception as exc:
            raise StorageError(
                f"store {self.store.uri.raw} refused the backfill record: {exc}"
            ) from None

    def _save_order(self, order: np.ndarray) -> None:
        """The order into the store (the record names it; saved with the record)."""
        from raycompat.stores.backfill import new_run_id

        run = (self.ck.get("order") or {}).get("run") or new_run_id()
        try:
            self.ck["order"] = self.up.records.write_order(run, order)
        except Exception as exc:
            raise StorageError(
                f"store {self.store.uri.raw} refused the backfill order: {exc}"
            ) from None
        self.up._order = np.asarray(order, np.int64)

    # ------------------------------------------------------------------ sources
    def gallery(self):
        """The gallery source (ids, initial and new vectors; what the policies order)."""
        if self._gallery is None:
            from raycompat.serving.gallery_source import open_gallery
            from raycompat.serving.scoring import adapted_transform

            mode = self.cfg.mode
            self._gallery = open_gallery(
                self.cfg.gallery,
                self.cfg.new_model,
                adapted=adapted_transform(mode),
                need_rank_merge=mode == "rank_merge",
            )
        return self._gallery

    def _vector_source(self, name: str):
        """Where new vectors come from (``gallery``, ``pipeline`` or ``embedder``; opened once);
        the store holds them as the new model made them (normalised), rho is the shards'."""
        if name not in self._sources:
            self._sources[name] = self._open_source(name)
        return self._sources[name]

    def _open_source(self, name: str):
        from raycompat.config import ConfigError

        cfg = self.cfg
        if name == "gallery":
            return self.gallery()
        if name == "pipeline":
            from raycompat.serving.gallery_source import PipelineOutput

            if not cfg.pipeline_output:
                raise ConfigError(
                    "source 'pipeline' needs the option pipeline_output (the pipeline's parquet)"
                )
            return PipelineOutput(cfg.pipeline_output)
        if name == "embedder":
            from raycompat.serving.embedder_pool import EmbedderPool

            if not cfg.new_model:
                raise ConfigError(
                    "source 'embedder' needs the option new_model (a ModelBundle directory)"
                )
            return EmbedderPool(
                cfg.new_model,
                cfg.items,
                size=cfg.embedder_actors,
                num_cpus=cfg.embedder_cpus,
                resolution=cfg.resolution,
                data_seed=cfg.data_seed,
            )
        raise ConfigError(f"unknown source {name!r}; allowed: gallery, pipeline, embedder")

    def _head(self):
        if not self.cfg.new_model:
            return None
        from raycompat.models import ModelBundle
        from raycompat.models.uncertainty_head import UncertaintyHead

        return UncertaintyHead.from_classifier_head(ModelBundle.load(self.cfg.new_model).head)

    # ------------------------------------------------------------------ the state machine
    def _state(self) -> State:
        """(lock held) The upgrade state of the record."""
        if self._finalizing_from is not None:
            return State.FINALIZING
        rb = self.ck.get("rollback") or {}
        return state_of(self.ck["state"], rb.get("state"), bool(self.ck.get("paused_by")))

    def _facts(self, **extra) -> Facts:
        """(lock held) What the state machine is told: the record, the batch in flight,
        and ``extra`` (the command's own input)."""
        rb = self.ck.get("rollback") or {}
        fin = self.ck.get("finalized") or {}
        fly = self._in_flight
        facts = {
            "position": int(self.ck.get("position") or 0),
            "total": int(self.ck.get("total") or 0),
            "has_order": self.order is not None,
            "policy": self.ck.get("policy"),
            "paused_by": self.ck.get("paused_by"),
            "override": bool(self.ck.get("override")),
            "rollback_state": rb.get("state"),
            "rollback_done": int(rb.get("done") or 0),
            "rollback_total": int(rb.get("total") or 0),
            "finalized_at": fin.get("position"),
            "finalized_dropped": int(fin.get("dropped") or 0),
            "in_flight": fly
            and f"{fly['kind']} batch of {fly['items']} item(s) from {fly['from']}",
        }
        return Facts(**{**facts, **extra})

    def _decide(self, command: Command, **extra) -> Answer:
        """(lock held) The state machine's answer to ``command`` now."""
        return LIVE_INDEX.decide(self._state(), command, self._facts(**extra))

    def _enter(self, state: State) -> None:
        """(lock held) Write ``state`` into the record (not saved): its public name, the
        rollback's own state (``running`` only while rolling back, ``paused`` while it is
        unfinished otherwise), ``paused_by`` only while a guard pauses the backfill."""
        enter_state(self.ck, state)
        if state is not State.FINALIZING:
            self._finalizing_from = None

    # ------------------------------------------------------------------ batches in flight
    def _settle(self) -> None:
        """The batch in flight is acknowledged (or failed): wake who waits for it."""
        with self.lock:
            self._in_flight = None
            self._notify()

    def _await_rest(self, timeout: float | None = None) -> None:
        """(lock held) Wait (at most ``timeout``, default a third of ``shard_timeout_s`` up to
        5 s) until no batch is in flight."""
        if timeout is None:
            timeout = min(5.0, self.cfg.shard_timeout_s / 3)
        end = time.monotonic() + timeout
        while self._in_flight is not None and (left := end - time.monotonic()) > 0:
            self.wake.wait(timeout=left)

    def _wait_for_holds(self) -> None:
        """(lock held) Before a batch is sent: wait while a ``/status`` holds the walk (new
        holds wait for this batch meanwhile, so that polling cannot starve the walk)."""
        while True:
            now = time.monotonic()
            for token, (end, _) in list(self._holds.items()):
                if end <= now:
                    del self._holds[token]
            if not self._holds:
                self._send_waiting = False
                self.wake.notify_all()
                return
            self._send_waiting = True
            self.wake.wait(timeout=min(end for end, _ in self._holds.values()) - now)

    def hold(self, lease_s: float = 35.0, wait_s: float = 1.0) -> dict:
        """Hold the walk for a consistent ``/status``: from now no batch is sent until
        ``status(release=token)`` (or :meth:`release_hold`) or ``lease_s`` seconds; waits at
        most ``wait_s`` for the batch in flight.  Returns ``{"token"}``."""
        with self.lock:
            end = time.monotonic() + min(float(wait_s), float(lease_s))
            while self._send_waiting and (left := end - time.monotonic()) > 0:
                self.wake.wait(timeout=left)  # the batch that waits goes first
            self._hold_seq += 1
            token = self._hold_seq
            self._holds[token] = [time.monotonic() + float(lease_s), False]
            self._await_rest(max(0.0, end - time.monotonic()))
            self._holds[token][1] = self._in_flight is None  # at rest: the counts will agree
            return {"token": token}

    def release_hold(self, token: int) -> bool:
        """End a hold; whether the counts read under it agree with the controller's state
        (it was at rest and the lease had not ended)."""
        with self.lock:
            held = self._holds.pop(int(token), None)
            self.wake.notify_all()
            return bool(held and held[0] > time.monotonic() and held[1])

    # ------------------------------------------------------------------ commands
    def start(
        self,
        policy: str = "random",
        seed: int = 0,
        rate: float | None = None,
        batch_size: int = 256,
        until: int | None = None,
        source: str = "gallery",
        restart: bool = False,
        cost_column: str | None = None,
        query_log: str | None = None,
        cost_base: str = "uncertainty:margin",
        order_base: str = "random",
        demand_k: int = 10,
        upgrade_on_read: bool = False,
        read_window: int = 8,
    ) -> dict:
        """Compute the policy's order and start walking it; errors come back as ``{"error"}``.
        ``cost_column``, ``query_log``, ``cost_base``, ``order_base``, ``demand_k``: the
        cost-aware and demand policies' inputs (as the simulator's flags); ``upgrade_on_read``:
        move what the last ``read_window`` searches returned to the front before each batch."""
        from raycompat.config import ConfigError

        command = Command.RESTART if restart else Command.START
        with self.lock:
            answer = self._decide(command)
            if not answer.ok:
                return answer.as_error()
        inputs = {
            "cost_column": cost_column,
            "query_log": query_log,
            "options": {"cost_base": cost_base, "order_base": order_base, "demand_k": demand_k},
        }
        reads = {"upgrade_on_read": bool(upgrade_on_read), "read_window": int(read_window)}
        try:
            self._vector_source(source)
            order = self._policy_order(policy, int(seed), inputs)
        except (ConfigError, ValueError) as exc:
            return {"error": str(exc), "status": 400}
        try:
            return self._begin(command, order, policy, seed, source, rate, batch_size, until, reads)
        except StorageError as exc:
            return {"error": f"backfill not started: {exc}", "status": 503}

    def _begin(self, command, order, policy, seed, source, rate, batch_size, until, reads) -> dict:
        """Save the order and the first record in the store, then wake the walk
        (decided again: another command may have come while the order was computed).  This
        backfill's positions in the store start above every position written before
        (``position_base``), so that a batch found there after a crash is this order's."""
        from raycompat.stores.backfill import new_run_id

        with self.lock:
            answer = self._decide(command)
            if not answer.ok:
                return answer.as_error()
            try:
                with self.store_lock:
                    base = int(self.store._max_position()) + 1
                meta = self.up.records.write_order(new_run_id(), np.asarray(order, np.int64))
            except Exception as exc:
                raise StorageError(
                    f"store {self.store.uri.raw} refused the backfill order: {exc}"
                ) from None
            self.up._order = np.asarray(order, np.int64)
            self.reads = collections.deque(maxlen=reads["read_window"])
            self._reads_applied = self.reads_seen
            self.up.rec = {
                "state": answer.state.public,
                "policy": policy,
                "seed": int(seed),
                "source": source,
                "new_model": self.plan.identities.default("new"),
                "rate": rate,
                "batch_size": int(batch_size),
                "until": until,
                "position": 0,
                "position_base": base,
                "total": int(len(order)),
                "order": meta,
                "mode": self.cfg.mode,
                "started": time.time(),
                **reads,
            }
            self.up.records.drop_orders(keep_run=meta["run"])
            self.error = None
            self.resumed = False
            self.gate.new_run(meta["run"])
            self.ck["canary"] = self.gate.record_info(int(len(order)))
            self.generation += 1
            self._rate_t0, self._rate_p0 = time.perf_counter(), 0
            self._save_record()
            self._notify()
            return self.status()

    def _policy_order(self, policy: str, seed: int, inputs: dict) -> np.ndarray:
        """The policy's order of the gallery's item ids (the simulator's policies; ``inputs``:
        the cost column, the query log and the policy options of :meth:`start`)."""
        from raycompat.serving.orders import policy_order_ids
        from raycompat.upgrade.policies import PolicyOptions

        options = PolicyOptions(**inputs["options"])
        names = (policy, options.cost_base, options.order_base)
        wants_head = any(n.startswith("uncertainty:") or n == "learned" for n in names)
        return policy_order_ids(
            policy,
            self.gallery(),
            mode=self.cfg.mode,
            seed=seed,
            head=self._head() if wants_head else None,
            learned_sample_fraction=self.cfg.learned_sample_fraction,
            options=options,
            cost_column=inputs["cost_column"],
            query_log=inputs["query_log"],
        )

    def note_reads(self, ids) -> dict:
        """The router's report of searches: ``ids`` one list of returned item ids per search,
        in the order they ran; kept (the last ``read_window``) while a backfill with
        ``upgrade_on_read`` runs.  Returns ``{"wanted": ...}``: whether reports are wanted."""
        with self.lock:
            wanted = bool(self.ck.get("upgrade_on_read")) and self.ck["state"] in (
                "running",
                "paused",
            )
            if wanted:
                for row in ids:
                    self.reads.append(np.asarray(row, dtype=np.int64))
                    self.reads_seen += 1
            return {"wanted": wanted}

    def _reorder_on_read(self, pos: int) -> None:
        """Before a batch: the window of recent searches' results to the front of the rest of
        the order, saved before the batch is taken (under the lock)."""
        if not self.ck.get("upgrade_on_read") or self.reads_seen == self._reads_applied:
            return
        from raycompat.serving.orders import reorder_on_read

        window = np.concatenate(list(reversed(self.reads))) if self.reads else np.zeros(0)
        order = reorder_on_read(self.order, pos, window)
        self._reads_applied = self.reads_seen
        if not np.array_equal(order, self.order):
            self._save_order(order)
            self._save_record()  # at once: the record names the order's digest

    def pause(self) -> dict:
        """Pause the walk (or a rollback in progress: ``resume`` continues it).  A batch
        already sent to the shards still lands (``in_flight`` in the status); one not sent
        yet is not sent."""
        with self.lock:
            before = self._state()
            after = self._decide(Command.PAUSE).state
            if after is not before:
                self._enter(after)
                self._try_save("paused")
            return self.status()

    def _try_save(self, what: str) -> None:
        """Save the record; if that fails the change holds in memory and ``error`` says
        that it is not durable."""
        try:
            self._save_record()
        except StorageError as exc:
            self.error = f"{what}, but the record was not saved: {exc}"

    def resume(
        self,
        until: int | None = None,
        rate: float | None = None,
        clear_until: bool = False,
        override: bool = False,
    ) -> dict:
        """Continue (``override``: past a canary guard; a paused rollback continues first)."""
        with self.lock:
            answer = self._decide(Command.RESUME_OVERRIDE if override else Command.RESUME)
            if not answer.ok:
                return answer.as_error()
            if override:
                self._record_override()
            if clear_until:
                self.ck["until"] = None
            elif until is not None:
                self.ck["until"] = int(until)
            if rate is not None:
                self.ck["rate"] = float(rate)
            if answer.state in (State.RUNNING, State.ROLLING_BACK):
                self.error = None  # the loop marks it done or paused at its end
                self.ck["error"] = None
            self._enter(answer.state)
            self._rate_t0, self._rate_p0 = time.perf_counter(), int(self.ck["position"])
            self._try_save("resumed")
            self._notify()
        self._ensure_worker()  # a walk that ended is started again
        return self.status()

    def status(self, release: int | None = None) -> dict:
        """The controller's status; ``release``: the token of a :meth:`hold`, ended here
        (``counts_consistent`` says whether the shard counts read under it agree)."""
        with self.lock:
            out = {
                k: self.ck.get(k)
                for k in (
                    "state",
                    "policy",
                    "seed",
                    "source",
                    "position",
                    "total",
                    "until",
                    "rate",
                    "batch_size",
                    "upgrade_on_read",
                    "read_window",
                )
            }
            out["store"] = self.store.uri.raw
            out["recovered"] = self.ck.get("recovered")  # a batch found in the store at start
            out["reads_seen"] = self.reads_seen
            out.update(self.upgrade_status())
            out["in_flight"] = dict(self._in_flight) if self._in_flight else None
            out["counts_consistent"] = None if release is None else self.release_hold(release)
            out["error"] = self.error
            out["resumed_from_checkpoint"] = self.resumed
            dt = time.perf_counter() - self._rate_t0
            moved = int(self.ck["position"]) - self._rate_p0
            out["items_per_s"] = moved / dt if dt > 0 and moved > 0 else None
            out["upsert_retries"] = self.upsert_retries
            out["worker_alive"] = bool(self._task and not self._task.done())
            out["worker_restarts"] = self.worker_restarts
            out["errors"] = self.errors
            out["compact_error"] = self.compact_error
            out["pid"] = os.getpid()
            try:
                import ray

                out["actor_name"] = ray.get_runtime_context().get_actor_name()
            except Exception:  # pragma: no cover - outside an actor
                out["actor_name"] = None
            return out

    # ------------------------------------------------------------------ the loop
    def _apply(self, pos: int, ids: np.ndarray, vecs: np.ndarray) -> None:
        """Write one batch of new vectors, the order's items from ``pos``, to the store with
        their positions: one commit (a refusal names the store)."""
        base = int(self.ck.get("position_base") or 0)
        positions = np.arange(base + pos, base + pos + len(ids), dtype=np.int64)
        try:
            with self.store_lock:
                self.store.write_new(ids, vecs, self.ck["new_model"], positions)
                self._compact_now_and_then()
        except Exception as exc:
            raise StorageError(f"store {self.store.uri.raw} refused the write: {exc}") from None

    def commit(self, writes: list, revert: np.ndarray | None = None) -> dict:
        """One commit of the store (``writes``, or the rollback of ``revert``):
        ``{"applied", "seq"}``; a refusal of the store is a :class:`StorageError` naming it
        and the store's own reason, nothing of the commit applied."""
        try:
            with self.store_lock:
                if revert is not None:
                    rows, seq = self.store.revert_items(revert)
                else:
                    rows, seq = self.store.write_items(writes)
                self._compact_now_and_then()
        except Exception as exc:
            raise StorageError(f"store {self.store.uri.raw} refused the write: {exc}") from None
        return {"applied": int(rows), "seq": int(seq)}

    def _compact_now_and_then(self) -> None:
        """(store lock held) Every :data:`COMPACT_EVERY` commits, merge the small fragments
        they appended and bring the store's indexes up to date (a follower's read of the rows
        newer than its sequence number scans every fragment the index does not cover). A
        failed compaction (a full disk) is tried again after the next commits."""
        self._commits += 1
        if self._commits < COMPACT_EVERY:
            return
        self._commits = 0
        try:
            self.store.compact()
        except Exception as exc:  # the writes are committed; compaction waits for the next
            self.compact_error = f"{type(exc).__name__}: {exc}"
        else:
            self.compact_error = None

    def unknown_ids(self, ids: np.ndarray) -> list[int]:
        """The ids of ``ids`` that are not in the store (its ids are read once: the live index
        neither adds nor deletes items), ascending."""
        if self._known is None:
            with self.store_lock:
                self._known = self.store.read_ids()
        ids = np.unique(np.asarray(ids, np.int64))
        return ids[~np.isin(ids, self._known)].tolist()

    async def upsert_items(self, groups: list) -> dict:
        """The router's upserts, ``[(field, model, ids, vectors)]``, grouped with the upserts
        that queued while the last commit ran into one commit of the store
        (:meth:`_upsert_batch`; the :class:`~raycompat.serving.batching.Batcher` of the
        searches: Serve's ``@serve.batch`` forms a batch of one per request while the last one
        runs, docs/architecture.md "Batching")."""
        if self._upserts is None:
            from raycompat.serving.batching import Batcher

            self._upserts = Batcher(self._upsert_batch, UPSERT_GROUP)
        return await self._upserts.submit(groups)

    async def _upsert_batch(self, requests: list) -> list:
        """One commit for every request; if it is refused, each request alone, so that one
        request's refusal is its own."""
        import asyncio

        from raycompat.stores import ItemWrite

        def writes(groups):
            return [ItemWrite(np.asarray(i, np.int64), f, np.asarray(v, np.float32), m)
                    for f, m, i, v in groups]  # fmt: skip

        def one(groups) -> dict:
            unknown = self.unknown_ids(np.concatenate([np.asarray(g[2]) for g in groups]))
            if unknown:
                return {"error": "unknown item ids", "unknown_ids": unknown}
            try:
                return self.commit(writes(groups))
            except StorageError as exc:
                return {"error": str(exc), "storage": True}

        together = [w for groups in requests for w in writes(groups)]
        if len(requests) > 1 and not self.unknown_ids(np.concatenate([w.ids for w in together])):
            try:
                res = await asyncio.to_thread(self.commit, together)
                return [res] * len(requests)
            except StorageError:
                pass
        return [await asyncio.to_thread(one, groups) for groups in requests]

    async def _walk(self) -> None:
        """The walk, an asyncio task on the replica's event loop: rollback batches, canary
        points and batches while the state says so, each piece's blocking part on a worker
        thread; it waits for a command when there is nothing to do.  Every failure (the
        store, the vector source, the record) lands in ``status``."""
        while True:
            self._walk_wake.clear()
            gen = self.generation
            try:
                busy = await self._step()
            except Exception as exc:
                await asyncio.to_thread(self._fail, gen, exc)
                busy = True
            if not busy:
                try:
                    await asyncio.wait_for(self._walk_wake.wait(), 1.0)
                except TimeoutError:
                    pass

    async def _step(self) -> bool:
        """One piece of work; ``False``: none now."""
        if await asyncio.to_thread(self._rollback_step):
            return True
        if await self._canary_step():
            return True
        return await asyncio.to_thread(self._batch_step)

    def _batch_step(self) -> bool:
        """(a worker thread) One batch: fetch its vectors, commit them to the store, save the
        record; ``False``: not running."""
        step = self._next_batch()
        if step is None:
            return self._still(self.generation)
        pos, batch, source, rate, gen = step
        vecs = self._vector_source(source).new_vectors(batch)
        if not self._send(gen, pos, batch):
            return True
        try:
            self._apply(pos, batch, vecs)
        except Exception:
            self._settle()
            raise
        self._advance(gen, pos, batch, rate)
        return True

    def _send(self, gen: int, pos: int, batch: np.ndarray) -> bool:
        """Mark the batch in flight once no ``/status`` holds the walk; ``False``: paused or
        restarted meanwhile, the batch is not sent."""
        with self.lock:
            self._wait_for_holds()
            if (
                gen != self.generation
                or self._state() is not State.RUNNING
                or int(self.ck["position"]) != pos
            ):
                return False
            self._in_flight = {"kind": "backfill", "from": pos, "items": int(batch.size)}
            return True

    def _next_batch(self):
        """``(position, ids, source, rate, generation)`` of the next batch, or ``None``: not
        running, the canary due first, or marked done / paused at its end or ``until``."""
        with self.lock:
            if self.ck["state"] != "running":
                return None
            pos, total = int(self.ck["position"]), int(self.ck["total"])
            if self.gate.due(self.ck.get("started"), pos, total):
                return None  # the canary is measured here first (:meth:`_canary_step`)
            until = self.ck.get("until")
            stop = total if until is None else min(total, int(until))
            stop = min(stop, self._canary_stop(pos, total))  # the canary's next position
            if pos >= stop:
                self._enter(self._decide(Command.END).state)
                self._save_record()
                return None
            self._reorder_on_read(pos)
            rate = self.ck.get("rate")
            size = _batch_size(int(self.ck["batch_size"]), rate)
            batch = self.order[pos : min(stop, pos + size)]
            return pos, batch, self.ck["source"], rate, self.generation

    def _fail(self, gen: int, exc: Exception) -> None:
        """State ``error`` with the message (``resume`` retries from the record)."""
        with self.lock:
            if gen != self.generation:  # restarted meanwhile: the failure is moot
                return
            named = isinstance(exc, StorageError)  # its message says what and where
            self.error = str(exc) if named else f"{type(exc).__name__}: {exc}"
            self.ck["error"] = self.error
            self._enter(self._decide(Command.FAILURE).state)  # an unfinished rollback: paused
            try:
                self._save_record()
            except StorageError as save_exc:
                self.error += f" (and the record was not saved: {save_exc})"
            self.errors += 1

    def _advance(self, gen: int, pos: int, batch: np.ndarray, rate: float | None) -> None:
        """Checkpoint the position after an acknowledged batch, then keep to ``rate``."""
        with self.lock:
            self._in_flight = None
            self._notify()
            if (
                gen == self.generation and int(self.ck["position"]) == pos
            ):  # not restarted meanwhile
                self.ck["position"] = pos + int(batch.size)
                self._enter(self._decide(Command.BATCH_DONE).state)  # the state stays
                if time.monotonic() - self._record_saved >= self.record_every_s:
                    self._save_record()
            p0, t0 = self._rate_p0, self._rate_t0
            cur = int(self.ck["position"])
        if rate:  # the next batch is due when cur items at `rate` have taken their time
            due = t0 + (cur - p0) / float(rate)
            while time.perf_counter() < due and self._still(gen):
                time.sleep(min(due - time.perf_counter(), 0.5))

    def _still(self, gen: int) -> bool:
        """Whether the backfill of generation ``gen`` is still running (a pause, a restart or a
        new rate ends a wait)."""
        with self.lock:
            return gen == self.generation and self.ck["state"] == "running"


def _event_loop() -> asyncio.AbstractEventLoop:
    """The loop the walk runs on: the replica's (Serve builds the controller on it); outside
    Serve (a test), a loop on a daemon thread of its own."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, name="backfill-loop", daemon=True).start()
        return loop


def _batch_size(batch_size: int, rate: float | None) -> int:
    """Items per batch: ``batch_size``, but at most one second's worth at ``rate`` (at least
    one item), so that a low rate is kept batch by batch instead of in bursts."""
    if not rate:
        return batch_size
    return max(1, min(batch_size, int(rate)))
