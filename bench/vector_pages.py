"""How fast pyarrow reads embedding columns written two ways: as pyarrow writes them by default
(snappy, dictionary tried, statistics) and as raycompat writes them (plain float32 pages:
``raycompat.embeddings.vector_parquet.write_options``), on one thread and on pyarrow's thread pool.

Prints MiB/s of float32 read back to ``[n, D]`` arrays for each file and the ratio plain /
default (the baseline: pyarrow's default writer, read the same way in the same process).

    python bench/vector_pages.py            # 200,000 x 128, two columns, row groups of 100,000
    python bench/vector_pages.py --rows 1000000 --dim 256
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402

from raycompat.embeddings.vector_parquet import write_options  # noqa: E402


def make_table(rows: int, dim: int, seed: int):
    import pyarrow as pa

    rng = np.random.default_rng(seed)

    def vectors():
        flat = rng.standard_normal((rows, dim), dtype=np.float32).reshape(-1)
        return pa.FixedSizeListArray.from_arrays(pa.array(flat), dim)

    return pa.table(
        {
            "item_id": pa.array(np.arange(rows, dtype=np.int64)),
            "split": pa.array(["gallery"] * rows),
            "old": vectors(),
            "new": vectors(),
        }
    )


def read_rate(path: str, threads: bool, repeats: int) -> float:
    """Best MiB/s over ``repeats`` reads of every row group's ``old`` and ``new``."""
    import pyarrow.parquet as pq

    best = float("inf")
    nbytes = 0
    for _ in range(repeats):
        pf = pq.ParquetFile(path)
        t0, nbytes = time.perf_counter(), 0
        for i in range(pf.num_row_groups):
            t = pf.read_row_group(i, columns=["old", "new"], use_threads=threads)
            for name in ("old", "new"):
                flat = t.column(name).combine_chunks().flatten().to_numpy(zero_copy_only=False)
                nbytes += flat.nbytes
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 2**20


def main(argv=None) -> int:
    import pyarrow.parquet as pq

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--row-group", type=int, default=100_000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    o = ap.parse_args(argv)
    table = make_table(o.rows, o.dim, o.seed)
    with tempfile.TemporaryDirectory() as folder:
        paths = {"default": os.path.join(folder, "default.parquet"),
                 "plain": os.path.join(folder, "plain.parquet")}  # fmt: skip
        pq.write_table(table, paths["default"], row_group_size=o.row_group)
        pq.write_table(table, paths["plain"], row_group_size=o.row_group,
                       **write_options(table.schema))  # fmt: skip
        print(f"vector_pages: {o.rows:,} x {o.dim}, columns old and new, row groups of "
              f"{o.row_group:,}, best of {o.repeats}")  # fmt: skip
        rates = {}
        for name, path in paths.items():
            size = os.path.getsize(path) / 2**20
            rates[name] = {t: read_rate(path, t, o.repeats) for t in (False, True)}
            print(f"  {name:<8} {size:8.1f} MiB on disk   one thread {rates[name][False]:7.0f} "
                  f"MiB/s   all threads {rates[name][True]:7.0f} MiB/s")  # fmt: skip
        for t, label in ((False, "one thread"), (True, "all threads")):
            print(f"  plain / default, {label}: {rates['plain'][t] / rates['default'][t]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
