"""The shard deployment: one Serve deployment per shard, one replica each, wrapping a
:class:`raycompat.serving.state.ShardState` kept in ``<state_dir>/shard-<i>`` (or, after a
reshard, ``<state_dir>/shards-g<k>/shard-<i>``: :mod:`raycompat.serving.layout`).

On (re)start the replica recovers from its snapshot + log; only when the directory is empty
does it load its items (placed by :func:`raycompat.serving.placement.shard_of`) from the
gallery source, in their initial representation, and write the first snapshot.
"""

from __future__ import annotations

import os
import time

import numpy as np

from raycompat.serving.durability import StorageError
from raycompat.serving.plan import ServingPlan
from raycompat.serving.state import REPRESENTATIONS, ShardState, UnknownItemError

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
    """Serve deployment class (bound per shard by :mod:`raycompat.serving.app`)."""

    def __init__(self, shard: int, plan: ServingPlan):
        t0 = time.perf_counter()
        cfg = plan.config
        self.shard = int(shard)
        self.n_shards = cfg.num_shards
        try:
            import faiss

            faiss.omp_set_num_threads(cfg.shard_threads)
        except Exception:  # pragma: no cover - faiss without OpenMP
            pass
        self.state = ShardState(
            shard_dir(cfg.state_dir, self.shard, cfg.num_shards),
            plan.dims.as_dict(),
            factory=cfg.factory,
            snapshot_every=cfg.snapshot_every,
            fsync=cfg.fsync,
            lock_wait_s=60.0,
        )
        if not self.state.initialized:
            self._load_initial(plan)
        self.started = time.time()
        self.startup_s = time.perf_counter() - t0
        self.searches = 0

    def _load_initial(self, plan: ServingPlan) -> None:
        """First start: this shard's items from the gallery, in their initial representation."""
        from raycompat.serving.gallery_source import open_gallery

        rep0 = plan.initial_representation
        src = open_gallery(
            plan.config.gallery, plan.config.new_model, need_adapted=rep0 == "adapted"
        )
        ids, vecs = src.initial_vectors(rep0, self.shard, self.n_shards)
        self.state.load_initial(rep0, ids, vecs)
        self.state.snapshot()
        self.state.recovery["initial_load"] = int(ids.size)

    def search(self, queries: dict[str, np.ndarray], k: int):
        self.searches += 1
        return self.state.search(queries, int(k))

    def unknown(self, ids) -> list:
        return self.state.unknown(ids)

    def upsert(self, ids, rep: str, vectors) -> dict:
        """Apply; returns ``{"applied", "seq"}``, or (nothing applied) ``{"error",
        "unknown_ids"}`` for unknown ids and ``{"error", "storage": True}`` when the log write
        failed."""
        try:
            return self.state.upsert(
                np.asarray(ids, np.int64), rep, np.asarray(vectors, np.float32)
            )
        except UnknownItemError as exc:
            return {"error": str(exc), "unknown_ids": exc.ids}
        except ValueError as exc:
            return {"error": str(exc)}
        except StorageError as exc:
            return {"error": f"shard {self.shard}: {exc}", "storage": True}

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

        return {
            "shard": self.shard,
            "items": self.state.counts(),
            "seq": self.state.seq,
            "upserts_applied": self.state.upserts_applied,
            "recovery": self.state.recovery,
            "log_bytes": self.state.log.size_bytes(),
            "storage": self.state.health(),
            "startup_s": self.startup_s,
            "started": self.started,
            "pid": os.getpid(),
            "searches": self.searches,
            "actor_id": ray.get_runtime_context().get_actor_id(),
            "actor_name": ray.get_runtime_context().get_actor_name(),
            "representations": list(REPRESENTATIONS),
        }
