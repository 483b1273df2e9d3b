"""Options of a served live index (one dataclass; ``parse_options`` checks names and values)."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Optional

from raycompat.config import ConfigError, choices, parse_options, positive

__all__ = ["ServingConfig", "serving_config"]


@dataclass
class ServingConfig:
    gallery: str = ""                    # embeddings parquet (simulator schema) or synthetic:N[:Do[:Dn[:seed]]]
    state_dir: str = "serving_state"     # shard snapshots + logs, backfill checkpoint
    mode: str = choices("compatible", "adapted", "rank_merge", "naive_merge", default="compatible")
    num_shards: int = positive(2)
    factory: str = "Flat"                # faiss factory string; Flat = exact
    compatible_dim: Optional[int] = None  # default: D_old
    shard_cpus: float = 0.0              # ray_actor_options num_cpus per shard replica
    shard_memory_mb: Optional[int] = None
    shard_threads: int = positive(1)     # faiss OpenMP threads per shard
    router_cpus: float = 0.0
    router_replicas: int = positive(1)
    snapshot_every: int = positive(200_000)   # upserted items between snapshots
    fsync: bool = True
    host: str = "127.0.0.1"
    port: int = positive(8000)
    app_name: str = "raycompat"
    route_prefix: str = "/"
    token_file: Optional[str] = None     # else env RAYCOMPAT_ADMIN_TOKEN
    new_model: Optional[str] = None      # new ModelBundle dir: image queries, embedder pool, psi, uncertainty
    old_model: Optional[str] = None      # /status; naive_merge image queries are embedded with it too
    pipeline_output: Optional[str] = None  # parquet from the Ray Data pipeline (item_id, new)
    items: Optional[str] = None          # parquet item_id, label (class), instance: what the embedder pool renders
    data_seed: int = 0
    resolution: Optional[int] = None     # glyph resolution for the embedder pool (default: bundle manifest)
    embedder_actors: int = positive(1)
    embedder_cpus: float = 0.5
    max_k: int = positive(1000)
    max_queries: int = positive(256)
    max_image_bytes: int = positive(1 << 20)
    max_upsert_items: int = positive(10000)
    learned_sample_fraction: float = 0.02


def serving_config(values=None, **kw) -> ServingConfig:
    """Build and check a :class:`ServingConfig` (unknown keys or bad values raise ``ConfigError``)."""
    cfg = parse_options(ServingConfig, {**(values or {}), **kw}, owner="serving")
    if not cfg.gallery:
        raise ConfigError("serving: option 'gallery' is required (embeddings parquet or synthetic:N)")
    if not cfg.gallery.startswith("synthetic:") and not os.path.exists(cfg.gallery):
        raise ConfigError(f"serving: gallery embeddings not found: {cfg.gallery}")
    for name in ("new_model", "pipeline_output", "items", "token_file"):
        p = getattr(cfg, name)
        if p and not os.path.exists(p):
            raise ConfigError(f"serving: option {name!r}: path not found: {p}")
    if cfg.port > 65535:
        raise ConfigError(f"serving: port must be <= 65535, got {cfg.port}")
    cfg.state_dir = os.path.abspath(cfg.state_dir)
    return cfg


def as_dict(cfg: ServingConfig) -> dict:
    return dataclasses.asdict(cfg)
