"""Assemble and start the live index on Ray Serve: N shard deployments, the backfill
controller and the router ingress, bound to ``host:port`` (127.0.0.1 unless configured).

``start_serving(cfg)`` returns the base URL; ``stop_serving(cfg)`` deletes the application
(``serve.shutdown`` is left to the caller, since Serve is cluster-wide).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Optional

from raycompat.serving.auth import TOKEN_ENV
from raycompat.serving.config import ServingConfig

__all__ = ["build_app", "start_serving", "stop_serving", "model_versions"]


def model_versions(cfg: ServingConfig) -> dict:
    """``{"old": {...}, "new": {...}}``: path, method and a manifest digest of each bundle given."""
    out = {}
    for role in ("old", "new"):
        path = getattr(cfg, f"{role}_model")
        if not path:
            continue
        mpath = os.path.join(path, "manifest.json")
        entry = {"path": os.path.abspath(path)}
        if os.path.isfile(mpath):
            raw = open(mpath, "rb").read()
            m = json.loads(raw)
            entry.update(method=m.get("method"), embed_dim=m.get("embed_dim"),
                         manifest_sha256=hashlib.sha256(raw).hexdigest()[:16])
        out[role] = entry
    return out


def build_app(cfg: ServingConfig):
    """The bound Serve application (router ingress over shards + controller)."""
    from ray import serve

    from raycompat.serving.backfill import BackfillController
    from raycompat.serving.gallery_source import open_gallery
    from raycompat.serving.router import build_router
    from raycompat.serving.scoring import initial_representation
    from raycompat.serving.shard import ShardServer

    d = dataclasses.asdict(cfg)
    src = open_gallery(cfg.gallery, cfg.new_model, need_adapted=initial_representation(cfg.mode) == "adapted")
    d["dims"] = src.dims()                       # what each representation holds
    d["query_dims"] = {"old": src.old_dim, "new": src.new_dim}   # what clients send
    if cfg.mode == "rank_merge":                 # new items hold rho(phi_n(g)); ConfigError if no rho / psi_rev
        from raycompat.serving.scoring import rank_merge_maps

        rho, psi_rev = rank_merge_maps(cfg.new_model)
        if rho.in_dim != src.new_dim or psi_rev.out_dim != src.old_dim:
            from raycompat.config import ConfigError

            raise ConfigError(f"mode 'rank_merge': rho maps {rho.in_dim} -> {rho.out_dim} dims and psi_rev "
                              f"{psi_rev.in_dim} -> {psi_rev.out_dim}, the gallery has new {src.new_dim} / old "
                              f"{src.old_dim} dims")
        d["dims"]["new"] = int(rho.out_dim)
    d["n_items"] = int(src.n_items)
    if cfg.compatible_dim is None:
        d["compatible_dim"] = d["dims"]["old"]
    if d["compatible_dim"] != d["dims"]["old"] and cfg.mode == "compatible":
        from raycompat.config import ConfigError

        raise ConfigError(f"serving: mode 'compatible' compares phi_n(q)[:D_c] with phi_o(g): compatible_dim "
                          f"must equal D_old={d['dims']['old']}, got {d['compatible_dim']}")
    d["models"] = model_versions(cfg)
    env = {}
    if os.environ.get(TOKEN_ENV) and not cfg.token_file:
        env[TOKEN_ENV] = os.environ[TOKEN_ENV]
    shard_opts = {"num_cpus": cfg.shard_cpus}
    if cfg.shard_memory_mb:
        shard_opts["memory"] = int(cfg.shard_memory_mb) * 1024 * 1024
    shard_cls = serve.deployment(ShardServer, max_ongoing_requests=64, health_check_period_s=2.0,
                                 health_check_timeout_s=30.0)
    shards = [shard_cls.options(name=f"shard-{i}", num_replicas=1, ray_actor_options=shard_opts).bind(i, d)
              for i in range(cfg.num_shards)]
    ctl_cls = serve.deployment(BackfillController, name="backfill", num_replicas=1,
                               ray_actor_options={"num_cpus": 0}, max_ongoing_requests=16)
    controller = ctl_cls.bind(shards, d)
    router_opts = {"num_cpus": cfg.router_cpus}
    if env:
        router_opts["runtime_env"] = {"env_vars": env}
    Router = build_router(d)
    return Router.options(num_replicas=cfg.router_replicas, ray_actor_options=router_opts,
                          max_ongoing_requests=256).bind(shards, controller, d)


def start_serving(cfg: ServingConfig, address: Optional[str] = None) -> str:
    """Connect to Ray, start Serve on ``cfg.host:cfg.port`` and deploy; returns the base URL."""
    from ray import serve

    from raycompat.cluster import connect

    connect(address)
    serve.start(http_options={"host": cfg.host, "port": int(cfg.port)})
    serve.run(build_app(cfg), name=cfg.app_name, route_prefix=cfg.route_prefix,
              logging_config={"log_level": "WARNING", "enable_access_log": False})
    prefix = cfg.route_prefix.rstrip("/")
    return f"http://{cfg.host}:{int(cfg.port)}{prefix}"


def stop_serving(cfg: ServingConfig) -> None:
    from ray import serve

    serve.delete(cfg.app_name)
