"""The exact index of a GPU shard (torch on CUDA) against a plain torch search and the GPU's
memory bandwidth: QPS and p50 / p99 per batch size for N items (default 10M x 128), the scan
rate in GB/s, and its ratio to the device's measured copy bandwidth (the roofline of a scan:
every batch reads the whole matrix once).

    python bench/gpu_index.py                          # a CUDA machine: 10M x 128
    python bench/gpu_index.py --device cpu --items 200000 --seconds 2   # a smoke run anywhere

The shard path is :class:`raycompat.serving.rep_index.TorchFlat` (blockwise matmul + top-k on
the device) followed by the canonical re-rank on the CPU (:func:`raycompat.index.canonical.
rerank_top_k`), exactly as a shard replica with a GPU searches; the baseline is one
``torch.topk(q @ X.T)`` per batch in the same process.  Needs torch and numpy only (no Ray,
no faiss).  Writes ``gpu_index.md`` and ``gpu_index.json`` to ``--out``.
"""

import argparse
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
    p.add_argument("--items", type=int, default=10_000_000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--batches", default="1,16,64,256")
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default="bench_out/gpu_index")
    return p.parse_args(argv)


def say(msg: str) -> None:
    print(f"[gpu_index] {msg}", flush=True)


def sync(torch, device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(torch, device, n_bytes: int = 1 << 30) -> float:
    """Bytes per second of a device-to-device copy (read + write), the scan's roofline."""
    x = torch.empty(n_bytes // 4, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    sync(torch, device)
    t, reps = time.perf_counter(), 10
    for _ in range(reps):
        y.copy_(x)
    sync(torch, device)
    return 2 * n_bytes * reps / (time.perf_counter() - t)


def timed(call, seconds: float) -> list[float]:
    call(0)
    lat, t0, i = [], time.perf_counter(), 1
    while time.perf_counter() - t0 < seconds:
        t = time.perf_counter()
        call(i)
        lat.append(time.perf_counter() - t)
        i += 1
    return lat


def summary(lat: list[float], batch: int, scan_bytes: int) -> dict:
    lat = np.asarray(lat)
    return {
        "qps": batch / lat.mean(),
        "p50_ms": 1000 * float(np.percentile(lat, 50)),
        "p99_ms": 1000 * float(np.percentile(lat, 99)),
        "scan_gb_s": scan_bytes / lat.mean() / 1e9,
        "calls": int(lat.size),
    }


def main(argv=None) -> None:
    a = parse_args(argv)
    import torch

    from raycompat.index.canonical import rerank_top_k
    from raycompat.serving.rep_index import TorchFlat

    device = torch.device(a.device)
    rng = np.random.default_rng(0)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    say(f"{a.items} x {a.dim} on {device} ({name})")
    vecs = rng.standard_normal((a.items, a.dim), dtype=np.float32)
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    queries = rng.standard_normal((4096, a.dim), dtype=np.float32)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    index = TorchFlat(a.dim, device)
    t = time.perf_counter()
    index.add(np.arange(a.items), vecs)
    sync(torch, device)
    say(f"loaded in {time.perf_counter() - t:.1f} s")
    bandwidth = copy_bandwidth(torch, device)
    say(f"device copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    x = index.mat[: a.items]
    scan_bytes = a.items * a.dim * 4
    norm = float(np.sqrt((vecs.astype(np.float64) ** 2).sum(1).max()))
    rows = {}
    for batch in (int(b) for b in a.batches.split(",")):

        def shard(i, batch=batch):
            q = queries[(i * batch) % (4096 - batch) :][:batch]
            S, L = index.search(q, a.k + 16)
            rerank_top_k(q, S, L, a.k, lambda ids: vecs[ids], norm, complete=False)

        def plain(i, batch=batch):
            q = torch.as_tensor(queries[(i * batch) % (4096 - batch) :][:batch], device=device)
            s, j = torch.topk(q @ x.T, a.k, dim=1)
            s.cpu(), j.cpu()

        rows[batch] = {
            "shard": summary(timed(shard, a.seconds), batch, scan_bytes),
            "plain": summary(timed(plain, a.seconds), batch, scan_bytes),
        }
        r = rows[batch]
        r["ratio_to_plain"] = r["shard"]["qps"] / r["plain"]["qps"]
        r["scan_to_bandwidth"] = r["shard"]["scan_gb_s"] * 1e9 / bandwidth
        say(
            f"batch {batch:4d}: shard {r['shard']['qps']:9.1f} QPS (p99 {r['shard']['p99_ms']:.1f} "
            f"ms, {r['shard']['scan_gb_s']:.0f} GB/s = {r['scan_to_bandwidth']:.2f} of the copy "
            f"bandwidth), plain torch {r['plain']['qps']:9.1f} QPS, ratio {r['ratio_to_plain']:.2f}"
        )
    write(a, device, bandwidth, rows)


def write(a, device, bandwidth: float, rows: dict) -> None:
    os.makedirs(a.out, exist_ok=True)
    lines = [
        f"# gpu_index: {a.items} x {a.dim} on {device}, k={a.k}",
        "",
        f"Device copy bandwidth (read + write): {bandwidth / 1e9:.0f} GB/s.",
        "",
        "| batch | shard QPS | shard p50 / p99 ms | scan GB/s | of bandwidth | plain torch QPS "
        "| ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for b, r in rows.items():
        s = r["shard"]
        lines.append(
            f"| {b} | {s['qps']:.1f} | {s['p50_ms']:.1f} / {s['p99_ms']:.1f} | "
            f"{s['scan_gb_s']:.0f} | {r['scan_to_bandwidth']:.2f} | {r['plain']['qps']:.1f} | "
            f"{r['ratio_to_plain']:.2f} |"
        )
    with open(os.path.join(a.out, "gpu_index.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    with open(os.path.join(a.out, "gpu_index.json"), "w") as fh:
        json.dump({"args": vars(a), "bandwidth": bandwidth, "rows": rows}, fh, indent=1)
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
