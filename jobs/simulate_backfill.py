"""simulate_backfill job: exact backfill curves (policies x query modes) from saved embeddings.

    python jobs/simulate_backfill.py DATASET [--new-model DIR] [--old-model DIR] \
        [--policies random,uncertainty:margin] [--modes compatible,cold] [--grid-step 5] [--k 100] \
        [--items-per-s-per-gpu 2000 --gpus 8] [--engine auto|memory|ray] --out backfill_out

DATASET (or --embeddings) is a parquet file, a folder of shards or a URI (s3://, gs://, file://).
Above --distributed-above-mb of vectors (or with --engine ray) the gallery is streamed through Ray
tasks, one row group each, on the cluster the job runs on (`ray job submit -- python
jobs/simulate_backfill.py ...`); the curves are the same as in memory.

Writes curves.json, curves.md and PNG plots to --out; every value carries its bootstrap interval
over the query classes (--resamples, --confidence, --bootstrap-seed), every plotted curve its
band (docs/methods.md, "Uncertainty"). Bad input (missing column, dimension mismatch, unknown
policy or mode, empty gallery, NaN embeddings) prints one line naming the problem and exits with
status 2. See `--help`.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from raycompat.simulator.job import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
