"""The live index's metrics: counters and histograms recorded through Serve's own metrics
(``ray.serve.metrics``), which each node's Ray metrics agent exports; ``GET /metrics`` renders
their sum over every replica of every node, with gauges read from ``/status``
(docs/live-index.md, "Metrics").

A router (or shard) replica only records (:class:`ServingMetrics`); no count lives in one
replica's memory, so two scrapes answered by two router replicas read the same counters.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Iterable

__all__ = [
    "BATCH_BUCKETS",
    "BUCKETS",
    "PREFIX",
    "ServingMetrics",
    "render_cluster_metrics",
    "scrape_nodes",
    "sum_over_replicas",
]

PREFIX = "raycompat_serving"
#: the latency histogram's upper bounds (seconds)
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
#: upper bounds of the batch-size histograms (requests, or queries, per search call)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
#: the labels our recorders set; every other label (Ray's and Serve's: node, worker, replica)
#: is summed over
OWN_LABELS = frozenset({"endpoint", "status", "stage", "shard", "le"})


class ServingMetrics:
    """The recorders of one replica (router or shard), Serve's ``Counter`` and ``Histogram``."""

    def __init__(self):
        from ray.serve.metrics import Counter, Histogram

        p = PREFIX
        self.requests = Counter(
            f"{p}_requests",
            description="HTTP requests by endpoint and status code.",
            tag_keys=("endpoint", "status"),
        )
        self.queries = Counter(f"{p}_queries", description="Query vectors searched.")
        self.retries = Counter(
            f"{p}_shard_call_retries",
            description="Shard calls sent again after their replica died.",
        )
        self.seconds = Histogram(
            f"{p}_request_seconds",
            description="Request latency in the router.",
            boundaries=list(BUCKETS),
            tag_keys=("endpoint",),
        )
        self.batch = {
            what: Histogram(
                f"{p}_search_batch_{what}",
                description=f"{what.capitalize()} per search call, as batched (router, shards).",
                boundaries=list(BATCH_BUCKETS),
                tag_keys=("stage", "shard"),
            )
            for what in ("requests", "queries")
        }

    def observe(self, endpoint: str, status: int, seconds: float, queries: int = 0) -> None:
        """One HTTP request the router answered."""
        self.requests.inc(1, tags={"endpoint": endpoint, "status": str(int(status))})
        self.seconds.observe(float(seconds), tags={"endpoint": endpoint})
        if queries:
            self.queries.inc(int(queries))

    def count_retry(self) -> None:
        """A shard call sent again because its replica died."""
        self.retries.inc(1)

    def observe_batch(self, stage: str, shard: str, requests: int, queries: int) -> None:
        """One search call as batched: ``requests`` requests of ``queries`` query rows."""
        tags = {"stage": stage, "shard": shard}
        self.batch["requests"].observe(int(requests), tags=tags)
        self.batch["queries"].observe(int(queries), tags=tags)


def scrape_nodes(timeout_s: float = 2.0) -> tuple[list[str], list[str]]:
    """``(texts, unreachable)``: the Prometheus text of every live node's Ray metrics agent,
    and the nodes (``address:port``) whose agent did not answer within ``timeout_s``."""
    import ray

    texts, unreachable = [], []
    for node in ray.nodes():
        port = node.get("MetricsExportPort")
        if not node.get("Alive") or not port:
            continue
        where = f"{node['NodeManagerAddress']}:{port}"
        try:
            with urllib.request.urlopen(f"http://{where}/metrics", timeout=timeout_s) as r:
                texts.append(r.read().decode())
        except OSError:
            unreachable.append(where)
    return texts, unreachable


def _our_lines(text: str) -> str:
    """The lines of our families in an agent's text (a long-running cluster's agent exports
    thousands of Ray's own samples, which the parser would read one by one)."""
    ours = f"ray_{PREFIX}_"
    keep = [
        line
        for line in text.splitlines()
        if line.startswith(ours) or (line.startswith("# ") and line[7:].startswith(ours))
    ]
    return "\n".join(keep) + "\n"


def sum_over_replicas(texts: Iterable[str], application: str | None = None) -> dict[str, dict]:
    """Our families in Ray's exposition ``texts`` (``ray_raycompat_serving_*``) of the Serve
    ``application`` (all: ``None``), each sample summed over every label but our own:
    ``{family: {"type", "help", "samples": {(sample name, labels): value}}}``, names without
    Ray's ``ray_`` prefix (a counter's with ``_total``, as its ``# TYPE`` line has it)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict] = {}
    for text in texts:
        for fam in text_string_to_metric_families(_our_lines(text)):
            if not fam.name.startswith(f"ray_{PREFIX}_"):
                continue
            name = fam.name[4:] + ("_total" if fam.type == "counter" else "")  # as written
            entry = out.setdefault(
                name, {"type": fam.type, "help": fam.documentation, "samples": {}}
            )
            for s in fam.samples:
                if application is not None and s.labels.get("application") != application:
                    continue
                own = {k: v for k, v in s.labels.items() if k in OWN_LABELS}
                if own.get("le", "+Inf") != "+Inf":  # Ray writes 1.0: the bound as given
                    own["le"] = format(float(own["le"]), "g")
                labels = tuple(sorted(own.items()))
                key = (s.name[4:], labels)
                entry["samples"][key] = entry["samples"].get(key, 0.0) + float(s.value)
    return out


def _labels(d: dict[str, str]) -> str:
    if not d:
        return ""
    esc = lambda v: str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')  # noqa: E731
    return "{" + ",".join(f'{k}="{esc(v)}"' for k, v in sorted(d.items())) + "}"


def _sample_order(key: tuple) -> tuple:
    name, labels = key
    d = dict(labels)
    le = d.pop("le", None)
    bound = float("inf") if le in (None, "+Inf") else float(le)
    return (tuple(sorted(d.items())), name.rsplit("_", 1)[-1] != "bucket", bound, name)


def render_cluster_metrics(
    families: dict[str, dict], gauges: Iterable[tuple[str, str, dict[str, str], float]] = ()
) -> str:
    """Prometheus text (format 0.0.4): the summed ``families`` (:func:`sum_over_replicas`),
    then ``gauges`` ``(name, help, labels, value)`` (names without the prefix)."""
    lines: list[str] = []
    for name, fam in sorted(families.items()):
        lines += [f"# HELP {name} {fam['help']}", f"# TYPE {name} {fam['type']}"]
        for key in sorted(fam["samples"], key=_sample_order):
            sample, labels = key
            lines.append(f"{sample}{_labels(dict(labels))} {fam['samples'][key]}")
    seen = set()
    for name, help_, labels, value in sorted(gauges, key=lambda g: g[0]):  # grouped
        if name not in seen:
            lines += [f"# HELP {PREFIX}_{name} {help_}", f"# TYPE {PREFIX}_{name} gauge"]
            seen.add(name)
        lines.append(f"{PREFIX}_{name}{_labels(labels)} {float(value)}")
    return "\n".join(lines) + "\n"
