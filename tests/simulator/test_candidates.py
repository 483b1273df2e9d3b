"""Several candidate models in one pass: each candidate's curves equal its single-candidate run,
number for number, in memory and on Ray (one read of each row group for all candidates)."""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pyarrow.parquet as pq
import pytest
from serving_helpers import labelled_embeddings
from simulator_inputs import assert_same, vec_col, write_dataset

from raycompat.embeddings.dataset import ParquetGallery
from raycompat.embeddings.gallery import BackfillInputError, load_parquet
from raycompat.simulator.candidates import simulate_candidates
from raycompat.simulator.memory_engine import simulate_backfill
from raycompat.simulator.ray_candidates import simulate_candidates_dataset
from raycompat.simulator.ray_engine import simulate_backfill_dataset
from raycompat.simulator.reference_cache import ReferenceCache

POLICIES = ("random", "sequential", "hinge-benefit")
MODES = ("compatible", "naive_merge", "cold")


def _numbers(result) -> str:
    d = result.to_dict()
    d.pop("stats")
    return json.dumps(d, default=str)


def _second_candidate(data):
    rng = np.random.default_rng(7)
    return dataclasses.replace(
        data,
        gallery_new=data.gallery_adapted,
        query_new=(data.query_new + rng.standard_normal(data.query_new.shape)).astype(np.float32),
    )


def test_in_memory_each_candidate_equals_its_own_run(tmp_path):
    a = labelled_embeddings()
    b = _second_candidate(a)
    said: list[str] = []
    multi = simulate_candidates({"bct": a, "ract": b}, POLICIES, MODES, k=10, progress=said.append)
    for name, data in (("bct", a), ("ract", b)):
        single = simulate_backfill(data, POLICIES, MODES, k=10)
        assert _numbers(multi[name]) == _numbers(single), name
        assert sorted(multi[name].stats["engine"]["sides"]) == ["new-new", "new-old", "old-old"]
    assert "scoring 5 side(s) for 2 candidate(s): " in "\n".join(said)  # old-old scored once
    # with the reference cache: the second candidate's reference comes from the same pass
    cache = ReferenceCache(str(tmp_path / "cache"))
    for _ in range(2):
        cached = simulate_candidates({"bct": a, "ract": b}, POLICIES, ["compatible"], k=10,
                                     reference_cache=cache)  # fmt: skip
        for name, data in (("bct", a), ("ract", b)):
            single = simulate_backfill(data, POLICIES, ["compatible"], k=10)
            assert _numbers(cached[name]) == _numbers(single), name
    assert cached["ract"].stats["reference_cache"]["state"] == "hit"
    assert "old-old" not in cached["ract"].stats["engine"]["sides"]


def test_candidates_must_share_the_old_gallery():
    a = labelled_embeddings()
    other = dataclasses.replace(a, gallery_old=a.gallery_old * 2)
    with pytest.raises(BackfillInputError, match="candidate 'b': its gallery_old differ"):
        simulate_candidates({"a": a, "b": other}, ["random"], ["compatible"], k=10)
    with pytest.raises(BackfillInputError, match="candidate name 'a@b'"):
        simulate_candidates({"a@b": a}, ["random"], ["compatible"], k=10)


def _with_candidate_column(root: str, seed: int = 3) -> str:
    """Add a column ``new_b`` (another candidate's new vectors) to every shard of ``root``."""
    rng = np.random.default_rng(seed)
    for f in sorted(os.listdir(root)):
        path = os.path.join(root, f)
        table = pq.read_table(path)
        new = np.stack(table.column("new").to_numpy(zero_copy_only=False)).astype(np.float32)
        other = np.round(new * 0.5 + rng.standard_normal(new.shape), 0) + 0.25
        rows = pq.ParquetFile(path).metadata.row_group(0).num_rows
        pq.write_table(table.append_column("new_b", vec_col(other)), path, row_group_size=rows)
    return root


def _as_single(root: str, column: str, dest) -> str:
    """The dataset with ``column`` as its ``new`` column (what a single run of it reads)."""
    os.makedirs(dest, exist_ok=True)
    for f in sorted(f for f in os.listdir(root) if f.endswith(".parquet")):
        table = pq.read_table(os.path.join(root, f))
        new = table.column(column)
        table = table.drop_columns(
            [c for c in ("new", "new_b", "adapted") if c in table.schema.names]
        )
        table = table.append_column("new", new)
        rows = pq.ParquetFile(os.path.join(root, f)).metadata.row_group(0).num_rows
        pq.write_table(table, os.path.join(dest, f), row_group_size=rows)
    return str(dest)


def test_on_ray_each_candidate_equals_its_own_run_with_one_read(tmp_path, ray_cluster):
    root = _with_candidate_column(write_dataset(tmp_path / "a", stored_uncertainty=False))
    ds = ParquetGallery.open(root)
    columns = {"bct": "new", "ract": "new_b"}
    said: list[str] = []
    multi = simulate_candidates_dataset(
        ds, columns, POLICIES, MODES, k=10, debug=True, progress=said.append
    )
    blocks = len([g for g in ds.groups if g.gallery_rows])
    # the positives' rows are read once for both candidates, as the score step reads once
    reads = [m for m in said if m.startswith("reading the ")]
    assert len(reads) == 1 and reads[0].endswith("(once for 2 candidates)"), said
    for name, col in columns.items():
        res = multi[name]
        assert res.stats["distributed"]["steps"]["score"]["tasks"] == blocks  # one read each
        single = simulate_backfill_dataset(ds.candidate_view(col), POLICIES, MODES, k=10)
        assert _numbers(res) == _numbers(single), name
        mem = simulate_backfill(
            load_parquet(_as_single(root, col, tmp_path / col)), POLICIES, MODES, k=10
        )
        assert_same(mem, res)
    with pytest.raises(BackfillInputError, match="candidate column 'nope' is not in"):
        simulate_candidates_dataset(ds, {"x": "nope"}, ["random"], ["compatible"], k=10)


def test_the_job_writes_each_candidates_report_and_the_comparison(tmp_path):
    from simulator_inputs import run_job, write_parquet

    emb = str(write_parquet(tmp_path / "emb.parquet", adapted=False))
    table = pq.read_table(emb)
    new = np.stack(table.column("new").to_numpy(zero_copy_only=False)).astype(np.float32)
    other = new[:, ::-1] * 0.7 + np.random.default_rng(1).standard_normal(new.shape)
    pq.write_table(table.append_column("new_b", vec_col(other.astype(np.float32))), emb)
    flags = ["--embeddings", emb, "--k", 10, "--grid-step", 25, "--no-plots", "--quiet"]
    out = tmp_path / "multi"
    r = run_job(*flags, "--candidates", "bct=new,ract=new_b", "--out", out)
    assert r.returncode == 0, r.stderr
    summary = json.loads((out / "candidates.json").read_text())
    assert {n: c["column"] for n, c in summary["candidates"].items()} == {
        "bct": "new",
        "ract": "new_b",
    }
    md = (out / "candidates.md").read_text()
    assert "| policy | mode | bct | ract |" in md and "[ract](ract/curves.md)" in md
    single = _as_single(os.path.dirname(emb), "new_b", tmp_path / "single")
    r = run_job("--embeddings", os.path.join(single, "emb.parquet"), *flags[2:],
                "--out", tmp_path / "one")  # fmt: skip
    assert r.returncode == 0, r.stderr
    one = json.loads((tmp_path / "one" / "curves.json").read_text())
    ract = json.loads((out / "ract" / "curves.json").read_text())
    assert ract["rows"] == one["rows"] and ract["references"] == one["references"]
    r = run_job(*flags, "--candidates", "bct=new", "--new-model", tmp_path, "--out", out / "x")
    assert r.returncode == 2 and "--candidates takes new-vector columns" in r.stderr


def test_candidates_with_equal_orders_share_one_array_and_one_segmentation():
    from raycompat.simulator.candidates import CandidatePlan, share_equal_orders
    from raycompat.simulator.rank_plan import CurveSpec, _segmentations
    from raycompat.simulator.run_plan import PlannedRun, ReferenceLookup, SimulationSpec

    rng = np.random.default_rng(0)
    shared, other = rng.permutation(50), rng.permutation(50)

    def plan(name, order):
        curve = CurveSpec(
            ("random", "compatible"), "old-old", "new-new", np.array([0, 25, 50]), order
        )
        orders = {("random", "compatible"): order}
        lookup = ReferenceLookup(None, False)
        run = PlannedRun(SimulationSpec(), None, None, orders, {}, [curve], {}, set(), lookup)
        return CandidatePlan(name, run)

    planned = [plan("a", shared), plan("b", shared.copy()), plan("c", other)]
    share_equal_orders(planned)
    orders = [cp.orders[("random", "compatible")] for cp in planned]
    assert orders[1] is orders[0] and planned[1].curves[0].order is orders[0]
    assert orders[2] is other  # a different order keeps its own array
    segs = _segmentations([c for cp in planned for c in cp.curves], 50)
    assert segs.of_curve == [0, 0, 1]


def test_a_block_normalized_once_gives_the_same_sides_bit_for_bit():
    from raycompat.upgrade.modes import SideBuilder, normalize_columns, scores_raw

    a = labelled_embeddings()
    cols = {"old": a.gallery_old.copy(), "new": a.gallery_new.copy()}
    normalize_columns(cols, "test block")
    pre = dataclasses.replace(a, gallery_old=cols["old"], gallery_new=cols["new"])
    fast = SideBuilder(pre, normalized=("gallery_old", "gallery_new"))
    for side in ("old-old", "new-old", "new-new"):
        assert np.array_equal(fast.side(side).gallery, SideBuilder(a).side(side).gallery), side
        assert np.array_equal(fast.side(side).queries, SideBuilder(a).side(side).queries), side
    assert scores_raw(["new-old", "rev-old:raw"]) and not scores_raw(["new-old", "old-old"])
    zero = {"old": np.zeros((2, 3), dtype=np.float32)}
    with pytest.raises(BackfillInputError, match="column 'old' of shard-7"):
        normalize_columns(zero, "shard-7")


def test_the_running_sum_keeps_no_view_of_a_blocks_result():
    """A block's result read from the object store is a view of it; the sum copies what it
    keeps, so that the result's memory is freed when the block has been added."""
    from raycompat.simulator.assembly import CountsSum
    from raycompat.simulator.block_pass import block_pass
    from raycompat.simulator.memory_engine import MemoryEngine
    from raycompat.simulator.rank_plan import plan_ranks
    from raycompat.simulator.run_plan import SimulationSpec, plan_run

    a = labelled_embeddings()
    engine = MemoryEngine(a)
    spec = SimulationSpec(policies=["random"], modes=["compatible"], k=10)
    run = plan_run(spec, engine, lambda m: None)
    sides = {s: engine.builder.side(s) for c in run.curves for s in c.sides()}
    plan = plan_ranks(sides, run.curves, a.query_labels, a.gallery_labels, device="cpu")
    block = block_pass(plan, sides)
    buffer = np.concatenate([[0], block.sides["old-old"].tie_items])
    block.sides["old-old"].tie_items = buffer[1:]  # a view, as an object-store read gives
    total = CountsSum(plan)
    total.add(block)
    kept = total.ties["old-old"][0][0]
    assert kept.base is None and np.array_equal(kept, buffer[1:])
