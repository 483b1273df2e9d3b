"""Cost of an exact backfill curve against one exact full-gallery search, on the same data.

Synthetic gallery (default 1M items, 1,000 queries, 256 dims; each query has a handful of
positives, the rest are distractors; old and new embeddings correlated, the new model
better).  In one process it measures:

1. the machine's float32 matrix-multiply rate (torch, 2048^3, best of 3);
2. one exact top-k search of the full gallery (k=100) with the blockwise torch code the
   curve engine uses (``raycompat.index.blocks.exact_topk``), and with in-process faiss
   ``IndexFlatIP`` for reference;
3. the whole 21-point and 101-point curves (one policy x one mode) with mAP@100, full mAP,
   top-1 and NFR@1 at every point (``raycompat.simulator.memory_engine.simulate_backfill``);

and prints  curve time / search time, against the faster of the two exact searches (goals:
<= 2.5 for 21 points, <= 5 for 101 points), the filter and count's thread-seconds against the
matrix products' (goal: at most half), the 21-point curve with the fused survivor kernel and
with the torch filter and count side by side (``raycompat.simulator.fused_kernel``),
the search's GFLOP/s as a fraction of the matmul rate (goal: >= 0.7), the peak RSS of the
process and the extra RSS while each curve runs (it must not grow with the grid).

NFR@1 needs top-1 correctness under old-old: a property of the gallery shared by every
policy and mode, computed once and timed separately ("old-old reference"); the curve
ratios exclude it and a second ratio includes it.

    python bench/curve_eval.py                      # full size (about 2.5 GB of embeddings)
    python bench/curve_eval.py --items 100000       # quick check
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from raycompat.embeddings.gallery import GalleryEmbeddings
from raycompat.index.blocks import exact_topk, fp32_matmul, resolve_device  # noqa: E402
from raycompat.metrics.rank_metrics import metrics_from_ranks  # noqa: E402
from raycompat.simulator.assembly import compute_ranks  # noqa: E402
from raycompat.simulator.memory_engine import simulate_backfill
from raycompat.simulator.rank_plan import CurveSpec  # noqa: E402
from raycompat.upgrade.score_sides import Side  # noqa: E402


# ----------------------------------------------------------------------------- data
def _unit_rows(a: np.ndarray) -> np.ndarray:
    a /= np.linalg.norm(a, axis=1, keepdims=True)
    return a


def make_data(n_items: int, n_queries: int, dim: int, positives: int, seed: int = 0):
    """float32 L2-normalised embeddings; labels: query q's positives have label q,
    distractors -1."""
    rng = np.random.default_rng(seed)
    centers = _unit_rows(rng.standard_normal((n_queries, dim), dtype=np.float32))
    n_pos = min(n_items, n_queries * positives)
    pos_items = np.sort(rng.choice(n_items, n_pos, replace=False))
    gl = np.full(n_items, -1, dtype=np.int64)
    gl[pos_items] = rng.permutation(np.repeat(np.arange(n_queries), positives)[:n_pos])
    g_old = np.empty((n_items, dim), dtype=np.float32)
    g_new = np.empty((n_items, dim), dtype=np.float32)
    chunk = 1 << 16
    for s in range(0, n_items, chunk):
        e = min(n_items, s + chunk)
        base = rng.standard_normal((e - s, dim), dtype=np.float32)
        g_old[s:e] = base
        g_new[s:e] = 0.6 * base + 0.8 * rng.standard_normal((e - s, dim), dtype=np.float32)
    # positives: class signal of varying strength (hard ones rank deep), stronger in the new model
    # signal-to-noise of a positive: from hard (rank ~1% of the gallery) to easy (rank 0)
    strength = (0.2 + 0.6 * rng.random(n_pos)).astype(np.float32) * np.sqrt(dim, dtype=np.float32)
    g_old[pos_items] += strength[:, None] * centers[gl[pos_items]]
    g_new[pos_items] += 1.3 * strength[:, None] * centers[gl[pos_items]]
    for a in (g_old, g_new):
        for s in range(0, n_items, chunk):
            _unit_rows(a[s : s + chunk])
    noise = rng.standard_normal((n_queries, dim), dtype=np.float32) / np.sqrt(dim, dtype=np.float32)
    q_old = _unit_rows(centers + 1.5 * noise)
    q_new = _unit_rows(
        centers
        + 1.0 * noise
        + 0.6
        * rng.standard_normal((n_queries, dim), dtype=np.float32)
        / np.sqrt(dim, dtype=np.float32)
    )
    return GalleryEmbeddings(
        gallery_labels=gl,
        query_labels=np.arange(n_queries),
        gallery_old=g_old,
        gallery_new=g_new,
        query_old=q_old,
        query_new=q_new,
        normalized=True,
        source="synthetic",
    )


# ----------------------------------------------------------------------------- memory
def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Samples the resident set size every 5 ms while the block runs."""

    def __enter__(self):
        self.base = rss_bytes()
        self.peak = self.base
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, rss_bytes())

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, rss_bytes())

    @property
    def extra(self) -> int:
        return self.peak - self.base


def timed(fn, *args, **kw):
    t0 = time.perf_counter()
    out = fn(*args, **kw)
    return time.perf_counter() - t0, out


# ----------------------------------------------------------------------------- parts
def matmul_rate(device, size: int = 2048, repeats: int = 3) -> float:
    a = torch.randn(size, size, device=device)
    b = torch.randn(size, size, device=device)
    best = float("inf")
    with fp32_matmul():
        for _ in range(repeats + 1):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            (a @ b).sum().item()
            if device.type == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
    return 2.0 * size**3 / best / 1e9


def faiss_search(q, g, k):
    import faiss

    t0 = time.perf_counter()
    index = faiss.IndexFlatIP(g.shape[1])
    index.add(g)
    t_add = time.perf_counter() - t0
    t0 = time.perf_counter()
    index.search(q, k)
    return t_add, time.perf_counter() - t0


def cached_runs(data, opts, dev, bb, t_search) -> dict:
    """The 21-point curve computing its own old-old reference into an empty reference cache
    (a first run), then again reusing it (a later run on the same old gallery)."""
    import tempfile

    from raycompat.simulator.reference_cache import ReferenceCache

    out = {}
    with tempfile.TemporaryDirectory() as folder:
        cache = ReferenceCache(folder)
        for run in ("first", "repeated"):
            t, r = timed(
                simulate_backfill,
                data,
                [opts.policy],
                [opts.mode],
                k=opts.k,
                seed=opts.seed,
                device=dev,
                reference_cache=cache,
                **bb,
            )
            state = r.stats["reference_cache"]["state"]
            out[run] = {"seconds": t, "ratio": t / t_search, "cache": state}
    return out


def pass_seconds(sides: dict) -> dict:
    """Thread-seconds of the matrix products and of the filter and count, summed over sides."""
    mm = sum(st["seconds_matmul"] for st in sides.values())
    fc = sum(st["seconds_filter"] + st["seconds_count"] for st in sides.values())
    return {"matmul": mm, "filter_count": fc, "fraction": fc / mm if mm else float("nan")}


def torch_filter_run(data, opts, dev, bb, ref_correct, t_search) -> dict:
    """The 21-point curve again with the torch filter and count (the fused kernel off)."""
    os.environ["RAYCOMPAT_FUSED_KERNEL"] = "0"
    try:
        t, r = timed(
            simulate_backfill,
            data,
            [opts.policy],
            [opts.mode],
            k=opts.k,
            seed=opts.seed,
            reference_correct=ref_correct,
            device=dev,
            **bb,
        )
    finally:
        del os.environ["RAYCOMPAT_FUSED_KERNEL"]
    sides = r.stats["engine"]["sides"]
    return {"seconds": t, "ratio": t / t_search, "threads": pass_seconds(sides)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--items", type=int, default=1_000_000)
    ap.add_argument("--queries", type=int, default=1000)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--positives", type=int, default=5, help="positives per query")
    ap.add_argument("--k", type=int, default=100)
    ap.add_argument("--policy", default="random")
    ap.add_argument("--mode", default="compatible")
    ap.add_argument("--device", default="auto")
    ap.add_argument(
        "--block-mb",
        type=float,
        default=None,
        help="score block budget in MiB for the search and the curves (default: the library's, "
        "8 for the search and 16 for the curve engine)",
    )
    ap.add_argument("--no-faiss", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="also write the numbers to this JSON file")
    opts = ap.parse_args(argv)
    dev = resolve_device(None if opts.device == "auto" else opts.device)
    bb = {} if opts.block_mb is None else {"block_bytes": int(opts.block_mb * 1024 * 1024)}
    n, nq, d = opts.items, opts.queries, opts.dim
    flops = 2.0 * n * nq * d
    res = {
        "items": n,
        "queries": nq,
        "dim": d,
        "k": opts.k,
        "policy": opts.policy,
        "mode": opts.mode,
        "device": str(dev),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }

    t_data, data = timed(make_data, n, nq, d, opts.positives, opts.seed)
    res["data_seconds"] = t_data
    res["rss_after_data_mb"] = rss_bytes() / 2**20

    res["matmul_gflops"] = matmul_rate(dev)
    t_search, _ = timed(exact_topk, data.query_new, data.gallery_new, opts.k, device=dev, **bb)
    res["search_seconds"] = t_search
    res["search_gflops"] = flops / t_search / 1e9
    if not opts.no_faiss:
        res["faiss_add_seconds"], res["faiss_search_seconds"] = faiss_search(
            data.query_new, data.gallery_new, opts.k
        )

    # the baseline: the faster of the two exact searches run here
    res["baseline"] = "torch"
    if res.get("faiss_search_seconds", float("inf")) < t_search:
        res["baseline"], t_search = "faiss", res["faiss_search_seconds"]
    res["baseline_seconds"] = t_search

    # old-old top-1 correctness (NFR reference): once per gallery, shared by every curve
    t_ref, rr = timed(
        compute_ranks,
        {"old-old": Side(data.query_old, data.gallery_old)},
        [CurveSpec("ref", "old-old", None, np.array([0]))],
        data.query_labels,
        data.gallery_labels,
        device=dev,
        **bb,
    )
    ref_correct = metrics_from_ranks(
        rr.curve("ref").ranks, rr.pairs_q, rr.npos, 1, return_per_query=True
    )[1]["correct1"][0]
    res["reference_seconds"] = t_ref

    curves = {}
    for step in (5.0, 1.0):
        with PeakRSS() as mem:
            t_curve, r = timed(
                simulate_backfill,
                data,
                [opts.policy],
                [opts.mode],
                grid_step=step,
                k=opts.k,
                seed=opts.seed,
                reference_correct=ref_correct,
                device=dev,
                **bb,
            )
        c = r.curves[0]
        pts = len(c.fractions)
        curves[pts] = {
            "seconds": t_curve,
            "ratio": t_curve / t_search,
            "ratio_with_reference": (t_curve + t_ref) / t_search,
            "extra_rss_mb": mem.extra / 2**20,
            "engine": {
                k: {kk: vv for kk, vv in v.items()} for k, v in r.stats["engine"]["sides"].items()
            },
            "values_at": {
                f"{100 * c.fractions[j]:g}%": {m: float(c.metrics[m][j]) for m in c.metrics}
                for j in (0, pts // 2, pts - 1)
            },
        }
    res["curves"] = curves
    res["torch_filter"] = torch_filter_run(data, opts, dev, bb, ref_correct, t_search)
    res["reference_cache"] = cached_runs(data, opts, dev, bb, t_search)
    res["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0

    # ------------------------------------------------------------------ table
    w = 44
    print(
        f"curve_eval: {n:,} items x {nq:,} queries x {d} dims, "
        f"{opts.positives} positives/query, k={opts.k}, "
        f"{opts.policy} / {opts.mode}, device {dev}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads"
    )
    print(f"{'matmul rate (torch float32 2048^3)':<{w}} {res['matmul_gflops']:10.1f} GFLOP/s")
    print(
        f"{'exact top-k search (blockwise torch)':<{w}} {t_search:10.2f} s   "
        f"{res['search_gflops']:.1f} GFLOP/s "
        f"= {res['search_gflops'] / res['matmul_gflops']:.2f} of the matmul rate (goal >= 0.7)"
    )
    if "faiss_search_seconds" in res:
        print(
            f"{'exact top-k search (faiss IndexFlatIP)':<{w}} "
            f"{res['faiss_search_seconds']:10.2f} s   "
            f"(+{res['faiss_add_seconds']:.2f} s add)"
        )
    print(
        f"{'baseline: the faster exact search':<{w}} {t_search:10.2f} s   ({res['baseline']}); "
        "every ratio below is against it"
    )
    print(f"{'old-old reference for NFR (once/gallery)':<{w}} {t_ref:10.2f} s")
    for pts, goal in ((21, 2.5), (101, 5)):
        cv = curves[pts]
        print(
            f"{f'{pts}-point curve (mAP@k, mAP, top-1, NFR@1)':<{w}} {cv['seconds']:10.2f} s   "
            f"ratio to search {cv['ratio']:.2f} (goal <= {goal}); "
            f"with the reference {cv['ratio_with_reference']:.2f}"
        )
    tf = res["torch_filter"]
    fused = pass_seconds(curves[21]["engine"])
    print(
        f"{'21-point curve, torch filter and count':<{w}} {tf['seconds']:10.2f} s   "
        f"ratio to search {tf['ratio']:.2f} (the fused kernel: {curves[21]['ratio']:.2f})"
    )
    for label, th in (("fused kernel", fused), ("torch filter", tf["threads"])):
        print(
            f"{f'  filter+count / matmul, {label}':<{w}} {th['fraction']:10.2f}     "
            f"({th['filter_count']:.2f} of {th['matmul']:.2f} thread-seconds; goal <= 0.5)"
        )
    for run, cr in res["reference_cache"].items():
        print(
            f"{f'21-point curve with NFR, {run} run':<{w}} {cr['seconds']:10.2f} s   "
            f"ratio to search {cr['ratio']:.2f} (reference cache: {cr['cache']})"
        )
    print(
        f"{'peak RSS of the process':<{w}} {res['peak_rss_mb']:10.0f} MiB (embeddings alone "
        f"{res['rss_after_data_mb']:.0f} MiB after generation)"
    )
    print(
        f"{'extra RSS while a curve runs':<{w}} "
        f"{curves[21]['extra_rss_mb']:10.1f} MiB (21 points), "
        f"{curves[101]['extra_rss_mb']:.1f} MiB (101 points)"
    )
    sides = curves[21]["engine"]
    print(
        f"{'scores at/above a query lowest threshold':<{w}} "
        + ", ".join(
            f"{name}: {100.0 * st['survivors'] / (n * nq):.2f}%" for name, st in sides.items()
        )
        + "  (the per-survivor work; the rest is matmul + one max-reduction)"
    )
    for name, st in sides.items():
        print(
            f"{f'  side {name} (21 points)':<{w}} {st['seconds']:10.2f} s   "
            f"{st.get('workers', 1)} worker(s); "
            f"thread-seconds: matmul {st['seconds_matmul']:.2f}, "
            f"filter {st['seconds_filter']:.2f}, "
            f"count {st['seconds_count']:.2f}"
        )
    v = curves[21]["values_at"]
    print(
        "values: "
        + "; ".join(
            f"t={t}: " + ", ".join(f"{m} {100 * x:.2f}" for m, x in vals.items())
            for t, vals in v.items()
        )
    )
    if opts.out:
        with open(opts.out, "w") as f:
            json.dump(res, f, indent=2)
        print(f"json: {opts.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
