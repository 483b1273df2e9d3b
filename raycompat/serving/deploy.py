"""Deploy the live index's application and, when a replica fails to start, say why.

Serve reports a failed deploy as "Failed to update the deployments ['shard-0']"; the reason (a
corrupt snapshot, a full disk, a shard directory held by another process) is only in the
deployment's status message.  :func:`run_application` raises :class:`DeployError` with that
reason's last line per failed deployment (docs/architecture.md, "Durability").
"""

from __future__ import annotations

import re

from raycompat.serving.config import ServingConfig

__all__ = ["DeployError", "run_application", "failure_reasons"]

_EXC_LINE = re.compile(r"^(?:[\w.]+\.)?(\w+(?:Error|Exception)): (.+)$")


class DeployError(RuntimeError):
    """The application did not start; the message names each failed deployment and why."""


def failure_reasons(app_name: str) -> list[str]:
    """``"<deployment>: <ExceptionType>: <message>"`` for every deployment of ``app_name`` that
    failed to start (the last exception line of its status message)."""
    from ray import serve

    app = serve.status().applications.get(app_name)
    if app is None:
        return []
    reasons = []
    for name, dep in app.deployments.items():
        if str(dep.status).endswith(("DEPLOY_FAILED", "UNHEALTHY")):
            lines = [
                m.group(1) + ": " + m.group(2)
                for m in map(_EXC_LINE.match, dep.message.splitlines())
                if m
            ]
            reasons.append(f"{name}: {lines[-1] if lines else dep.message.splitlines()[0]}")
    return reasons


def run_application(cfg: ServingConfig, app) -> None:
    """``serve.run`` the bound application ``app`` under ``cfg``'s name and route prefix;
    :class:`DeployError` naming each failed deployment's reason."""
    from ray import serve

    try:
        serve.run(
            app,
            name=cfg.app_name,
            route_prefix=cfg.route_prefix,
            logging_config={"log_level": "WARNING", "enable_access_log": False},
        )
    except RuntimeError as exc:
        reasons = failure_reasons(cfg.app_name)
        if not reasons:
            raise
        raise DeployError(
            f"the live index {cfg.app_name!r} did not start: " + "; ".join(reasons)
        ) from exc
