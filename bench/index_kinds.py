"""Every index kind on one representation, in process, one thread, with a shard's faiss settings
(``configure_faiss``): build time, bytes per item, memory, recall@10 against the exact index
(with its 95 % bootstrap interval over the queries), QPS at 16 queries per call (the canonical
re-rank included), the ratio to the exact (flat) index's QPS on the same queries, and the cost
of removing 256 ids (docs/indexes.md, "Measured").

    bash .ci/env python bench/index_kinds.py                                  # C = 1000
    bash .ci/env python bench/index_kinds.py --gallery synthetic:250000:128:128:0:10000

Prints one markdown row per kind.
"""

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

KINDS = ("flat", "ivf_flat", "ivf_flat:nprobe=128", "ivf_pq", "hnsw", "hnsw:ef_search=128")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--gallery", default="synthetic:250000:128:128:0:1000")
    p.add_argument("--kinds", default=",".join(KINDS), help="KIND[:option=value,...], ...")
    p.add_argument("--queries", type=int, default=1008)
    return p.parse_args(argv)


def spec(text: str) -> dict:
    kind, _, rest = text.partition(":")
    return {"kind": kind, **dict(kv.split("=", 1) for kv in rest.split(",") if kv)}


def measure(text: str, ids, x, batches) -> tuple[dict, np.ndarray]:
    from raycompat.index.ann import index_options
    from raycompat.serving.rep_index import RepIndex

    rep = RepIndex(x.shape[1], index_options(device="cpu", **spec(text)), text, background=False)
    t = time.perf_counter()
    rep.add(ids, x)
    build = time.perf_counter() - t
    served = np.concatenate([rep.search(b, 10)[1] for b in batches])
    t = time.perf_counter()
    for b in batches:
        rep.search(b, 10)
    qps = sum(len(b) for b in batches) / (time.perf_counter() - t)
    d = rep.describe()
    per_item = rep.index.memory_bytes() / ids.size
    t = time.perf_counter()
    for b in range(20):
        rep.remove(ids[b * 256 : (b + 1) * 256])
    remove_ms = (time.perf_counter() - t) / 20 * 1e3
    shown = ", ".join(f"{k} {d[k]}" for k in ("nlist", "nprobe", "ef_search") if d[k])
    row = dict(
        kind=text, shown=shown, build=build, per_item=per_item, mib=d["memory_bytes"] / 2**20
    )
    return {**row, "qps": qps, "remove_ms": remove_ms}, served


def main(argv=None) -> None:
    a = parse_args(argv)
    from raycompat.index.ann import configure_faiss
    from raycompat.metrics.recall import recall_at_k, recall_interval
    from raycompat.serving.gallery_source import open_gallery

    gal = open_gallery(a.gallery)
    configure_faiss(1, gal.new_dim)
    ids = np.arange(gal.n_items)
    x = gal.vectors_of("new", ids)
    q = gal.query_vectors(a.queries, seed=1, rep="new")
    batches = [q[b : b + 16] for b in range(0, len(q), 16)]
    print(f"{a.gallery}, {a.queries} queries in batches of 16, k=10, one thread", flush=True)
    print(
        "| kind | parameters | build s | index B/item | memory MiB | recall@10 | QPS | x flat | "
        "remove 256 ids, ms |\n|---|---|---|---|---|---|---|---|---|",
        flush=True,
    )
    exact = flat_qps = None
    for text in a.kinds.split(","):
        r, served = measure(text, ids, x, batches)
        if exact is None:  # the first kind is the exact reference
            exact, flat_qps = served, r["qps"]
        print(
            f"| {r['kind']} | {r['shown'] or '-'} | {r['build']:.1f} | {r['per_item']:.0f} | "
            f"{r['mib']:.0f} | {recall_interval(recall_at_k(served, exact, 10)[1]).text(4)} | "
            f"{r['qps']:.0f} | "
            f"{r['qps'] / flat_qps:.1f} | {r['remove_ms']:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
