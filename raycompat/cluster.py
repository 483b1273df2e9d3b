"""Connecting to Ray the way every job does: an existing cluster when one is named (or when
``ray job submit`` set ``RAY_ADDRESS``), otherwise an embedded local Ray."""

from __future__ import annotations

import os

#: Serve's proxy reads its middlewares from this variable of its node's environment; the value
#: is the live index's (raycompat.serving.proxy.proxy_middlewares: JSON error answers)
SERVE_PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
SERVE_PROXY_CALLBACK = "raycompat.serving.proxy.proxy_middlewares"


#: ``0``: an embedded local cluster starts without Ray's dashboard (no job uses it; the test
#: suite sets it, saving the dashboard's start-up in every job it runs)
DASHBOARD_ENV = "RAYCOMPAT_RAY_DASHBOARD"


def connect(address: str | None = None, num_cpus: int | None = None, quiet: bool = True):
    """``ray.init`` once; returns the Ray context.

    ``address`` ``None`` and no ``RAY_ADDRESS``: start an embedded local cluster on this
    machine (``address="local"``), even when a ``ray start`` cluster runs here; pass
    ``--address auto`` to join that one instead.  ``RAYCOMPAT_RAY_DASHBOARD=0`` starts the
    embedded cluster without Ray's dashboard."""
    import ray

    if ray.is_initialized():
        return ray.get_runtime_context()
    os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
    # a local cluster started here gives Serve's proxy the live index's JSON error middleware
    os.environ.setdefault(SERVE_PROXY_CALLBACK_ENV, SERVE_PROXY_CALLBACK)
    # Ray Train's print patch would log every worker line twice on the driver.
    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
    address = address or os.environ.get("RAY_ADDRESS")
    kwargs = dict(ignore_reinit_error=True, log_to_driver=True)
    if quiet:
        kwargs["logging_level"] = "warning"
    if address:
        return ray.init(address=address, **kwargs)
    if os.environ.get(DASHBOARD_ENV, "").strip() == "0":
        kwargs["include_dashboard"] = False
    return ray.init(address="local", num_cpus=num_cpus, **kwargs)
