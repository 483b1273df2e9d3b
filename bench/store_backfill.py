"""A store backfill's writes and a half-upgraded store's searches, on LanceDB and Milvus Lite.

A gallery of ``--items`` items (default 1,000,000) with ``--dim``-dimensional old vectors and a
new vector column that is null (LanceDB) or zeros (Milvus) until the item is upgraded, created
with ``raycompat.stores.create_store``. Per backend:

1. **Write throughput**: the store backfill's write path, ``store.write_new(ids, vectors,
   fingerprint, positions)`` (the checks, the ids and growing positions, one atomic write per
   batch), against the store's own bulk upsert of the same columns at the same batch size:
   LanceDB ``merge_insert(id).when_matched_update_all()`` on a table of the same shape,
   Milvus ``upsert`` of the whole rows built from the vectors in memory (what a writer that
   holds the rows does; ``write_new`` reads them first, Milvus having no partial update). The
   vectors are computed before (no embedding time). Both write the same ``--write-rows`` items
   in the same random order, each into its own copy of the gallery, batch by batch in turn
   (which goes first alternates), so the machine's load falls on both alike. Prints rows/s of
   both and their ratio (goal >= 0.8).
2. **Search latency** of the gallery ``--upgraded`` (default 30 %) upgraded: the mode search an
   application calls, ``raycompat.stores.search(store, StoreQueries(new=q), k, mode)``, for
   ``compatible`` and ``rank_merge`` (a random bundle with ``rho`` and ``psi_rev``, as
   ``tests/stores/test_stores_modes.py`` builds), against one plain exact search of the old
   field through the engine's own call (LanceDB ``table.search(...).bypass_vector_index()``,
   Milvus ``client.search`` on its FLAT index) for the same batch of ``--queries`` queries,
   k = 10. Median and p95 ms per query batch and their ratios (goals: compatible <= 1.5,
   rank merge <= 2.5); for information also ``store.search('old', ...)`` and
   ``store.search_compatible``. One call of each mode is profiled: where its time goes.

    python bench/store_backfill.py --out DIR                      # 1M x 128, lance and milvus
    python bench/store_backfill.py --milvus-items 250000 --out DIR  # docs/benchmarks.md, 18 min
    python bench/store_backfill.py --items 20000 --write-rows 4000 --out DIR --overwrite

Writes ``results.json`` and ``results.md`` to ``--out`` (refused if it is a non-empty folder,
unless ``--overwrite``): the machine, the date, the versions, every figure and ratio, the
command. The stores live under ``--work`` (a new temporary folder by default), removed at the
end unless ``--keep-work``.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import importlib.metadata
import json
import os
import platform
import pstats
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402

from raycompat.stores import (  # noqa: E402
    GalleryBlock,
    StoreQueries,
    create_store,
    search,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OLD_MODEL, NEW_MODEL = "old-v1", "new-v2"
GOALS = {"write": 0.8, "compatible": 1.5, "rank_merge": 2.5}
#: (name in the tables, what it is) of every timed search
SEARCHES = {
    "plain": "engine's exact search of the old field (baseline)",
    "store_search": "store.search('old', q, k)",
    "store_compatible": "store.search_compatible(q, q[:, :D_old], k)",
    "compatible": "search(store, StoreQueries(new=q), k, 'compatible')",
    "rank_merge": "search(store, StoreQueries(new=q), k, 'rank_merge', bundle=...)",
}
START = time.perf_counter()


def say(msg: str) -> None:
    print(f"[store_backfill {time.perf_counter() - START:6.0f} s] {msg}", flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--items", type=int, default=1_000_000, help="gallery items")
    p.add_argument(
        "--milvus-items",
        type=int,
        default=0,
        help="gallery items on Milvus Lite (0: --items); for a size Milvus Lite holds",
    )
    p.add_argument("--dim", type=int, default=128, help="old and new vector dimension")
    p.add_argument("--write-rows", type=int, default=30_000, help="rows written in part 1")
    p.add_argument("--batch-size", type=int, default=1_000, help="rows per write batch")
    p.add_argument(
        "--fill-batch",
        type=int,
        default=16_000,
        help="rows per write_new while filling to --upgraded",
    )
    p.add_argument("--upgraded", type=float, default=0.3, help="fraction upgraded in part 2")
    p.add_argument("--queries", type=int, default=16, help="queries per search batch")
    p.add_argument("--search-reps", type=int, default=10, help="timed batches per search")
    p.add_argument(
        "--rank-merge-reps", type=int, default=3, help="timed batches of the rank_merge search"
    )
    p.add_argument("--rho-hidden", type=int, default=128, help="hidden width of rho, psi_rev")
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--backends", default="lance,milvus", help="lance and/or milvus")
    p.add_argument("--out", required=True, help="results folder")
    p.add_argument("--overwrite", action="store_true", help="write into a non-empty --out")
    p.add_argument("--work", default=None, help="folder for the stores (default: a temp folder)")
    p.add_argument("--keep-work", action="store_true", help="leave the stores on disk")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    a.backends = [b for b in a.backends.split(",") if b]
    for b in a.backends:
        if b not in ("lance", "milvus"):
            p.error(f"--backends: unknown backend {b!r} (lance, milvus)")
    if os.path.isdir(a.out) and os.listdir(a.out) and not a.overwrite:
        p.error(f"--out {a.out} exists and is not empty; pass --overwrite to write into it")
    if a.batch_size < 1 or a.write_rows < a.batch_size:
        p.error("--write-rows must be at least --batch-size, which must be >= 1")
    return a


# ----------------------------------------------------------------------------- machine
def machine() -> dict:
    mem = 0
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * 1024
    return {
        "cpu_count": os.cpu_count(),
        "arch": platform.machine(),
        "memory_gib": round(mem / 2**30, 1),
        "python": platform.python_version(),
    }


def versions() -> dict:
    out = {}
    for dist in ("raycompat", "lancedb", "pylance", "pymilvus", "milvus-lite", "pyarrow", "numpy"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    try:
        git = ["git", "-C", ROOT]
        head = subprocess.run(
            [*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        )
        dirty = subprocess.run([*git, "status", "--porcelain"], capture_output=True, text=True)
        out["commit"] = head.stdout.strip() + (" (working tree changed)" if dirty.stdout else "")
    except OSError:
        out["commit"] = None
    return out


def rss_mib() -> float:
    """Resident memory of this process and its children (Milvus Lite's server runs in it)."""
    total, pids = 0, [os.getpid()]
    while pids:
        pid = pids.pop()
        try:
            with open(f"/proc/{pid}/statm") as fh:
                total += int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            with open(f"/proc/{pid}/task/{pid}/children") as fh:
                pids += [int(c) for c in fh.read().split()]
        except OSError:
            continue
    return total / 2**20


class Peak:
    """The largest :func:`rss_mib` seen at the progress points."""

    def __init__(self) -> None:
        self.mib = rss_mib()

    def sample(self) -> float:
        now = rss_mib()
        self.mib = max(self.mib, now)
        return now


# ----------------------------------------------------------------------------- data
def unit_rows(rng: np.random.Generator, n: int, dim: int) -> np.ndarray:
    x = rng.standard_normal((n, dim), dtype=np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x


class Data:
    """The gallery's old vectors, the backfill order, the new vectors of the items it
    upgrades (in order), and the query batches."""

    def __init__(self, a: argparse.Namespace, n: int) -> None:
        rng = np.random.default_rng(a.seed)
        self.n = n
        self.ids = np.arange(n, dtype=np.int64)
        self.labels = self.ids % 1000
        self.old = unit_rows(rng, n, a.dim)
        self.order = rng.permutation(n).astype(np.int64)
        self.target = max(a.write_rows, int(round(a.upgraded * n)))
        if self.target > n:
            raise SystemExit(f"--write-rows {a.write_rows} is more than the {n} items")
        self.new = unit_rows(rng, self.target, a.dim)  # new[i]: item order[i]
        reps = max(a.search_reps, a.rank_merge_reps) + 1
        self.queries = unit_rows(rng, reps * a.queries, a.dim).reshape(reps, a.queries, a.dim)

    def blocks(self, rows: int = 65_536):
        for s in range(0, self.n, rows):
            sl = slice(s, s + rows)
            yield GalleryBlock(self.ids[sl], self.labels[sl], self.old[sl])


def make_bundle(dim: int, hidden: int, seed: int):
    """A new model's bundle with RM's rho and psi_rev (random MLPs, eval mode)."""
    import torch

    from raycompat.models import ModelBundle, ProjectionMLP

    torch.manual_seed(seed)
    mods = {
        "rho": ProjectionMLP(dim, dim, hidden_dim=hidden, num_blocks=1, role="rho"),
        "psi_rev": ProjectionMLP(dim, dim, hidden_dim=hidden, num_blocks=1, role="psi_rev"),
    }
    return ModelBundle(mods, dict(method="bench")).eval()


# ----------------------------------------------------------------------------- backends
class LanceBase:
    """The baseline writer and searcher on LanceDB: a plain connection to the table."""

    name = "lance"
    upsert_name = "merge_insert"

    def __init__(self, db_path: str, table: str) -> None:
        import lancedb

        self.db = lancedb.connect(db_path)
        self.table = self.db.open_table(table)
        self.table_name = table

    def write(self, data: Data, rows: np.ndarray, positions: np.ndarray) -> None:
        import pyarrow as pa

        n, dim = len(rows), data.new.shape[1]
        vectors = pa.FixedSizeListArray.from_arrays(pa.array(data.new[rows].ravel()), dim)
        names = ["item_id", "new", "new_model", "upgraded", "upgrade_position"]
        schema = pa.schema([self.table.schema.field(c) for c in names])
        batch = pa.table(
            [data.order[rows], vectors, [NEW_MODEL] * n, np.ones(n, bool), positions],
            schema=schema,
        )
        self.table.merge_insert("item_id").when_matched_update_all().execute(batch)

    def search(self, q: np.ndarray, k: int) -> None:
        query = self.table.search(q, vector_column_name="old").distance_type("dot")
        query.select(["item_id", "_distance"]).limit(k).bypass_vector_index().to_arrow()

    def drop(self) -> None:
        self.db.drop_table(self.table_name)
        self.db.drop_table(self.table_name + "__raycompat_state", ignore_missing=True)

    def settle(self, store) -> str:
        return "no settling step"


class MilvusBase:
    """The baseline on Milvus: the collection's pymilvus client, whole-row upserts."""

    name = "milvus"
    upsert_name = "upsert"

    def __init__(self, store) -> None:
        self.store = store
        self.client = store._client  # the pymilvus MilvusClient of the collection
        self.collection = store.uri.name

    def write(self, data: Data, rows: np.ndarray, positions: np.ndarray) -> None:
        ids, old, new = data.order[rows], data.old, data.new
        batch = [
            {
                "item_id": item,
                "label": item % 1000,
                "old": old[item],
                "new": new[r],
                "old_model": OLD_MODEL,
                "new_model": NEW_MODEL,
                "upgraded": True,
                "upgrade_position": pos,
            }
            for item, r, pos in zip(ids.tolist(), rows.tolist(), positions.tolist(), strict=True)
        ]
        self.client.upsert(self.collection, batch)

    def drop(self) -> None:
        for name in (self.collection, self.collection + "__raycompat_state"):
            self.client.drop_collection(name)
        self.store.close()

    def settle(self, store) -> str:
        store._client.flush(store.uri.name)
        return "flush() after the writes"


class MilvusSearcher:
    """The plain search on Milvus: the client's exact search of the old field (FLAT index)."""

    def __init__(self, store) -> None:
        self.client, self.collection = store._client, store.uri.name

    def search(self, q: np.ndarray, k: int) -> None:
        self.client.search(
            self.collection,
            data=q,
            anns_field="old",
            limit=k,
            output_fields=["item_id"],
            search_params={"metric_type": "IP", "params": {}},
        )


# ----------------------------------------------------------------------------- parts
def eta(done: int, total: int, elapsed: float) -> str:
    if not done:
        return "?"
    return f"{elapsed / done * (total - done):.0f} s"


def create_pair(a, backend: str, data: Data, work: str, peak: Peak):
    """Two copies of the gallery: the one write_new writes (and the searches use), and the
    baseline's."""
    if backend == "lance":
        db = os.path.join(work, "lance")
        uris = [f"lance://{db}/gallery_{s}" for s in ("rc", "base")]
    else:
        uris = [f"milvus://{work}/milvus.db/gallery_{s}" for s in ("rc", "base")]
    stores, seconds = [], []
    for i, uri in enumerate(uris):
        t0 = time.perf_counter()
        stores.append(create_store(uri, data.blocks(), old_model=OLD_MODEL, new_dim=a.dim))
        seconds.append(time.perf_counter() - t0)
        say(
            f"{backend}: created copy {i + 1}/2 of the gallery, {data.n:,} x {a.dim} "
            f"({data.n / seconds[-1]:,.0f} rows/s, {seconds[-1]:.0f} s); RSS "
            f"{peak.sample():,.0f} MiB"
            + (f"; ETA {seconds[0]:.0f} s for the second" if i == 0 else "")
        )
    if backend == "lance":
        base = LanceBase(os.path.join(work, "lance"), "gallery_base")
    else:
        base = MilvusBase(stores[1])
    return stores[0], stores[1], base, seconds


def write_part(a, backend: str, data: Data, store, base, peak: Peak) -> dict:
    """Part 1: the same batches through write_new and through the plain upsert, in turn."""
    batches = a.write_rows // a.batch_size
    rc_s, base_s = [], []
    t0 = last = time.perf_counter()
    for b in range(batches):
        rows = np.arange(b * a.batch_size, (b + 1) * a.batch_size)
        ids, vecs = data.order[rows], data.new[rows]

        def ours(ids=ids, vecs=vecs, rows=rows):
            t = time.perf_counter()
            store.write_new(ids, vecs, NEW_MODEL, rows)
            rc_s.append(time.perf_counter() - t)

        def theirs(rows=rows):
            t = time.perf_counter()
            base.write(data, rows, rows)
            base_s.append(time.perf_counter() - t)

        for step in (ours, theirs) if b % 2 == 0 else (theirs, ours):
            step()
        now = time.perf_counter()
        if now - last > 15 or b == batches - 1:
            last = now
            done = (b + 1) * a.batch_size
            say(
                f"{backend}: write {b + 1}/{batches} batches of {a.batch_size:,}: write_new "
                f"{done / sum(rc_s):,.0f} rows/s, {base.upsert_name} {done / sum(base_s):,.0f} "
                f"rows/s, ratio {sum(base_s) / sum(rc_s):.2f}; ETA "
                f"{eta(b + 1, batches, now - t0)}; RSS {peak.sample():,.0f} MiB"
            )
    rows = batches * a.batch_size
    rest = rows - a.batch_size

    def rate(times, n):
        return n / sum(times) if times and sum(times) > 0 else None

    out = {
        "rows": rows,
        "batch_size": a.batch_size,
        "batches": batches,
        "write_new_rows_per_s": rate(rc_s, rows),
        "upsert_rows_per_s": rate(base_s, rows),
        "upsert_call": base.upsert_name,
        "write_new_batch_ms": {
            "median": 1e3 * float(np.median(rc_s)),
            "p95": 1e3 * float(np.percentile(rc_s, 95)),
            "first": 1e3 * rc_s[0],
        },
        "upsert_batch_ms": {
            "median": 1e3 * float(np.median(base_s)),
            "p95": 1e3 * float(np.percentile(base_s, 95)),
            "first": 1e3 * base_s[0],
        },
        "write_new_after_first_rows_per_s": rate(rc_s[1:], rest),
        "upsert_after_first_rows_per_s": rate(base_s[1:], rest),
    }
    out["ratio"] = out["write_new_rows_per_s"] / out["upsert_rows_per_s"]
    if rest:
        out["ratio_after_first"] = (
            out["write_new_after_first_rows_per_s"] / out["upsert_after_first_rows_per_s"]
        )
    out["goal_met"] = out["ratio"] >= GOALS["write"]
    return out


def fill(a, backend: str, data: Data, store, start: int, peak: Peak) -> dict:
    """write_new up to the --upgraded fraction, in batches of --fill-batch (bounded on Milvus
    by one atomic upsert)."""
    batch = a.fill_batch
    if backend == "milvus":
        from raycompat.stores.milvus import MAX_UPSERT_BYTES

        batch = min(batch, MAX_UPSERT_BYTES // (4 * 2 * a.dim + 1024))
    t0 = last = time.perf_counter()
    done = start
    while done < data.target:
        rows = np.arange(done, min(done + batch, data.target))
        store.write_new(data.order[rows], data.new[rows], NEW_MODEL, rows)
        done += len(rows)
        now = time.perf_counter()
        if now - last > 15 or done == data.target:
            last = now
            say(
                f"{backend}: fill to {done:,}/{data.target:,} upgraded (batches of {batch:,}): "
                f"{(done - start) / (now - t0):,.0f} rows/s; ETA "
                f"{eta(done - start, data.target - start, now - t0)}; RSS "
                f"{peak.sample():,.0f} MiB"
            )
    seconds = time.perf_counter() - t0
    return {
        "rows": done - start,
        "batch": batch,
        "seconds": seconds,
        "rows_per_s": (done - start) / seconds if done > start else None,
    }


def check_compatible(store, data: Data, q: np.ndarray, k: int) -> dict:
    """The compatible search against a numpy float64 brute force over the vectors in memory
    (in blocks of items): how many queries get the same top-k ids."""
    res = search(store, StoreQueries(new=q), k, "compatible")
    slot = np.full(data.n, -1, np.int64)  # item -> row of data.new, -1: not upgraded
    slot[data.order[: data.target]] = np.arange(data.target)
    qd = q.astype(np.float64)
    qd /= np.linalg.norm(qd, axis=1, keepdims=True)
    sims = np.empty((len(q), data.n))
    for s in range(0, data.n, 131_072):
        sl = slice(s, s + 131_072)
        sims[:, sl] = qd @ data.old[sl].T.astype(np.float64)
        up = np.flatnonzero(slot[sl] >= 0)
        sims[:, s + up] = qd @ data.new[slot[sl][up]].T.astype(np.float64)
    same = 0
    for row in range(len(q)):
        top = np.argpartition(-sims[row], k)[: k + 1]
        top = top[np.lexsort((top, -sims[row][top]))][:k]
        same += int(np.array_equal(np.sort(data.ids[top]), np.sort(res.ids[row])))
    return {"queries": len(q), "same_top_k": same}


def profile(fn) -> dict:
    """Cumulative seconds of the raycompat functions one call spends the most in."""
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.runcall(fn)
    total = time.perf_counter() - t0
    stats = pstats.Stats(prof).stats
    rows = []
    for (path, _line, func), (_cc, calls, _tt, cum, _callers) in stats.items():
        if os.path.abspath(path).startswith(os.path.join(ROOT, "raycompat") + os.sep):
            mod = os.path.splitext(os.path.basename(path))[0]
            rows.append((f"{mod}.{func}", calls, cum))
    rows.sort(key=lambda r: -r[2])
    return {
        "seconds": total,
        "top": [{"function": f, "calls": c, "seconds": s} for f, c, s in rows[1:9]],
    }


def search_part(a, backend: str, data: Data, store, plain, bundle, peak: Peak) -> dict:
    """Part 2: every search on the same query batches, in a rotating order."""
    k, qs = a.k, data.queries
    calls = {
        "plain": lambda q: plain.search(q, k),
        "store_search": lambda q: store.search("old", q, k),
        "store_compatible": lambda q: store.search_compatible(q, q[:, : a.dim], k),
        "compatible": lambda q: search(store, StoreQueries(new=q), k, "compatible"),
        "rank_merge": lambda q: search(store, StoreQueries(new=q), k, "rank_merge", bundle=bundle),
    }
    reps = {name: a.search_reps for name in calls}
    reps["rank_merge"] = a.rank_merge_reps
    for fn in calls.values():  # warm-up, untimed, on the last batch
        fn(qs[-1])
    times = {name: [] for name in calls}
    names = list(calls)
    total = sum(reps.values())
    t0 = last = time.perf_counter()
    for r in range(max(reps.values())):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            if r < reps[name]:
                t = time.perf_counter()
                calls[name](qs[r])
                times[name].append(time.perf_counter() - t)
        now = time.perf_counter()
        if now - last > 15 or r == max(reps.values()) - 1:
            last = now
            done = sum(len(v) for v in times.values())
            med = ", ".join(f"{n} {1e3 * np.median(v):,.0f}" for n, v in times.items() if v)
            say(
                f"{backend}: search {r + 1}/{max(reps.values())} rounds, median ms per batch of "
                f"{a.queries}: {med}; ETA {eta(done, total, now - t0)}; RSS "
                f"{peak.sample():,.0f} MiB"
            )
    out = {
        "queries_per_batch": a.queries,
        "k": k,
        "upgraded": data.target,
        "upgraded_fraction": data.target / data.n,
        "searches": {},
    }
    base = np.median(times["plain"])
    base95 = np.percentile(times["plain"], 95)
    for name, v in times.items():
        med, p95 = float(np.median(v)), float(np.percentile(v, 95))
        row = {
            "what": SEARCHES[name],
            "batches": len(v),
            "median_ms": 1e3 * med,
            "p95_ms": 1e3 * p95,
            "ratio_median": med / base,
            "ratio_p95": p95 / base95,
        }
        if name in GOALS:
            row["goal"] = GOALS[name]
            row["goal_met"] = row["ratio_median"] <= GOALS[name]
        out["searches"][name] = row
    out["compatible_check"] = check_compatible(store, data, qs[0], k)
    say(
        f"{backend}: compatible search agrees with a numpy float64 brute force on "
        f"{out['compatible_check']['same_top_k']}/{a.queries} queries; profiling one call of "
        "each mode"
    )
    out["profile"] = {
        "compatible": profile(lambda: calls["compatible"](qs[1])),
        "rank_merge": profile(lambda: calls["rank_merge"](qs[1])),
    }
    return out


def run_backend(a, backend: str, work: str) -> dict:
    n = a.milvus_items if backend == "milvus" and a.milvus_items else a.items
    say(f"{backend}: {n:,} items x {a.dim}: generating vectors")
    data = Data(a, n)
    peak = Peak()
    result = {"items": n, "dim": a.dim}
    store, base_store, base, create_s = create_pair(a, backend, data, work, peak)
    result["create_s"] = create_s
    result["create_rows_per_s"] = [n / s for s in create_s]
    result["write"] = write_part(a, backend, data, store, base, peak)
    w = result["write"]
    say(
        f"{backend}: write path {w['write_new_rows_per_s']:,.0f} rows/s vs "
        f"{w['upsert_call']} {w['upsert_rows_per_s']:,.0f} rows/s: ratio {w['ratio']:.2f} "
        f"(goal >= {GOALS['write']}: {'met' if w['goal_met'] else 'NOT met'})"
    )
    base.drop()
    if backend == "lance":
        base_store.close()
    rows = np.arange(w["rows"], min(w["rows"] + a.batch_size, data.target))
    if len(rows):  # one more batch, profiled: where write_new's time goes
        w["profile"] = profile(
            lambda: store.write_new(data.order[rows], data.new[rows], NEW_MODEL, rows)
        )
    result["fill"] = fill(a, backend, data, store, w["rows"] + len(rows), peak)
    result["settle"] = base.settle(store)
    # the engine's own exact search of the old field: a plain connection to the table the
    # store wrote (LanceDB), or the store's own client (Milvus Lite: one process at a time)
    if backend == "lance":
        plain = LanceBase(os.path.join(work, "lance"), "gallery_rc")
    else:
        plain = MilvusSearcher(store)
    bundle = make_bundle(a.dim, a.rho_hidden, a.seed)
    result["search"] = search_part(a, backend, data, store, plain, bundle, peak)
    result["rank_merge_bundle"] = (
        f"random rho and psi_rev: ProjectionMLP({a.dim} -> {a.rho_hidden} -> {a.dim}), one "
        "block each"
    )
    store.close()
    peak.sample()
    result["peak_rss_mib"] = peak.mib
    for name in ("compatible", "rank_merge"):
        s = result["search"]["searches"][name]
        say(
            f"{backend}: {name} median {s['median_ms']:,.0f} ms vs plain "
            f"{result['search']['searches']['plain']['median_ms']:,.0f} ms: ratio "
            f"{s['ratio_median']:.2f} (goal <= {s['goal']}: "
            f"{'met' if s['goal_met'] else 'NOT met'})"
        )
    return result


# ----------------------------------------------------------------------------- report
def report_markdown(report: dict) -> str:
    m, v = report["machine"], report["versions"]
    lines = [
        "# store_backfill",
        "",
        f"Date: {report['date']}. Command: `{report['command']}`.",
        "",
        f"Machine: {m['cpu_count']} CPU cores ({m['arch']}), {m['memory_gib']} GiB memory; load "
        f"average {report['load_at_start']:.1f} at the start, {report['load_at_end']:.1f} at the "
        "end. Versions: " + ", ".join(f"{k} {val}" for k, val in v.items() if val) + ".",
        "",
        "## Write throughput (no embedding time: the vectors are computed before)",
        "",
        "| backend | items | rows written | batch | write_new rows/s | store's upsert | rows/s "
        "| ratio (goal >= 0.8) | after the first batch | median batch ms, write_new / upsert |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in report["backends"].items():
        w = r["write"]
        after = w.get("ratio_after_first")
        lines.append(
            f"| {name} | {r['items']:,} x {r['dim']} | {w['rows']:,} | {w['batch_size']:,} | "
            f"{w['write_new_rows_per_s']:,.0f} | {w['upsert_call']} | "
            f"{w['upsert_rows_per_s']:,.0f} | **{w['ratio']:.2f}** "
            f"{'met' if w['goal_met'] else 'not met'} | "
            + (f"{after:.2f}" if after is not None else "-")
            + f" | {w['write_new_batch_ms']['median']:,.0f} / "
            f"{w['upsert_batch_ms']['median']:,.0f} |"
        )
    lines += [
        "",
        "## Search latency, half-upgraded gallery (ms per batch of queries)",
        "",
        "| backend | upgraded | search | batches | median ms | p95 ms | ratio to plain, median "
        "/ p95 | goal |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in report["backends"].items():
        s = r["search"]
        for row in s["searches"].values():
            goal = (
                f"<= {row['goal']}: {'met' if row['goal_met'] else 'not met'}"
                if "goal" in row
                else ""
            )
            lines.append(
                f"| {name} | {s['upgraded']:,} ({100 * s['upgraded_fraction']:.0f} %) | "
                f"{row['what']} | {row['batches']} | {row['median_ms']:,.0f} | "
                f"{row['p95_ms']:,.0f} | {row['ratio_median']:.2f} / {row['ratio_p95']:.2f} | "
                f"{goal} |"
            )
    lines += ["", "## Other figures", ""]
    for name, r in report["backends"].items():
        s, f = r["search"], r["fill"]
        c = s["compatible_check"]
        lines.append(
            f"- {name}: create {', '.join(f'{x:.0f}' for x in r['create_s'])} s per copy "
            f"({r['create_rows_per_s'][0]:,.0f} rows/s); fill to the upgraded fraction "
            f"{f['rows']:,} rows in batches of {f['batch']:,}, {f['seconds']:.0f} s "
            + (f"({f['rows_per_s']:,.0f} rows/s)" if f["rows_per_s"] else "")
            + f"; before the searches: {r['settle']}; "
            f"{s['queries_per_batch']} queries per batch, k = {s['k']}; compatible search = "
            f"numpy float64 brute force on {c['same_top_k']}/{c['queries']} queries; "
            f"{r['rank_merge_bundle']}; peak RSS {r['peak_rss_mib']:,.0f} MiB."
        )
        profiles = dict(s["profile"])
        if "profile" in r["write"]:
            profiles = {"write_new": r["write"]["profile"], **profiles}
        for mode, p in profiles.items():
            top = ", ".join(
                f"{t['function']} {t['seconds']:.2f} s ({t['calls']}x)" for t in p["top"][:6]
            )
            lines.append(f"  - one {mode} call, {p['seconds']:.2f} s under cProfile: {top}")
    for note in report.get("notes", []):
        lines.append(f"- {note}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    a = parse_args(argv)
    load_at_start = os.getloadavg()[0]
    own_work = a.work is None
    work = a.work or tempfile.mkdtemp(prefix="store_backfill_")
    if not own_work:
        os.makedirs(work, exist_ok=True)
        work = tempfile.mkdtemp(prefix="store_backfill_", dir=work)
    os.makedirs(a.out, exist_ok=True)
    report = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": "python " + " ".join(shlex.quote(x) for x in sys.argv),
        "args": vars(a),
        "machine": machine(),
        "versions": versions(),
        "load_at_start": load_at_start,
        "backends": {},
        "notes": [],
    }
    say(
        f"backends {', '.join(a.backends)}; {a.items:,} items x {a.dim}; {a.write_rows:,} rows "
        f"written in batches of {a.batch_size:,}; searches at {100 * a.upgraded:.0f} % "
        f"upgraded; {os.cpu_count()} cores, load average {load_at_start:.1f}; stores in {work}"
    )
    try:
        for backend in a.backends:
            report["backends"][backend] = run_backend(a, backend, work)
            if backend == "milvus" and report["backends"][backend]["items"] != a.items:
                report["notes"].append(
                    f"Milvus Lite ran at {report['backends'][backend]['items']:,} items, not "
                    f"{a.items:,} (--milvus-items)."
                )
    finally:
        if not a.keep_work:
            shutil.rmtree(work, ignore_errors=True)
    report["load_at_end"] = os.getloadavg()[0]
    md = report_markdown(report)
    with open(os.path.join(a.out, "results.json"), "w") as fh:
        json.dump(report, fh, indent=1, default=str)
    with open(os.path.join(a.out, "results.md"), "w") as fh:
        fh.write(md)
    print(md, flush=True)
    say(f"wrote {a.out}/results.md and results.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
