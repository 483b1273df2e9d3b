"""Cost of an exact backfill curve on Ray, streamed from parquet, against one exact faiss search.

Writes a synthetic gallery (default 10M items, 1,000 queries, 128 dims, 5 planted positives
per query, the rest distractors) as parquet shards -- outside the timed part, and reused when
DIR already holds a dataset written with the same parameters (DIR/_bench.json).  Then, in one
process, it measures:

1. the float32 matrix-multiply rate (torch 2048^3: all threads, one thread, and CUDA if any);
2. one exact faiss top-k search (k=100) of the new queries over the new gallery vectors,
   streamed row group by row group (the top-k merged with ``faiss.ResultHeap``), reading and
   searching timed apart;
3. the 21-point curve with the distributed path (``ParquetGallery.open`` +
   ``simulate_backfill_dataset`` on a local Ray), the old-old NFR reference pass included;

and prints the curve's wall time, its ratio to the faiss search (goal <= 3.5), the peak PSS of
the driver, of the largest Ray process and of all of them summed (goal < 4 GiB), the bytes
read per second, and a projection for 1B items on N GPU nodes from the measured block rates
(docs/architecture.md, "Distributed backfill simulation").  ``--compare-memory`` also runs the
in-memory path (``load_parquet`` + ``simulate_backfill``) and checks the curves are equal.

    python bench/curve_eval_large.py --parquet /data/cel10m                 # 10M items
    python bench/curve_eval_large.py --items 1000000 --parquet /tmp/cel_1m --compare-memory
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from curve_eval import matmul_rate, timed  # noqa: E402

from raycompat.embeddings.vector_parquet import write_options  # noqa: E402
from raycompat.simulator.reference_cache import ReferenceCache  # noqa: E402

W = 46  # width of the table's first column


# ----------------------------------------------------------------------------- data
def _unit(a: np.ndarray) -> np.ndarray:
    a /= np.linalg.norm(a, axis=1, keepdims=True)
    return a


def _params(o) -> dict:
    return {"items": o.items, "queries": o.queries, "dim": o.dim, "positives": o.positives,
            "rows_per_file": o.rows_per_file, "row_group": o.row_group, "seed": o.seed,
            "hardest_rank": o.hardest_rank, "vector_pages": "plain",
            **({"candidates": o.candidates} if o.candidates > 1 else {})}  # fmt: skip


def candidate_columns(o) -> dict[str, str]:
    """The candidates' new-vector columns: ``new``, then ``new_2`` .. ``new_<--candidates>``."""
    return {f"c{i}": "new" if i == 1 else f"new_{i}" for i in range(1, o.candidates + 1)}


def _weakest_signal(dim: int, hardest_rank: float) -> float:
    """The weakest positive's signal ``a`` (its vector is ``unit(noise + a sqrt(D) centre)``)
    whose expected old-old score sits at the ``1 - hardest_rank`` quantile of the distractors'
    scores: the hardest positives rank about ``hardest_rank`` deep, at every dimension.

    An old query keeps ``1/sqrt(1 + 1.5^2)`` of its centre, so that score is
    ``0.555 a / sqrt(1 + a^2)``; a distractor's score is about ``N(0, 1/D)``."""
    from statistics import NormalDist

    c = NormalDist().inv_cdf(1.0 - hardest_rank) / (np.sqrt(1.0 + 1.5**2) ** -1 * np.sqrt(dim))
    if not 0 < c < 1:
        raise SystemExit(f"--hardest-rank {hardest_rank} is not reachable at {dim} dims")
    return float(c / np.sqrt(1.0 - c * c))


def _plant(n: int, nq: int, dim: int, positives: int, seed: int, hardest_rank: float):
    """Query-sized parts of bench/curve_eval.py's make_data: class centres, the positives'
    items (sorted), labels and signal strengths (the hardest about ``hardest_rank`` deep in the
    old-old ranking, :func:`_weakest_signal`), the old and new queries."""
    rng = np.random.default_rng(seed)
    centers = _unit(rng.standard_normal((nq, dim), dtype=np.float32))
    n_pos = min(n, nq * positives)
    items = np.sort(rng.choice(n, n_pos, replace=False))
    labels = rng.permutation(np.repeat(np.arange(nq), positives)[:n_pos])
    low = _weakest_signal(dim, hardest_rank)
    strength = (low + 0.6 * rng.random(n_pos)).astype(np.float32) * np.float32(np.sqrt(dim))
    noise = rng.standard_normal((nq, dim), dtype=np.float32) / np.float32(np.sqrt(dim))
    extra = rng.standard_normal((nq, dim), dtype=np.float32) / np.float32(np.sqrt(dim))
    q_old, q_new = _unit(centers + 1.5 * noise), _unit(centers + noise + 0.6 * extra)
    return centers, items, labels, strength, q_old, q_new


def _gallery_chunk(plant, s: int, e: int, dim: int, seed: int):
    """Old and new vectors and labels of gallery items ``s:e`` (positives carry a class signal,
    stronger in the new model), generated 64K rows at a time."""
    centers, items, labels, strength, _, _ = plant
    rng = np.random.default_rng([seed, s])
    old = rng.standard_normal((e - s, dim), dtype=np.float32)
    new = np.empty_like(old)
    for a in range(0, e - s, 1 << 16):
        b = min(e - s, a + (1 << 16))
        new[a:b] = 0.6 * old[a:b] + 0.8 * rng.standard_normal((b - a, dim), dtype=np.float32)
    lo, hi = np.searchsorted(items, [s, e])
    local, lab = items[lo:hi] - s, labels[lo:hi]
    gl = np.full(e - s, -1, dtype=np.int64)
    gl[local] = lab
    old[local] += strength[lo:hi, None] * centers[lab]
    new[local] += 1.3 * strength[lo:hi, None] * centers[lab]
    return _unit(old), _unit(new), gl


def _table(ids, labels, split: str, old: np.ndarray, new: np.ndarray, others=()):
    """The rows; ``others``: further candidates' new vectors (columns ``new_2``, ...)."""
    import pyarrow as pa

    d = old.shape[1]
    vec = lambda a: pa.FixedSizeListArray.from_arrays(pa.array(a.reshape(-1)), d)  # noqa: E731
    return pa.table({
        "item_id": pa.array(ids, pa.int64()),
        "label": pa.array(labels, pa.int64()),
        "split": pa.array(np.full(len(ids), split, dtype=object), pa.string()),
        "old": vec(old),
        "new": vec(new),
        **{f"new_{i + 2}": vec(a) for i, a in enumerate(others)},
    })  # fmt: skip


def _other_candidates(new: np.ndarray, count: int, seed: int, s: int) -> list[np.ndarray]:
    """Further candidates' new vectors: the first candidate's, perturbed (seeded per chunk)."""
    rng = np.random.default_rng([seed, s, 2])
    scale = np.float32(0.3 / np.sqrt(new.shape[1]))
    return [_unit(new + scale * rng.standard_normal(new.shape, dtype=np.float32))
            for _ in range(count)]  # fmt: skip


def write_dataset(o) -> float:
    """The shards (queries first, in the first file), one file's rows in memory at a time."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    t0 = time.perf_counter()
    n, nq, d = o.items, o.queries, o.dim
    plant = _plant(n, nq, d, o.positives, o.seed, o.hardest_rank)
    for f, s in enumerate(range(0, n, o.rows_per_file)):
        e = min(n, s + o.rows_per_file)
        old, new, gl = _gallery_chunk(plant, s, e, d, o.seed)
        others = _other_candidates(new, o.candidates - 1, o.seed, s)
        t = _table(np.arange(s, e), gl, "gallery", old, new, others)
        if f == 0:
            q_others = _other_candidates(plant[5], o.candidates - 1, o.seed, n + 1)
            q = _table(n + np.arange(nq), np.arange(nq), "query", plant[4], plant[5], q_others)
            t = pa.concat_tables([q, t])
        pq.write_table(t, os.path.join(o.parquet, f"part-{f:05d}.parquet"),
                       row_group_size=o.row_group, **write_options(t.schema))  # fmt: skip
        del old, new, t, others
    with open(os.path.join(o.parquet, "_bench.json"), "w") as fh:
        json.dump(_params(o), fh)
    return time.perf_counter() - t0


def prepare_dataset(o) -> float | None:
    """Write the shards unless DIR holds this dataset; seconds spent writing (None: reused)."""
    meta = os.path.join(o.parquet, "_bench.json")
    if os.path.exists(meta):
        with open(meta) as fh:
            if json.load(fh) == _params(o):
                return None
    if os.path.isdir(o.parquet) and os.listdir(o.parquet):
        if not o.overwrite:
            sys.exit(f"error: {o.parquet} holds something else (see {meta}); pass --overwrite")
        shutil.rmtree(o.parquet)
    os.makedirs(o.parquet, exist_ok=True)
    return write_dataset(o)


# ----------------------------------------------------------------------------- memory
def _pss(pid: int) -> int:
    """Proportional set size of a process in bytes (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _descendants(root: int) -> list[int]:
    """``root`` and every process under it: the embedded Ray's gcs_server, raylet, dashboard
    and (children of the raylet) its workers -- nothing another run started."""
    children: dict[int, list[int]] = {}
    for p in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(p) as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(p.split("/")[2]))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def _kind(pid: int) -> str:
    """driver, worker (a Ray task worker), or the process's name (raylet, gcs_server, ...)."""
    if pid == os.getpid():
        return "driver"
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return "gone"
    name = argv[0].decode(errors="replace").split(" ")[0]
    if name.startswith("ray::"):
        return name if name.endswith("Agent") else "worker"
    is_worker = any(a.endswith(b"default_worker.py") for a in argv[1:3])
    return "worker" if is_worker else os.path.basename(name) or "?"


class PssSampler:
    """Samples every 0.2 s the PSS of this process and of every process under it."""

    def __enter__(self):
        self.peak_sum, self.peak, self.kinds = 0, {}, {}
        self.start = _pss(os.getpid())  # the driver's when sampling starts
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _sample(self) -> None:
        total = 0
        for pid in _descendants(os.getpid()):
            v = _pss(pid)
            total += v
            if v > self.peak.get(pid, 0):
                self.peak[pid] = v
                self.kinds.setdefault(pid, _kind(pid))
        self.peak_sum = max(self.peak_sum, total)

    def _run(self):
        while not self._stop.wait(0.2):
            self._sample()

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self._sample()

    def summary(self) -> dict:
        workers = [v for p, v in self.peak.items() if self.kinds.get(p) == "worker"]
        others = {f"{self.kinds[p]}/{p}": v for p, v in self.peak.items() if p != os.getpid()}
        return {"peak_sum": self.peak_sum, "driver": self.peak.get(os.getpid(), 0),
                "driver_start": self.start, "largest_worker": max(workers, default=0),
                "workers": len(workers), "per_process": others}  # fmt: skip


# ----------------------------------------------------------------------------- faiss baseline
def _row_groups(path: str):
    import pyarrow.parquet as pq

    for f in sorted(glob.glob(os.path.join(path, "*.parquet"))):
        pf = pq.ParquetFile(f)
        for i in range(pf.num_row_groups):
            yield pf, i


def _read_new(pf, i: int, want_query: bool) -> np.ndarray:
    """The 'new' vectors of the gallery (or query) rows of one row group, float32 [n, D]."""
    import pyarrow.compute as pc

    t = pf.read_row_group(i, columns=["new", "split"])
    col = t.column("new").combine_chunks()
    vec = col.flatten().to_numpy().reshape(len(col), -1)
    is_q = pc.equal(t.column("split"), "query").to_numpy(zero_copy_only=False)
    return vec[is_q if want_query else ~is_q]


def read_queries(path: str, nq: int) -> np.ndarray:
    parts, got = [], 0
    for pf, i in _row_groups(path):
        parts.append(_read_new(pf, i, True))
        got += len(parts[-1])
        if got >= nq:
            break
    return np.ascontiguousarray(np.concatenate(parts))


def faiss_stream(path: str, queries: np.ndarray, k: int) -> dict:
    """Exact top-k inner product over every gallery row, one row group at a time."""
    import faiss

    heap = faiss.ResultHeap(queries.shape[0], k, keep_max=True)
    t_read = t_search = 0.0
    offset = 0
    for pf, i in _row_groups(path):
        t0 = time.perf_counter()
        g = np.ascontiguousarray(_read_new(pf, i, False))
        t1 = time.perf_counter()
        if len(g):
            dist, idx = faiss.knn(queries, g, min(k, len(g)), metric=faiss.METRIC_INNER_PRODUCT)
            heap.add_result(dist, np.where(idx >= 0, idx + offset, -1))
        offset += len(g)
        t_read, t_search = t_read + t1 - t0, t_search + time.perf_counter() - t1
    t0 = time.perf_counter()
    heap.finalize()
    search_s = t_search + time.perf_counter() - t0
    return {"read_s": t_read, "search_s": search_s, "items": offset, "ids": heap.I.copy()}


def _same_rows(a: np.ndarray, b: np.ndarray) -> float:
    """Fraction of queries whose top-k id sets agree (ties at the k-th score may differ)."""
    return float(np.mean([set(x) == set(y) for x, y in zip(a, b, strict=True)]))


def torch_stream(path: str, queries: np.ndarray, k: int) -> dict:
    """The same exact top-k with torch: one blockwise matmul per row group (all threads) and a
    running top-k merged by ``torch.topk`` over the previous best and the block's best."""
    q = torch.from_numpy(queries)
    best_s = torch.full((len(q), k), -float("inf"))
    best_i = torch.full((len(q), k), -1, dtype=torch.int64)
    t_read = t_search = 0.0
    offset = 0
    for pf, i in _row_groups(path):
        t0 = time.perf_counter()
        g = torch.from_numpy(np.ascontiguousarray(_read_new(pf, i, False)))
        t1 = time.perf_counter()
        if len(g):
            scores, idx = torch.topk(q @ g.t(), min(k, len(g)), dim=1)
            s = torch.cat([best_s, scores], dim=1)
            ids = torch.cat([best_i, idx + offset], dim=1)
            best_s, where = torch.topk(s, k, dim=1)
            best_i = torch.gather(ids, 1, where)
        offset += len(g)
        t_read, t_search = t_read + t1 - t0, t_search + time.perf_counter() - t1
    return {"read_s": t_read, "search_s": t_search, "items": offset, "ids": best_i.numpy()}


def baseline(res: dict) -> dict:
    """The faster of the two exact streamed searches (issue: a weak BLAS must not flatter)."""
    name = min(("faiss", "torch"), key=lambda n: res[n]["search_s"])
    return {"name": name, **{k: res[name][k] for k in ("search_s", "read_s")}}


# ----------------------------------------------------------------------------- the curves
def run_distributed(o, cache=None):
    """One simulate_backfill_dataset run (Ray started and stopped around it); ``cache``: the
    :class:`ReferenceCache` it stores its old-old reference in, or reuses it from."""
    import ray

    from raycompat.embeddings.dataset import ParquetGallery
    from raycompat.simulator.ray_engine import DistributedOptions, simulate_backfill_dataset

    ray.init(address="local", num_cpus=o.cpus, logging_level="warning")
    with PssSampler() as mem:
        t_open, ds = timed(ParquetGallery.open, o.parquet)
        opts = DistributedOptions(max_in_flight=o.max_in_flight)
        extra = {} if o.block_mb is None else {"block_bytes": int(o.block_mb * 2**20)}
        t_sim, r = timed(
            simulate_backfill_dataset,
            ds,
            [o.policy],
            [o.mode],
            k=o.k,
            progress=print,
            options=opts,
            reference_cache=cache,
            **extra,
        )
    ray.shutdown()
    return {"open_s": t_open, "simulate_s": t_sim, "memory": mem.summary()}, r


def pyarrow_read(path: str, threads: bool) -> dict:
    """pyarrow's own read of every gallery row group's ``old`` and ``new`` columns to float32
    ``[n, D]`` arrays in this process: on one thread (what a score task, which holds one CPU,
    can do) or on pyarrow's whole thread pool (``threads``)."""
    import pyarrow as pa

    t_read, nbytes = 0.0, 0
    for pf, i in _row_groups(path):
        t0 = time.perf_counter()
        t = pf.read_row_group(i, columns=["old", "new"], use_threads=threads)
        for name in ("old", "new"):
            flat = t.column(name).combine_chunks().flatten().to_numpy(zero_copy_only=False)
            nbytes += flat.astype(np.float32, copy=False).nbytes
        t_read += time.perf_counter() - t0
    n_threads = pa.cpu_count() if threads else 1
    return {"read_s": t_read, "float32_bytes": nbytes, "bytes_per_s": nbytes / t_read,
            "threads": n_threads}  # fmt: skip


def run_candidates(o, cache, base: dict, one_wall: float) -> dict:
    """Every candidate of the dataset in one pass (the old-old reference from ``cache``); what
    each candidate after the first adds to ``one_wall`` (one candidate, the reference reused),
    as a ratio to the faster search, reading included."""
    import ray

    from raycompat.embeddings.dataset import ParquetGallery
    from raycompat.simulator.ray_candidates import simulate_candidates_dataset
    from raycompat.simulator.ray_engine import DistributedOptions

    ray.init(address="local", num_cpus=o.cpus, logging_level="warning")
    with PssSampler() as mem:
        t0 = time.perf_counter()
        ds = ParquetGallery.open(o.parquet)
        results = simulate_candidates_dataset(
            ds, candidate_columns(o), [o.policy], [o.mode], k=o.k, progress=print,
            options=DistributedOptions(max_in_flight=o.max_in_flight), reference_cache=cache,
        )  # fmt: skip
        wall = time.perf_counter() - t0
    ray.shutdown()
    search = base["search_s"] + base["read_s"]
    r = next(iter(results.values()))
    return {
        "candidates": len(results),
        "wall_s": wall,
        "ratio_incl_reading": wall / search,
        "added_per_candidate_incl_reading": (wall - one_wall) / (len(results) - 1) / search,
        "peak_sum": mem.summary()["peak_sum"],
        "score_s": r.stats["distributed"]["steps"]["score"]["seconds"],
        "cache": r.stats.get("reference_cache", {}).get("state"),
    }


def repeated_run(o, cache, base: dict) -> dict:
    """The same curve again, reusing the old-old reference the first run stored."""
    cv, r = run_distributed(o, cache)
    wall = cv["open_s"] + cv["simulate_s"]
    return {
        "wall_s": wall,
        "cache": r.stats["reference_cache"]["state"],
        "ratio": wall / base["search_s"],
        "ratio_incl_reading": wall / (base["search_s"] + base["read_s"]),
        "sides": sorted(r.stats["engine"]["sides"]),
        "peak_sum": cv["memory"]["peak_sum"],
    }


def _differences(a, b) -> list[str]:
    """The curve metrics and reference values that are not equal (NaN equal to NaN)."""
    same = lambda x, y: np.array_equal(x, y, equal_nan=True)  # noqa: E731
    out = [f"{c.label} {m}" for c in a.curves for m in c.metrics
           if not same(c.metrics[m], b.curve(c.policy, c.mode).metrics[m])]  # fmt: skip
    out += [f"reference {n} {m}" for n, v in a.references.items() for m in v
            if not same(v[m], b.references.get(n, {}).get(m, np.nan))]  # fmt: skip
    return out


def run_in_memory(o, dist) -> dict:
    """load_parquet + simulate_backfill on the same shards; every value equal to ``dist``'s."""
    from raycompat.embeddings.gallery import load_parquet
    from raycompat.simulator.memory_engine import simulate_backfill

    with PssSampler() as mem:
        t_load, data = timed(load_parquet, o.parquet)
        t_sim, r = timed(simulate_backfill, data, [o.policy], [o.mode], k=o.k)
    del data
    diff = _differences(dist, r)
    return {"load_s": t_load, "simulate_s": t_sim, "memory": mem.summary(), "differ": diff}


# ----------------------------------------------------------------------------- projection
def projection(o, res: dict, r) -> dict:
    """1B items on ``--nodes-for-projection`` GPU nodes: max(compute, read) per item / nodes."""
    dist = r.stats["distributed"]
    n, sides = r.n_items, len(r.stats["engine"]["sides"])
    flop = sides * 2.0 * r.n_queries * o.dim  # useful matmul per item
    gpu = any(str(x).startswith("cuda") for x in dist["devices"])
    rate = n / dist["task_seconds"]["score_total"]  # items per task-second
    gflops = rate * flop / 1e9
    frac = gflops / res["matmul_gflops_cuda" if gpu else "matmul_gflops_1thread"]
    if o.gpu_items_per_s or gpu:
        compute = 1.0 / (o.gpu_items_per_s or rate)
        how = "GPU block rate " + ("given (--gpu-items-per-s)" if o.gpu_items_per_s else "measured")
    else:
        compute = flop / (frac * o.gpu_matmul_tflops * 1e12)
        how = (f"assumed: the CPU block pass's {frac:.3f} of the matmul rate, kept on a GPU "
               f"of {o.gpu_matmul_tflops:g} TFLOP/s float32 (--gpu-matmul-tflops)")  # fmt: skip
    read = dist["bytes_read"] / n / (o.read_gb_per_s_per_node * 1e9)
    hours = lambda per_item: 1e9 * per_item / o.nodes_for_projection / 3600.0  # noqa: E731
    return {"sides": sides, "device": "cuda" if gpu else "cpu", "items_per_task_s": rate,
            "task_gflops": gflops, "fraction_of_matmul": frac, "compute_how": how,
            "compute_hours": hours(compute), "read_hours": hours(read),
            "bytes_per_item": dist["bytes_read"] / n, "nodes": o.nodes_for_projection,
            "hours_1b": hours(max(compute, read)),
            "bound": "compute" if compute >= read else "read"}  # fmt: skip


# ----------------------------------------------------------------------------- report
def _line(name: str, text: str) -> None:
    print(f"{name:<{W}} {text}")


def print_measured(o, res: dict, r) -> None:
    gib, mib = 2.0**30, 2.0**20
    dist, cv, fs, m = r.stats["distributed"], res["curve"], res["faiss"], res["curve"]["memory"]
    print(f"curve_eval_large: {r.n_items:,} items x {r.n_queries:,} queries x {o.dim} dims, "
          f"{o.positives} positives/query, k={o.k}, {o.policy} / {o.mode}, {o.cpus} Ray CPUs, "
          f"{len(dist['blocks_per_node'])} node(s), devices {dist['devices']}")  # fmt: skip
    cuda = f", CUDA {res['matmul_gflops_cuda']:.0f}" if "matmul_gflops_cuda" in res else ""
    _line("matmul rate (torch float32 2048^3)",
          f"{res['matmul_gflops']:10.1f} GFLOP/s ({res['matmul_gflops_1thread']:.1f} one thread"
          f"{cuda})")  # fmt: skip
    ts, base = res["torch"], res["baseline"]
    _line("exact top-k search (faiss, streamed)",
          f"{fs['search_s']:10.2f} s   (+{fs['read_s']:.2f} s reading parquet)")  # fmt: skip
    _line("exact top-k search (torch matmul + topk)",
          f"{ts['search_s']:10.2f} s   (+{ts['read_s']:.2f} s reading parquet); same top-k "
          f"ids: {res['same_ids']:.4f} of rows")  # fmt: skip
    _line("21-point curve on Ray, NFR reference incl.",
          f"{cv['wall_s']:10.2f} s   (open {cv['open_s']:.2f} s + simulate "
          f"{cv['simulate_s']:.2f} s)")  # fmt: skip
    _line(f"ratio to the faster search ({base['name']}), excl. reading",
          f"{cv['ratio']:10.2f}     (goal <= 3.5); incl. reading "
          f"{cv['ratio_incl_reading']:.2f} (goal <= 4)")  # fmt: skip
    _line(
        "  against faiss / torch, excl. reading",
        f"{cv['wall_s'] / fs['search_s']:10.2f} / {cv['wall_s'] / ts['search_s']:.2f}",
    )
    _line("curve's useful matmul rate",
          f"{cv['useful_gflops']:10.1f} GFLOP/s = {cv['fraction_of_matmul']:.3f} of the "
          f"all-thread matmul rate ({cv['sides']} sides x 2 x Q x D per item)")  # fmt: skip
    for step, st in dist["steps"].items():
        _line(f"  step {step}", f"{st['seconds']:10.2f} s   {st['tasks']} blocks, "
              f"{st['items']:,} items")  # fmt: skip
    _line("peak PSS, all processes summed",
          f"{m['peak_sum'] / gib:10.2f} GiB (goal < 4 GiB); driver {m['driver'] / mib:.0f} MiB "
          f"({m['driver_start'] / mib:.0f} at the start), "
          f"largest of {m['workers']} workers {m['largest_worker'] / mib:.0f} MiB")  # fmt: skip
    _line("read from disk (score step)",
          f"{dist['bytes_per_s'] / mib:10.1f} MiB/s compressed; {cv['vector_mb_per_s']:.1f} MiB/s "
          f"of float32 vectors; {dist['items_per_s']:,.0f} items/s")  # fmt: skip
    pa_rate, task_rate = res["pyarrow_read"]["bytes_per_s"], dist["read_float32_bytes_per_task_s"]
    pa_all = res["pyarrow_read_threads"]["bytes_per_s"]
    _line("read per second of reading (one core)",
          f"{task_rate / mib:10.1f} MiB/s of float32 in the score tasks; pyarrow's own read of "
          f"the same row groups on one thread {pa_rate / mib:.1f} MiB/s: ratio "
          f"{task_rate / pa_rate:.2f} (goal >= 0.8)")  # fmt: skip
    n_threads = res["pyarrow_read_threads"]["threads"]
    _line("  pyarrow on all its threads",
          f"{pa_all / mib:10.1f} MiB/s ({n_threads} threads); the tasks' read against it "
          f"{task_rate / pa_all:.2f}")  # fmt: skip
    if "multi" in res:
        mu = res["multi"]
        _line(f"{mu['candidates']} candidates in one pass",
              f"{mu['wall_s']:10.2f} s   ratio incl. reading {mu['ratio_incl_reading']:.2f}; each "
              f"candidate after the first adds {mu['added_per_candidate_incl_reading']:.2f} "
              f"(goal <= 2.5); peak PSS {mu['peak_sum'] / gib:.2f} GiB (goal < 4 GiB); old-old "
              f"reference: {mu['cache']}")  # fmt: skip
        _line("  its score step (one read per row group)", f"{mu['score_s']:10.2f} s")
    rp = res["repeated"]
    _line("repeated run, old-old reference reused",
          f"{rp['wall_s']:10.2f} s   ratio {rp['ratio']:.2f} (goal <= 3), incl. reading "
          f"{rp['ratio_incl_reading']:.2f}; cache {rp['cache']}; sides {', '.join(rp['sides'])}; "
          f"peak PSS {rp['peak_sum'] / gib:.2f} GiB")  # fmt: skip
    nodes = dist["blocks_per_node"].items()
    _line("blocks per node", ", ".join(f"{k[:12]}: {v}" for k, v in nodes))
    _line("scores at/above a query's lowest threshold",
          ", ".join(f"{s}: {100.0 * st['survivors'] / (r.n_items * r.n_queries):.3f}%"
                    for s, st in r.stats["engine"]["sides"].items()))  # fmt: skip


def print_compared(res: dict) -> None:
    im, wall = res["in_memory"], res["curve"]["wall_s"]
    _line("in-memory path (load_parquet + simulate)",
          f"{im['load_s'] + im['simulate_s']:10.2f} s   (load {im['load_s']:.2f} s + simulate "
          f"{im['simulate_s']:.2f} s; peak PSS {im['memory']['peak_sum'] / 2**30:.2f} GiB); "
          f"distributed {wall:.2f} s; equal: {'yes' if not im['differ'] else 'NO'}")  # fmt: skip


def print_projection(o, p: dict, nq: int) -> None:
    print(f"PROJECTION (not measured) for 1,000,000,000 items x {nq:,} queries x {o.dim} dims "
          f"on {p['nodes']} GPU nodes: {p['hours_1b']:.3g} h ({p['bound']}-bound)")  # fmt: skip
    print(f"  {p['device']} block pass: {p['items_per_task_s']:,.0f} items/task-second = "
          f"{p['task_gflops']:.1f} GFLOP/s of useful matmul ({p['sides']} sides x 2 x Q x D per "
          f"item) = {p['fraction_of_matmul']:.3f} of the "
          f"{'CUDA' if p['device'] == 'cuda' else 'one-thread'} matmul rate")  # fmt: skip
    print(f"  compute bound {p['compute_hours']:.3g} h ({p['compute_how']}); read bound "
          f"{p['read_hours']:.3g} h ({p['bytes_per_item']:.0f} B/item at "
          f"{o.read_gb_per_s_per_node:g} GB/s per node); the driver holds ~24 B/item "
          f"(labels, ids, order): ~24 GB at 1B")  # fmt: skip


# ----------------------------------------------------------------------------- main
def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in (("--items", 10_000_000), ("--queries", 1000), ("--dim", 128),
                          ("--positives", 5), ("--rows-per-file", 500_000),
                          ("--row-group", 65_536), ("--k", 100), ("--seed", 0),
                          ("--cpus", os.cpu_count()), ("--nodes-for-projection", 8),
                          ("--candidates", 1)):  # fmt: skip
        ap.add_argument(name, type=int, default=default)
    ap.add_argument("--parquet", required=True, help="folder of the shards (written or reused)")
    ap.add_argument("--overwrite", action="store_true", help="replace DIR's other contents")
    ap.add_argument("--policy", default="random")
    ap.add_argument("--mode", default="compatible")
    ap.add_argument("--compare-memory", action="store_true", help="also run the in-memory path")
    ap.add_argument("--out", default=None, help="also write the numbers to this JSON file")
    ap.add_argument("--gpu-items-per-s", type=float, default=None, help="measured GPU rate")
    ap.add_argument("--gpu-matmul-tflops", type=float, default=50.0)
    ap.add_argument("--read-gb-per-s-per-node", type=float, default=2.0)
    ap.add_argument("--hardest-rank", type=float, default=0.01,
                    help="the weakest planted positives rank about this fraction deep")  # fmt: skip
    ap.add_argument("--block-mb", type=float, default=None,
                    help="score block budget in MiB (default: the engine's)")  # fmt: skip
    ap.add_argument("--max-in-flight", type=int, default=None,
                    help="block tasks in flight (default: twice the Ray CPUs)")  # fmt: skip
    return ap.parse_args(argv)


def measure_matmul(res: dict) -> None:
    cpu = torch.device("cpu")
    res["matmul_gflops"] = matmul_rate(cpu)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    res["matmul_gflops_1thread"] = matmul_rate(cpu)
    torch.set_num_threads(threads)
    if torch.cuda.is_available():
        res["matmul_gflops_cuda"] = matmul_rate(torch.device("cuda"))


def main(argv=None) -> int:
    o = parse(argv)
    res: dict = {"params": _params(o), "write_s": prepare_dataset(o)}
    print(f"dataset: {o.parquet} ({'reused' if res['write_s'] is None else 'written'})")
    measure_matmul(res)
    queries = read_queries(o.parquet, o.queries)
    res["faiss"] = faiss_stream(o.parquet, queries, o.k)
    res["torch"] = torch_stream(o.parquet, queries, o.k)
    res["same_ids"] = _same_rows(res["faiss"].pop("ids"), res["torch"].pop("ids"))
    res["baseline"] = base = baseline(res)
    res["pyarrow_read"] = pyarrow_read(o.parquet, threads=False)
    res["pyarrow_read_threads"] = pyarrow_read(o.parquet, threads=True)
    with tempfile.TemporaryDirectory() as folder:
        cache = ReferenceCache(folder, print)
        cv, r = run_distributed(o, cache)
        res["repeated"] = repeated_run(o, cache, base)
        if o.candidates > 1:
            res["multi"] = run_candidates(o, cache, base, res["repeated"]["wall_s"])
    cv["wall_s"] = cv["open_s"] + cv["simulate_s"]
    cv["ratio"] = cv["wall_s"] / base["search_s"]
    cv["ratio_incl_reading"] = cv["wall_s"] / (base["search_s"] + base["read_s"])
    cv["sides"] = len(r.stats["engine"]["sides"])
    useful = cv["sides"] * 2.0 * r.n_queries * o.dim * r.n_items
    cv["useful_gflops"] = useful / cv["wall_s"] / 1e9
    cv["fraction_of_matmul"] = cv["useful_gflops"] / res["matmul_gflops"]
    score_s = r.stats["distributed"]["steps"]["score"]["seconds"]
    cv["vector_mb_per_s"] = r.n_items * o.dim * 4 * 2 / score_s / 2**20
    cv["stats"] = r.stats["distributed"]
    cv["engine_sides"] = r.stats["engine"]["sides"]
    res["curve"] = cv
    if o.compare_memory:
        res["in_memory"] = run_in_memory(o, r)
    res["projection"] = projection(o, res, r)
    print_measured(o, res, r)
    if o.compare_memory:
        print_compared(res)
    print_projection(o, res["projection"], r.n_queries)
    if o.out:
        with open(o.out, "w") as f:
            json.dump(res, f, indent=2, default=str)
        print(f"json: {o.out}")
    if res.get("in_memory", {}).get("differ"):
        print(f"FAIL: the paths differ in {res['in_memory']['differ']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
