"""How much each claim's check moves from one training seed to another (issue 28, point 5).

A one-seed run's intervals resample the queries only: a verdict can flip when the training is
repeated on another machine or with another seed. A run with ``--seeds N`` (N > 1) measures the
training variation: every check's difference has its per-seed values. This module collects them
(:func:`check_spread`), from the run itself or from an earlier run's ``report.json``
(``--seed-spread-from``, :func:`load_seed_spread`), so that the report can show, beside every
verdict, how far the difference moved between seeds. docs/reproduce.md, "Training variation".
"""

from __future__ import annotations

import json
import os

import numpy as np

from raycompat.config import ConfigError

__all__ = ["FRAGILE_SDS", "check_spread", "load_seed_spread", "seed_spread"]

#: a check whose difference lies within this many seed-to-seed standard deviations of 0 could
#: change its verdict with the training seed (the report flags it)
FRAGILE_SDS = 2.0


def check_spread(claims: list[dict]) -> dict:
    """``{claim id: {check: {per_seed, sd, value}}}`` for every check whose difference has
    per-seed values (a run with several seeds)."""
    out: dict = {}
    for claim in claims:
        for check in claim.get("checks") or []:
            d = check.get("difference") or {}
            per_seed = d.get("per_seed")
            if not per_seed or len(per_seed) < 2:
                continue
            values = np.asarray(per_seed, dtype=np.float64)
            out.setdefault(claim["id"], {})[check["check"]] = dict(
                per_seed=[float(v) for v in values],
                sd=float(values.std(ddof=1)),
                value=float(d["value"]),
            )
    return out


def load_seed_spread(path: str) -> dict:
    """The seed-to-seed spread of an earlier run's ``report.json`` (a reproduce report of a run
    with ``--seeds`` > 1): ``{source, seeds, checks}``. ``ConfigError`` naming the file when it
    is not one."""
    flag = f"--seed-spread-from {path}"
    if not os.path.isfile(path):
        raise ConfigError(f"{flag}: no such file (give the report.json of a --seeds N run)")
    try:
        with open(path) as f:
            report = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{flag}: not a JSON file ({exc})") from None
    if not isinstance(report, dict) or report.get("job") != "reproduce" or "claims" not in report:
        raise ConfigError(f"{flag}: not a reproduce report.json (no 'job': 'reproduce' claims)")
    seeds = (report.get("results") or {}).get("seeds") or []
    if len(seeds) < 2:
        raise ConfigError(
            f"{flag}: that run trained {len(seeds) or 1} seed(s); the spread needs a run with "
            "--seeds 2 or more"
        )
    return dict(
        source=os.path.abspath(path), seeds=list(seeds), checks=check_spread(report["claims"])
    )


def seed_spread(claims: list[dict], seeds: list[int], source: str | None) -> dict | None:
    """The spread the report shows: this run's own when it trained several seeds, else the one
    of ``source`` (``--seed-spread-from``), else ``None`` (not measured)."""
    if len(seeds) > 1:
        return dict(source="this run", seeds=list(seeds), checks=check_spread(claims))
    if source:
        return load_seed_spread(source)
    return None
