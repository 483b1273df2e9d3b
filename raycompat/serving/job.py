"""Start the live index (Ray Serve: shards, backfill controller, router) on a cluster; it keeps
running.

Every :class:`raycompat.serving.config.ServingConfig` option is a flag (``--gallery``,
``--num-shards``, ``--shard-replicas``, ``--index``, ``--shard-autoscaling``, ``--host``,
``--port`` ...).  The job
connects to the cluster (``--address``, or the one ``ray job submit`` runs it in), starts
Serve's HTTP proxy on ``--host:--port`` (on the head node only with the default
``--proxy-location HeadOnly``), deploys the application and waits until ``GET /status``
answers.  Then it exits: Serve's controller is a detached actor, so the index keeps serving
after the job ends, until ``--stop`` (or ``serve shutdown``) removes it.  A restarted job
with the same ``--state-dir`` recovers every shard from its snapshot and log (see
docs/architecture.md, Serving).

Admin endpoints need the bearer token of ``RAYCOMPAT_ADMIN_TOKEN`` or ``--token-file``; the
job refuses to start an index that no token protects.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
import urllib.request
from dataclasses import dataclass

from raycompat.config import (
    ConfigError,
    add_options,
    choices,
    make_parser,
    option,
    options_from_args,
    positive,
)
from raycompat.console import job_main, quiet_ray
from raycompat.serving.config import ServingConfig

__all__ = ["ServeIndexOptions", "main", "build_parser"]

PROXY_LOCATIONS = ("HeadOnly", "EveryNode", "Disabled")


@dataclass(frozen=True)
class ServeIndexOptions:
    """The job's own flags, and the index's (``serving``: every ``ServingConfig`` option)."""

    address: str | None = option(
        None, help="Ray address (none: the job's cluster, or an embedded one)"
    )
    proxy_location: str = choices(
        *PROXY_LOCATIONS,
        default="HeadOnly",
        help="where Serve runs HTTP proxies (HeadOnly: one endpoint, on the head node)",
    )
    wait_s: float = positive(300.0, help="how long to wait for GET /status, in seconds")
    stop: bool = option(False, help="delete the application named --app-name and exit")
    block: bool = option(
        False, help="stay in the foreground and delete the application on Ctrl-C (like `serve run`)"
    )
    verbose: bool = option(False, help="keep Ray's own INFO lines")
    serving: ServingConfig = option(
        factory=ServingConfig, help="index options (raycompat.serving.config.ServingConfig)"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = make_parser(
        "serve-index",
        description="Start the raycompat live index "
        "(Ray Serve: shards, backfill controller, router) on a "
        "cluster and leave it running.",
    )
    add_options(parser, ServeIndexOptions)
    return parser


def _wait_ready(url: str, wait_s: float) -> dict:
    deadline = time.time() + wait_s
    last = None
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(url + "/status", timeout=10) as r:
                return json.loads(r.read())
        except Exception as exc:  # not up yet: connection refused, 503 while replicas start
            last = exc
            time.sleep(1.0)
    raise TimeoutError(f"{url}/status did not answer within {wait_s:.0f} s (last error: {last})")


def _checked_config(opts: ServeIndexOptions) -> ServingConfig:
    """The index's config with every check that needs no cluster: paths, and an admin token."""
    from raycompat.serving.auth import TOKEN_ENV, load_admin_token
    from raycompat.serving.config import serving_config

    cfg = serving_config(dataclasses.asdict(opts.serving))
    if load_admin_token(cfg.token_file) is None:  # checked here, before anything is deployed
        raise ConfigError(
            f"no admin token: set {TOKEN_ENV} or pass --token-file (the admin endpoints "
            "start, pause and resume backfills and write to the index)"
        )
    return cfg


def _deploy(opts: ServeIndexOptions, cfg: ServingConfig) -> str:
    """Start Serve's proxy (unless Serve runs already, at this address) and the application;
    returns the index's URL."""
    from raycompat.cluster import connect
    from raycompat.serving.app import start_serving
    from raycompat.serving.proxy import check_http_address

    connect(opts.address)
    check_http_address(cfg)  # refuses another address before anything is said or deployed
    print(
        f"[serve_index] deploying {cfg.app_name!r}: {cfg.num_shards} shards, "
        f"gallery {cfg.gallery}, state {cfg.state_dir}",
        flush=True,
    )
    return start_serving(cfg, opts.address, opts.proxy_location)


def _stop(opts: ServeIndexOptions) -> int:
    from ray import serve

    from raycompat.cluster import connect

    connect(opts.address)
    serve.delete(opts.serving.app_name)
    print(f"[serve_index] deleted application {opts.serving.app_name!r}", flush=True)
    return 0


def _block(app_name: str) -> None:
    from ray import serve

    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        serve.delete(app_name)


def _warn_without_json_errors(url: str) -> None:
    """Say so when Serve's proxy lacks the JSON error middleware (a `ray start` without it)."""
    from raycompat.serving.proxy import PROXY_CALLBACK, PROXY_CALLBACK_ENV, proxy_has_json_errors

    if not proxy_has_json_errors(url):
        print(
            "[serve_index] note: Serve's proxy answers its own errors (a dead replica, a timeout) "
            f"as plain text: start the head node with {PROXY_CALLBACK_ENV}={PROXY_CALLBACK} "
            "(cluster.yaml does) for JSON 503s with Retry-After",
            flush=True,
        )


@job_main
def main(argv: list[str] | None = None) -> int:
    opts = options_from_args(ServeIndexOptions, build_parser().parse_args(argv))
    quiet_ray(opts.verbose)
    if opts.stop:
        return _stop(opts)
    cfg = _checked_config(opts)
    url = _deploy(opts, cfg)
    status = _wait_ready(url, opts.wait_s)
    print(
        f"[serve_index] serving at {url}: {json.dumps(status.get('items'))} "
        "items per representation; "
        f"API schema at {url}/openapi.json" + (f", docs at {url}/docs" if cfg.api_docs else ""),
        flush=True,
    )
    _warn_without_json_errors(url)
    if opts.block:
        _block(cfg.app_name)
        return 0
    print(
        f"[serve_index] the index keeps running; stop it with: python jobs/serve_index.py --stop "
        f"--app-name {cfg.app_name}",
        flush=True,
    )
    return 0
