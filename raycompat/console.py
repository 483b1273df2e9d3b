"""What a job prints: errors on stderr with exit code 2, one progress line per step with an
ETA, one summary line per phase, and Ray's own per-report INFO lines off unless asked for.

Every job's ``main`` is wrapped by :func:`job_main`, so a ``ConfigError`` (a bad option, an
input that disagrees with another, an unusable output path) is one ``error: ...`` line on
stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import time
from collections.abc import Callable

from raycompat.config import ConfigError

__all__ = ["fail", "job_main", "Progress", "phase", "quiet_ray", "format_eta"]

#: the loggers whose INFO lines flood a job's console (Ray Train's per-report and
#: checkpoint lines, Ray Data's progress and plan lines, Serve's per-request lines)
RAY_LOGGERS = (
    "ray.train",
    "ray.tune",
    "ray.data",
    "ray.serve",
    "ray.air",
    "ray._private",
    "ray.util",
)


def fail(message: str) -> int:
    """Print ``error: message`` on stderr; returns the exit status 2."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    return 2


def job_main(fn: Callable[..., int | None]) -> Callable[..., int]:
    """Wrap a job's ``main(argv)``: a ``ConfigError`` becomes :func:`fail` (exit 2)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs) -> int:
        try:
            return int(fn(*args, **kwargs) or 0)
        except ConfigError as err:
            return fail(str(err))

    return wrapper


def quiet_ray(verbose: bool = False) -> None:
    """Ray's INFO lines off (``verbose=True`` keeps them): sets the environment that Ray's
    workers read when they start, and this process's loggers."""
    if verbose:
        os.environ["RAYCOMPAT_VERBOSE"] = "1"
        return
    os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("RAY_TRAIN_ENABLE_STATE_TRACKING", "0")
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    # Ray Data configures its loggers when it is imported, from this variable
    os.environ.setdefault("RAY_DATA_LOG_LEVEL", "WARNING")
    for name in RAY_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


def is_verbose() -> bool:
    """Whether the job was started with ``--verbose`` (also seen by Ray workers)."""
    return os.environ.get("RAYCOMPAT_VERBOSE") == "1"


def format_eta(seconds: float) -> str:
    """``75`` -> ``1m15s``; ``3700`` -> ``1h01m``."""
    seconds = max(0, int(round(seconds)))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


class Progress:
    """One line per finished step: ``[name] 3/10 <fields> 12.0s elapsed, ETA 28s``.

    The ETA is the mean time per step so far times the steps left, counted from the first
    step this process saw (a resumed run does not count the steps it skipped).
    """

    def __init__(self, name: str, total: int, *, done: int = 0, stream=None):
        self.name = name
        self.total = int(total)
        self.start_done = int(done)
        self.started = time.monotonic()
        self.stream = stream or sys.stdout

    def eta(self, done: int) -> float:
        steps = done - self.start_done
        if steps <= 0:
            return float("nan")
        return (time.monotonic() - self.started) / steps * (self.total - done)

    def step(self, done: int, **fields) -> str:
        """Print the line for ``done`` steps out of ``total`` and return it."""
        parts = [f"[{self.name}] {done}/{self.total}"]
        parts += [f"{k} {_fmt(v)}" for k, v in fields.items()]
        elapsed = time.monotonic() - self.started
        eta = self.eta(done)
        tail = f"{elapsed:.1f}s elapsed"
        if done < self.total and eta == eta:
            tail += f", ETA {format_eta(eta)}"
        line = " ".join(parts) + f" | {tail}"
        print(line, file=self.stream, flush=True)
        return line


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def phase(name: str, summary: str, seconds: float | None = None) -> str:
    """Print the one-line summary of a finished phase: ``== name: summary (12 s)``."""
    took = f" ({seconds:.0f} s)" if seconds is not None else ""
    line = f"== {name}: {summary}{took}"
    print(line, flush=True)
    return line
