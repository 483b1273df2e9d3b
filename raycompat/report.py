"""Writing results a person can open: JSON with every number, markdown tables."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Sequence
from typing import Any


def json_safe(value: Any) -> Any:
    """``value`` made standard JSON: NaN/inf -> None (``json.dump`` would write ``NaN``), dict
    keys -> str, tuples -> lists, numpy scalars -> Python numbers; nested containers too."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        return json_safe(value.item())
    return value


def with_version(report: dict) -> dict:
    """``report`` with ``raycompat_version`` (the package's ``__version__``) first: every
    report a job writes records the code that made it."""
    import raycompat

    return {"raycompat_version": raycompat.__version__, **report}


def write_json(path: str, obj: Any) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(json_safe(obj), f, indent=2)
    os.replace(tmp, path)
    return path


def fmt(value: Any, digits: int = 4) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if not math.isfinite(value):
            return "n/a"
        return f"{value:.{digits}f}"
    return str(value)


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[Any]], digits: int = 4) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(fmt(v, digits) for v in row) + " |")
    return "\n".join(lines)


def machine_description(load_at_start: float) -> str:
    """Cores, architecture and the 1-minute load average at the start and the end of a run
    (a load well above the core count means other jobs shared the machine)."""
    import platform

    return (
        f"{os.cpu_count()} CPU cores, {platform.machine()}; "
        f"load average {load_at_start:.1f} at the "
        f"start, {os.getloadavg()[0]:.1f} at the end"
    )
