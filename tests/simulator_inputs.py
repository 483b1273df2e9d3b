"""Small simulator inputs the tests share: embeddings parquet files, a model bundle with psi,
and the simulate-backfill job run as a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys

import locations
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = locations.REPO
JOB = os.path.join(ROOT, "jobs", "simulate_backfill.py")


def vec_col(a: np.ndarray) -> pa.Array:
    a = np.ascontiguousarray(a, dtype=np.float32)
    return pa.FixedSizeListArray.from_arrays(pa.array(a.reshape(-1)), a.shape[1])


def write_parquet(
    path,
    *,
    n_gallery=60,
    n_query=8,
    d_old=8,
    d_new=12,
    drop=None,
    nan_ids=(),
    no_gallery=False,
    bad_new_dim=False,
    adapted=True,
    seed=0,
):
    rng = np.random.default_rng(seed)
    n = n_gallery + n_query
    labels = np.concatenate([rng.integers(0, 5, n_gallery), rng.integers(0, 5, n_query)])
    split = ["gallery"] * (n_gallery - 10) + ["distractor"] * 10 + ["query"] * n_query
    if no_gallery:
        split = ["query"] * n
    old = rng.standard_normal((n, d_old)).astype(np.float32) + labels[:, None] * 0.5
    new = rng.standard_normal((n, d_new)).astype(np.float32) + labels[:, None] * 0.8
    ids = np.arange(1000, 1000 + n, dtype=np.int64)
    for i in nan_ids:
        new[list(ids).index(i), 2] = np.nan
    cols = {
        "item_id": pa.array(ids),
        "label": pa.array(labels),
        "split": pa.array(split),
        "old": vec_col(old),
        "new": vec_col(new),
    }
    if bad_new_dim:
        cols["new"] = pa.array(
            [list(map(float, r[: d_new - (i == 3)])) for i, r in enumerate(new)],
            type=pa.list_(pa.float32()),
        )
    if adapted:
        cols["adapted"] = vec_col(new + 0.1 * rng.standard_normal(new.shape).astype(np.float32))
    if drop:
        cols.pop(drop)
    pq.write_table(pa.table(cols), path)
    return path


def run_job(*args, timeout=240):
    """The simulate-backfill job's command line in this process (its ``main``, as
    ``jobs/simulate_backfill.py`` calls it): a ``CompletedProcess``-like result with its exit
    code, stdout and stderr. Ray, if the run needs it, is the session's (``ray_cluster``)."""
    import contextlib
    import io
    import types

    from raycompat.simulator.job import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in args])
        except SystemExit as exc:  # argparse's own errors (exit 2) and --help (exit 0)
            code = exc.code if isinstance(exc.code, int) else 2
    return types.SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


def run_job_program(*args, timeout=240):
    """``python jobs/simulate_backfill.py ARGS`` as a child process."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run(
        [sys.executable, JOB, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )


def make_bundle(path, d_new=12, d_old=8):
    import torch

    from raycompat.models import ClassifierHead, Embedder, ModelBundle, ProjectionMLP

    torch.manual_seed(0)
    modules = {
        "embedder": Embedder("test_resnet", d_new, in_chans=1),
        "head": ClassifierHead(d_new, 5, kind="cosface"),
        "psi": ProjectionMLP(d_old, d_new, hidden_dim=16, num_blocks=1, role="psi"),
    }
    ModelBundle(modules, {"compatible_dim": d_old, "in_chans": 1, "resolution": 16}).save(str(path))
    return path


def write_dataset(
    root,
    *,
    n=360,
    nq=24,
    d_old=8,
    d_new=12,
    shards=3,
    row_group=23,
    adapted=True,
    stored_uncertainty=True,
    seed=0,
):
    """Shards with small row groups; queries spread over the shards; coarse values (many
    exact score ties) and a few duplicated vectors."""
    rng = np.random.default_rng(seed)
    total = n + nq
    labels = rng.integers(0, 9, total)
    split = np.array(["gallery"] * (n - 40) + ["distractor"] * 40 + ["query"] * nq)
    rng.shuffle(split)
    old = np.round(rng.standard_normal((total, d_old)) + 0.4 * labels[:, None], 0)
    new = np.round(rng.standard_normal((total, d_new)) + 0.6 * labels[:, None], 0)
    old[0] = old[1] = old[2] + 0.0  # identical rows: exact ties on every side
    new[0] = new[1]
    old[np.abs(old).sum(axis=1) == 0, 0] = 1.0
    new[np.abs(new).sum(axis=1) == 0, 0] = 1.0
    cols = {
        "item_id": np.arange(total, dtype=np.int64) + 5000,
        "label": labels,
        "split": split,
        "old": old,
        "new": new,
    }
    if adapted:
        cols["adapted"] = np.round(new * 0.8 + rng.standard_normal(new.shape), 0) + 0.5
    if stored_uncertainty:
        for kind in ("least_confidence", "margin", "entropy"):
            cols[f"unc_{kind}"] = np.round(rng.random(total), 1)  # ties in the order too
    os.makedirs(root, exist_ok=True)
    bounds = np.linspace(0, total, shards + 1).astype(int)
    for s in range(shards):
        part = slice(bounds[s], bounds[s + 1])
        table = {
            k: vec_col(v[part]) if k in ("old", "new", "adapted") else pa.array(v[part])
            for k, v in cols.items()
        }
        pq.write_table(
            pa.table(table), os.path.join(root, f"part-{s}.parquet"), row_group_size=row_group
        )
    return str(root)


def assert_same(mem, dist):
    assert [(c.policy, c.mode) for c in mem.curves] == [(c.policy, c.mode) for c in dist.curves]
    for a, b in zip(mem.curves, dist.curves, strict=True):
        assert np.array_equal(a.counts, b.counts)
        for m in a.metrics:
            assert np.array_equal(a.metrics[m], b.metrics[m], equal_nan=True), (a.label, m)
    assert mem.references == dist.references
    for key, order in mem.orders.items():
        assert np.array_equal(order, dist.orders[key]), key
