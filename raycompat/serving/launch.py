"""``jobs/serve_index.py``: start the live index on a Ray cluster and leave it running.

Every :class:`raycompat.serving.config.ServingConfig` option is a flag (``--gallery``,
``--num-shards``, ``--shard-cpus``, ``--factory``, ``--host``, ``--port`` ...).  The job
connects to the cluster (``--address``, or the one ``ray job submit`` runs it in), starts
Serve's HTTP proxy on ``--host:--port`` (on the head node only with the default
``--proxy-location HeadOnly``), deploys the application and waits until ``GET /status``
answers.  Then it exits: Serve's controller is a detached actor, so the index keeps serving
after the job ends, until ``--stop`` (or ``serve shutdown``) removes it.  A restarted job
with the same ``--state-dir`` recovers every shard from its snapshot and log.

Admin endpoints need the bearer token of ``RAYCOMPAT_ADMIN_TOKEN`` or ``--token-file``; the
job refuses to start an index that no token protects.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time
import urllib.request
from typing import Optional, get_type_hints

from raycompat.config import ConfigError

__all__ = ["main", "build_parser"]

PROXY_LOCATIONS = ("HeadOnly", "EveryNode", "Disabled")


def _flag_type(hint):
    if hint in (int, Optional[int]):
        return int
    if hint in (float, Optional[float]):
        return float
    if hint is bool:
        return lambda v: {"true": True, "1": True, "yes": True, "false": False, "0": False,
                          "no": False}[v.strip().lower()]
    return str


def build_parser() -> argparse.ArgumentParser:
    from raycompat.serving.config import ServingConfig

    p = argparse.ArgumentParser(
        description="Start the raycompat live index (Ray Serve: shards, backfill controller, router) on a "
                    "cluster and leave it running.")
    p.add_argument("--address", default=None, help="Ray address (default: the job's cluster, or an embedded one)")
    p.add_argument("--proxy-location", default="HeadOnly", choices=PROXY_LOCATIONS,
                   help="where Serve runs HTTP proxies (default HeadOnly: one endpoint, on the head node)")
    p.add_argument("--wait-s", type=float, default=300.0, help="how long to wait for GET /status (default 300)")
    p.add_argument("--stop", action="store_true", help="delete the application named --app-name and exit")
    p.add_argument("--block", action="store_true",
                   help="stay in the foreground and delete the application on Ctrl-C (like `serve run`)")
    g = p.add_argument_group("index options (raycompat.serving.config.ServingConfig)")
    hints = get_type_hints(ServingConfig)
    for f in dataclasses.fields(ServingConfig):
        default = f.default if f.default is not dataclasses.MISSING else None
        g.add_argument("--" + f.name.replace("_", "-"), type=_flag_type(hints[f.name]), default=default,
                       help=f"default: {default}")
    return p


def _wait_ready(url: str, wait_s: float) -> dict:
    deadline = time.time() + wait_s
    last = None
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(url + "/status", timeout=10) as r:
                return json.loads(r.read())
        except Exception as exc:   # not up yet: connection refused, 503 while replicas start
            last = exc
            time.sleep(1.0)
    raise TimeoutError(f"{url}/status did not answer within {wait_s:.0f} s (last error: {last})")


def main(argv=None) -> int:
    from raycompat.serving.auth import TOKEN_ENV, load_admin_token
    from raycompat.serving.config import ServingConfig, serving_config

    args = build_parser().parse_args(argv)
    try:
        from ray import serve

        from raycompat.cluster import connect

        if args.stop:
            connect(args.address)
            serve.delete(args.app_name)
            print(f"[serve_index] deleted application {args.app_name!r}", flush=True)
            return 0
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(ServingConfig)}
        cfg = serving_config(values)
        if load_admin_token(cfg.token_file) is None:   # checked here, before anything is deployed
            raise ConfigError(f"no admin token: set {TOKEN_ENV} or pass --token-file (the admin endpoints "
                              "start, pause and resume backfills and write to the index)")
        from raycompat.serving.app import build_app

        connect(args.address)
        serve.start(proxy_location=args.proxy_location, http_options={"host": cfg.host, "port": int(cfg.port)})
        print(f"[serve_index] deploying {cfg.app_name!r}: {cfg.num_shards} shards, gallery {cfg.gallery}, "
              f"state {cfg.state_dir}", flush=True)
        serve.run(build_app(cfg), name=cfg.app_name, route_prefix=cfg.route_prefix,
                  logging_config={"log_level": "WARNING", "enable_access_log": False})
    except ConfigError as exc:
        print(f"error: {exc}", flush=True)
        return 2
    url = f"http://{cfg.host}:{int(cfg.port)}{cfg.route_prefix.rstrip('/')}"
    status = _wait_ready(url, args.wait_s)
    print(f"[serve_index] serving at {url}: {json.dumps(status.get('items'))} items per representation; "
          f"docs at {url}/docs", flush=True)
    if args.block:
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            serve.delete(cfg.app_name)
        return 0
    print(f"[serve_index] the index keeps running; stop it with: python jobs/serve_index.py --stop "
          f"--app-name {cfg.app_name}", flush=True)
    return 0
