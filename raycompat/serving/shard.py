"""The shard deployment: one Serve deployment per shard, with ``shard_replicas`` replicas (or
Serve's autoscaling), each a :class:`raycompat.serving.shard_cache.ShardCache` of the shard's
rows of the served store (:mod:`raycompat.serving.served_store`).

A replica keeps nothing on disk: on (re)start it loads its rows from the store and then follows
the store's commits, so every replica of a shard, on any node, answers from the same gallery.
Writes do not pass through a shard: the backfill controller commits them to the store.  A
replica that cannot read the store fails :meth:`ShardServer.check_health`, and Serve replaces
it.  Searches that arrive together are answered by one search call
(:class:`raycompat.serving.batching.Batcher`, :func:`search_grouped`).
"""

from __future__ import annotations

import asyncio
import os
import time

from raycompat.index.ann import configure_faiss
from raycompat.serving.batching import Batcher, query_rows, split_rows, stacked_groups
from raycompat.serving.metrics import ServingMetrics
from raycompat.serving.plan import ServingPlan
from raycompat.serving.shard_cache import REPRESENTATIONS, CacheRule, ShardCache

__all__ = ["ShardServer", "cache_rule"]


def cache_rule(plan: ServingPlan) -> CacheRule:
    """What a store row becomes in a shard of this plan's mode (:class:`CacheRule`)."""
    from raycompat.serving.gallery_source import open_gallery
    from raycompat.serving.scoring import adapted_transform, rank_merge_maps

    cfg = plan.config
    initial = plan.initial_representation
    adapted, adapted_model = None, ""
    if initial == "adapted":
        src = open_gallery(cfg.gallery, cfg.new_model, adapted=adapted_transform(cfg.mode))
        adapted = lambda ids: src.vectors_of("adapted", ids)  # noqa: E731
        adapted_model = plan.identities.default("adapted") if plan.identities else ""
    new_map = rank_merge_maps(cfg.new_model)[0] if cfg.mode == "rank_merge" else None
    return CacheRule(initial, adapted, adapted_model, new_map)


class ShardServer:
    """Serve deployment class (bound per shard by :mod:`raycompat.serving.app`)."""

    def __init__(self, shard: int, plan: ServingPlan):
        from raycompat.serving.served_store import open_served_store

        t0 = time.perf_counter()
        cfg = plan.config
        self.shard = int(shard)
        self.n_shards = cfg.num_shards
        self.plan = plan
        configure_faiss(cfg.shard_threads, max(plan.dims.as_dict().values()))
        self.state = ShardCache(
            open_served_store(cfg),
            self.shard,
            cfg.num_shards,
            plan.dims.as_dict(),
            cache_rule(plan),
            index=cfg.index,
            name=f"shard-{self.shard}",
        )
        self.started = time.time()
        self.startup_s = time.perf_counter() - t0
        self.searches = 0
        self.recorder = ServingMetrics()
        self.batcher = Batcher(
            self._search_batch, cfg.search_batch_size, cfg.search_batch_wait_ms / 1000
        )

    def check_health(self) -> None:
        """Serve's health check: a replica that cannot read the store is unhealthy (Serve
        replaces it); the error names the store and the cause."""
        try:
            self.state.catch_up()
        except Exception as exc:
            raise RuntimeError(f"shard {self.shard}: the store cannot be read: {exc}") from None

    async def search(self, queries: dict, k: int, exact: bool = False):
        """Top-k ``(scores, ids, rep codes)`` of ``queries`` (one array per representation),
        searched together with the calls that arrive meanwhile (docs/architecture.md,
        "Batching"): the same rows as searching them alone."""
        return await self.batcher.submit((queries, int(k), bool(exact)))

    async def _search_batch(self, calls: list) -> list:
        queries, k, exact = (list(column) for column in zip(*calls, strict=True))
        self.searches += len(queries)
        rows = sum(query_rows(q) for q in queries)
        self.recorder.observe_batch("shard", str(self.shard), len(queries), rows)
        return await asyncio.to_thread(search_grouped, self.state, queries, k, exact)

    def unknown(self, ids) -> list:
        return self.state.unknown(ids)

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

    def status(self) -> dict:
        """This replica's status; a store it cannot read is named in ``store.error`` (the
        counts are then those it held last: its searches answer 503 meanwhile)."""
        import ray

        ctx = ray.get_runtime_context()
        try:
            self.state.catch_up()
        except Exception:  # kept in follow_status()["error"]
            pass
        return {
            "shard": self.shard,
            "replica": _replica_id(),
            "items": self.state.counts(follow=False),
            "seq": self.state.seq,
            "store": self.state.follow_status(),
            "models": self.state.model_counts(follow=False),
            "index": {r: ix.describe() for r, ix in self.state.reps.items()},
            "startup_s": self.startup_s,
            "started": self.started,
            "pid": os.getpid(),
            "searches": self.searches,
            "actor_id": ctx.get_actor_id(),
            "node_id": ctx.get_node_id(),
            "actor_name": ctx.get_actor_name(),
            "representations": list(REPRESENTATIONS),
        }


def _replica_id() -> str | None:
    from ray import serve

    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside a Serve replica (tests)
        return None


def search_grouped(state: ShardCache, queries: list, k: list, exact: list) -> list:
    """``state.search`` of every request of a batch, one search per stackable group
    (:mod:`raycompat.serving.batching`)."""
    out: list = [None] * len(queries)
    for members, stacked, kk, ex in stacked_groups(queries, k, exact):
        result = state.search(stacked, kk, exact=ex)
        sizes = [query_rows(queries[j]) for j in members]
        for j, rows in zip(members, split_rows(result, sizes), strict=True):
            out[j] = rows
    return out
