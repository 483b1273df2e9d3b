"""The cost-aware, demand and upgrade-on-read policies (docs/methods.md, "Backfill policies"):
hand-computed orders, the summed-cost time axis, frequency-weighted metrics on hand-made data,
the in-memory and Ray engines value for value, the simulator's orders equal to the live
controller's, and bad input named."""

from __future__ import annotations

import os
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from galleries import clustered_gallery

from raycompat.data.workload import write_query_log, zipf_class_weights, zipf_query_log
from raycompat.embeddings.gallery import BackfillInputError, GalleryEmbeddings, load_parquet
from raycompat.serving.gallery_source import ParquetGallerySource, write_gallery_parquet
from raycompat.serving.orders import policy_order_ids, reorder_on_read
from raycompat.simulator.memory_engine import simulate_backfill
from raycompat.upgrade.cost import CostModel
from raycompat.upgrade.policies import (
    PolicyOptions,
    random_order,
    read_window_ids,
    searches_before,
)
from raycompat.upgrade.query_log import memory_log_searches, read_query_log


def unit_at(degrees) -> np.ndarray:
    a = np.deg2rad(np.asarray(degrees, dtype=np.float64))
    return np.stack([np.cos(a), np.sin(a)], axis=1).astype(np.float32)


def costed(seed=0, n=120, n_q=16):
    """A clustered gallery with integer costs and a stored margin column with ties."""
    rng = np.random.default_rng(seed)
    data = clustered_gallery(seed, n, n_q, 8, 5)
    return data.with_arrays(
        item_costs=rng.integers(1, 6, n).astype(np.float64),
        extra={"uncertainty": {"margin": np.round(rng.random(n), 1)}},
        gallery_ids=np.arange(n, dtype=np.int64) * 3 + 11,
        query_ids=np.arange(n_q, dtype=np.int64) + 1000,
    )


def write_costed(root, data: GalleryEmbeddings, shards=2, row_group=29, costs=None) -> str:
    """``data`` as parquet shards with small row groups, its costs (or ``costs``) in column
    ``bytes`` and its margin in ``unc_margin`` (queries first, spread over the shards)."""

    def vec(a):
        a = np.ascontiguousarray(a, np.float32)
        return pa.FixedSizeListArray.from_arrays(pa.array(a.reshape(-1)), a.shape[1])

    nq = data.n_queries
    cols = {
        "item_id": np.concatenate([data.query_ids, data.gallery_ids]),
        "label": np.concatenate([data.query_labels, data.gallery_labels]),
        "split": np.array(["query"] * nq + ["gallery"] * data.n_items),
        "old": np.concatenate([data.query_old, data.gallery_old]),
        "new": np.concatenate([data.query_new, data.gallery_new]),
        "bytes": np.concatenate([np.zeros(nq), data.item_costs if costs is None else costs]),
        "unc_margin": np.concatenate([np.zeros(nq), data.extra["uncertainty"]["margin"]]),
    }
    os.makedirs(root, exist_ok=True)
    cut = np.linspace(0, nq + data.n_items, shards + 1).astype(int)
    for s in range(shards):
        part = {
            k: vec(v[cut[s] : cut[s + 1]])
            if k in ("old", "new")
            else pa.array(v[cut[s] : cut[s + 1]])
            for k, v in cols.items()
        }
        path = os.path.join(root, f"part-{s}.parquet")
        pq.write_table(pa.table(part), path, row_group_size=row_group)
    return str(root)


def zipf_log(tmp_path, data, searches=300, name="log.parquet"):
    cols = zipf_query_log(data.query_ids, data.query_labels, searches=searches, exponent=1.2)
    return write_query_log(str(tmp_path / name), cols)


# ----------------------------------------------------------------------------- cost-aware
def test_cost_aware_puts_cheap_items_first_and_time_is_summed_cost_over_the_rate():
    data = costed()
    equal = data.with_arrays(extra={"uncertainty": {"margin": np.full(data.n_items, 0.5)}})
    rate = 4.0
    r = simulate_backfill(
        equal,
        ["cost-aware", "random"],
        ["compatible", "cold"],
        k=5,
        grid_step=25,
        cost=CostModel(rate, unit="bytes"),
    )
    costs = equal.item_costs
    # equal benefit: priority 0.5 / c, so the cheapest first, ties by lower gallery index
    want = np.lexsort((np.arange(equal.n_items), costs))
    order = r.orders[("cost-aware", "compatible")]
    assert np.array_equal(order, want)
    assert (np.diff(costs[order]) >= 0).all() and costs[order[0]] == costs.min() == 1
    total = float(costs.sum())  # integers: every sum exact
    for c in r.curves:
        assert c.seconds[-1] == total / rate and c.backfilled_cost[-1] == total, c.label
    c = r.curve("cost-aware", "compatible")
    n = c.backfilled
    assert c.backfilled_cost.tolist() == [float(costs[order[:m]].sum()) for m in n]
    assert np.array_equal(c.seconds, c.backfilled_cost / rate)
    assert c.seconds[1] < r.curve("random", "compatible").seconds[1]  # cheap items first
    # unequal benefit: b / c, with the stored margin as b
    r2 = simulate_backfill(data, ["cost-aware"], ["compatible"], k=5, grid_step=50)
    b = data.extra["uncertainty"]["margin"]
    assert np.array_equal(
        r2.orders[("cost-aware", "compatible")], np.argsort(-(b / costs), kind="stable")
    )


def test_cost_column_is_read_and_checked_by_the_embeddings_reader(tmp_path):
    data = costed()
    root = write_costed(tmp_path / "ok", data)
    assert np.array_equal(load_parquet(root, cost_column="bytes").item_costs, data.item_costs)
    with pytest.raises(BackfillInputError, match=r"missing column\(s\) \['pixels'\] in .*part-0"):
        load_parquet(root, cost_column="pixels")
    ids = data.gallery_ids[[5, 9]]  # rows 21 and 25 of part-0
    for bad in (0.0, np.nan, -2.0):
        costs = data.item_costs.copy()
        costs[[5, 9]] = bad
        broken = write_costed(tmp_path / f"bad{bad}", data, costs=costs)
        with pytest.raises(BackfillInputError) as err:
            load_parquet(broken, cost_column="bytes")
        msg = str(err.value)
        assert "cost column 'bytes' of " in msg and "part-0.parquet (row group 0)" in msg, msg
        assert "not a finite number > 0" in msg and f"item ids [{ids[0]}, {ids[1]}]" in msg, msg
    part = os.path.join(root, "part-1.parquet")
    table = pq.read_table(part)
    words = pa.array(["x"] * table.num_rows)
    pq.write_table(table.set_column(table.column_names.index("bytes"), "bytes", words), part)
    with pytest.raises(
        BackfillInputError, match="cost column 'bytes' of .*part-1.parquet must hold"
    ):
        load_parquet(root, cost_column="bytes")


# ----------------------------------------------------------------------------- demand
def hand_gallery() -> GalleryEmbeddings:
    """Six old/new items on the unit circle and three labelled queries whose top-2 and AP are
    easy to work out by hand (docstrings of the tests below)."""
    return GalleryEmbeddings(
        gallery_labels=np.array([0, 1, 0, 2, 2, 2]),
        gallery_old=unit_at([0, 90, 180, 10, 100, 270]),
        gallery_new=unit_at([75, 200, 180, 300, 310, 320]),
        query_labels=np.array([0, 1, 0]),
        query_old=unit_at([100, 85, 0]),
        query_new=unit_at([5, 95, 5]),
        gallery_ids=np.array([40, 41, 42, 43, 44, 45]),
        query_ids=np.array([7, 8, 9]),
    )


def test_demand_orders_by_hand_computed_popularity_with_ties_by_the_base_order(tmp_path):
    """Compatible t=0 state: query 7 (at 5 deg) returns items 40 (0 deg) and 43 (10 deg), query
    8 (95 deg) items 41 (90 deg) and 44 (100 deg); counts 3 and 1.  Popularity: 40, 43 -> 3;
    41, 44 -> 1; 42, 45 -> 0.  Ties follow random(seed 5)."""
    data = hand_gallery()
    log = write_query_log(
        str(tmp_path / "q.parquet"), {"query_id": np.array([7, 8, 7]), "count": np.array([2, 1, 1])}
    )
    ql = read_query_log(log)
    opts = PolicyOptions(demand_k=2)
    r = simulate_backfill(
        data,
        ["demand"],
        ["compatible"],
        k=2,
        seed=5,
        grid_step=50,
        query_log=ql,
        policy_options=opts,
    )
    pop = np.array([3, 1, 0, 3, 1, 0])
    base = random_order(6, 5)
    want = [i for p in (3, 1, 0) for i in base if pop[i] == p]
    assert r.orders[("demand", "compatible")].tolist() == want
    # ties by another base order: sequential
    seq = simulate_backfill(
        data,
        ["demand"],
        ["compatible"],
        k=2,
        grid_step=50,
        query_log=ql,
        policy_options=PolicyOptions(demand_k=2, order_base="sequential"),
    )
    assert seq.orders[("demand", "compatible")].tolist() == [0, 3, 1, 4, 2, 5]
    # a log of query vectors (ids the embeddings do not know) searches the same way
    vectors = write_query_log(
        str(tmp_path / "v.parquet"),
        {"query_id": np.array([70, 80]), "count": np.array([3, 1]), "new": data.query_new[:2]},
    )
    by_vector = simulate_backfill(
        data, ["demand"], ["compatible"], k=2, seed=5, grid_step=50, policy_options=opts,
        query_log=read_query_log(vectors),
    )  # fmt: skip
    assert by_vector.orders[("demand", "compatible")].tolist() == want
    assert by_vector.query_log["evaluation_queries"] == 0 and not by_vector.curves[0].weighted
    # a log of returned item ids: popularity is their summed count
    res = write_query_log(
        str(tmp_path / "r.parquet"),
        {"item_id": np.array([45, 42, 45]), "count": np.array([1, 2, 2])},
    )
    rr = simulate_backfill(
        data,
        ["demand"],
        ["compatible"],
        k=2,
        grid_step=50,
        query_log=read_query_log(res),
        policy_options=PolicyOptions(order_base="sequential"),
    )
    assert rr.orders[("demand", "compatible")].tolist() == [5, 2, 0, 1, 3, 4]


def test_frequency_weighted_map_and_nfr_on_hand_made_data(tmp_path):
    """Items A (old 0 deg, label 0), B (90, label 1), C (180, label 0).  t=0 (compatible):
    queries 7 and 9 (new 10 deg) rank A, B, C: AP@3 = (1 + 2/3) / 2 = 5/6; query 8 (80 deg)
    ranks B first: AP@3 = 1.  Old-old top-1: 7 (old 100 deg) wrong, 8 and 9 right.  t=1
    (new-new, A at 75 deg): 8's top-1 is A, a flip; 9 keeps A.  Counts 3, 1, 4: weighted
    mAP@3(0) = (3 * 5/6 + 1 + 4 * 5/6) / 8 = 41/48, weighted NFR@1(1) = 1 / (1 + 4)."""
    data = GalleryEmbeddings(
        gallery_labels=np.array([0, 1, 0]),
        gallery_old=unit_at([0, 90, 180]),
        gallery_new=unit_at([75, 200, 180]),
        query_labels=np.array([0, 1, 0]),
        query_old=unit_at([100, 85, 0]),
        query_new=unit_at([10, 80, 10]),
        query_ids=np.array([7, 8, 9]),
    )
    log = write_query_log(
        str(tmp_path / "w.parquet"), {"query_id": np.array([7, 8, 9]), "count": np.array([3, 1, 4])}
    )
    r = simulate_backfill(
        data, ["random"], ["compatible"], k=3, fractions=[0.0, 1.0], query_log=read_query_log(log)
    )
    c = r.curve("random", "compatible")
    assert c.metrics["mAP@3"][0] == pytest.approx(8 / 9, abs=1e-12)
    assert c.weighted["mAP@3"][0] == pytest.approx(41 / 48, abs=1e-12)
    assert c.metrics["NFR@1"].tolist() == [0.0, 0.5]
    assert c.weighted["NFR@1"][0] == 0.0 and c.weighted["NFR@1"][1] == pytest.approx(0.2, abs=1e-15)
    assert r.weighted_references["old-old"]["NFR@1"]["value"] == 0.0
    assert r.query_log["evaluation_queries"] == 3 and r.query_log["searches"] == 8


# ----------------------------------------------------------------------------- engines
def test_in_memory_and_ray_engines_agree_for_cost_aware_demand_and_upgrade_on_read(
    tmp_path, ray_cluster
):
    from raycompat.embeddings.dataset import ParquetGallery as StreamedGallery
    from raycompat.simulator.ray_engine import simulate_backfill_dataset

    data = costed(1, n=150, n_q=20)
    root = write_costed(tmp_path / "g", data, row_group=50)
    ql = read_query_log(zipf_log(tmp_path, data))
    policies = ["random", "cost-aware", "demand", "upgrade-on-read"]
    modes = ["compatible", "cold"]
    opts = PolicyOptions(
        demand_k=4, queries_per_item=0.5, read_window=3, order_base="uncertainty:margin"
    )
    kw = dict(
        k=5,
        grid_step=25,
        seed=2,
        query_log=ql,
        cost=CostModel(3.0, unit="bytes"),
        policy_options=opts,
    )
    mem = simulate_backfill(load_parquet(root, cost_column="bytes"), policies, modes, **kw)
    dist = simulate_backfill_dataset(
        StreamedGallery.open(root, cost_column="bytes"), policies, modes, **kw
    )
    assert len(StreamedGallery.open(root).groups) == 4
    for key, order in mem.orders.items():
        assert np.array_equal(order, dist.orders[key]), key
    for a, b in zip(mem.curves, dist.curves, strict=True):
        assert a.label == b.label
        for m in a.metrics:
            assert np.array_equal(a.metrics[m], b.metrics[m], equal_nan=True), (a.label, m)
        for m in a.weighted:
            assert np.array_equal(a.weighted[m], b.weighted[m], equal_nan=True), (a.label, m)
        assert np.array_equal(a.seconds, b.seconds) and np.array_equal(
            a.backfilled_cost, b.backfilled_cost
        )
    assert mem.curves[0].seconds[-1] == data.item_costs.sum() / 3.0


# ----------------------------------------------------------------------------- live orders
def test_simulator_orders_equal_the_live_controllers_for_the_same_inputs(tmp_path):
    data = costed(2)
    path = write_gallery_parquet(
        str(tmp_path / "g.parquet"),
        data,
        items={
            "bytes": np.concatenate([np.ones(data.n_queries), data.item_costs]),
            "unc_margin": np.concatenate(
                [np.zeros(data.n_queries), data.extra["uncertainty"]["margin"]]
            ),
        },
    )
    log = zipf_log(tmp_path, data)
    ql = read_query_log(log)
    opts = PolicyOptions(
        demand_k=4, queries_per_item=0.7, read_window=2, order_base="uncertainty:margin"
    )
    modes = ["compatible", "naive_merge"]
    policies = ["cost-aware", "demand", "upgrade-on-read"]
    sim = simulate_backfill(
        data, policies, modes, k=5, grid_step=50, seed=3, query_log=ql, policy_options=opts
    )
    source = ParquetGallerySource(path)
    live_kw = dict(seed=3, options=opts, cost_column="bytes", query_log=log)
    for policy in ("cost-aware", "demand"):
        for mode in modes:
            live = policy_order_ids(policy, source, mode=mode, **live_kw)
            assert np.array_equal(live, data.gallery_ids[sim.orders[(policy, mode)]]), policy
    # upgrade on read: the controller's rule, reorder_on_read on the queue of item ids before
    # each item with the window of the searches so far, walks the simulator's order
    events = ql.stream(3)
    for mode in modes:
        results = memory_log_searches(ql, data, k=opts.demand_k).results(mode)
        results_ids = np.where(results >= 0, data.gallery_ids[results], -1)
        queue = policy_order_ids("uncertainty:margin", source, mode=mode)
        order, arrived = queue, 0
        for position in range(data.n_items):
            now = searches_before(position, opts.queries_per_item, events.size)
            if now > arrived:
                arrived = now
                window = read_window_ids(results_ids, events, now, opts.read_window)
                order = reorder_on_read(order, position, window)
        want = data.gallery_ids[sim.orders[("upgrade-on-read", mode)]]
        assert np.array_equal(order, want) and not np.array_equal(order, queue), mode


# ----------------------------------------------------------------------------- bad input
def test_bad_query_logs_are_named(tmp_path):
    data = costed()

    def run(log, **kw):
        ql = read_query_log(log)
        return simulate_backfill(data, ["demand"], ["compatible"], k=5, query_log=ql, **kw)

    other_dim = write_query_log(
        str(tmp_path / "dim.parquet"), {"query_id": np.array([1, 2]), "new": np.ones((2, 5))}
    )
    with pytest.raises(
        BackfillInputError,
        match=r"dimension mismatch: column 'new' of query log .*dim.parquet has dim 5, the "
        r"embeddings' queries have 8",
    ):
        run(other_dim)
    unknown = write_query_log(
        str(tmp_path / "items.parquet"), {"item_id": np.array([11, 12, 99, 13, 14])}
    )
    with pytest.raises(
        BackfillInputError,
        match=r"'item_id' of query log .*items.parquet: 3 item id\(s\) not in the gallery: "
        r"\[12, 13, 99\]",
    ):
        run(unknown)
    strangers = write_query_log(str(tmp_path / "q.parquet"), {"query_id": np.array([1000, 5, 6])})
    with pytest.raises(
        BackfillInputError, match=r"query ids \[5, 6\] are not queries of the embeddings"
    ):
        run(strangers)
    zero = write_query_log(
        str(tmp_path / "zero.parquet"),
        {"query_id": np.array([1000, 1001]), "count": np.array([1, 0])},
    )
    with pytest.raises(
        BackfillInputError,
        match=r"column 'count' of query log .*zero.parquet must be > 0; ids \[1001\]",
    ):
        read_query_log(zero)
    neither = write_query_log(str(tmp_path / "none.parquet"), {"count": np.array([1])})
    with pytest.raises(BackfillInputError, match="needs exactly one of the columns 'query_id'"):
        read_query_log(neither)
    with pytest.raises(BackfillInputError, match="policy 'demand' needs a query log"):
        simulate_backfill(data, ["demand"], ["compatible"], k=5, grid_step=50)
    with pytest.raises(BackfillInputError, match="cost-aware needs a scored base policy"):
        simulate_backfill(
            data,
            ["cost-aware"],
            ["compatible"],
            k=5,
            grid_step=50,
            policy_options=PolicyOptions(cost_base="random"),
        )


def test_zipf_workload_is_seeded_and_follows_its_exponent():
    w = zipf_class_weights(3, 1.0, seed=0)
    ranks = np.random.default_rng([0, 0]).permutation(3) + 1
    assert np.allclose(w, (1.0 / ranks) / (1.0 / ranks).sum()) and np.isclose(w.sum(), 1.0)
    assert np.allclose(zipf_class_weights(4, 0.0, seed=1), 0.25)
    ids, labels = np.arange(40) + 100, np.repeat(np.arange(10), 4)
    a = zipf_query_log(ids, labels, searches=5000, exponent=1.5, seed=3)
    b = zipf_query_log(ids, labels, searches=5000, exponent=1.5, seed=3)
    assert all(np.array_equal(a[k], b[k]) for k in a) and a["order"].tolist() == list(range(5000))
    per_class = np.bincount(labels[a["query_id"] - 100], minlength=10)
    top = np.argmax(zipf_class_weights(10, 1.5, seed=3))
    assert per_class.argmax() == top and per_class[top] > 0.3 * 5000  # 1 / H(10, 1.5) = 0.51
    assert not np.array_equal(
        a["query_id"], zipf_query_log(ids, labels, searches=5000, exponent=1.5, seed=4)["query_id"]
    )


def test_live_index_walks_cost_aware_and_moves_searched_items_to_the_front(
    serve_port, token_file, tmp_path
):
    """Through HTTP: a cost-aware backfill walks the simulator's order; with upgrade_on_read the
    items two searches returned (most recent search first) lead the rest of the order."""
    from ray import serve
    from serving_helpers import backfill_order, deploy

    data = costed(3, n=80, n_q=8)
    path = write_gallery_parquet(
        str(tmp_path / "g.parquet"),
        data,
        items={
            "bytes": np.concatenate([np.ones(data.n_queries), data.item_costs]),
            "unc_margin": np.concatenate(
                [np.zeros(data.n_queries), data.extra["uncertainty"]["margin"]]
            ),
        },
    )
    sim = simulate_backfill(data, ["cost-aware"], ["compatible"], k=5, grid_step=50)
    _, client = deploy(
        serve_port, tmp_path / "state", path, token_file, app="reads", prefix="/reads",
        num_shards=1,
    )  # fmt: skip
    try:
        client.start_backfill(policy="cost-aware", cost_column="bytes")
        client.wait_backfill(data.n_items, timeout=120)
        want = data.gallery_ids[sim.orders[("cost-aware", "compatible")]]
        assert np.array_equal(backfill_order(client), want)
        st = client.start_backfill(
            policy="sequential", upgrade_on_read=True, read_window=2, until=0, restart=True
        )
        assert st["upgrade_on_read"] is True and client.wait_backfill(0)["state"] == "paused"
        returned = []
        for q in data.query_new[:2]:
            ids, _, _ = client.search(q[None], k=5)
            returned.append(ids[0])
            seen = len(returned)
            t0 = time.time()
            while client.status()["backfill"]["reads_seen"] < seen:
                assert time.time() - t0 < 30, "the router did not report the search"
                time.sleep(0.05)
        client.resume_backfill(until=20)
        client.wait_backfill(20, timeout=120)
        window = np.concatenate(returned[::-1])
        expected = reorder_on_read(data.gallery_ids, 0, window)
        assert np.array_equal(backfill_order(client), expected)
        assert set(expected[:4]) <= set(window) and not np.array_equal(expected, data.gallery_ids)
    finally:
        serve.delete("reads")
