"""Search batching: the project's :class:`~raycompat.serving.batching.Batcher` (what the router
and the shards use) against Serve's own ``@serve.batch``, on one process's event loop, with the
shard's real search behind both (faiss ``IndexFlatIP``, run in a worker thread as a shard does).

``--concurrency`` clients (one table per count) each send one-query requests back to back
for ``--seconds``; per batcher: requests/s, p50 / p99 latency and the mean batch size.
Baselines in the same process: every request searched alone (no batching), and the roofline,
back-to-back batched searches of ``concurrency`` queries (the most a batcher can reach). The
ratio printed is each batcher's throughput over the roofline's.

    bash .ci/env python bench/search_batching.py
    bash .ci/env python bench/search_batching.py --items 1000000 --concurrency 16 --seconds 5

Writes ``--out`` (JSON and markdown).
"""

import argparse
import asyncio
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--items", type=int, default=250_000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--concurrency", default="1,16", help="client counts, one table each")
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument(
        "--jitter-ms",
        type=float,
        default=2.0,
        help="each client waits a uniform 0..jitter before a request (HTTP requests do not "
        "arrive in the same event-loop tick); 0: in lockstep",
    )
    p.add_argument("--out", default="bench/results/search_batching")
    return p.parse_args(argv)


def make_index(items: int, dim: int):
    import faiss

    rng = np.random.default_rng(0)
    x = rng.standard_normal((items, dim), dtype=np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    index = faiss.IndexFlatIP(dim)
    index.add(x)
    return index, x


class Search:
    """The shard's search of a batch of requests (rows stacked, each request its own rows)."""

    def __init__(self, index, k: int):
        self.index, self.k = index, k
        self.sizes: list[int] = []

    async def batch(self, queries: list) -> list:
        self.sizes.append(len(queries))
        stacked = np.concatenate(queries)
        _, ids = await asyncio.to_thread(self.index.search, stacked, self.k)
        return [ids[j : j + 1] for j in range(len(queries))]


async def load(submit, queries: np.ndarray, concurrency: int, seconds: float, jitter_s) -> dict:
    latencies: list[float] = []
    end = time.perf_counter() + seconds

    async def client(c: int):
        j = c
        rng = np.random.default_rng(c)
        while time.perf_counter() < end:
            if jitter_s:
                await asyncio.sleep(float(rng.uniform(0, jitter_s)))
            t0 = time.perf_counter()
            await submit(queries[j % len(queries)][None])
            latencies.append(time.perf_counter() - t0)
            j += concurrency

    t0 = time.perf_counter()
    await asyncio.gather(*(client(c) for c in range(concurrency)))
    dt = time.perf_counter() - t0
    lat = np.asarray(latencies) * 1000
    return {
        "requests_per_s": len(latencies) / dt,
        "p50_ms": float(np.percentile(lat, 50)),
        "p99_ms": float(np.percentile(lat, 99)),
    }


def own_batcher(search: Search, max_batch: int, wait_s: float = 0.0):
    from raycompat.serving.batching import Batcher

    batcher = Batcher(search.batch, max_batch, wait_s)
    return batcher.submit


def serve_batch(search: Search, max_batch: int, wait_s: float):
    from ray import serve
    from ray.serve import batching

    # outside a replica, Serve's queue cannot read max_ongoing_requests for a warning it logs
    # at creation; only that warning is skipped, the batching is Serve's own
    batching._BatchQueue._warn_if_max_batch_size_exceeds_max_ongoing_requests = lambda self: None

    @serve.batch(max_batch_size=max_batch, batch_wait_timeout_s=wait_s)
    async def submit(queries: list) -> list:
        return await search.batch(queries)

    return submit


async def alone(search: Search):
    async def submit(q):
        return (await search.batch([q]))[0]

    return submit


def roofline(index, queries: np.ndarray, batch: int, k: int, seconds: float) -> float:
    """Queries/s of back-to-back batched searches of ``batch`` queries (no event loop)."""
    index.search(queries[:batch], k)  # warm
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        index.search(queries[(n % 8) * batch : (n % 8 + 1) * batch], k)
        n += 1
    return n * batch / (time.perf_counter() - t0)


async def run(args) -> list[dict]:
    index, _ = make_index(args.items, args.dim)
    rng = np.random.default_rng(1)
    queries = rng.standard_normal((8 * args.concurrency, args.dim), dtype=np.float32)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    rows = []
    top = roofline(index, queries, args.concurrency, args.k, args.seconds)
    rows.append({"batcher": f"roofline: batches of {args.concurrency}", "requests_per_s": top})
    kinds = [
        ("alone (no batching)", lambda s: alone(s)),
        ("raycompat Batcher (wait 0)", lambda s: own_batcher(s, args.max_batch)),
        ("raycompat Batcher (wait 2 ms)", lambda s: own_batcher(s, args.max_batch, 0.002)),
        ("@serve.batch (wait 0)", lambda s: serve_batch(s, args.max_batch, 0.0)),
        ("@serve.batch (wait 2 ms)", lambda s: serve_batch(s, args.max_batch, 0.002)),
        ("@serve.batch (wait 10 ms)", lambda s: serve_batch(s, args.max_batch, 0.01)),
    ]
    for name, make in kinds:
        search = Search(index, args.k)
        submit = make(search)
        if asyncio.iscoroutine(submit):
            submit = await submit
        row = await load(submit, queries, args.concurrency, args.seconds, args.jitter_ms / 1000)
        row["batcher"] = name
        row["mean_batch"] = float(np.mean(search.sizes)) if search.sizes else None
        row["batches"] = len(search.sizes)
        rows.append(row)
    for row in rows:
        row["ratio_to_roofline"] = row["requests_per_s"] / top
    return rows


def markdown(rows: list[dict], args) -> str:
    head = "| batcher | requests/s | p50 ms | p99 ms | mean batch | batches | / roofline |"
    out = [
        f"{args.items:,} x {args.dim} IndexFlatIP, k={args.k}, {args.concurrency} clients of "
        f"one query each (0..{args.jitter_ms:g} ms apart), max batch {args.max_batch}, "
        f"{args.seconds:g} s per row",
        "",
        head,
        "|---|---|---|---|---|---|---|",
    ]

    def f(v, spec):
        return "" if v is None else format(v, spec)

    for r in rows:
        out.append(
            f"| {r['batcher']} | {r['requests_per_s']:.0f} | {f(r.get('p50_ms'), '.1f')} | "
            f"{f(r.get('p99_ms'), '.1f')} | {f(r.get('mean_batch'), '.1f')} | "
            f"{r.get('batches', '')} | {r['ratio_to_roofline']:.2f} |"
        )
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    import faiss

    faiss.omp_set_num_threads(os.cpu_count() or 1)
    tables, text = {}, ""
    for c in [int(c) for c in str(args.concurrency).split(",")]:
        one = argparse.Namespace(**{**vars(args), "concurrency": c})
        tables[c] = asyncio.run(run(one))
        text += markdown(tables[c], one) + "\n"
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as fh:
        doc = {"args": vars(args), "load_avg": os.getloadavg(), "tables": tables}
        json.dump(doc, fh, indent=2)
    with open(os.path.join(args.out, "results.md"), "w") as fh:
        fh.write(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
