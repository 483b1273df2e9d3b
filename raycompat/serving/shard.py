"""The shard deployment: one Serve deployment per shard, with ``shard_replicas`` replicas (or
Serve's autoscaling), wrapping a :class:`raycompat.serving.state.ShardState` kept in
``<state_dir>/shard-<i>`` (or, after a reshard, ``<state_dir>/shards-g<k>/shard-<i>``:
:mod:`raycompat.serving.layout`).

On (re)start a replica recovers from the shard's snapshot + log, which every replica of the
shard shares; only when the directory is empty does the first replica load the shard's items
(placed by :func:`raycompat.serving.placement.shard_of`) from the gallery source, in their
initial representation, as the first snapshot.  Searches that arrive together are answered
by one search call (:class:`raycompat.serving.batching.Batcher`, :func:`search_grouped`).
"""

from __future__ import annotations

import asyncio
import os
import time

import numpy as np

from raycompat.index.ann import configure_faiss
from raycompat.serving.batching import Batcher, query_rows, split_rows, stacked_groups
from raycompat.serving.metrics import BatchSizes
from raycompat.serving.plan import ServingPlan
from raycompat.serving.state import REPRESENTATIONS, ShardState, UnknownItemError
from raycompat.storage import StorageError

__all__ = ["ShardServer", "shard_dir"]


def shard_dir(state_dir: str, shard: int, num_shards: int) -> str:
    """Where shard ``shard`` keeps its snapshot and log, by the state directory's layout
    (:mod:`raycompat.serving.layout`); ``RuntimeError`` if that layout has another shard
    count."""
    from raycompat.serving.layout import StateLayout, read_layout

    layout = read_layout(state_dir) or StateLayout(num_shards=num_shards)
    if layout.num_shards != num_shards:
        raise RuntimeError(
            f"{state_dir} holds {layout.num_shards} shards, this index has {num_shards}"
        )
    return layout.shard_dir(state_dir, shard)


class ShardServer:
    """Serve deployment class (bound per shard by :mod:`raycompat.serving.app`); every replica
    of a shard opens the same directory (:mod:`raycompat.serving.shared_log`)."""

    def __init__(self, shard: int, plan: ServingPlan):
        t0 = time.perf_counter()
        cfg = plan.config
        self.shard = int(shard)
        self.n_shards = cfg.num_shards
        self.plan = plan
        configure_faiss(cfg.shard_threads, max(plan.dims.as_dict().values()))
        self.state = ShardState(
            shard_dir(cfg.state_dir, self.shard, cfg.num_shards),
            plan.dims.as_dict(),
            index=cfg.index,
            snapshot_every=cfg.snapshot_every,
            fsync=cfg.fsync,
            initial=self._initial_items,
            tail_interval_s=1.0,
            name=f"shard-{self.shard}",
            default_models=plan.identities.defaults() if plan.identities else None,
            kept_on_disk=cfg.kept_on_disk,
        )
        self.started = time.time()
        self.startup_s = time.perf_counter() - t0
        self.searches = 0
        self.batches = BatchSizes()
        self.batcher = Batcher(
            self._search_batch, cfg.search_batch_size, cfg.search_batch_wait_ms / 1000
        )

    def _initial_items(self) -> tuple[str, np.ndarray, np.ndarray]:
        """First start of the shard: its items from the gallery, in their initial
        representation (called by one replica, under the shard's write lock)."""
        from raycompat.serving.gallery_source import open_gallery
        from raycompat.serving.scoring import adapted_transform

        cfg = self.plan.config
        rep0 = self.plan.initial_representation
        src = open_gallery(cfg.gallery, cfg.new_model, adapted=adapted_transform(cfg.mode))
        ids, vecs = src.initial_vectors(rep0, self.shard, self.n_shards)
        return rep0, ids, vecs

    async def search(self, queries: dict, k: int, exact: bool = False):
        """Top-k ``(scores, ids, rep codes)`` of ``queries`` (one array per representation),
        searched together with the calls that arrive meanwhile (docs/architecture.md,
        "Batching"): the same rows as searching them alone."""
        return await self.batcher.submit((queries, int(k), bool(exact)))

    async def _search_batch(self, calls: list) -> list:
        queries, k, exact = (list(column) for column in zip(*calls, strict=True))
        self.searches += len(queries)
        self.batches.observe(len(queries), sum(query_rows(q) for q in queries))
        return await asyncio.to_thread(search_grouped, self.state, queries, k, exact)

    def unknown(self, ids) -> list:
        return self.state.unknown(ids)

    def upsert(self, ids, rep: str, vectors, model: str = "") -> dict:
        """Apply (``model``: the fingerprint of the model that produced ``vectors``; ``""``: the
        representation's default); returns ``{"applied", "seq"}``, or (nothing applied)
        ``{"error", "unknown_ids"}`` for unknown ids and ``{"error", "storage": True}`` when the
        log write failed."""
        return self._write(
            lambda: self.state.upsert(
                np.asarray(ids, np.int64), rep, np.asarray(vectors, np.float32), model
            )
        )

    def rollback(self, ids) -> dict:
        """Return the items of ``ids`` that keep an old vector to it: ``{"rolled_back": ids,
        "seq"}``, or an error as :meth:`upsert` answers it."""
        return self._write(lambda: self.state.rollback(np.asarray(ids, np.int64)))

    def finalize(self) -> dict:
        """Drop the kept old vectors and write a snapshot: ``{"dropped", "seq", "snapshot"}``,
        or an error as :meth:`upsert` answers it."""
        return self._write(self.state.finalize)

    def _write(self, write) -> dict:
        try:
            return write()
        except UnknownItemError as exc:
            return {"error": str(exc), "unknown_ids": exc.ids}
        except StorageError as exc:  # before ValueError: a StorageError is a ConfigError
            return {"error": f"shard {self.shard}: {exc}", "storage": True}
        except ValueError as exc:
            return {"error": str(exc)}

    def kept_ids(self) -> np.ndarray:
        """The ids that keep an old vector for a rollback."""
        return self.state.kept_ids()

    def models_of(self, ids) -> list:
        """The model fingerprint of each id's vector (``None``: not on this shard)."""
        return self.state.models_of(ids)

    def counts(self) -> dict[str, int]:
        return self.state.counts()

    def representation_of(self, ids) -> list:
        return self.state.representation_of(ids)

    def lookup(self, ids):
        """``(representations, vectors)`` of ``ids`` (for checks and tests)."""
        return self.state.lookup(ids)

    def items(self):
        return self.state.items()

    def snapshot(self) -> dict:
        """``{"path"}``, or ``{"error"}`` naming what failed (the log is kept then)."""
        try:
            return {"path": self.state.snapshot()}
        except StorageError as exc:
            return {"error": f"shard {self.shard}: {exc}"}

    def status(self) -> dict:
        import ray

        ctx = ray.get_runtime_context()
        return {
            "shard": self.shard,
            "replica": _replica_id(),
            "items": self.state.counts(),
            "seq": self.state.seq,
            "upserts_applied": self.state.upserts_applied,
            "log": self.state.replica_status(),
            "recovery": self.state.recovery,
            "log_bytes": self.state.log.current.size_bytes(),
            "storage": self.state.health(),
            "models": self.state.model_counts(),
            "kept": self.state.kept_usage(),
            "index": {r: ix.describe() for r, ix in self.state.reps.items()},
            "startup_s": self.startup_s,
            "started": self.started,
            "pid": os.getpid(),
            "searches": self.searches,
            "batches": self.batches.as_json(),
            "actor_id": ctx.get_actor_id(),
            "actor_name": ctx.get_actor_name(),
            "representations": list(REPRESENTATIONS),
        }


def _replica_id() -> str | None:
    from ray import serve

    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside a Serve replica (tests)
        return None


def search_grouped(state: ShardState, queries: list, k: list, exact: list) -> list:
    """``state.search`` of every request of a batch, one search per stackable group
    (:mod:`raycompat.serving.batching`)."""
    out: list = [None] * len(queries)
    for members, stacked, kk, ex in stacked_groups(queries, k, exact):
        result = state.search(stacked, kk, exact=ex)
        sizes = [query_rows(queries[j]) for j in members]
        for j, rows in zip(members, split_rows(result, sizes), strict=True):
            out[j] = rows
    return out
