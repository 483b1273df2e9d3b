"""Assemble and start the live index on Ray Serve: N shard deployments, the backfill
controller and the router ingress, bound to ``host:port`` (127.0.0.1 unless configured).

``build_app(cfg)`` derives the :class:`~raycompat.serving.plan.ServingPlan` once and binds
every deployment to it; ``start_serving(cfg)`` returns the base URL; ``stop_serving(cfg)``
deletes the application (``serve.shutdown`` is left to the caller, since Serve is cluster-wide).
"""

from __future__ import annotations

import json
import socket

from raycompat.serving.config import ServingConfig
from raycompat.serving.plan import ServingPlan, build_plan

__all__ = [
    "build_app",
    "start_serving",
    "stop_serving",
    "free_port",
    "replica_options",
    "router_replicas",
]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def build_app(cfg: ServingConfig):
    """The bound Serve application (router ingress over shards + controller); the served
    store is created from the gallery first if it does not exist, and checked."""
    from raycompat.serving.served_store import ensure_store, open_served_store

    plan = build_plan(cfg)
    ensure_store(cfg, plan.identities.default("old"), plan.query_dims.new)
    check_store(plan, open_served_store(cfg))
    shards = _bind_shards(plan)
    controller = _bind_controller(plan, shards)
    return _bind_router(plan, shards, controller)


def check_store(plan: ServingPlan, store) -> None:
    """The store's vectors have the gallery's dimensions (``ConfigError`` naming both)."""
    from raycompat.config import ConfigError

    try:
        old_dim, new_dim = store.old_dim, store.describe().new_dim
    finally:
        store.close()
    dims = plan.query_dims
    if (old_dim is not None and old_dim != dims.old) or new_dim != dims.new:
        raise ConfigError(
            f"serving: store {store.uri.raw} holds old {old_dim} / new {new_dim} dims, the "
            f"gallery {plan.config.gallery} old {dims.old} / new {dims.new}"
        )


def replica_options(replicas: int, autoscaling: str | None) -> dict:
    """Serve's ``num_replicas`` or, when given, its ``autoscaling_config`` (never both)."""
    if autoscaling:
        return {"autoscaling_config": json.loads(autoscaling)}
    return {"num_replicas": int(replicas)}


#: Serve's health checks of every replica (shards, router, backfill controller): a replica that
#: died is found, and its replacement started, within 2 s (Serve's default period is 10 s)
#: every deployment's health checks and shutdown: a replica that is stopped (a redeploy, a
#: scale-down, ``--stop``) looks for its last request every 0.5 s, not Serve's 2 s
HEALTH_CHECKS = {
    "health_check_period_s": 2.0,
    "health_check_timeout_s": 30.0,
    "graceful_shutdown_wait_loop_s": 0.5,
}


def actor_options(cfg: ServingConfig, **options) -> dict:
    """A replica's ``ray_actor_options``: ``options``, and the metrics report interval of
    ``metrics_interval_s`` in its environment (Ray reads it when the replica's process starts)."""
    if cfg.metrics_interval_s:
        interval = str(int(cfg.metrics_interval_s * 1000))
        options["runtime_env"] = {"env_vars": {"RAY_metrics_report_interval_ms": interval}}
    return options


def _bind_shards(plan: ServingPlan) -> list:
    from ray import serve

    from raycompat.serving.shard import ShardServer

    cfg = plan.config
    opts = actor_options(cfg, num_cpus=cfg.shard_cpus, num_gpus=cfg.shard_gpus)
    if cfg.shard_memory_mb:
        opts["memory"] = int(cfg.shard_memory_mb) * 1024 * 1024
    shard_cls = serve.deployment(
        ShardServer,
        max_ongoing_requests=max(64, 2 * cfg.search_batch_size),
        **HEALTH_CHECKS,
    )
    replicas = replica_options(cfg.shard_replicas, cfg.shard_autoscaling)
    if cfg.shard_replicas_per_node:
        replicas["max_replicas_per_node"] = int(cfg.shard_replicas_per_node)
    return [
        shard_cls.options(name=f"shard-{i}", ray_actor_options=opts, **replicas).bind(i, plan)
        for i in range(cfg.num_shards)
    ]


def _bind_controller(plan: ServingPlan, shards: list):
    from ray import serve

    from raycompat.serving.backfill_controller import BackfillController

    ctl_cls = serve.deployment(
        BackfillController,
        name="backfill",
        num_replicas=1,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=16,
        **HEALTH_CHECKS,
    )
    return ctl_cls.bind(shards, plan)


def _bind_router(plan: ServingPlan, shards: list, controller):
    from raycompat.serving.auth import AdminToken, load_admin_token
    from raycompat.serving.router import Router

    cfg = plan.config
    # read here (token_file, else RAYCOMPAT_ADMIN_TOKEN of this process); replicas get its hash
    admin = AdminToken.from_token(load_admin_token(cfg.token_file))
    return Router.options(
        ray_actor_options=actor_options(cfg, num_cpus=cfg.router_cpus),
        max_ongoing_requests=256,
        **HEALTH_CHECKS,
        **replica_options(router_replicas(cfg), cfg.router_autoscaling),
    ).bind(shards, controller, plan, admin)


def router_replicas(cfg: ServingConfig, cluster_cpus: float | None = None) -> int:
    """``router_replicas``, or (0) two where the cluster has at least 2 CPUs (and room for two
    replicas of ``router_cpus``), else one: with one replica, requests wait while Serve replaces
    a router that died (docs/live-index.md, "Replicas")."""
    if cfg.router_replicas:
        return int(cfg.router_replicas)
    if cluster_cpus is None:
        import ray

        cluster_cpus = float(ray.cluster_resources().get("CPU", 0))
    return 2 if cluster_cpus >= max(2.0, 2 * cfg.router_cpus) else 1


def start_serving(
    cfg: ServingConfig, address: str | None = None, proxy_location: str | None = None
) -> str:
    """Connect to Ray, start Serve on ``cfg.host:cfg.port`` (``ConfigError`` if Serve already
    listens elsewhere) and deploy (:class:`~raycompat.serving.deploy.DeployError` naming why a
    deployment failed); returns the base URL."""
    from ray import serve

    from raycompat.cluster import connect
    from raycompat.serving.deploy import run_application
    from raycompat.serving.proxy import check_http_address, serve_http_options

    connect(address)
    if not check_http_address(cfg):
        kw = {"proxy_location": proxy_location} if proxy_location else {}
        serve.start(http_options=serve_http_options(cfg), **kw)
    run_application(cfg, build_app(cfg))
    prefix = cfg.route_prefix.rstrip("/")
    return f"http://{cfg.host}:{int(cfg.port)}{prefix}"


def stop_serving(cfg: ServingConfig) -> None:
    """Delete the application ``cfg.app_name``."""
    from ray import serve

    serve.delete(cfg.app_name)
