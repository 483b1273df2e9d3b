"""Load benchmark of the live index: concurrent HTTP searches against N items on S shards
(default 1M x 128-dim clustered synthetic vectors on 4 shards), idle and during a live backfill.

Three tables:

1. **In-process baselines**, the strongest honest ones: exact search of the same vectors at
   batch size = concurrency, in this process, with as many threads as the machine has cores:
   faiss ``IndexFlatIP`` and a blockwise torch matrix product + top-k; the faster of the two
   is the baseline.
2. **HTTP, exact index** (``--index flat``): QPS and p50 / p99 latency per concurrency level,
   idle and during a live backfill, and the ratio of HTTP QPS to the baseline at the same
   batch size.  One query per request; the router and the shards batch concurrent requests.
3. **Approximate indexes** (``--indexes``): per index kind, the time from deploy to ready
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
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--backfill-rate", type=float, default=2000.0, help="items/s while loaded")
    p.add_argument(
        "--indexes",
        default="flat,ivf_flat,ivf_flat:nprobe=128,ivf_pq:nprobe=128,hnsw:ef_search=128",
        help="index configurations: KIND[:option=value,...] (docs/indexes.md)",
    )
    p.add_argument("--approx-concurrency", type=int, default=16)
    p.add_argument("--recall-queries", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=32, help="search_batch_size")
    p.add_argument("--batch-wait-ms", type=float, default=0.0, help="search_batch_wait_ms")
    p.add_argument("--out", default="bench_out/serve_load")
    p.add_argument("--address", default=None)
    return p.parse_args(argv)


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
    return {
        "qps": queries_per_call * lat.size / wall,
        "p50_ms": 1000 * float(np.percentile(lat, 50)) if lat.size else None,
        "p99_ms": 1000 * float(np.percentile(lat, 99)) if lat.size else None,
        "requests": int(lat.size),
        "errors": int(errors),
    }


# ----------------------------------------------------------------------------- in process
def timed_calls(call, seconds: float) -> tuple[list, float]:
    lat, t0 = [], time.perf_counter()
    i = 0
    while time.perf_counter() - t0 < seconds:
        t = time.perf_counter()
        call(i)
        lat.append(time.perf_counter() - t)
        i += 1
    return lat, time.perf_counter() - t0


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
    lat, wall = timed_calls(call, a.seconds)
    return summarize(lat, 0, wall, batch)


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
    lat, wall = timed_calls(call, a.seconds)
    return summarize(lat, 0, wall, batch)


def inprocess_baselines(vecs, queries, a, levels) -> dict:
    """Per batch size: faiss and torch, and which is the baseline (the faster)."""
    out = {}
    for c in levels:
        f = faiss_baseline(vecs, queries, a, c)
        t = torch_baseline(vecs, queries, a, c)
        best = "faiss" if f["qps"] >= t["qps"] else "torch"
        out[c] = {"faiss": f, "torch": t, "best": best, "qps": max(f["qps"], t["qps"])}
        say(
            f"in-process batch {c:3d}: faiss {f['qps']:8.1f} QPS (p99 {f['p99_ms']:.0f} ms), "
            f"torch {t['qps']:8.1f} QPS (p99 {t['p99_ms']:.0f} ms) -> baseline {best}"
        )
    return out


# ----------------------------------------------------------------------------- HTTP
async def _http_run(url: str, bodies: list, c: int, seconds: float) -> tuple[list, int, float]:
    import aiohttp

    lat, errors = [], [0]
    headers = {"content-type": "application/json"}
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


def http_load(url: str, bodies: list, c: int, seconds: float) -> dict:
    """``c`` concurrent single-query requests for ``seconds``: QPS, latency, the driver's CPU
    seconds per second, and the mean number of requests per search call of the router."""
    import requests

    before = router_batches(requests.get(url + "/metrics", timeout=60).text)
    cpu0 = time.process_time()
    lat, errors, wall = asyncio.run(_http_run(url + "/search", bodies, c, seconds))
    r = summarize(lat, errors, wall)
    r["client_cpu_s_per_s"] = (time.process_time() - cpu0) / wall
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


def search_bodies(queries: np.ndarray, k: int) -> list[bytes]:
    return [json.dumps({"vectors": [q.tolist()], "k": k}).encode() for q in queries[:1024]]


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
        snapshot_every=10**9,
        fsync=False,
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
    bodies = search_bodies(queries, a.k)
    client.search(queries[:3], k=a.k)
    out = {"idle": {}, "backfill": {}}
    try:
        for phase in ("idle", "backfill"):
            if phase == "backfill":
                client.start_backfill(
                    policy="sequential", rate=a.backfill_rate, batch_size=256, restart=True
                )
            for c in levels:
                p0 = client.status()["backfill"]["position"]
                r = http_load(url, bodies, c, a.seconds)
                r["backfill_items_per_s"] = (
                    client.status()["backfill"]["position"] - p0
                ) / a.seconds
                r["ratio_to_inprocess"] = r["qps"] / baselines[c]["qps"]
                out[phase][c] = r
                say(
                    f"HTTP flat {phase:8s} c={c:3d}: {r['qps']:7.1f} QPS p50 {r['p50_ms']:.0f} "
                    f"p99 {r['p99_ms']:.0f} ms, errors {r['errors']}, ratio "
                    f"{r['ratio_to_inprocess']:.2f}, client CPU {r['client_cpu_s_per_s']:.2f}, "
                    f"{r['requests_per_batch'] or 0:.1f} requests per search call"
                )
        out["final"] = client.status()["backfill"]
        out["metrics"] = client.metrics()
    finally:
        stop_serving(cfg)
    return out


def approx_row(a, kind: str, queries: np.ndarray) -> dict:
    """One index kind: build time, memory, QPS, p99 and recall, idle and during a backfill."""
    from raycompat.serving.app import stop_serving

    cfg, url, client, build_s = start_index(a, kind)
    bodies = search_bodies(queries, a.k)
    rq = queries[: a.recall_queries]
    row = {"kind": kind, "build_s": build_s, **index_memory(client)}
    try:
        client.search(queries[:3], k=a.k)
        row["idle"] = http_load(url, bodies, a.approx_concurrency, a.seconds)
        row["idle"]["recall"] = recall(client, rq, a.k)
        client.start_backfill(policy="sequential", rate=a.backfill_rate, batch_size=256)
        row["backfill"] = http_load(url, bodies, a.approx_concurrency, a.seconds)
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
def interval_text(iv: dict) -> str:
    return f"{iv['value']:.4f} [{iv['low']:.4f}, {iv['high']:.4f}]"


def report_markdown(a, levels, baselines, exact, approx, load_at_start) -> str:
    lines = [
        f"# serve_load: {a.items} items x {a.dim} dims ({a.clusters} clusters) on {a.shards} "
        f"shards, k={a.k}",
        "",
        f"Machine: {machine_description(load_at_start)}. Batching: at most {a.batch_size} "
        f"requests per search call, {a.batch_wait_ms:g} ms wait. One query per request.",
        "",
        "## In-process baselines (exact, batch size = concurrency, all cores)",
        "",
        "| batch | faiss QPS | faiss p99 ms | torch QPS | torch p99 ms | baseline |",
        "|---|---|---|---|---|---|",
    ]
    for c in levels:
        b = baselines[c]
        lines.append(
            f"| {c} | {b['faiss']['qps']:.1f} | {b['faiss']['p99_ms']:.0f} | "
            f"{b['torch']['qps']:.1f} | {b['torch']['p99_ms']:.0f} | {b['best']} |"
        )
    lines += [
        "",
        "## HTTP, exact index",
        "",
        "| phase | concurrency | HTTP QPS | p50 / p99 ms | ratio to baseline | errors | "
        "backfill items/s | client CPU (cores) | requests per search call |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for phase in ("idle", "backfill"):
        for c in levels:
            r = exact[phase][c]
            lines.append(
                f"| {phase} | {c} | {r['qps']:.1f} | {r['p50_ms']:.0f} / {r['p99_ms']:.0f} | "
                f"{r['ratio_to_inprocess']:.2f} | {r['errors']} | "
                f"{r['backfill_items_per_s']:.0f} | {r['client_cpu_s_per_s']:.2f} | "
                f"{r['requests_per_batch'] or 0:.1f} |"
            )
    lines += [
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
    return "\n".join(lines) + "\n"


def main(argv=None):
    a = parse_args(argv)
    levels = [int(x) for x in a.concurrency.split(",")]
    from raycompat.cluster import connect
    from raycompat.serving.auth import TOKEN_ENV

    os.environ.setdefault(TOKEN_ENV, "bench-token-" + os.urandom(8).hex())
    os.makedirs(a.out, exist_ok=True)
    load_at_start = os.getloadavg()[0]
    say(
        f"{a.items} items x {a.dim} dims, {a.shards} shards, k={a.k}, levels {levels}, "
        f"{a.seconds:.0f} s each; {os.cpu_count()} cores, load average {load_at_start:.1f}"
    )
    vecs, queries = vectors_and_queries(a)
    baselines = inprocess_baselines(vecs, queries, a, levels)
    del vecs
    gc.collect()
    connect(a.address)
    exact = exact_http(a, levels, queries, baselines)
    approx = [approx_row(a, kind, queries) for kind in a.indexes.split(",") if kind]
    md = report_markdown(a, levels, baselines, exact, approx, load_at_start)
    with open(os.path.join(a.out, "serve_load.md"), "w") as fh:
        fh.write(md)
    with open(os.path.join(a.out, "serve_load.json"), "w") as fh:
        json.dump(
            {
                "args": vars(a),
                "inprocess": baselines,
                "exact_http": exact,
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
