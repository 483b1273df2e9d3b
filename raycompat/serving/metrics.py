"""Prometheus text exposition (format 0.0.4) of the router's counters and latency histograms.

Kept in-process per router replica (no global registry): ``requests_total{endpoint,status}``,
``request_seconds`` histogram per endpoint, plus gauges the router fills from the shards and
the backfill controller at scrape time (items per representation, backfill position).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

__all__ = ["RouterMetrics", "BUCKETS"]

BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def _labels(d: dict[str, str]) -> str:
    if not d:
        return ""
    esc = lambda v: str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')  # noqa: E731
    return "{" + ",".join(f'{k}="{esc(v)}"' for k, v in sorted(d.items())) + "}"


class RouterMetrics:
    def __init__(self, prefix: str = "raycompat_serving"):
        self.prefix = prefix
        self.lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = {}
        self.hist: dict[str, list] = {}
        self.hist_sum: dict[str, float] = {}
        self.queries = 0
        self.retries = 0

    def count_retry(self) -> None:
        """A shard call sent again because its replica died."""
        with self.lock:
            self.retries += 1

    def observe(self, endpoint: str, status: int, seconds: float, queries: int = 0) -> None:
        with self.lock:
            key = (endpoint, int(status))
            self.requests[key] = self.requests.get(key, 0) + 1
            h = self.hist.setdefault(endpoint, [0] * (len(BUCKETS) + 1))
            for i, b in enumerate(BUCKETS):
                if seconds <= b:
                    h[i] += 1
            h[-1] += 1
            self.hist_sum[endpoint] = self.hist_sum.get(endpoint, 0.0) + seconds
            self.queries += queries

    def render(
        self,
        gauges: Iterable[tuple[str, str, dict[str, str], float]] = (),
        batches: list[tuple[dict, dict]] = (),
    ) -> str:
        p = self.prefix
        lines = [
            f"# HELP {p}_requests_total HTTP requests by endpoint and status code.",
            f"# TYPE {p}_requests_total counter",
        ]
        with self.lock:
            for (ep, st), n in sorted(self.requests.items()):
                lines.append(
                    f"{p}_requests_total{_labels({'endpoint': ep, 'status': str(st)})} {n}"
                )
            lines += [
                f"# HELP {p}_queries_total Query vectors searched.",
                f"# TYPE {p}_queries_total counter",
                f"{p}_queries_total {self.queries}",
                f"# HELP {p}_shard_call_retries_total Shard calls sent again after their "
                "replica died.",
                f"# TYPE {p}_shard_call_retries_total counter",
                f"{p}_shard_call_retries_total {self.retries}",
                f"# HELP {p}_request_seconds Request latency in the router.",
                f"# TYPE {p}_request_seconds histogram",
            ]
            for ep, h in sorted(self.hist.items()):
                for b, c in zip(BUCKETS, h, strict=False):
                    lines.append(
                        f"{p}_request_seconds_bucket{_labels({'endpoint': ep, 'le': repr(b)})} {c}"
                    )
                lines.append(
                    f"{p}_request_seconds_bucket{_labels({'endpoint': ep, 'le': '+Inf'})} {h[-1]}"
                )
                lines.append(
                    f"{p}_request_seconds_sum{_labels({'endpoint': ep})} {self.hist_sum[ep]}"
                )
                lines.append(f"{p}_request_seconds_count{_labels({'endpoint': ep})} {h[-1]}")
        seen = set()
        for name, help_, labels, value in sorted(gauges, key=lambda g: g[0]):  # grouped
            if name not in seen:
                lines += [f"# HELP {p}_{name} {help_}", f"# TYPE {p}_{name} gauge"]
                seen.add(name)
            lines.append(f"{p}_{name}{_labels(labels)} {float(value)}")
        lines += batch_histogram_lines(p, list(batches))
        return "\n".join(lines) + "\n"


#: upper bounds of the batch-size histogram buckets (requests, or queries, per search call)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class BatchSizes:
    """Histograms of the search batches one process formed: requests and queries per batch
    (``GET /metrics`` renders them as ``search_batch_requests`` / ``search_batch_queries``)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.counts = {
            "requests": [0] * (len(BATCH_BUCKETS) + 1),
            "queries": [0] * (len(BATCH_BUCKETS) + 1),
        }
        self.sums = {"requests": 0, "queries": 0}

    def observe(self, requests: int, queries: int) -> None:
        with self.lock:
            for what, n in (("requests", requests), ("queries", queries)):
                h = self.counts[what]
                for i, b in enumerate(BATCH_BUCKETS):
                    if n <= b:
                        h[i] += 1
                h[-1] += 1
                self.sums[what] += int(n)

    def as_json(self) -> dict:
        """``{"buckets", "requests": {"counts", "sum"}, "queries": {...}}`` (cumulative counts,
        the last one the total number of batches)."""
        with self.lock:
            return {
                "buckets": list(BATCH_BUCKETS),
                **{w: {"counts": list(self.counts[w]), "sum": self.sums[w]} for w in self.counts},
            }


def batch_histogram_lines(prefix: str, batches: list[tuple[dict, dict]]) -> list[str]:
    """Prometheus lines of ``search_batch_{requests,queries}`` histograms from
    ``[(labels, BatchSizes.as_json())]`` (the router's own, and one per shard replica)."""
    lines = []
    for what in ("requests", "queries"):
        name = f"{prefix}_search_batch_{what}"
        lines += [
            f"# HELP {name} {what.capitalize()} per search call, as batched (router and shards).",
            f"# TYPE {name} histogram",
        ]
        for labels, h in batches:
            counts = h[what]["counts"]
            for b, c in zip(h["buckets"], counts, strict=False):
                lines.append(f"{name}_bucket{_labels({**labels, 'le': str(b)})} {c}")
            lines.append(f"{name}_bucket{_labels({**labels, 'le': '+Inf'})} {counts[-1]}")
            lines.append(f"{name}_sum{_labels(labels)} {h[what]['sum']}")
            lines.append(f"{name}_count{_labels(labels)} {counts[-1]}")
    return lines
