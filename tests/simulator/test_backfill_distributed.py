"""The distributed backfill simulator (Ray tasks over parquet row groups) against the in-memory
one: the same curves value for value, for every policy and query mode, ties included; bad input
named with its shard; a killed worker retried without counting a block twice."""

from __future__ import annotations

import os
import signal
import threading
import time
import types

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from simulator_inputs import assert_same, write_dataset
from simulator_inputs import vec_col as vec

from raycompat.embeddings.dataset import ParquetGallery
from raycompat.embeddings.gallery import BackfillInputError, load_parquet
from raycompat.models.uncertainty_head import UncertaintyHead
from raycompat.simulator.memory_engine import simulate_backfill
from raycompat.simulator.ray_engine import DistributedOptions, simulate_backfill_dataset
from raycompat.upgrade.modes import apply_bundle_modules
from raycompat.upgrade.policies import POLICIES


def modules(d_old=8, d_new=12):
    import torch

    from raycompat.models import ProjectionMLP

    torch.manual_seed(0)
    return {
        "psi": ProjectionMLP(d_old, d_new, hidden_dim=16, num_blocks=1, role="psi"),
        "rho": ProjectionMLP(d_new, 10, hidden_dim=16, num_blocks=1, role="rho"),
        "psi_rev": ProjectionMLP(10, d_old, hidden_dim=16, num_blocks=1, role="psi_rev"),
    }


def head(d_new=12, classes=9):
    rng = np.random.default_rng(3)
    return UncertaintyHead(weight=rng.standard_normal((classes, d_new)), kind="softmax")


def test_many_small_blocks_give_the_in_memory_curves(tmp_path, ray_cluster):
    root = write_dataset(tmp_path / "a")
    ds = ParquetGallery.open(root)
    assert len(ds.groups) > 15 and ds.n_items == 360 and ds.n_queries == 24
    policies = ["random", "sequential", "hinge-benefit", "learned"] + [
        p for p in POLICIES if p.startswith("uncertainty:")
    ]
    modes = ["compatible", "adapted", "rank_merge", "naive_merge", "cold"]
    kw = dict(k=10, seed=4, learned_sample_fraction=0.1, grid_step=10.0)
    mods = modules()
    data = apply_bundle_modules(load_parquet(root), types.SimpleNamespace(modules=mods))
    mem = simulate_backfill(data, policies, modes, **kw)
    dist = simulate_backfill_dataset(ds, policies, modes, modules=mods, debug=True, **kw)
    assert_same(mem, dist)
    assert dist.stats["distributed"]["blocks"] == len([g for g in ds.groups if g.gallery_rows])
    assert (
        sum(dist.stats["distributed"]["blocks_per_node"].values())
        == dist.stats["distributed"]["blocks"]
    )


def test_blocks_apply_psi_and_the_head_and_the_raw_distance(tmp_path, ray_cluster):
    """No adapted or uncertainty columns: psi, FCT's h and the head run on each block;
    rank_merge with the un-normalised distance needs a norm pass."""
    from raycompat.models import ForwardTransformation

    root = write_dataset(tmp_path / "b", adapted=False, stored_uncertainty=False, seed=1)
    policies = ["uncertainty:entropy", "learned", "hinge-benefit", "random"]
    modes = ["adapted", "fct", "rank_merge"]
    kw = dict(k=5, head=head(), rank_merge_distance="sq_l2_raw", learned_sample_fraction=0.2)
    mods = dict(modules(), fct=ForwardTransformation(8, 12, hidden_dim=16))
    data = apply_bundle_modules(load_parquet(root), types.SimpleNamespace(modules=mods))
    mem = simulate_backfill(data, policies, modes, **kw)
    opts = DistributedOptions(max_in_flight=3)
    dist = simulate_backfill_dataset(
        ParquetGallery.open(root), policies, modes, modules=mods, options=opts, **kw
    )
    assert_same(mem, dist)
    assert "norms" in dist.stats["distributed"]["steps"]


def test_ray_data_sort_gives_the_same_global_order(tmp_path, ray_cluster):
    """Above ``sort_above`` items the order of block scores comes from Ray Data's sort of
    (-score, gallery index): the same order as the driver's stable sort, ties included."""
    # stored scores rounded: many ties; 6 blocks across 3 shards (Ray Data's sort starts a map
    # and a reduce task per block)
    root = write_dataset(tmp_path / "sort", seed=6, row_group=64)
    policy = ["uncertainty:margin"]
    mem = simulate_backfill(load_parquet(root), policy, ["compatible"], k=5)
    opts = DistributedOptions(sort_above=0)
    dist = simulate_backfill_dataset(
        ParquetGallery.open(root), policy, ["compatible"], k=5, options=opts
    )
    assert_same(mem, dist)


def _shards(tmp_path, name, **kw):
    return write_dataset(tmp_path / name, adapted=False, stored_uncertainty=False, **kw)


def _rewrite(path, fn):
    table = fn(pq.read_table(path))
    pq.write_table(table, path, row_group_size=23)


def test_bad_shards_are_named(tmp_path, ray_cluster):
    # a shard without a column
    root = _shards(tmp_path, "missing")
    _rewrite(f"{root}/part-1.parquet", lambda t: t.drop_columns(["new"]))
    with pytest.raises(BackfillInputError, match=r"part-1\.parquet.*|missing column.*part-1"):
        ParquetGallery.open(root)
    # a shard with another dimension
    root = _shards(tmp_path, "dim")
    wide = lambda t: t.set_column(  # noqa: E731
        t.schema.get_field_index("old"),
        "old",
        vec(np.ones((t.num_rows, 9))),
    )
    _rewrite(f"{root}/part-2.parquet", wide)
    with pytest.raises(BackfillInputError, match=r"dimension mismatch in column 'old'.*part-2"):
        ParquetGallery.open(root)
    # duplicate ids across shards
    root = _shards(tmp_path, "dup")
    _rewrite(
        f"{root}/part-2.parquet",
        lambda t: t.set_column(0, "item_id", pa.array(np.arange(t.num_rows) + 5000)),
    )
    with pytest.raises(BackfillInputError, match=r"duplicate item ids.*part-0.*part-2"):
        ParquetGallery.open(root)
    # an unreadable file
    root = _shards(tmp_path, "garbage")
    with open(f"{root}/part-1.parquet", "wb") as f:
        f.write(b"not a parquet file")
    with pytest.raises(BackfillInputError, match=r"cannot read parquet .*part-1\.parquet"):
        ParquetGallery.open(root)


def test_nan_vectors_are_named_with_their_shard_and_ids(tmp_path, ray_cluster):
    root = _shards(tmp_path, "nan")

    def poison(t):
        new = np.stack(t.column("new").to_numpy(zero_copy_only=False))
        kind = np.asarray(t.column("split").to_pylist())
        row = int(np.flatnonzero(kind != "query")[30])
        new[row, 3] = np.nan
        return t.set_column(t.schema.get_field_index("new"), "new", vec(new))

    _rewrite(f"{root}/part-2.parquet", poison)
    ds = ParquetGallery.open(root)  # the key pass does not read vectors
    with pytest.raises(BackfillInputError, match=r"NaN or inf .*'new' of .*part-2\.parquet"):
        simulate_backfill_dataset(ds, ["random"], ["compatible"], k=5)


def test_uri_paths_read_the_same_dataset(tmp_path, ray_cluster):
    root = _shards(tmp_path, "uri", seed=2)
    a = simulate_backfill_dataset(ParquetGallery.open(root), ["random"], ["compatible"], k=5)
    b = simulate_backfill_dataset(
        ParquetGallery.open("file://" + root), ["random"], ["compatible"], k=5
    )
    assert_same(a, b)


def _ray_workers(raylet: int) -> list[int]:
    """Pids of the worker processes of this session's raylet (titled ``ray::...``; another
    cluster on the machine, e.g. another pytest-xdist worker's, has its own raylet)."""
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    is_worker = f.read(5) == b"ray::"
                with open(f"/proc/{pid}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if is_worker and parent == raylet:
                out.append(int(pid))
    return out


def _raylet_pid() -> int:
    """This session's raylet: the parent of its worker processes (Ray's state API)."""
    import ray
    from ray.util.state import list_workers

    address = ray.get_runtime_context().gcs_address
    workers = list_workers(address=address, filters=[("worker_type", "=", "WORKER")], limit=100)
    for w in workers:
        try:
            with open(f"/proc/{w.pid}/stat") as f:
                return int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    raise AssertionError(f"no live worker process among {workers}")


def _kill_first_block_worker(stop: threading.Event, killed: list, raylet: int) -> None:
    """SIGKILL the first worker process of ``raylet`` seen running a block pass (Ray titles
    it ``ray::_pass_task`` while it runs one)."""
    workers, refreshed = [], 0.0
    while not stop.is_set():
        if time.monotonic() - refreshed > 0.2:
            workers, refreshed = _ray_workers(raylet), time.monotonic()
        for pid in workers:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    running = f.read(15) == b"ray::_pass_task"
            except OSError:
                continue
            if running:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
                return
        time.sleep(0.002)


def _retried(name: str) -> bool:
    """Whether a task called ``name`` finished on a second attempt (Ray's state API, whose
    task events arrive a little late)."""
    import ray
    from ray.util.state import list_tasks

    address = ray.get_runtime_context().gcs_address  # this session's cluster, not another one
    for _ in range(30):
        tasks = list_tasks(address=address, filters=[("name", "=", name)], detail=True, limit=10000)
        if any(t.attempt_number >= 1 and t.state == "FINISHED" for t in tasks):
            return True
        time.sleep(0.5)
    return False


def test_a_killed_block_worker_is_retried_and_the_curve_stays_exact(tmp_path, ray_cluster):
    root = write_dataset(
        tmp_path / "kill", n=8000, nq=200, d_old=32, d_new=48, shards=4, row_group=1000, seed=5
    )
    kw = dict(k=20, grid_step=10.0)
    mem = simulate_backfill(load_parquet(root), ["random"], ["compatible", "naive_merge"], **kw)
    stop, killed = threading.Event(), []
    killer = threading.Thread(
        target=_kill_first_block_worker, args=(stop, killed, _raylet_pid()), daemon=True
    )
    killer.start()
    ds = ParquetGallery.open(root)
    try:
        dist = simulate_backfill_dataset(
            ds,
            ["random"],
            ["compatible", "naive_merge"],
            options=DistributedOptions(max_in_flight=2),
            **kw,
        )
    finally:
        stop.set()
        killer.join()
    assert killed, "no block task was seen running"
    assert _retried("_pass_task"), "Ray did not retry the killed block task"
    assert_same(mem, dist)
    # every block counted once: one finished task per row group with gallery rows
    assert dist.stats["distributed"]["blocks"] == len([g for g in ds.groups if g.gallery_rows])
