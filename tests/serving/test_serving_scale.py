"""The live index at scale through real HTTP on Ray Serve: batched searches equal unbatched ones,
two replicas per shard lose no query and no acknowledged upsert when one is killed, autoscaling
configs reach Serve.

One app for the three tests, in file order: 2 shards whose two replicas each come from
``shard_autoscaling`` (``initial_replicas``), an autoscaled router, searches batched up to 16
requests with a 50 ms wait, 300 items.  2 shards: shard_autoscaling must reach every shard
deployment (``[2, 2]`` replicas), and the batched searches are merged across both shards.  (How
autoscaling configs are checked, without Serve: test_serving_units.py.)"""

import threading
import time

import numpy as np
import pytest
import requests
from serving_helpers import (
    deploy,
    labelled_embeddings,
    reset_backfill,
    undeploy,
    wait_for_metric,
)

from raycompat.serving.gallery_source import write_gallery_parquet

DATA = labelled_embeddings(n_items=300, n_queries=40, classes=20)
APP = "scaled"

pytestmark = pytest.mark.serve


@pytest.fixture(scope="module")
def scaled_app(serve_port, token_file, tmp_path_factory):
    root = tmp_path_factory.mktemp("scaled")
    gallery = write_gallery_parquet(str(root / "embeddings.parquet"), DATA)
    _, client = deploy(
        serve_port,
        root / "state",
        gallery,
        token_file,
        app=APP,
        prefix="/scaled",
        num_shards=2,
        shard_autoscaling={"min_replicas": 1, "max_replicas": 3, "initial_replicas": 2},
        router_autoscaling='{"min_replicas": 1, "max_replicas": 2}',
        search_batch_size=16,
        search_batch_wait_ms=50.0,
        metrics_interval_s=1.0,
    )
    yield client
    undeploy(APP)


def _search(base, body):
    r = requests.post(base + "/search", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["results"]


def _histogram(metrics: str, name: str, labels: str) -> dict[str, float]:
    """``{le: count}`` of a histogram of a Prometheus text page, summed over the series whose
    labels contain ``labels``."""
    out = {}
    for line in metrics.splitlines():
        if line.startswith(f"{name}_bucket{{") and labels in line:
            le = line.split('le="')[1].split('"')[0]
            out[le] = out.get(le, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def test_autoscaling_configs_reach_serve(scaled_app):
    """Serve runs the router, the shards and the controller; each shard has the two replicas
    of ``initial_replicas``; a search is answered."""
    from ray import serve

    deployments = serve.status().applications[APP].deployments
    assert set(deployments) >= {"router", "shard-0", "shard-1", "backfill"}
    st = scaled_app.status()
    assert [len(s["replicas"]) for s in st["shards"]] == [2, 2]  # initial_replicas
    assert _search(scaled_app.base, {"vectors": DATA.query_new[:2].tolist(), "k": 5})


def test_concurrent_searches_are_batched_and_equal_searches_alone(scaled_app):
    """24 requests at once (k 10 or 37, new- or old-model queries, one or three queries each)
    are answered in batches of several requests; every answer, canonical scores included, is
    bit-identical to the same request sent alone afterwards (a batch of one, maybe on the
    shard's other replica)."""
    client = scaled_app
    client.upsert(  # a few items in the new representation: both sides are searched
        [
            {"id": int(i), "representation": "new", "vector": DATA.gallery_new[j].tolist()}
            for j, i in enumerate(DATA.gallery_ids[:40])
        ]
    )
    bodies = []
    for j in range(24):
        model = "old" if j % 4 == 3 else "new"
        q = DATA.query_old if model == "old" else DATA.query_new
        rows = q[j : j + (3 if j % 2 else 1)]
        bodies.append({"vectors": rows.tolist(), "k": 37 if j % 3 else 10, "model": model})
    name = "raycompat_serving_search_batch_requests"
    counted = 'raycompat_serving_requests_total{endpoint="/search",status="200"}'
    searched = wait_for_metric(client, counted, 1)[-1]  # the app's search before this test
    router0 = _histogram(client.metrics(), name, 'stage="router"')
    together = [None] * len(bodies)
    barrier = threading.Barrier(len(bodies))

    def send(j):
        barrier.wait()
        together[j] = _search(client.base, bodies[j])

    threads = [threading.Thread(target=send, args=(j,)) for j in range(len(bodies))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wait_for_metric(client, counted, searched + len(bodies))  # both routers', summed by Ray
    metrics = client.metrics()
    alone = [_search(client.base, b) for b in bodies]
    assert together == alone
    after = _histogram(metrics, name, 'stage="router"')
    router = {le: count - router0.get(le, 0.0) for le, count in after.items()}
    shard = _histogram(metrics, name, 'stage="shard"')
    assert router["+Inf"] >= len(bodies) // 16 + 1 and router["1"] < router["+Inf"]
    assert router["+Inf"] < 2 * len(bodies)  # fewer search calls than requests
    assert shard["+Inf"] > 0


def test_two_replicas_per_shard_lose_nothing_when_one_is_killed(scaled_app):
    """R=2: a replica of shard 0 is killed during a live backfill under query load and admin
    upserts.  No query fails, every acknowledged upsert is served afterwards, every item is
    served exactly once throughout, and the backfill finishes."""
    import ray

    client = scaled_app
    reset_backfill(client)
    n = DATA.gallery_ids.size
    outcomes, wrong = [], []
    stop = threading.Event()

    def queries():
        sess = requests.Session()
        body = {"vectors": DATA.query_new[:3].tolist(), "k": n}
        while not stop.is_set():
            t = time.time()
            try:
                r = sess.post(client.base + "/search", json=body, timeout=60)
                outcomes.append((t, r.status_code))
                if r.status_code == 200:
                    for row in r.json()["results"]:
                        if sorted(h["id"] for h in row) != sorted(DATA.gallery_ids.tolist()):
                            wrong.append(len(row))
            except requests.RequestException as exc:
                outcomes.append((t, type(exc).__name__))

    # admin upserts move untouched items (the last 100 of the backfill order are never
    # reached: until) back and forth; each acknowledged one is remembered
    acked: dict[int, list] = {}
    upsert_outcomes = []

    def upserts():
        rng = np.random.default_rng(5)
        pool = DATA.gallery_ids[-60:]
        while not stop.is_set():
            i = int(rng.choice(pool))
            vec = rng.standard_normal(16).tolist()
            try:
                r = requests.post(
                    client.base + "/admin/upsert",
                    json={"items": [{"id": i, "representation": "old", "vector": vec}]},
                    headers={"Authorization": f"Bearer {client.token}"},
                    timeout=60,
                )
                upsert_outcomes.append(r.status_code)
                if r.status_code == 200:
                    acked[i] = vec
            except requests.RequestException as exc:
                upsert_outcomes.append(type(exc).__name__)
            time.sleep(0.02)

    threads = [threading.Thread(target=queries) for _ in range(2)]
    threads.append(threading.Thread(target=upserts))
    try:
        client.start_backfill(
            policy="sequential", rate=50.0, batch_size=10, until=n - 60, restart=True
        )
        for th in threads:
            th.start()
        while client.status()["backfill"]["position"] < 120:
            time.sleep(0.05)
        victim = client.status()["shards"][0]["replicas"][0]
        ray.kill(ray.get_actor(victim["actor_name"], namespace="serve"), no_restart=True)
        t_kill = time.time()
        t0 = time.time()
        while client.status()["backfill"]["state"] != "paused":  # paused at until
            assert time.time() - t0 < 240, "the backfill did not finish after the kill"
            time.sleep(0.2)
        time.sleep(1.0)
    finally:
        stop.set()
        for th in threads:
            th.join(timeout=60)
    t0 = time.time()
    while True:  # Serve replaces the killed replica
        st = client.status()
        pids = {r["pid"] for r in st["shards"][0]["replicas"]}
        if victim["pid"] not in pids and len(pids) == 2:
            break
        assert time.time() - t0 < 120, f"no replacement replica: {pids}"
        time.sleep(0.5)
    assert st["items"]["new"] == n - 60
    from raycompat.index.search import l2_normalize

    for i, vec in acked.items():
        ids, scores, reps = client.search(l2_normalize(np.asarray([vec])), k=1, model="old")
        assert ids[0, 0] == i and reps[0, 0] == "old" and scores[0, 0] > 0.9999
    failed = [o for o in outcomes if o[1] != 200]
    after = [o for o in outcomes if o[0] >= t_kill]
    print(
        f"\nREPLICAS: {len(outcomes)} queries ({len(after)} after the kill), {len(failed)} "
        f"failed; {len(upsert_outcomes)} admin upserts, "
        f"{sum(1 for o in upsert_outcomes if o != 200)} failed, {len(acked)} items acked"
    )
    assert len(after) > 10 and not failed, failed[:5]
    assert upsert_outcomes and all(o == 200 for o in upsert_outcomes)
    assert not wrong, wrong[:5]
