"""Serve's HTTP proxy for the live index: its options (request timeout, error middleware), and
the address of a Serve instance that already runs (docs/architecture.md, "Router").

Serve answers some requests itself, without reaching the router: a router replica that died
mid-request (plain-text 500), a request past ``request_timeout_s`` (plain-text 408), a deleted
or unknown route (plain-text 404), no replica available (503).  :class:`JsonProxyErrors`, a
pure ASGI middleware around everything the proxy serves, turns those into the index's JSON
error body; a 5xx or a 408 becomes 503 with ``Retry-After``.  JSON responses (the router's
own) pass through untouched, bodies streamed.

Serve 2.60 takes proxy middlewares only from the environment of the Ray node that runs the
proxy: ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=raycompat.serving.proxy.proxy_middlewares``
(:data:`PROXY_CALLBACK_ENV`) where ``ray start`` runs.  :func:`raycompat.cluster.connect` sets it
for the local clusters it starts; ``cluster.yaml`` sets it on the head node.
:func:`proxy_has_json_errors` tells whether a running proxy has it.
"""

from __future__ import annotations

import json

from raycompat.cluster import SERVE_PROXY_CALLBACK, SERVE_PROXY_CALLBACK_ENV
from raycompat.config import ConfigError
from raycompat.serving.config import ServingConfig

__all__ = [
    "JsonProxyErrors",
    "PROXY_CALLBACK_ENV",
    "PROXY_CALLBACK",
    "proxy_middlewares",
    "proxy_has_json_errors",
    "serve_http_options",
    "running_http_address",
    "check_http_address",
]

#: the environment variable Serve's proxy reads its middlewares from, and our callback
PROXY_CALLBACK_ENV, PROXY_CALLBACK = SERVE_PROXY_CALLBACK_ENV, SERVE_PROXY_CALLBACK

#: seconds a client should wait before retrying a request the proxy could not serve
RETRY_AFTER_S = 1
_MAX_MESSAGE = 1024


def _json_error(status: int, message: str) -> tuple[dict, dict]:
    """The ASGI start and body messages of the index's JSON error body."""
    body = json.dumps({"error": message, "problems": []}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 503:
        headers.append((b"retry-after", str(RETRY_AFTER_S).encode()))
    start = {"type": "http.response.start", "status": status, "headers": headers}
    return start, {"type": "http.response.body", "body": body, "more_body": False}


def _replacement(status: int, text: str) -> tuple[int, str]:
    """What a plain-text proxy answer becomes: 5xx and 408 -> 503, other 4xx keep theirs."""
    text = text.strip()[:_MAX_MESSAGE]
    if status == 408:
        return 503, f"the request timed out in the index's HTTP proxy ({text or 'no answer'})"
    if status >= 500:
        return 503, f"the live index is unavailable ({text or f'proxy status {status}'})"
    return status, text or f"HTTP {status}"


class JsonProxyErrors:
    """Pure ASGI middleware: the proxy's own error answers as JSON (see the module docstring)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state = {"started": False, "held": None, "text": b""}

        async def guarded_send(message):
            if message["type"] == "http.response.start":
                headers = dict(message.get("headers") or [])
                is_json = headers.get(b"content-type", b"").startswith(b"application/json")
                if message["status"] >= 400 and not is_json:
                    state["held"] = message["status"]  # replaced once its body has arrived
                    return
                state["started"] = True
            elif message["type"] == "http.response.body" and state["held"] is not None:
                state["text"] = (state["text"] + message.get("body", b""))[:_MAX_MESSAGE]
                if not message.get("more_body", False):
                    await self._send(
                        send, state, state["held"], state["text"].decode("utf-8", "replace")
                    )
                return
            await send(message)

        try:
            await self.app(scope, receive, guarded_send)
        except Exception as exc:  # the proxy raised before answering
            if state["started"]:
                raise
            await self._send(send, state, 500, type(exc).__name__)
            return
        if not state["started"]:  # the proxy gave up without answering (a dead replica)
            await self._send(
                send, state, state["held"] or 500, state["text"].decode("utf-8", "replace")
            )

    @staticmethod
    async def _send(send, state: dict, status: int, text: str) -> None:
        start, body = _json_error(*_replacement(status, text))
        state["started"], state["held"] = True, None
        await send(start)
        await send(body)


def proxy_middlewares() -> list:
    """What Serve's proxy calls (through :data:`PROXY_CALLBACK_ENV`) for its middlewares."""
    from starlette.middleware import Middleware

    return [Middleware(JsonProxyErrors)]


def proxy_has_json_errors(url: str) -> bool:
    """Whether the proxy serving ``url`` answers an unknown path with the JSON error body."""
    import urllib.error
    import urllib.parse
    import urllib.request

    parts = urllib.parse.urlsplit(url)
    probe = f"{parts.scheme}://{parts.netloc}/-raycompat-probe-unknown-path"
    try:
        with urllib.request.urlopen(probe, timeout=10) as r:
            ctype = r.headers.get("content-type", "")
    except urllib.error.HTTPError as exc:
        ctype = exc.headers.get("content-type", "")
    except OSError:
        return False
    return ctype.startswith("application/json")


def serve_http_options(cfg: ServingConfig) -> dict:
    """Serve's ``http_options`` for ``cfg``: host, port and request timeout."""
    return {
        "host": cfg.host,
        "port": int(cfg.port),
        "request_timeout_s": float(cfg.request_timeout_s),
    }


def running_http_address() -> tuple[str, int] | None:
    """``(host, port)`` of the Serve instance running on the connected cluster, or ``None``."""
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    try:
        controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    except ValueError:  # no Serve controller on this cluster
        return None
    opts = ray.get(controller.get_http_config.remote(), timeout=60)
    return str(opts.host), int(opts.port)


def check_http_address(cfg: ServingConfig) -> bool:
    """Whether Serve already runs (then at ``cfg.host:cfg.port``); ``ConfigError`` naming the
    running address when it listens elsewhere (Serve's HTTP options are cluster-wide)."""
    running = running_http_address()
    if running is None:
        return False
    if running != (cfg.host, int(cfg.port)):
        host, port = running
        raise ConfigError(
            f"Serve is already running on this cluster with HTTP at {host}:{port}; "
            f"--host/--port {cfg.host}:{cfg.port} cannot take effect (Serve's HTTP options are "
            f"cluster-wide): pass --host {host} --port {port}, or stop Serve first with "
            "`serve shutdown`"
        )
    return True
