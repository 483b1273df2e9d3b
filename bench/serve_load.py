"""Load benchmark of the live index: concurrent HTTP searches against N items on S shards
(default 1M x 128-dim synthetic vectors on 4 shards), idle and during a live backfill; QPS and
p50 / p99 latency per concurrency level, and the ratio to in-process faiss (IndexFlatIP over
the same vectors, searched one query per call from the same number of threads, one OpenMP
thread each -- as the shards run).

    bash .ci/env python bench/serve_load.py                       # 1M items, 4 shards
    bash .ci/env python bench/serve_load.py --items 100000 --seconds 5

The report records the load average: numbers taken beside other jobs are rough.
"""

import argparse
import json
import os
import shutil
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from raycompat.report import machine_description  # noqa: E402


def run_threads(concurrency: int, seconds: float, one_call):
    """``concurrency`` threads calling ``one_call(i)`` for ``seconds``: (QPS, latencies, errors)."""
    lat, errors = [], [0]
    lock = threading.Lock()
    stop = time.perf_counter() + seconds

    def worker(w):
        mine, i = [], w
        while time.perf_counter() < stop:
            t = time.perf_counter()
            ok = one_call(i)
            mine.append(time.perf_counter() - t)
            if not ok:
                with lock:
                    errors[0] += 1
            i += concurrency
        with lock:
            lat.extend(mine)

    t0 = time.perf_counter()
    ths = [threading.Thread(target=worker, args=(w,)) for w in range(concurrency)]
    for th in ths:
        th.start()
    for th in ths:
        th.join()
    wall = time.perf_counter() - t0
    return len(lat) / wall, np.asarray(lat), errors[0]


def summarize(qps, lat, errors):
    return {
        "qps": qps,
        "p50_ms": 1000 * float(np.percentile(lat, 50)) if lat.size else None,
        "p99_ms": 1000 * float(np.percentile(lat, 99)) if lat.size else None,
        "requests": int(lat.size),
        "errors": int(errors),
    }


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--items", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument(
        "--backfill-rate", type=float, default=2000.0, help="items/s during the live-backfill run"
    )
    p.add_argument("--out", default="bench_out/serve_load")
    p.add_argument("--address", default=None)
    return p.parse_args(argv)


def inprocess_index(a):
    """IndexFlatIP over the shards' old vectors, all of them (one OpenMP thread per caller)."""
    import faiss

    from raycompat.serving.gallery_source import SyntheticGallery

    gal = SyntheticGallery(a.items, a.dim, a.dim, seed=0)
    t = time.perf_counter()
    vecs = gal.vectors_of("old", np.arange(a.items, dtype=np.int64))
    print(
        f"[serve_load] generated {vecs.shape[0]} vectors in {time.perf_counter() - t:.1f} s",
        flush=True,
    )
    faiss.omp_set_num_threads(1)
    index = faiss.IndexFlatIP(a.dim)
    index.add(vecs)
    return index


def measure_inprocess(index, queries, a, c):
    """Measured right before each HTTP run, so both see the same load from other jobs."""
    qps, lat, err = run_threads(
        c, a.seconds, lambda i: index.search(queries[i % 4096 : i % 4096 + 1], a.k) and True
    )
    r = summarize(qps, lat, err)
    print(
        f"  in-process faiss  c={c:3d}: {qps:8.1f} QPS  p50 {r['p50_ms']:.1f} ms  "
        f"p99 {r['p99_ms']:.1f} ms",
        flush=True,
    )
    return r


def start_index(a):
    """Serve the synthetic gallery; ``(cfg, url, client)``."""
    from raycompat.cluster import connect
    from raycompat.serving.app import free_port, start_serving
    from raycompat.serving.auth import TOKEN_ENV
    from raycompat.serving.client import ServingClient
    from raycompat.serving.config import serving_config

    os.environ.setdefault(TOKEN_ENV, "bench-token-" + os.urandom(8).hex())
    connect(a.address)
    state = os.path.abspath(os.path.join(a.out, "state"))
    shutil.rmtree(state, ignore_errors=True)
    cfg = serving_config(
        gallery=f"synthetic:{a.items}:{a.dim}:{a.dim}:0",
        state_dir=state,
        num_shards=a.shards,
        port=free_port(),
        app_name="serve_load",
        snapshot_every=10**9,
    )
    t = time.perf_counter()
    url = start_serving(cfg, a.address)
    client = ServingClient(url, token=os.environ[TOKEN_ENV], timeout=120)
    st = client.wait_ready(timeout=900)
    print(
        f"[serve_load] served at {url} in {time.perf_counter() - t:.1f} s: {st['items']}",
        flush=True,
    )
    return cfg, url, client


def measure_http(a, url, client, levels, queries, index) -> tuple[dict, dict, dict]:
    """Idle, then during a live backfill: HTTP and in-process numbers per concurrency level."""
    import requests

    sessions = [requests.Session() for _ in range(max(levels))]

    def http_call(i):
        r = sessions[i % len(sessions)].post(
            url + "/search", json={"vectors": [queries[i % 4096].tolist()], "k": a.k}, timeout=120
        )
        return r.status_code == 200

    results = {"idle": {}, "backfill": {}}
    baseline = {"idle": {}, "backfill": {}}
    for phase in ("idle", "backfill"):
        if phase == "backfill":
            client.start_backfill(
                policy="sequential", rate=a.backfill_rate, batch_size=256, restart=True
            )
        for c in levels:
            baseline[phase][c] = measure_inprocess(index, queries, a, c)
            p0 = client.status()["backfill"]["position"]
            t0 = time.perf_counter()
            qps, lat, err = run_threads(c, a.seconds, http_call)
            moved = client.status()["backfill"]["position"] - p0
            r = summarize(qps, lat, err)
            r["backfill_items_per_s"] = moved / (time.perf_counter() - t0)
            r["ratio_to_inprocess"] = qps / baseline[phase][c]["qps"]
            results[phase][c] = r
            print(
                f"  HTTP {phase:8s} c={c:3d}: {qps:8.1f} QPS  p50 {r['p50_ms']:.1f} ms  "
                f"p99 {r['p99_ms']:.1f} ms  errors {err}  "
                f"ratio to in-process {r['ratio_to_inprocess']:.3f}"
                + (
                    f"  (backfill {r['backfill_items_per_s']:.0f} items/s)"
                    if phase == "backfill"
                    else ""
                ),
                flush=True,
            )
    final = client.status()
    client.pause_backfill()
    return baseline, results, final


def report_markdown(a, levels, baseline, results, final, load_at_start, cores) -> str:
    rows = []
    for c in levels:
        for phase in ("idle", "backfill"):
            b, r = baseline[phase][c], results[phase][c]
            rows.append(
                f"| {phase} | {c} | {b['qps']:.1f} | {b['p50_ms']:.0f} / {b['p99_ms']:.0f} | "
                f"{r['qps']:.1f} | {r['p50_ms']:.0f} / {r['p99_ms']:.0f} | "
                f"{r['ratio_to_inprocess']:.2f} | {r['errors']} | "
                + (f"{r['backfill_items_per_s']:.0f} |" if phase == "backfill" else "- |")
            )
    return "\n".join(
        [
            f"# serve_load: {a.items} items x {a.dim} dims on {a.shards} shards, k={a.k}",
            "",
            f"Machine: {machine_description(load_at_start)}; "
            "the load at the start is taken before the benchmark "
            f"starts its own processes (above {cores}: "
            "other jobs shared the machine and the numbers are rough). "
            "In-process baseline: "
            "faiss IndexFlatIP over the same vectors in this process, one query per call, "
            "one OpenMP thread per "
            "calling thread, measured right before each HTTP run. "
            "ratio = HTTP QPS / in-process QPS.",
            "",
            "| phase | concurrency | in-process QPS | in-process p50 / p99 ms | "
            "HTTP QPS | HTTP p50 / p99 ms | "
            "ratio | HTTP errors | backfill items/s |",
            "|---|---|---|---|---|---|---|---|---|",
            *rows,
            "",
            f"Backfill at the end: {final['backfill']['position']} / {final['backfill']['total']} "
            "items upgraded.",
        ]
    )


def main(argv=None):
    a = parse_args(argv)
    levels = [int(x) for x in a.concurrency.split(",")]
    from raycompat.serving.app import stop_serving

    os.makedirs(a.out, exist_ok=True)
    queries = np.random.default_rng(123).standard_normal((4096, a.dim)).astype(np.float32)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    cores = os.cpu_count()
    load_at_start = os.getloadavg()[0]
    print(
        f"[serve_load] {a.items} items x {a.dim} dims, {a.shards} shards, k={a.k}, "
        f"levels {levels}, "
        f"{a.seconds:.0f} s each; machine: {cores} cores, load average {load_at_start:.1f}",
        flush=True,
    )
    index = inprocess_index(a)
    cfg, url, client = start_index(a)
    client.search(queries[:3], k=a.k)  # a spot check that searching works
    try:
        baseline, results, final = measure_http(a, url, client, levels, queries, index)
    finally:
        stop_serving(cfg)
    md = report_markdown(a, levels, baseline, results, final, load_at_start, cores)
    with open(os.path.join(a.out, "serve_load.md"), "w") as fh:
        fh.write(md + "\n")
    with open(os.path.join(a.out, "serve_load.json"), "w") as fh:
        json.dump(
            {"args": vars(a), "inprocess": baseline, "served": results, "cores": cores},
            fh,
            indent=1,
        )
    print(md, flush=True)
    print(f"[serve_load] wrote {a.out}/serve_load.md and .json")


if __name__ == "__main__":
    main()
