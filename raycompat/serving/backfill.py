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
"""
from __future__ import annotations

import json
import os
import threading
import time
from typing import List, Optional

import numpy as np

from raycompat.serving.placement import split_by_shard

__all__ = ["BackfillController", "backfill_dir"]


def backfill_dir(state_dir: str) -> str:
    return os.path.join(state_dir, "backfill")


def _atomic_write(path: str, data: bytes) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


class BackfillController:
    """Serve deployment class (one replica); ``shards``: the shard deployment handles."""

    def __init__(self, shards: list, cfg: dict):
        self.shards = list(shards)
        self.cfg = cfg
        self.dir = backfill_dir(cfg["state_dir"])
        os.makedirs(self.dir, exist_ok=True)
        self.lock = threading.RLock()
        self.wake = threading.Condition(self.lock)
        self.order: Optional[np.ndarray] = None
        self.ck = {"state": "idle", "position": 0, "total": 0}
        self.resumed = False
        self.error: Optional[str] = None
        self._sources = {}
        self._source = None
        self._gallery = None
        self.upsert_retries = 0
        self.generation = 0
        self._rate_t0 = time.perf_counter()
        self._rate_p0 = 0
        self._load_checkpoint()
        self.thread = threading.Thread(target=self._loop, name="backfill", daemon=True)
        self.thread.start()

    # ------------------------------------------------------------------ checkpoint
    def _load_checkpoint(self) -> None:
        path = os.path.join(self.dir, "checkpoint.json")
        if not os.path.exists(path):
            return
        with open(path) as fh:
            ck = json.load(fh)
        self.order = np.load(os.path.join(self.dir, "order.npy"), allow_pickle=False)
        self.ck = ck
        if ck.get("state") == "running":
            self.resumed = True
        self._rate_p0 = int(ck["position"])

    def _save_checkpoint(self) -> None:
        _atomic_write(os.path.join(self.dir, "checkpoint.json"), json.dumps(self.ck).encode())

    # ------------------------------------------------------------------ sources
    def gallery(self):
        if self._gallery is None:
            from raycompat.serving.gallery_source import open_gallery

            self._gallery = open_gallery(self.cfg["gallery"], self.cfg.get("new_model"),
                                         need_adapted=self.cfg["mode"] == "adapted",
                                         need_rank_merge=self.cfg["mode"] == "rank_merge")
        return self._gallery

    def _vector_source(self, name: str):
        if name in self._sources:
            return self._sources[name]
        from raycompat.config import ConfigError

        if name == "gallery":
            src = self.gallery()
        elif name == "pipeline":
            from raycompat.serving.gallery_source import PipelineOutput

            if not self.cfg.get("pipeline_output"):
                raise ConfigError("source 'pipeline' needs the option pipeline_output (the pipeline's parquet)")
            src = PipelineOutput(self.cfg["pipeline_output"])
        elif name == "embedder":
            from raycompat.serving.embedder_pool import EmbedderPool

            if not self.cfg.get("new_model"):
                raise ConfigError("source 'embedder' needs the option new_model (a ModelBundle directory)")
            src = EmbedderPool(self.cfg["new_model"], self.cfg.get("items"), size=self.cfg.get("embedder_actors", 1),
                               num_cpus=self.cfg.get("embedder_cpus", 0.5), resolution=self.cfg.get("resolution"),
                               data_seed=self.cfg.get("data_seed", 0))
        else:
            raise ConfigError(f"unknown source {name!r}; allowed: gallery, pipeline, embedder")
        if self.cfg["mode"] == "rank_merge":      # a new item holds rho(phi_n(g))
            from raycompat.serving.scoring import rank_merge_maps

            src.new_map = rank_merge_maps(self.cfg.get("new_model"))[0]
        self._sources[name] = src
        return src

    def _head(self):
        if not self.cfg.get("new_model"):
            return None
        from raycompat.backfill.policies import UncertaintyHead
        from raycompat.models import ModelBundle

        return UncertaintyHead.from_classifier_head(ModelBundle.load(self.cfg["new_model"]).head)

    # ------------------------------------------------------------------ commands
    def start(self, policy: str = "random", seed: int = 0, rate: Optional[float] = None, batch_size: int = 256,
              until: Optional[int] = None, source: str = "gallery", restart: bool = False) -> dict:
        """Compute the policy's order and start walking it; errors come back as ``{"error"}``."""
        from raycompat.config import ConfigError
        from raycompat.serving.orders import policy_order_ids

        with self.lock:
            if self.ck["state"] in ("running", "paused") and not restart:
                return {"error": f"a backfill is already {self.ck['state']} "
                                 f"(policy {self.ck.get('policy')}); pause/resume it or pass restart=true",
                        "status": 409}
        try:
            self._vector_source(source)
            order = policy_order_ids(policy, self.gallery(), mode=self.cfg["mode"], seed=int(seed),
                                     head=self._head() if policy.startswith("uncertainty:") or policy == "learned"
                                     else None, learned_sample_fraction=self.cfg.get("learned_sample_fraction", 0.02))
        except (ConfigError, ValueError) as exc:
            return {"error": str(exc), "status": 400}
        with self.lock:
            self.order = np.asarray(order, np.int64)
            np.save(os.path.join(self.dir, "order.npy.tmp.npy"), self.order, allow_pickle=False)
            os.replace(os.path.join(self.dir, "order.npy.tmp.npy"), os.path.join(self.dir, "order.npy"))
            self.ck = {"state": "running", "policy": policy, "seed": int(seed), "source": source,
                       "rate": rate, "batch_size": int(batch_size), "until": until, "position": 0,
                       "total": int(self.order.size), "mode": self.cfg["mode"], "started": time.time()}
            self.error = None
            self.resumed = False
            self.generation += 1
            self._rate_t0, self._rate_p0 = time.perf_counter(), 0
            self._save_checkpoint()
            self.wake.notify_all()
            return self.status()

    def pause(self) -> dict:
        with self.lock:
            if self.ck["state"] == "running":
                self.ck["state"] = "paused"
                self._save_checkpoint()
            return self.status()

    def resume(self, until: Optional[int] = None, rate: Optional[float] = None) -> dict:
        with self.lock:
            if self.order is None:
                return {"error": "no backfill to resume: start one first", "status": 409}
            if until is not None:
                self.ck["until"] = int(until)
            if rate is not None:
                self.ck["rate"] = float(rate)
            if self.ck["position"] < self.ck["total"] and self.ck["state"] in ("paused", "running", "error"):
                self.ck["state"] = "running"
                self.error = None
            self._rate_t0, self._rate_p0 = time.perf_counter(), int(self.ck["position"])
            self._save_checkpoint()
            self.wake.notify_all()
            return self.status()

    def status(self) -> dict:
        with self.lock:
            out = {k: self.ck.get(k) for k in ("state", "policy", "seed", "source", "position", "total",
                                               "until", "rate", "batch_size")}
            out["error"] = self.error
            out["resumed_from_checkpoint"] = self.resumed
            dt = time.perf_counter() - self._rate_t0
            moved = int(self.ck["position"]) - self._rate_p0
            out["items_per_s"] = moved / dt if dt > 0 and moved > 0 else None
            out["upsert_retries"] = self.upsert_retries
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
        deadline = time.time() + float(self.cfg.get("upsert_retry_s", 300))
        while pending:
            responses = {s: self.shards[s].upsert.remote(ids[parts[s]], "new", vecs[parts[s]]) for s in pending}
            failed = []
            for s, r in responses.items():
                try:
                    res = r.result()
                except Exception:  # replica down or restarting: retry the batch on that shard
                    failed.append(s)
                    continue
                if "error" in res:
                    raise RuntimeError(f"shard {s} refused a backfill upsert: {res['error']}")
            pending = failed
            if pending:
                self.upsert_retries += 1
                if time.time() > deadline:
                    raise RuntimeError(f"shard(s) {pending} unavailable for {self.cfg.get('upsert_retry_s', 300)} s")
                time.sleep(0.5)

    def _loop(self) -> None:
        while True:
            with self.lock:
                while self.ck["state"] != "running":
                    self.wake.wait(timeout=1.0)
                pos, total = int(self.ck["position"]), int(self.ck["total"])
                until = self.ck.get("until")
                stop = total if until is None else min(total, int(until))
                if pos >= stop:
                    self.ck["state"] = "done" if pos >= total else "paused"
                    self._save_checkpoint()
                    continue
                batch = self.order[pos:min(stop, pos + int(self.ck["batch_size"]))]
                source, rate = self.ck["source"], self.ck.get("rate")
                gen = self.generation
            try:
                vecs = self._vector_source(source).new_vectors(batch)
                self._apply(batch, vecs)
            except Exception as exc:  # keep the controller alive; report the failure
                with self.lock:
                    if gen != self.generation:
                        continue
                    self.error = f"{type(exc).__name__}: {exc}"
                    self.ck["state"] = "error"
                    self._save_checkpoint()
                continue
            with self.lock:
                if gen == self.generation and int(self.ck["position"]) == pos:   # not restarted meanwhile
                    self.ck["position"] = pos + int(batch.size)
                    self._save_checkpoint()
                p0, t0 = self._rate_p0, self._rate_t0
                cur = int(self.ck["position"])
            if rate:
                wait = t0 + (cur - p0) / float(rate) - time.perf_counter()
                if wait > 0:
                    time.sleep(min(wait, 5.0))
