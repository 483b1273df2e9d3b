"""The rates the planner's clock runs on (docs/planning.md, "How each number is computed").

* :class:`EmbeddingRate`: re-embedding items, per device, after a fixed start-up;
  ``seconds(n, devices) = startup_s + n / (items_per_s * devices)``. Given (``--items-per-s``),
  read from an ``embed-gallery`` run's ``_summary.json`` (:func:`rate_from_summary`), measured
  on the spot by such a run on built-in glyphs (:func:`measure_embedding_rate`), or read from a
  simulation's ``cost_model``.
* :class:`PsiRate`: the adapted mode's refresh of every stored old vector with psi (DMU), a
  batched matmul per device: given (``--psi-per-s``) or measured on the spot
  (:func:`measure_psi_rate`, the method of ``bench/psi_refresh.py``).
* :class:`SearchLoad`: the query load and one device's search rate, which price the second
  search per query of the modes that search twice (:data:`SEARCHES_PER_QUERY`).

Every rate carries ``source``: given, read from a named file, or measured on the spot.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, replace

import numpy as np

from raycompat.config import ConfigError

__all__ = [
    "SEARCHES_PER_QUERY",
    "EmbeddingRate",
    "PsiRate",
    "SearchLoad",
    "check_rate_device",
    "measure_embedding_rate",
    "measure_psi_rate",
    "rate_from_cost_model",
    "rate_from_summary",
    "searches_per_query",
    "window_rates",
]

SUMMARY_FILE = "_summary.json"
#: searches per query while the gallery holds old and new vectors: rank_merge searches the
#: old vectors with psi_rev(rho(q)) and the new ones with rho(q); naive_merge the old ones with
#: the old model's query and the new ones with the new model's (docs/methods.md, "Query
#: strategies"). Every other mode searches one query vector.
SEARCHES_PER_QUERY = {"rank_merge": 2, "naive_merge": 2}


def searches_per_query(mode: str) -> int:
    return SEARCHES_PER_QUERY.get(mode, 1)


@dataclass(frozen=True)
class EmbeddingRate:
    """``items_per_s`` new embeddings per second on one device, after ``startup_s`` seconds."""

    items_per_s: float
    startup_s: float = 0.0
    source: str = "given"
    #: the kind of device the rate was measured on (``"gpu"``, ``"cpu"``), None when unknown
    device_kind: str | None = None
    #: the slowest and fastest of the measurement's timed windows (items/s), None when the
    #: rate was given or measured as one number (:func:`window_rates`)
    window_range: tuple[float, float] | None = None
    #: how many timed windows ``window_range`` spans
    windows: int = 0

    def __post_init__(self):
        if not math.isfinite(self.items_per_s) or self.items_per_s <= 0:
            raise ConfigError(f"embedding rate must be > 0 items/s, got {self.items_per_s!r}")

    def at(self, items_per_s: float) -> EmbeddingRate:
        """This rate with another items/s (the same start-up, source and device kind)."""
        return replace(self, items_per_s=float(items_per_s), window_range=None, windows=0)

    def seconds(self, items: float, devices: int) -> float:
        """Seconds to re-embed ``items`` items on ``devices`` devices."""
        return self.startup_s + items / (self.items_per_s * devices)


@dataclass(frozen=True)
class PsiRate:
    """``vectors_per_s`` stored old vectors refreshed with psi per second on one device."""

    vectors_per_s: float
    source: str = "given"

    def seconds(self, items: float, devices: int) -> float:
        return items / (self.vectors_per_s * devices)


@dataclass(frozen=True)
class SearchLoad:
    """``queries_per_s`` served while the backfill runs; ``searches_per_s``: one device's
    search rate. A mode searching ``s`` times per query keeps ``queries_per_s * (s - 1) /
    searches_per_s`` extra devices busy until the backfill ends."""

    queries_per_s: float
    searches_per_s: float

    def extra_devices(self, mode: str) -> float:
        return self.queries_per_s * (searches_per_query(mode) - 1) / self.searches_per_s


#: the steady part of a measured run is cut into this many windows of equal time
RATE_WINDOWS = 8


def window_rates(series, first_output_s: float | None, windows: int = RATE_WINDOWS):
    """The items/s of ``windows`` equal-time windows of a run's steady part (after its first
    output), from its ``(seconds, items, ...)`` progress series (linear between samples);
    empty when the series is too short to cut."""
    if not series or first_output_s is None:
        return []
    t = np.asarray([float(p[0]) for p in series], np.float64)
    items = np.asarray([float(p[1]) for p in series], np.float64)
    steady = t >= first_output_s
    if steady.sum() < windows + 1 or t[-1] - first_output_s <= 0:
        return []
    edges = np.linspace(max(first_output_s, t[steady][0]), t[-1], windows + 1)
    counts = np.interp(edges, t, items)
    return [float(r) for r in np.diff(counts) / np.diff(edges)]


def rate_from_summary(path: str, source: str | None = None) -> EmbeddingRate:
    """The rate of an ``embed-gallery`` run (its folder or ``_summary.json``).

    With a steady rate (items after the first output over the time after it), that is the
    rate, and the start-up is the rest of the run's wall time: ``startup_s = seconds -
    items / steady``, so the prediction for the run's own item count is its wall time. A run
    with one output (no steady rate) gives ``items / seconds`` and no start-up."""
    file = os.path.join(path, SUMMARY_FILE) if os.path.isdir(path) else path
    try:
        with open(file) as f:
            summary = json.load(f)
        items = int(summary["items_written"]) + int(summary.get("items_skipped") or 0)
        seconds = float(summary["seconds"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"--rate-summary {file}: not an embed-gallery summary ({exc})") from None
    if items <= 0 or seconds <= 0:
        raise ConfigError(f"--rate-summary {file}: the run embedded nothing ({items} items)")
    steady = summary.get("steady_items_per_s")
    if steady:
        rate, startup = float(steady), seconds - items / float(steady)
    else:
        rate, startup = items / seconds, 0.0
    columns = ",".join(summary.get("columns") or [])
    said = source or f"read from {file}"
    series = (summary.get("memory") or {}).get("series_s_items_rss_pss")
    spread = [r for r in window_rates(series, summary.get("first_output_s")) if r > 0]
    span = (min(spread), max(spread)) if len(spread) == RATE_WINDOWS else None
    return EmbeddingRate(
        rate,
        max(0.0, startup),
        f"{said}: {items:,} items ({columns}) in {seconds:.1f} s"
        + (f", steady {rate:,.1f} items/s after a start-up of {startup:.1f} s" if steady else "")
        + (
            f"; its {RATE_WINDOWS} timed windows ran at {span[0]:,.1f} to {span[1]:,.1f} items/s"
            if span
            else ""
        ),
        window_range=span,
        windows=RATE_WINDOWS if span else 0,
    )


def rate_from_cost_model(cost_model: dict | None, path: str) -> EmbeddingRate | None:
    """The per-device rate a simulation recorded (``curves.json``'s ``cost_model``)."""
    if not cost_model or not cost_model.get("items_per_s_per_gpu"):
        return None
    said = cost_model.get("source", "given")
    device = str(cost_model.get("device") or "gpu").lower()
    return EmbeddingRate(
        float(cost_model["items_per_s_per_gpu"]),
        0.0,
        f"read from {path} (its cost model: {said}, "
        f"{cost_model.get('rate_label', 'items/s per device')})",
        device_kind="gpu" if device == "gpu" or device.startswith("cuda") else "cpu",
    )


def check_rate_device(rate: EmbeddingRate, device_kind: str, path: str) -> None:
    """A simulation's recorded rate must come from the kind of device the plan is for (hours
    from another kind's rate are off by the ratio of the two rates): ``ConfigError`` naming how
    to give the right rate, or to use this one anyway."""
    if rate.device_kind is None or rate.device_kind == device_kind:
        return
    raise ConfigError(
        f"--results {path}: its recorded embedding rate ({rate.items_per_s:,.1f} items/s) is "
        f"a {rate.device_kind.upper()} rate, and the plan is for --device-kind {device_kind}: "
        f"give the {device_kind.upper()}'s rate (--items-per-s, --rate-summary or "
        f"--rate-model), or --no-rate-device-check to plan with this one"
    )


def _require_device(device_kind: str, flag: str, given: str) -> str:
    """The torch device a measurement for ``device_kind`` runs on (``ConfigError`` for a GPU
    plan on a machine without one)."""
    import torch

    if device_kind == "gpu":
        if not torch.cuda.is_available():
            raise ConfigError(
                f"{flag} measures on this machine, which has no CUDA device, but --device-kind "
                f"is gpu: give {given} instead"
            )
        return "cuda"
    return "cpu"


def measure_embedding_rate(
    model: str, items: int, out: str, device_kind: str, log=print
) -> EmbeddingRate:
    """Embed ``items`` built-in glyph items with ``model``'s embedder through ``embed-gallery``
    (Ray Data, into ``out``, replaced if there) and read the run's summary
    (:func:`rate_from_summary`); ``--device-kind cpu`` keeps the embedder off any GPU."""
    from raycompat.pipeline.job import EmbedGalleryOptions, run_job
    from raycompat.pipeline.options import ExecutionOptions, StageFlags

    _require_device(device_kind, "--rate-model", "--items-per-s or --rate-summary")
    if not os.path.isfile(os.path.join(model, "manifest.json")):
        raise ConfigError(f"--rate-model {model}: not a model bundle (no manifest.json)")
    chunk = max(1, -(-items // 8))  # 8 shards, rendered shard by shard: a steady rate
    stages = {f"{stage}_batch_size": min(256, chunk) for stage in ("render", "preprocess", "new")}
    opts = EmbedGalleryOptions(
        out=out,
        new_model=model,
        columns=("new",),
        ids=f"0:{items}",
        distractors=items,
        execution=ExecutionOptions(overwrite=True, chunk_size=chunk),
        stages=StageFlags(**stages, **({} if device_kind == "gpu" else {"new_gpus": 0.0})),
    )
    log(f"measuring the embedding rate: embed-gallery of {items:,} glyph items -> {out}")
    run = run_job(opts)
    said = f"measured on the spot by embed-gallery with {model} on this machine ({run.path})"
    return rate_from_summary(os.path.join(out, SUMMARY_FILE), source=said)


def measure_psi_rate(model: str, device_kind: str, seconds: float = 1.0) -> PsiRate:
    """psi refreshes per second of ``model``'s psi (BN folded: a batched matmul per layer) on
    random stored old vectors, on this machine's device of ``device_kind``: the best of three
    timed rounds of ``seconds`` each (``bench/psi_refresh.py`` measures the same)."""
    import torch

    from raycompat.models import ModelBundle
    from raycompat.pipeline.psi_refresh import FoldedPsi

    device = _require_device(device_kind, "--psi-model", "--psi-per-s")
    try:
        psi = ModelBundle.load(model).modules["psi"].eval()
    except (FileNotFoundError, KeyError, OSError) as exc:
        raise ConfigError(f"--psi-model {model}: no psi module ({exc})") from None
    folded = FoldedPsi(psi, device=device)
    batch = 8192 if device == "cuda" else 2048
    x = torch.randn(batch, folded.in_dim, device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    folded(x)
    best = 0.0
    for _ in range(3):
        sync()
        calls, started = 0, time.perf_counter()
        while time.perf_counter() - started < seconds:
            folded(x)
            calls += 1
        sync()
        best = max(best, calls * batch / (time.perf_counter() - started))
    return PsiRate(best, f"measured on the spot: psi of {model} on {device}, batch {batch}")
