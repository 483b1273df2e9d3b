"""The live index at scale through real HTTP on Ray Serve: batched searches equal unbatched ones,
two replicas per shard lose no query and no acknowledged upsert when one is killed, approximate
indexes report their recall against exact search, autoscaling configs reach Serve."""

import threading
import time

import numpy as np
import pytest
import requests
from serving_helpers import deploy, labelled_embeddings

from raycompat.config import ConfigError

DATA = labelled_embeddings()


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


def test_concurrent_searches_are_batched_and_equal_searches_alone(
    serve_port, gallery_parquet, token_file, tmp_path
):
    """24 requests at once (k 10 or 37, new- or old-model queries, one or three queries each)
    are answered in batches of several requests; every answer, canonical scores included, is
    bit-identical to the same request sent alone afterwards (a batch of one)."""
    from ray import serve

    _, client = deploy(
        serve_port,
        tmp_path / "state",
        gallery_parquet,
        token_file,
        app="batching",
        prefix="/batching",
        num_shards=2,
        search_batch_size=16,
        search_batch_wait_ms=50.0,
        fsync=False,
    )
    try:
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
        alone = [_search(client.base, b) for b in bodies]
        assert together == alone
        router = _histogram(
            client.metrics(), "raycompat_serving_search_batch_requests", 'stage="router"'
        )
        shard = _histogram(
            client.metrics(), "raycompat_serving_search_batch_requests", 'stage="shard"'
        )
        assert router["+Inf"] >= len(bodies) // 16 + 1 and router["1"] < router["+Inf"]
        assert router["+Inf"] < 2 * len(bodies)  # fewer search calls than requests
        assert shard["+Inf"] > 0
    finally:
        serve.delete("batching")


def test_autoscaling_configs_are_checked_and_reach_serve(serve_port, gallery_parquet, tmp_path):
    from ray import serve

    from raycompat.serving.config import serving_config

    with pytest.raises(ConfigError, match="shard_autoscaling.*unknown key 'max_replica'"):
        serving_config(gallery=gallery_parquet, shard_autoscaling='{"max_replica": 2}')
    with pytest.raises(ConfigError, match="router_autoscaling.*max_replicas"):
        serving_config(
            gallery=gallery_parquet, router_autoscaling={"min_replicas": 3, "max_replicas": 2}
        )
    with pytest.raises(ConfigError, match="must be a JSON object"):
        serving_config(gallery=gallery_parquet, shard_autoscaling="[1, 2]")
    _, client = deploy(
        serve_port,
        tmp_path / "state",
        gallery_parquet,
        app="autoscaled",
        prefix="/autoscaled",
        num_shards=1,
        shard_autoscaling={"min_replicas": 1, "max_replicas": 3, "initial_replicas": 2},
        router_autoscaling='{"min_replicas": 1, "max_replicas": 2}',
        fsync=False,
    )
    try:
        deployments = serve.status().applications["autoscaled"].deployments
        assert set(deployments) >= {"router", "shard-0", "backfill"}
        st = client.status()
        assert len(st["shards"][0]["replicas"]) == 2  # initial_replicas
        assert _search(client.base, {"vectors": DATA.query_new[:2].tolist(), "k": 5})
    finally:
        serve.delete("autoscaled")


def test_two_replicas_per_shard_lose_nothing_when_one_is_killed(
    serve_port, gallery_parquet, token_file, tmp_path
):
    """R=2: a replica of shard 0 is killed during a live backfill under query load and admin
    upserts.  No query fails, every acknowledged upsert is served afterwards, every item is
    served exactly once throughout, and the backfill finishes."""
    import ray
    from ray import serve

    _, client = deploy(
        serve_port,
        tmp_path / "state",
        gallery_parquet,
        token_file,
        app="replicas",
        prefix="/replicas",
        num_shards=2,
        shard_replicas=2,
        snapshot_every=150,
    )
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
        client.start_backfill(policy="sequential", rate=100.0, batch_size=10, until=n - 60)
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
    try:
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
    finally:
        serve.delete("replicas")
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
