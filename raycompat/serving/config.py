"""Options of a served live index (one frozen dataclass; ``parse_options`` checks names and values).

What the gallery and the model bundles determine (dimensions, item count, model versions) is
not an option: :func:`raycompat.serving.plan.build_plan` derives it once, into the
:class:`~raycompat.serving.plan.ServingPlan` every deployment receives.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from raycompat.config import ConfigError, choices, nonnegative, option, parse_options, positive
from raycompat.index.ann import IndexOptions
from raycompat.storage import StorageError, resolve_location
from raycompat.upgrade.canary import CanaryOptions
from raycompat.upgrade.modes import SERVED_MODES

__all__ = ["ServingConfig", "serving_config"]


@dataclass(frozen=True)
class ServingConfig:
    """Every option of the live index (docs/architecture.md "Serving")."""

    gallery: str = option(
        "",
        help="embeddings parquet (simulator schema) or "
        "synthetic:N[:D_old[:D_new[:seed[:clusters]]]]",
    )
    state_dir: str = option(
        "serving_state", help="the backfill checkpoint, and the store's folder without 'store'"
    )
    store: str = option(
        "",
        help="the store the index serves: a store URI (lance://PATH/TABLE) or a folder (an "
        "embedded LanceDB table 'gallery' in it; default <state_dir>/store), created from "
        "'gallery' on the first start",
    )
    store_columns: str | None = option(
        None, help="the store's column names, as backfill-store's --store-columns"
    )
    mode: str = choices(*SERVED_MODES, default="compatible", help="query strategy served")
    num_shards: int = positive(2, help="shard deployments")
    index: IndexOptions = option(
        factory=IndexOptions, help="the search index of every representation (docs/indexes.md)"
    )
    compatible_dim: int | None = option(
        None, help="D_c, the compatible dims of a new query (default: D_old)"
    )
    shard_cpus: float = option(0.0, help="ray_actor_options num_cpus per shard replica")
    shard_memory_mb: int | None = option(
        None, help="ray_actor_options memory per shard replica (MiB)"
    )
    shard_threads: int = positive(1, help="faiss OpenMP threads per shard")
    shard_replicas: int = positive(
        1,
        help="replicas per shard, each a cache of the shard's rows of the store (replaced by "
        "shard_autoscaling when that is given)",
    )
    shard_replicas_per_node: int = nonnegative(
        0,
        help="at most this many replicas of one shard on a node (Serve's max_replicas_per_node; "
        "0: no limit); 1 puts a shard's replicas on different nodes",
    )
    shard_gpus: float = option(
        0.0, help="ray_actor_options num_gpus per shard replica (the index then lives on the GPU)"
    )
    shard_autoscaling: str | None = option(
        None,
        help="Serve autoscaling_config of every shard deployment, as JSON: e.g. "
        '\'{"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 8}\'',
    )
    router_autoscaling: str | None = option(
        None, help="Serve autoscaling_config of the router, as JSON (replaces router_replicas)"
    )
    search_batch_size: int = positive(
        32, help="most search requests gathered into one search call (router and shards)"
    )
    search_batch_wait_ms: float = nonnegative(
        0.0,
        help="longest wait, in ms, for more search requests to join a batch once its first "
        "request is there (0: a batch takes the requests that queued while the last one ran)",
    )
    router_cpus: float = option(0.0, help="ray_actor_options num_cpus per router replica")
    router_replicas: int = nonnegative(
        0,
        help="router replicas (0: two where the cluster has at least 2 CPUs, else one; with one, "
        "requests wait while Serve replaces a router that died)",
    )
    metrics_interval_s: float | None = option(
        None,
        min=0.1,
        help="seconds between two pushes of a replica's counters to its node's Ray metrics "
        "agent, which /metrics and Prometheus read (Ray's metrics_report_interval_ms; "
        "default Ray's, 10 s)",
    )
    host: str = option("127.0.0.1", help="HTTP host")
    port: int = positive(8000, help="HTTP port")
    app_name: str = option("raycompat", help="Serve application name")
    route_prefix: str = option("/", help="Serve route prefix")
    token_file: str | None = option(None, help="admin token file (else env RAYCOMPAT_ADMIN_TOKEN)")
    new_model: str | None = option(
        None, help="new ModelBundle dir: image queries, embedder pool, psi, uncertainty"
    )
    old_model: str | None = option(
        None, help="old ModelBundle dir: /status; naive_merge image queries"
    )
    pipeline_output: str | None = option(
        None, help="parquet from the Ray Data pipeline (item_id, new)"
    )
    items: str | None = option(
        None, help="parquet item_id, label (class), instance: what the embedder pool renders"
    )
    data_seed: int = option(0, help="glyph renderer seed of the embedder pool")
    resolution: int | None = option(
        None, help="glyph resolution of the embedder pool (default: bundle manifest)"
    )
    embedder_actors: int = positive(1, help="embedder pool actors")
    embedder_cpus: float = option(0.5, help="num_cpus per embedder actor")
    max_k: int = positive(1000, help="largest k of a search")
    max_queries: int = positive(256, help="queries per search request")
    max_image_bytes: int = positive(1 << 20, help="bytes per query image")
    max_upsert_items: int = positive(10000, help="items per upsert request and backfill batch")
    max_body_bytes: int = positive(
        32 << 20, help="bytes per request body (413 above it, checked before the body is read)"
    )
    api_docs: bool = option(
        False,
        help="serve the /docs and /redoc pages (they load their scripts from a CDN, so they are "
        "blank on a machine without internet); /openapi.json is always served",
    )
    max_request_pixels: int = positive(
        16 * 4096 * 4096, help="pixels of all the images of one search request, decoded or not"
    )
    learned_sample_fraction: float = option(
        0.02, help="sample fraction of the 'learned' backfill policy"
    )
    request_timeout_s: float = positive(
        60.0,
        help="Serve's HTTP request timeout, in seconds (set when this index starts Serve): a "
        "request still unanswered then gets a JSON 503 with Retry-After",
    )
    shard_timeout_s: float = positive(
        30.0, help="seconds the router waits for a shard or the backfill controller (then 503)"
    )
    upsert_retry_s: float = positive(
        300.0, help="seconds the backfill controller retries a batch on a shard that is down"
    )
    canary: CanaryOptions = option(
        factory=CanaryOptions,
        help="the canary gate of a backfill: when it is measured and what pauses it "
        "(docs/live-index.md, 'Upgrading a live gallery safely')",
    )


def serving_config(values: Mapping[str, Any] | None = None, **kw: Any) -> ServingConfig:
    """Build and check a :class:`ServingConfig` (unknown keys or bad values raise ``ConfigError``);
    ``state_dir`` and a ``store`` folder become absolute local paths."""

    cfg = parse_options(ServingConfig, {**(values or {}), **kw}, owner="serving")
    _check_paths(cfg)
    if cfg.port > 65535:
        raise ConfigError(f"serving: port must be <= 65535, got {cfg.port}")
    from raycompat.serving.served_store import check_followed

    store = cfg.store
    if store and "://" not in store:  # a folder: absolute, as every replica must read it
        store = os.path.abspath(os.path.expanduser(store))
    cfg = dataclasses.replace(
        cfg,
        store=store,
        state_dir=state_directory(cfg.state_dir, "serving: state_dir"),
        shard_autoscaling=autoscaling_json("shard_autoscaling", cfg.shard_autoscaling),
        router_autoscaling=autoscaling_json("router_autoscaling", cfg.router_autoscaling),
    )
    check_followed(cfg)  # a store no replica could follow is refused before anything starts
    return cfg


def autoscaling_json(name: str, value) -> str | None:
    """``value`` (a mapping or JSON text) checked against Serve's ``AutoscalingConfig``, as
    canonical JSON; ``ConfigError`` naming the option and the bad key (Serve itself ignores
    unknown keys silently)."""
    if value is None or value == "":
        return None
    try:
        data = json.loads(value) if isinstance(value, str) else dict(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"serving: option {name!r} must be a JSON object: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"serving: option {name!r} must be a JSON object, got {value!r}")
    from pydantic import ValidationError
    from ray.serve.config import AutoscalingConfig

    unknown = sorted(set(data) - set(AutoscalingConfig.model_fields))
    if unknown:
        raise ConfigError(
            f"serving: option {name!r}: unknown key {unknown[0]!r}; allowed keys: "
            f"{sorted(AutoscalingConfig.model_fields)}"
        )
    try:
        AutoscalingConfig(**data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "value"
        raise ConfigError(f"serving: option {name!r}: {where}: {first['msg']}") from None
    return json.dumps(data, sort_keys=True)


def _check_paths(cfg: ServingConfig) -> None:
    if not cfg.gallery:
        raise ConfigError(
            "serving: option 'gallery' is required (embeddings parquet or synthetic:N)"
        )
    if not cfg.gallery.startswith("synthetic:") and not os.path.exists(cfg.gallery):
        raise ConfigError(f"serving: gallery embeddings not found: {cfg.gallery}")
    for name in ("new_model", "pipeline_output", "items", "token_file"):
        p = getattr(cfg, name)
        if p and not os.path.exists(p):
            raise ConfigError(f"serving: option {name!r}: path not found: {p}")


def state_directory(location: str, what: str = "state_dir") -> str:
    """The live index's state directory as an absolute local path (``~`` expanded; a
    ``file://`` URI's path); StorageError naming ``what`` for a place off this machine's disk."""
    place = resolve_location(location, what)
    if not place.on_disk:
        raise StorageError(
            f"{what} {place.uri}: the live index's state must be a local folder "
            "(its default store, an embedded LanceDB table, is made there)"
        )
    return place.root
