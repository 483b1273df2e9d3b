"""The backfill controller: walks a policy's order across the shards, upserting each item's
new-model vector, at a given rate, pausable, resumable, and crash-safe.

Progress is checkpointed in ``<state_dir>/backfill/`` after every batch the shards have
acknowledged (``order.npy``: the order as item ids, written once; ``checkpoint.json``: policy,
seed, source, position, until, rate, state; both written atomically).  Shards log an upsert
durably before acknowledging it (:mod:`raycompat.serving.durability`), so:

* a controller crash resumes at the checkpointed position (a batch applied but not yet
  checkpointed is applied again -- idempotent: same ids, same vectors, same representation);
* an item upgraded before a crash stays upgraded (nothing ever moves an item back);
* a shard replica that dies mid-batch makes the upsert fail; the controller retries the
  batch until the restarted replica (recovered from its snapshot + log) accepts it.

New vectors come from the gallery source (the embeddings parquet's ``new`` column, or the
synthetic generator), the Ray Data pipeline's parquet output, or the embedder actor pool.

Upgrade on read (``upgrade_on_read`` at start; docs/live-index.md): the router reports the ids
every search returned (:meth:`BackfillController.note_reads`); the controller keeps the last
``read_window`` searches and, before a batch, when searches came in since the last batch,
moves the items they returned that are still waiting to the front of the rest of the order
(:func:`raycompat.serving.orders.reorder_on_read`, the simulator's ``upgrade-on-read`` rule)
and saves ``order.npy`` before the batch.  Only the part after ``position`` moves, so the
backfilled prefix, exactly-once and the crash resume are as before.
"""

from __future__ import annotations

import collections
import json
import os
import threading
import time

import numpy as np

from raycompat.serving.durability import CorruptStateError, atomic_write
from raycompat.serving.placement import split_by_shard
from raycompat.serving.plan import ServingPlan
from raycompat.serving.thread_handles import ThreadHandle
from raycompat.serving.upgrade import UpgradeCommands
from raycompat.storage import StorageError

__all__ = ["BackfillController", "backfill_dir"]


def backfill_dir(state_dir: str) -> str:
    return os.path.join(state_dir, "backfill")


class BackfillController(UpgradeCommands):
    """Serve deployment class (one replica); ``shards``: the shard deployment handles.  The
    canary gate, rollback, finalize and the stale listing: :class:`UpgradeCommands`."""

    def __init__(self, shards: list, plan: ServingPlan):
        self.shards = [ThreadHandle(h) for h in shards]  # called from the walking thread
        self.plan = plan
        self.cfg = plan.config
        self.dir = backfill_dir(self.cfg.state_dir)
        os.makedirs(self.dir, exist_ok=True)
        self.lock = threading.RLock()
        self.wake = threading.Condition(self.lock)
        self.order: np.ndarray | None = None
        self.ck = {"state": "idle", "position": 0, "total": 0}
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
        self._load_checkpoint()
        self._init_upgrade()
        self.thread: threading.Thread | None = None
        self.worker_restarts = 0
        self._ensure_worker()

    def _ensure_worker(self) -> None:
        """Start the walking thread, or a new one if the last one died."""
        if self.thread is not None and self.thread.is_alive():
            return
        if self.thread is not None:
            self.worker_restarts += 1
        self.thread = threading.Thread(target=self._loop, name="backfill", daemon=True)
        self.thread.start()

    # ------------------------------------------------------------------ checkpoint
    def _load_checkpoint(self) -> None:
        path = os.path.join(self.dir, "checkpoint.json")
        if not os.path.exists(path):
            return
        try:
            with open(path) as fh:
                ck = json.load(fh)
            self.order = np.load(os.path.join(self.dir, "order.npy"), allow_pickle=False)
            int(ck["position"]), int(ck["total"]), ck["state"]
        except Exception as exc:  # name the file and the cause, not only Serve's failure
            raise CorruptStateError(
                f"backfill checkpoint in {self.dir} is corrupt ({type(exc).__name__}: {exc}); "
                "move the directory away to forget the backfill (items keep their state)"
            ) from None
        self.ck = ck
        if ck.get("state") == "running":
            self.resumed = True
        self._rate_p0 = int(ck["position"])
        self.reads = collections.deque(maxlen=int(ck.get("read_window") or 1))

    def _save_checkpoint(self) -> None:
        data = json.dumps(self.ck).encode()
        atomic_write(os.path.join(self.dir, "checkpoint.json"), lambda fh: fh.write(data))

    def _save_order(self) -> None:
        order = self.order
        atomic_write(
            os.path.join(self.dir, "order.npy"),
            lambda fh: np.save(fh, order, allow_pickle=False),
        )

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
        in the rank_merge mode its vectors go through rho."""
        if name not in self._sources:
            src = self._open_source(name)
            if self.cfg.mode == "rank_merge":  # a new item holds rho(phi_n(g))
                from raycompat.serving.scoring import rank_merge_maps

                src.new_map = rank_merge_maps(self.cfg.new_model)[0]
            self._sources[name] = src
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

        with self.lock:
            if self.ck["state"] in ("running", "paused", "rolling_back") and not restart:
                return {
                    "error": f"a backfill is already {self.ck['state']} "
                    f"(policy {self.ck.get('policy')}); pause/resume it or pass restart=true",
                    "status": 409,
                }
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
            return self._begin(order, policy, seed, source, rate, batch_size, until, reads)
        except StorageError as exc:
            return {"error": f"backfill not started: {exc}", "status": 503}

    def _begin(self, order, policy, seed, source, rate, batch_size, until, reads) -> dict:
        """Save the order and the first checkpoint, then wake the walking thread."""
        with self.lock:
            self.order = np.asarray(order, np.int64)
            self._save_order()
            self.reads = collections.deque(maxlen=reads["read_window"])
            self._reads_applied = self.reads_seen
            self.ck = {
                "state": "running",
                "policy": policy,
                "seed": int(seed),
                "source": source,
                "rate": rate,
                "batch_size": int(batch_size),
                "until": until,
                "position": 0,
                "total": int(self.order.size),
                "mode": self.cfg.mode,
                "started": time.time(),
                **reads,
            }
            self.error = None
            self.resumed = False
            self.gate.new_run()
            self.generation += 1
            self._rate_t0, self._rate_p0 = time.perf_counter(), 0
            self._save_checkpoint()
            self.wake.notify_all()
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
            self.order = order
            self._save_order()

    def pause(self) -> dict:
        """Pause the walk (or a rollback in progress: ``resume`` continues it)."""
        with self.lock:
            if self.ck["state"] == "rolling_back":
                self.ck["rollback"]["state"] = "paused"
            if self.ck["state"] in ("running", "rolling_back"):
                self.ck["state"] = "paused"
                self._try_save("paused")
            return self.status()

    def _try_save(self, what: str) -> None:
        """Save the checkpoint; if that fails the change holds in memory and ``error`` says
        that it is not durable."""
        try:
            self._save_checkpoint()
        except StorageError as exc:
            self.error = f"{what}, but the checkpoint was not saved: {exc}"

    def resume(
        self,
        until: int | None = None,
        rate: float | None = None,
        clear_until: bool = False,
        override: bool = False,
    ) -> dict:
        """Continue (``override``: past a canary guard; a paused rollback continues first)."""
        with self.lock:
            if self.order is None:
                return {"error": "no backfill to resume: start one first", "status": 409}
            refused = self._resume_checks(bool(override))
            if refused:
                return refused
            if clear_until:
                self.ck["until"] = None
            elif until is not None:
                self.ck["until"] = int(until)
            if rate is not None:
                self.ck["rate"] = float(rate)
            if self.ck["state"] in ("paused", "running", "error"):
                self.ck["state"] = "running"  # the loop marks it done or paused at its end
                self.error = None
            self._rate_t0, self._rate_p0 = time.perf_counter(), int(self.ck["position"])
            self._try_save("resumed")
            self._ensure_worker()  # a worker that died is started again
            self.wake.notify_all()
            return self.status()

    def status(self) -> dict:
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
            out["reads_seen"] = self.reads_seen
            out.update(self.upgrade_status())
            out["error"] = self.error
            out["resumed_from_checkpoint"] = self.resumed
            dt = time.perf_counter() - self._rate_t0
            moved = int(self.ck["position"]) - self._rate_p0
            out["items_per_s"] = moved / dt if dt > 0 and moved > 0 else None
            out["upsert_retries"] = self.upsert_retries
            out["worker_alive"] = bool(self.thread and self.thread.is_alive())
            out["worker_restarts"] = self.worker_restarts
            out["errors"] = self.errors
            out["pid"] = os.getpid()
            try:
                import ray

                out["actor_name"] = ray.get_runtime_context().get_actor_name()
            except Exception:  # pragma: no cover - outside an actor
                out["actor_name"] = None
            return out

    # ------------------------------------------------------------------ the loop
    def _apply(self, ids: np.ndarray, vecs: np.ndarray) -> None:
        parts = split_by_shard(ids, len(self.shards))
        pending = [s for s, p in enumerate(parts) if p.size]
        deadline = time.time() + self.cfg.upsert_retry_s
        while pending:
            responses = {
                s: self.shards[s].upsert.remote(ids[parts[s]], "new", vecs[parts[s]])
                for s in pending
            }
            failed = []
            for s, r in responses.items():
                try:
                    res = r.result()
                except Exception:  # replica down or restarting: retry the batch on that shard
                    failed.append(s)
                    continue
                if res.get("storage"):
                    raise StorageError(res["error"])
                if "error" in res:
                    raise RuntimeError(f"shard {s} refused a backfill upsert: {res['error']}")
            pending = failed
            if pending:
                self.upsert_retries += 1
                if time.time() > deadline:
                    raise RuntimeError(
                        f"shard(s) {pending} unavailable for {self.cfg.upsert_retry_s:g} s"
                    )
                time.sleep(0.5)

    def _loop(self) -> None:
        """The controller's thread: walk the order batch by batch while the state is running.
        Every failure (a shard, the vector source, a checkpoint write) lands in ``status``."""
        while True:
            gen = self.generation
            try:
                self._step()
            except Exception as exc:
                self._fail(gen, exc)

    def _step(self) -> None:
        """One batch: fetch its vectors, upsert them on the shards, checkpoint."""
        if self._rollback_step() or self._canary_step():
            return
        step = self._next_batch()
        if step is None:
            return
        pos, batch, source, rate, gen = step
        vecs = self._vector_source(source).new_vectors(batch)
        self._apply(batch, vecs)
        self._advance(gen, pos, batch, rate)

    def _next_batch(self):
        """``(position, ids, source, rate, generation)`` of the next batch once running, or
        ``None`` after marking the backfill done / paused at its end or ``until``."""
        with self.lock:
            while self.ck["state"] != "running":
                if self.ck["state"] == "rolling_back":  # the rollback's step takes the turn
                    self.wake.wait(timeout=1.0)
                    return None
                self.wake.wait(timeout=1.0)
            pos, total = int(self.ck["position"]), int(self.ck["total"])
            if self.gate.due(self.ck.get("started"), pos, total):
                return None  # the canary is measured here first (:meth:`_canary_step`)
            until = self.ck.get("until")
            stop = total if until is None else min(total, int(until))
            stop = min(stop, self._canary_stop(pos, total))  # the canary's next position
            if pos >= stop:
                self.ck["state"] = "done" if pos >= total else "paused"
                self._save_checkpoint()
                return None
            self._reorder_on_read(pos)
            rate = self.ck.get("rate")
            size = _batch_size(int(self.ck["batch_size"]), rate)
            batch = self.order[pos : min(stop, pos + size)]
            return pos, batch, self.ck["source"], rate, self.generation

    def _fail(self, gen: int, exc: Exception) -> None:
        """State ``error`` with the message (``resume`` retries from the checkpoint)."""
        with self.lock:
            if gen != self.generation:  # restarted meanwhile: the failure is moot
                return
            named = isinstance(exc, StorageError)  # its message says what and where
            self.error = str(exc) if named else f"{type(exc).__name__}: {exc}"
            self.ck["state"] = "error"
            try:
                self._save_checkpoint()
            except StorageError as save_exc:
                self.error += f" (and the checkpoint was not saved: {save_exc})"
            self.errors += 1

    def _advance(self, gen: int, pos: int, batch: np.ndarray, rate: float | None) -> None:
        """Checkpoint the position after an acknowledged batch, then keep to ``rate``."""
        with self.lock:
            if (
                gen == self.generation and int(self.ck["position"]) == pos
            ):  # not restarted meanwhile
                self.ck["position"] = pos + int(batch.size)
                self._save_checkpoint()
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


def _batch_size(batch_size: int, rate: float | None) -> int:
    """Items per batch: ``batch_size``, but at most one second's worth at ``rate`` (at least
    one item), so that a low rate is kept batch by batch instead of in bursts."""
    if not rate:
        return batch_size
    return max(1, min(batch_size, int(rate)))
