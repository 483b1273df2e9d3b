"""Load benchmark of the live index: concurrent HTTP searches against N items on S shards
(default 1M x 128-dim clustered synthetic vectors on 4 shards), idle and during a live backfill.

Three tables:

1. **In-process baselines**, the strongest honest ones: exact search of the same vectors at
   batch size = concurrency, in this process, with as many threads as the machine has cores:
   faiss ``IndexFlatIP`` and a blockwise torch matrix product + top-k; the faster of the two
   is the baseline.
2. **HTTP, exact index** (``--index flat``): QPS and p50 / p99 latency per concurrency level,
   idle and during a live backfill, and the ratio of HTTP QPS to the baseline at the same
   batch size.  A level ``C`` is C concurrent requests of one query each, ``CxQ`` C concurrent
   requests of Q queries each (batch size C * Q); the router and the shards batch concurrent
   requests.  Beside it, **what a query costs**: the CPU time per answered query of every
   process on the HTTP path (client, Serve's proxy, the router replicas, the shard replicas),
   read from ``/proc/<pid>/stat`` over the level (the replicas' pids from Ray's state API),
   against the in-process search's CPU time per query at the same batch size, so that the
   ratio means the same on 2 cores and on 64.
3. **Upserts** (``--upsert-levels``): ``POST /admin/upsert`` throughput (items/s) and p50 / p99
   latency per level ``CxN`` (C concurrent requests of N items each), the time from deploy to
   ready (the shards loading the gallery), and the ratio to the in-process baseline: the same
   writes committed one request at a time straight to the store (``write_items``), in this
   process.  The table is made by whichever raycompat this script imports, so the same script
   run from an older checkout measures that code ("before" / "after" in docs/benchmarks.md).
4. **Approximate indexes** (``--indexes``): per index kind, the time from deploy to ready
   (loading, training), the index memory of all shards, QPS and p99 at ``--approx-concurrency``
   and recall@k of the served results against exact search of the same live gallery
   (``"exact": true``), idle and during a live backfill (paused while recall is measured).

    bash .ci/env python bench/serve_load.py                       # 1M items, 4 shards
    bash .ci/env python bench/serve_load.py --items 100000 --seconds 4 --indexes flat,hnsw

The load generator is one asyncio process (aiohttp) on the same cores; its own CPU time is
reported.  The report records the load average: numbers taken beside other jobs are rough.
"""

import argparse
import asyncio
import gc
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from raycompat.report import machine_description  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--items", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--clusters", type=int, default=2000, help="synthetic gallery clusters")
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--k", type=int, default=10)
    p.add_argument(
        "--concurrency",
        default="1,4,16,1x16",
        help="levels: C (C concurrent one-query requests) or CxQ (Q queries per request)",
    )
    p.add_argument("--phases", default="idle,backfill", help="idle and/or backfill")
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--backfill-rate", type=float, default=2000.0, help="items/s while loaded")
    p.add_argument(
        "--indexes",
        default="flat,ivf_flat,ivf_flat:nprobe=128,ivf_pq:nprobe=128,hnsw:ef_search=128",
        help="index configurations: KIND[:option=value,...] (docs/indexes.md)",
    )
    p.add_argument("--approx-concurrency", type=int, default=16)
    p.add_argument(
        "--upsert-levels",
        default="1x1,1x16,16x1,16x16",
        help="upsert levels CxN: C concurrent requests of N items (empty: no upsert table)",
    )
    p.add_argument("--tables", default="exact,upserts,approx", help="which tables to make")
    p.add_argument("--recall-queries", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=32, help="search_batch_size")
    p.add_argument("--batch-wait-ms", type=float, default=0.0, help="search_batch_wait_ms")
    p.add_argument("--out", default="bench_out/serve_load")
    p.add_argument("--address", default=None)
    p.add_argument(
        "--serve-env",
        default="",
        help="KEY=VALUE,... set before the local Ray cluster starts (Serve's feature flags, e.g. "
        "RAY_SERVE_USE_GRPC_BY_DEFAULT=1); not applied with --address",
    )
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- levels
@dataclass(frozen=True)
class Level:
    """``requests`` concurrent requests of ``queries`` queries each (``C`` or ``CxQ``)."""

    requests: int
    queries: int = 1

    @property
    def batch(self) -> int:
        """Queries in flight: the in-process baseline's batch size."""
        return self.requests * self.queries

    def __str__(self) -> str:
        return str(self.requests) if self.queries == 1 else f"{self.requests}x{self.queries}"


def parse_levels(text: str) -> list[Level]:
    """``"1,4,16,1x16"`` -> levels; ``ValueError`` naming a bad one."""
    levels = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        c, _, q = part.partition("x")
        if not c.isdigit() or (q and not q.isdigit()) or int(c) < 1 or int(q or 1) < 1:
            raise ValueError(f"--concurrency: bad level {part!r} (expected C or CxQ, C, Q >= 1)")
        levels.append(Level(int(c), int(q or 1)))
    return levels


# ----------------------------------------------------------------------------- CPU accounting
CLK_TCK = os.sysconf("SC_CLK_TCK")
#: the processes an HTTP query passes through, in the order of the report's columns
PATH_KINDS = ("client", "proxy", "router", "shards")


def _stat_fields(pid: int) -> list[str] | None:
    """``/proc/<pid>/stat`` from field 3 (state) on, or ``None`` once the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads) so far; 0 once gone."""
    f = _stat_fields(pid)
    return 0.0 if f is None else (int(f[11]) + int(f[12])) / CLK_TCK


def with_descendants(pids: set[int]) -> set[int]:
    """``pids`` and every process below them (e.g. the haproxy that Serve's proxy actor runs)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        f = _stat_fields(int(name)) if name.isdigit() else None
        if f is not None:
            children.setdefault(int(f[1]), []).append(int(name))
    out, todo = set(), list(pids)
    while todo:
        pid = todo.pop()
        if pid not in out:
            out.add(pid)
            todo += children.get(pid, [])
    return out


def app_processes(app_name: str) -> dict[str, set[int]]:
    """The pids of the app's processes by kind (``proxy``, ``router``, ``shards``, and ``other``:
    Serve's controller, the backfill controller and the local Ray daemons), from Ray's state API
    on this session's cluster."""
    import ray
    from ray.util.state import list_actors

    kinds: dict[str, set[int]] = {"proxy": set(), "router": set(), "shards": set(), "other": set()}
    replica = f"ServeReplica:{app_name}:"
    actors = list_actors(
        address=ray.get_runtime_context().gcs_address,
        filters=[("state", "=", "ALIVE")],
        limit=10_000,
        raise_on_missing_output=False,
    )
    for actor in actors:
        cls = actor.class_name or ""
        if cls in ("ProxyActor", "HAProxyManager"):
            kinds["proxy"].add(actor.pid)
        elif cls == replica + "router":
            kinds["router"].add(actor.pid)
        elif cls.startswith(replica + "shard-"):
            kinds["shards"].add(actor.pid)
        elif cls in ("ServeController", replica + "backfill"):
            kinds["other"].add(actor.pid)
    out = {kind: with_descendants(pids) for kind, pids in kinds.items()}
    node = getattr(ray._private.worker, "_global_node", None)  # a cluster this process started
    for infos in (getattr(node, "all_processes", None) or {}).values():  # raylet, GCS, ...:
        out["other"] |= {i.process.pid for i in infos if getattr(i, "process", None)}  # not
    return out  # their descendants: every worker process is one of the raylet's


class CpuMeter:
    """CPU seconds so far of the client (this process) and of each kind of app process."""

    def __init__(self, app_name: str):
        self.pids = app_processes(app_name)

    def sample(self) -> dict[str, float]:
        out = {kind: sum(process_cpu_s(p) for p in pids) for kind, pids in self.pids.items()}
        out["client"] = time.process_time()
        return out

    def counts(self) -> dict[str, int]:
        return {kind: len(pids) for kind, pids in self.pids.items()}


def background_cores(app_name: str, seconds: float) -> dict[str, float]:
    """Cores each kind of process uses while no request arrives (its own timers: health checks,
    metrics, log tailing), over ``seconds``."""
    meter = CpuMeter(app_name)
    before, t0 = meter.sample(), time.perf_counter()
    time.sleep(seconds)
    after, wall = meter.sample(), time.perf_counter() - t0
    return {k: (after[k] - before[k]) / wall for k in before}


def cpu_ms_per_query(before: dict, after: dict, queries: int) -> dict:
    """Per kind, ms of CPU per answered query between two samples; ``path``: the HTTP path's
    kinds together (:data:`PATH_KINDS`)."""
    per = {k: 1000 * (after[k] - before[k]) / max(queries, 1) for k in before}
    per["path"] = sum(per[k] for k in PATH_KINDS)
    return per


# ----------------------------------------------------------------------------- data
def gallery_spec(a) -> str:
    return f"synthetic:{a.items}:{a.dim}:{a.dim}:0:{a.clusters}"


def vectors_and_queries(a) -> tuple[np.ndarray, np.ndarray]:
    """The old vectors every shard starts with, and realistic queries for them."""
    from raycompat.serving.gallery_source import open_gallery

    gal = open_gallery(gallery_spec(a))
    t = time.perf_counter()
    vecs = gal.vectors_of("old", np.arange(a.items, dtype=np.int64))
    queries = gal.query_vectors(4096, seed=123)
    say(f"generated {vecs.shape[0]} vectors in {time.perf_counter() - t:.1f} s")
    return vecs, np.ascontiguousarray(queries, np.float32)


def say(msg: str) -> None:
    print(f"[serve_load] {msg}", flush=True)


def summarize(lat: list, errors: int, wall: float, queries_per_call: int = 1) -> dict:
    lat = np.asarray(lat)
    answered = int(queries_per_call * (lat.size - errors))
    return {
        "queries": answered,
        "qps": answered / wall,
        "p50_ms": 1000 * float(np.percentile(lat, 50)) if lat.size else None,
        "p99_ms": 1000 * float(np.percentile(lat, 99)) if lat.size else None,
        "requests": int(lat.size),
        "errors": int(errors),
    }


# ----------------------------------------------------------------------------- in process
def timed_calls(call, seconds: float, batch: int) -> dict:
    """``call(i)`` repeatedly for ``seconds``: QPS, latency, and this process's CPU time per
    query (every thread: the search's own threads included)."""
    lat, t0, cpu0 = [], time.perf_counter(), time.process_time()
    i = 0
    while time.perf_counter() - t0 < seconds:
        t = time.perf_counter()
        call(i)
        lat.append(time.perf_counter() - t)
        i += 1
    cpu = time.process_time() - cpu0
    out = summarize(lat, 0, time.perf_counter() - t0, batch)
    out["cpu_ms_per_query"] = 1000 * cpu / max(out["queries"], 1)
    return out


def faiss_baseline(vecs, queries, a, batch: int) -> dict:
    """faiss with the shards' settings (``configure_faiss``: BLAS from 4 queries) on all cores."""
    import faiss

    from raycompat.index.ann import configure_faiss

    configure_faiss(os.cpu_count(), a.dim)
    index = faiss.IndexFlatIP(a.dim)
    index.add(vecs)
    n = queries.shape[0] - batch

    def call(i):
        s = (i * batch) % n
        index.search(queries[s : s + batch], a.k)

    call(0)
    return timed_calls(call, a.seconds, batch)


def torch_baseline(vecs, queries, a, batch: int, block: int = 1 << 16) -> dict:
    import torch

    torch.set_num_threads(os.cpu_count())
    x = torch.from_numpy(vecs)
    q_all = torch.from_numpy(queries)
    n = queries.shape[0] - batch

    def call(i):
        s = (i * batch) % n
        q = q_all[s : s + batch]
        best_s, best_i = None, None
        for start in range(0, x.shape[0], block):
            sc, ix = torch.topk(q @ x[start : start + block].T, a.k, dim=1)
            ix = ix + start
            if best_s is not None:
                sc, pos = torch.topk(torch.cat([best_s, sc], 1), a.k, dim=1)
                ix = torch.gather(torch.cat([best_i, ix], 1), 1, pos)
            best_s, best_i = sc, ix

    call(0)
    return timed_calls(call, a.seconds, batch)


def inprocess_baselines(vecs, queries, a, batches) -> dict:
    """Per batch size: faiss and torch, and which is the baseline (the faster), with its CPU
    time per query."""
    out = {}
    for c in batches:
        f = faiss_baseline(vecs, queries, a, c)
        t = torch_baseline(vecs, queries, a, c)
        best = "faiss" if f["qps"] >= t["qps"] else "torch"
        out[c] = {
            "faiss": f,
            "torch": t,
            "best": best,
            "qps": max(f["qps"], t["qps"]),
            "cpu_ms_per_query": (f if best == "faiss" else t)["cpu_ms_per_query"],
        }
        say(
            f"in-process batch {c:3d}: faiss {f['qps']:8.1f} QPS (p99 {f['p99_ms']:.0f} ms, "
            f"{f['cpu_ms_per_query']:.2f} CPU ms/query), torch {t['qps']:8.1f} QPS (p99 "
            f"{t['p99_ms']:.0f} ms, {t['cpu_ms_per_query']:.2f} CPU ms/query) -> baseline {best}"
        )
    return out


# ----------------------------------------------------------------------------- HTTP
async def _http_run(
    url: str, bodies: list, c: int, seconds: float, headers: dict | None = None
) -> tuple[list, int, float]:
    import aiohttp

    lat, errors = [], [0]
    headers = {"content-type": "application/json", **(headers or {})}
    connector = aiohttp.TCPConnector(limit=c)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        stop = time.perf_counter() + seconds

        async def worker(w: int):
            i = w
            while time.perf_counter() < stop:
                t = time.perf_counter()
                try:
                    async with session.post(
                        url, data=bodies[i % len(bodies)], headers=headers
                    ) as r:
                        await r.read()
                        ok = r.status == 200
                except aiohttp.ClientError:
                    ok = False
                lat.append(time.perf_counter() - t)
                errors[0] += not ok
                i += c

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(w) for w in range(c)))
        return lat, errors[0], time.perf_counter() - t0


def http_load(url: str, bodies: list, c: int, seconds: float, app_name: str, q: int = 1) -> dict:
    """``c`` concurrent requests of ``q`` queries for ``seconds``: QPS, latency, the driver's
    CPU seconds per second, CPU ms per answered query of every kind of process
    (:func:`cpu_ms_per_query`), and the mean number of requests per search call of the router."""
    import requests

    before = router_batches(requests.get(url + "/metrics", timeout=60).text)
    meter = CpuMeter(app_name)
    cpu0 = meter.sample()
    lat, errors, wall = asyncio.run(_http_run(url + "/search", bodies, c, seconds))
    cpu1 = meter.sample()
    r = summarize(lat, errors, wall, q)
    r["client_cpu_s_per_s"] = (cpu1["client"] - cpu0["client"]) / wall
    r["cpu_ms_per_query"] = cpu_ms_per_query(cpu0, cpu1, r["queries"])
    r["processes"] = meter.counts()
    after = router_batches(requests.get(url + "/metrics", timeout=60).text)
    calls = after[1] - before[1]
    r["requests_per_batch"] = (after[0] - before[0]) / calls if calls else None
    return r


def router_batches(metrics: str) -> tuple[float, float]:
    """``(requests, search calls)`` of the router so far, from ``/metrics``."""
    total = {"sum": 0.0, "count": 0.0}
    for line in metrics.splitlines():
        for part in total:
            if line.startswith(f"raycompat_serving_search_batch_requests_{part}{{") and (
                'stage="router"' in line
            ):
                total[part] += float(line.rsplit(" ", 1)[1])
    return total["sum"], total["count"]


def search_bodies(queries: np.ndarray, k: int, q: int = 1) -> list[bytes]:
    """Request bodies of ``q`` consecutive queries each (1024 bodies at most)."""
    n = min(1024, queries.shape[0] // q)
    return [
        json.dumps({"vectors": queries[i * q : (i + 1) * q].tolist(), "k": k}).encode()
        for i in range(n)
    ]


def recall(client, queries: np.ndarray, k: int) -> dict:
    """Recall@k of the served results against exact search of the same live gallery, with its
    95 % bootstrap interval over the queries."""
    from raycompat.metrics.recall import recall_at_k, recall_interval

    served, _, _ = client.search(queries, k=k)
    exact, _, _ = client.search(queries, k=k, exact=True)
    return recall_interval(recall_at_k(served, exact, k)[1]).to_dict()


# ----------------------------------------------------------------------------- serving
def index_spec(spec: str) -> dict:
    """``ivf_flat:nprobe=128`` -> ``{"kind": "ivf_flat", "nprobe": "128"}``."""
    kind, _, rest = spec.partition(":")
    return {"kind": kind, **dict(kv.split("=", 1) for kv in rest.split(",") if kv)}


def start_index(a, kind: str):
    """Serve the synthetic gallery with index ``kind`` (``KIND[:option=value,...]``):
    ``(cfg, url, client, seconds from deploy to every index built)``."""
    from raycompat.serving.app import free_port, start_serving
    from raycompat.serving.auth import TOKEN_ENV
    from raycompat.serving.client import ServingClient
    from raycompat.serving.config import serving_config

    state = os.path.abspath(os.path.join(a.out, "state-" + kind.split(":")[0]))
    shutil.rmtree(state, ignore_errors=True)
    cfg = serving_config(
        gallery=gallery_spec(a),
        state_dir=state,
        num_shards=a.shards,
        index=index_spec(kind),
        port=getattr(a, "port", None) or free_port(),
        app_name="serve_load",
        search_batch_size=a.batch_size,
        search_batch_wait_ms=a.batch_wait_ms,
    )
    a.port = cfg.port
    t = time.perf_counter()
    url = start_serving(cfg, a.address)
    client = ServingClient(url, token=os.environ[TOKEN_ENV], timeout=600)
    st = client.wait_ready(timeout=1800)
    wait_trained(client)
    seconds = time.perf_counter() - t
    say(f"{kind}: served and its indexes built at {url} in {seconds:.1f} s: {st['items']}")
    return cfg, url, client, seconds


def wait_trained(client, timeout: float = 3600.0) -> None:
    """Until every representation that holds enough items has its index built (the shards
    train in the background and search exactly until then)."""
    t0 = time.perf_counter()
    while True:
        pending = [
            (s["shard"], rep)
            for s in client.status()["shards"]
            for rep, ix in s["index"].items()
            if ix["rebuilding"] or (ix["items"] >= max(ix["train_min"], 1) and not ix["trained"])
        ]
        if not pending:
            return
        if time.perf_counter() - t0 > timeout:
            raise TimeoutError(f"indexes still building after {timeout:.0f} s: {pending}")
        time.sleep(1.0)


def index_memory(client) -> dict:
    """Bytes of the shards' indexes (vectors included) and resident memory of the replicas."""
    st = client.status()
    index = sum(ix.get("memory_bytes", 0) for s in st["shards"] for ix in s["index"].values())
    rss = 0
    for s in st["shards"]:
        for rep in s["replicas"]:
            try:
                with open(f"/proc/{rep['pid']}/status") as fh:
                    kb = next(ln for ln in fh if ln.startswith("VmRSS")).split()[1]
                rss += int(kb) * 1024
            except (OSError, StopIteration, KeyError, TypeError):
                pass
    return {"index_bytes": int(index), "shard_rss_bytes": int(rss)}


def exact_http(a, levels, queries, baselines) -> dict:
    """The exact index over HTTP, idle and during a live backfill, per concurrency level."""
    from raycompat.serving.app import stop_serving

    cfg, url, client, _ = start_index(a, "flat")
    bodies = {lv.queries: search_bodies(queries, a.k, lv.queries) for lv in levels}
    client.search(queries[:3], k=a.k)
    phases = a.phases.split(",")
    out = {phase: {} for phase in phases}
    try:
        out["background_cores"] = background_cores(cfg.app_name, a.seconds)
        say(
            "with no request, cores used by: "
            + ", ".join(f"{k} {v:.3f}" for k, v in out["background_cores"].items())
        )
        for phase in phases:
            if phase == "backfill":
                client.start_backfill(
                    policy="sequential", rate=a.backfill_rate, batch_size=256, restart=True
                )
            for lv in levels:
                p0 = client.status()["backfill"]["position"]
                r = http_load(
                    url, bodies[lv.queries], lv.requests, a.seconds, cfg.app_name, lv.queries
                )
                r["backfill_items_per_s"] = (
                    client.status()["backfill"]["position"] - p0
                ) / a.seconds
                base = baselines[lv.batch]
                r["ratio_to_inprocess"] = r["qps"] / base["qps"]
                r["cpu_ratio_to_inprocess"] = (
                    r["cpu_ms_per_query"]["path"] / base["cpu_ms_per_query"]
                )
                out[phase][str(lv)] = r
                say(f"HTTP flat {phase:8s} c={str(lv):5s}: " + level_text(r))
        out["final"] = client.status()["backfill"]
        out["metrics"] = client.metrics()
    finally:
        stop_serving(cfg)
    return out


def upsert_bodies(a, n_items: int, count: int = 256) -> tuple[list[bytes], list]:
    """``count`` upsert bodies of ``n_items`` random existing ids with random new vectors, and
    the same writes as ``(ids, vectors)`` for the in-process baseline."""
    rng = np.random.default_rng(7)
    bodies, writes = [], []
    for _ in range(count):
        ids = rng.choice(a.items, n_items, replace=False)
        vecs = rng.standard_normal((n_items, a.dim)).astype(np.float32)
        vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
        items = [{"id": int(i), "representation": "new", "vector": v.round(6).tolist()}
                 for i, v in zip(ids, vecs, strict=True)]  # fmt: skip
        bodies.append(json.dumps({"items": items}).encode())
        writes.append((ids.astype(np.int64), vecs))
    return bodies, writes


def store_baseline(cfg, writes: list, seconds: float) -> dict | None:
    """The same writes committed one at a time straight to the served store, in this process
    (None where the index keeps no store: an older checkout)."""
    try:
        from raycompat.serving.served_store import open_served_store
        from raycompat.stores import ItemWrite
    except ImportError:
        return None
    store = open_served_store(cfg)
    fp = "b" * 16
    lat, i, t0 = [], 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        ids, vecs = writes[i % len(writes)]
        t = time.perf_counter()
        store.write_items([ItemWrite(ids, "new", vecs, fp)])
        lat.append(time.perf_counter() - t)
        i += 1
    r = summarize(lat, 0, time.perf_counter() - t0, len(writes[0][0]))
    store.close()
    return r


def upsert_http(a) -> dict:
    """The upsert table: start-up, then per level the items/s and latency of admin upserts,
    and the in-process baseline at the same request size."""
    from raycompat.serving.app import stop_serving
    from raycompat.serving.auth import TOKEN_ENV

    levels = parse_levels(a.upsert_levels)
    cfg, url, client, startup = start_index(a, "flat")
    out = {"startup_s": startup, "levels": {}, "baselines": {}}
    headers = {"Authorization": f"Bearer {os.environ[TOKEN_ENV]}"}
    try:
        for lv in levels:
            bodies, writes = upsert_bodies(a, lv.queries)
            lat, errors, wall = asyncio.run(
                _http_run(url + "/admin/upsert", bodies, lv.requests, a.seconds, headers)
            )
            r = summarize(lat, errors, wall, lv.queries)
            if lv.queries not in out["baselines"]:
                out["baselines"][lv.queries] = store_baseline(cfg, writes, a.seconds)
            base = out["baselines"][lv.queries]
            r["ratio_to_store"] = r["qps"] / base["qps"] if base else None
            out["levels"][str(lv)] = r
            say(
                f"HTTP upsert c={str(lv):5s}: {r['qps']:.0f} items/s p50 {r['p50_ms']:.1f} p99 "
                f"{r['p99_ms']:.1f} ms, errors {r['errors']}, ratio to the store in-process "
                + (f"{r['ratio_to_store']:.2f}" if r["ratio_to_store"] else "-")
            )
    finally:
        stop_serving(cfg)
    return out


def upsert_table(up: dict | None) -> list[str]:
    """The upsert table (items/s: the ``qps`` of a level counts items)."""
    if not up:
        return []
    lines = [
        "",
        f"## Upserts (deploy to ready: {up['startup_s']:.1f} s)",
        "",
        "| level (requests x items) | items/s | p50 ms | p99 ms | errors | store in-process "
        "items/s | ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in up["levels"].items():
        n = int(name.split("x")[1]) if "x" in name else 1
        base = up["baselines"].get(n) or up["baselines"].get(str(n))
        b = f"{base['qps']:.0f}" if base else "-"
        ratio = f"{r['ratio_to_store']:.2f}" if r.get("ratio_to_store") else "-"
        lines.append(
            f"| {name} | {r['qps']:.0f} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | "
            f"{r['errors']} | {b} | {ratio} |"
        )
    return lines


def approx_row(a, kind: str, queries: np.ndarray) -> dict:
    """One index kind: build time, memory, QPS, p99 and recall, idle and during a backfill."""
    from raycompat.serving.app import stop_serving

    cfg, url, client, build_s = start_index(a, kind)
    bodies = search_bodies(queries, a.k)
    rq = queries[: a.recall_queries]
    row = {"kind": kind, "build_s": build_s, **index_memory(client)}
    try:
        client.search(queries[:3], k=a.k)
        row["idle"] = http_load(url, bodies, a.approx_concurrency, a.seconds, cfg.app_name)
        row["idle"]["recall"] = recall(client, rq, a.k)
        client.start_backfill(policy="sequential", rate=a.backfill_rate, batch_size=256)
        row["backfill"] = http_load(url, bodies, a.approx_concurrency, a.seconds, cfg.app_name)
        client.pause_backfill()
        bf = client.status()["backfill"]
        row["backfill"]["recall"] = recall(client, rq, a.k)
        row["backfill"]["items_new"] = bf["position"]
        row["index_after"] = {
            r: ix for r, ix in client.status()["shards"][0]["index"].items() if ix.get("items")
        }
    finally:
        stop_serving(cfg)
    for phase in ("idle", "backfill"):
        r = row[phase]
        say(
            f"{kind:20s} {phase:8s}: {r['qps']:7.1f} QPS p99 {r['p99_ms']:.0f} ms recall@{a.k} "
            f"{interval_text(r['recall'])} (build {build_s:.0f} s, "
            f"index {row['index_bytes'] / 2**20:.0f} MiB)"
        )
    return row


# ----------------------------------------------------------------------------- report
def level_text(r: dict) -> str:
    """One HTTP level in a line: QPS, latency, ratios, CPU ms per query by process kind."""
    cpu = r["cpu_ms_per_query"]
    kinds = ", ".join(f"{k} {cpu[k]:.2f}" for k in PATH_KINDS)
    return (
        f"{r['qps']:7.1f} QPS p50 {r['p50_ms']:.0f} p99 {r['p99_ms']:.0f} ms, errors "
        f"{r['errors']}, ratio {r['ratio_to_inprocess']:.2f}, "
        f"{r['requests_per_batch'] or 0:.1f} requests per search call; CPU ms/query: {kinds}, "
        f"path {cpu['path']:.2f} ({r['cpu_ratio_to_inprocess']:.2f}x in-process), other "
        f"{cpu['other']:.2f}"
    )


def interval_text(iv: dict) -> str:
    return f"{iv['value']:.4f} [{iv['low']:.4f}, {iv['high']:.4f}]"


def report_markdown(a, levels, baselines, exact, approx, load_at_start, upserts=None) -> str:
    lines = [
        f"# serve_load: {a.items} items x {a.dim} dims ({a.clusters} clusters) on {a.shards} "
        f"shards, k={a.k}",
        "",
        f"Machine: {machine_description(load_at_start)}. Batching: at most {a.batch_size} "
        f"requests per search call, {a.batch_wait_ms:g} ms wait. Levels: C concurrent requests "
        "of one query, CxQ of Q queries each. Serve flags: " + (a.serve_env or "none") + ".",
        "",
        "## In-process baselines (exact, batch size = queries in flight, all cores)",
        "",
        "| batch | faiss QPS | faiss p99 ms | faiss CPU ms/query | torch QPS | torch p99 ms | "
        "torch CPU ms/query | baseline |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c, b in sorted(baselines.items()):
        f, t = b["faiss"], b["torch"]
        lines.append(
            f"| {c} | {f['qps']:.1f} | {f['p99_ms']:.0f} | {f['cpu_ms_per_query']:.2f} | "
            f"{t['qps']:.1f} | {t['p99_ms']:.0f} | {t['cpu_ms_per_query']:.2f} | {b['best']} |"
        )
    if exact:
        lines += exact_tables(exact, levels)
    lines += upsert_table(upserts)
    lines += approx_table(a, approx)
    return "\n".join(lines) + "\n"


def exact_tables(exact: dict, levels) -> list[str]:
    """The exact index's HTTP table, and what a query costs: CPU ms per answered query of every
    kind of process against the in-process search's at the same batch size."""
    phases = [p for p in ("idle", "backfill") if p in exact]
    lines = [
        "",
        "## HTTP, exact index",
        "",
        "| phase | level | HTTP QPS | p50 / p99 ms | ratio to baseline | errors | "
        "backfill items/s | client CPU (cores) | requests per search call |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for phase in phases:
        for lv in levels:
            r = exact[phase][str(lv)]
            lines.append(
                f"| {phase} | {lv} | {r['qps']:.1f} | {r['p50_ms']:.0f} / {r['p99_ms']:.0f} | "
                f"{r['ratio_to_inprocess']:.2f} | {r['errors']} | "
                f"{r['backfill_items_per_s']:.0f} | {r['client_cpu_s_per_s']:.2f} | "
                f"{r['requests_per_batch'] or 0:.1f} |"
            )
    lines += [
        "",
        "## What a query costs: CPU ms per answered query (exact index)",
        "",
        "`other`: Serve's controller, the backfill controller and the Ray daemons (not on the "
        "query's path). Ratio: the path's CPU per query over the in-process baseline's.",
        "",
        "| phase | level | QPS | p50 / p99 ms | client | proxy | router | shards | path | "
        "in-process | ratio | other |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    if "background_cores" in exact:
        bg = ", ".join(f"{k} {v:.3f}" for k, v in exact["background_cores"].items())
        lines[-4] += f" With no request, the cores each kind used: {bg}."
    for phase in phases:
        for lv in levels:
            r = exact[phase][str(lv)]
            cpu = r["cpu_ms_per_query"]
            base = cpu["path"] / r["cpu_ratio_to_inprocess"]
            lines.append(
                f"| {phase} | {lv} | {r['qps']:.1f} | {r['p50_ms']:.0f} / {r['p99_ms']:.0f} | "
                + " | ".join(f"{cpu[k]:.2f}" for k in (*PATH_KINDS, "path"))
                + f" | {base:.2f} | {r['cpu_ratio_to_inprocess']:.2f} | {cpu['other']:.2f} |"
            )
    return lines


def approx_table(a, approx: list) -> list[str]:
    if not approx:
        return []
    lines = [
        "",
        f"## Approximate indexes (concurrency {a.approx_concurrency}; recall@{a.k} against exact "
        f"search of the same live gallery, {a.recall_queries} queries, with its 95 % bootstrap "
        "interval over the queries)",
        "",
        f"| index | build s | index MiB | shard RSS MiB | idle QPS | idle p99 ms | idle "
        f"recall@{a.k} | backfill QPS | backfill p99 ms | backfill recall@{a.k} | items new |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in approx:
        i, b = row["idle"], row["backfill"]
        lines.append(
            f"| {row['kind']} | {row['build_s']:.0f} | {row['index_bytes'] / 2**20:.0f} | "
            f"{row['shard_rss_bytes'] / 2**20:.0f} | {i['qps']:.1f} | {i['p99_ms']:.0f} | "
            f"{interval_text(i['recall'])} | {b['qps']:.1f} | {b['p99_ms']:.0f} | "
            f"{interval_text(b['recall'])} | "
            f"{b['items_new']} |"
        )
    return lines


def apply_serve_env(text: str) -> dict:
    """``KEY=VALUE,...`` into this process's environment (which a local cluster started here
    inherits); ``ValueError`` naming a malformed entry."""
    env = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        key, eq, value = part.partition("=")
        if not eq or not key:
            raise ValueError(f"--serve-env: expected KEY=VALUE, got {part!r}")
        env[key] = value
    os.environ.update(env)
    return env


def main(argv=None):
    a = parse_args(argv)
    levels = parse_levels(a.concurrency)
    from raycompat.cluster import connect
    from raycompat.serving.auth import TOKEN_ENV

    os.environ.setdefault(TOKEN_ENV, "bench-token-" + os.urandom(8).hex())
    apply_serve_env(a.serve_env)
    os.makedirs(a.out, exist_ok=True)
    load_at_start = os.getloadavg()[0]
    say(
        f"{a.items} items x {a.dim} dims, {a.shards} shards, k={a.k}, levels "
        f"{[str(lv) for lv in levels]}, {a.seconds:.0f} s each; {os.cpu_count()} cores, load "
        f"average {load_at_start:.1f}"
    )
    vecs, queries = vectors_and_queries(a)
    baselines = inprocess_baselines(vecs, queries, a, sorted({lv.batch for lv in levels}))
    del vecs
    gc.collect()
    connect(a.address)
    tables = a.tables.split(",")
    exact = exact_http(a, levels, queries, baselines) if "exact" in tables else None
    upserts = upsert_http(a) if "upserts" in tables and a.upsert_levels else None
    kinds = [kind for kind in a.indexes.split(",") if kind] if "approx" in tables else []
    approx = [approx_row(a, kind, queries) for kind in kinds]
    md = report_markdown(a, levels, baselines, exact, approx, load_at_start, upserts)
    with open(os.path.join(a.out, "serve_load.md"), "w") as fh:
        fh.write(md)
    with open(os.path.join(a.out, "serve_load.json"), "w") as fh:
        json.dump(
            {
                "args": vars(a),
                "load_at_end": os.getloadavg()[0],
                "inprocess": baselines,
                "exact_http": exact,
                "upserts": upserts,
                "approximate": approx,
                "cores": os.cpu_count(),
            },
            fh,
            indent=1,
            default=str,
        )
    print(md, flush=True)
    say(f"wrote {a.out}/serve_load.md and .json")


if __name__ == "__main__":
    main()
