"""The guarded live upgrade through real HTTP on Ray Serve: the canary gate, rollback under a
shard kill, finalize, model identity, and the probe's findings (router replicas, storage
errors in /status, bodies of pause and finalize, an upsert refused whole by a full disk, replica
tags behind the token).

Two apps: ``gate`` (one shard) for both models of the canary gate (the second model's vectors
come from a pipeline output, after a rollback), and ``up`` (two shards, two routers) for the
other tests, in file order (the last of them fills shard 1's disk)."""

import json
import os
import time

import locations
import numpy as np
import pytest
import requests
from serving_helpers import (
    TOKEN,
    backfill_order,
    deploy,
    fill,
    metric_value,
    mount_tmpfs,
    reset_backfill,
    umount,
    undeploy,
    wait_for_metric,
)

from raycompat.embeddings.gallery import load_parquet
from raycompat.index.search import l2_normalize
from raycompat.serving.client import ServingHTTPError

APP = "upgrade"


pytestmark = pytest.mark.serve


@pytest.fixture(scope="module")
def up(serve_port, gallery_parquet, token_file, tmp_path_factory):
    """``(client, state dir, data, tmpfs)``: a 2-shard index with the default router replicas
    (two on the 4-CPU test cluster), its store on a 32 MiB tmpfs (a folder of the state dir
    where mounting is not permitted: ``None``) that test_an_upsert_refused_by_a_full_disk_...
    fills.  2 shards: a rollback goes on while shard 0 is killed; 2 routers: one is killed
    while the other answers."""
    state = tmp_path_factory.mktemp("upgrade_state")
    fs = str(tmp_path_factory.mktemp("upgrade_fs"))
    mounted = mount_tmpfs(fs, 32 << 20)
    _, client = deploy(serve_port, state, gallery_parquet, token_file, app=APP,
                       prefix="/upgrade", num_shards=2, router_replicas=0, metrics_interval_s=1.0,
                       store=fs if mounted else "")  # fmt: skip
    yield client, str(state), load_parquet(gallery_parquet), fs if mounted else None
    undeploy(APP)
    if mounted:
        umount(fs)


def call(client, method, path, body=None, token=TOKEN, **kw):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return requests.request(
        method, client.base + path, json=body, headers=headers, timeout=60, **kw
    )


def _items(app: str, n_shards: int = 2) -> dict[int, int]:
    """``{item id: representation code}`` over every shard; an id on two shards fails."""
    from ray import serve

    out = {}
    for s in range(n_shards):
        ids, codes = serve.get_deployment_handle(f"shard-{s}", app_name=app).items.remote().result()
        for i, c in zip(ids.tolist(), codes.tolist(), strict=True):
            assert i not in out, f"item {i} twice"
            out[i] = c
    return out


def _fingerprints(status: dict) -> dict[str, str]:
    return {m["representation"]: fp for fp, m in status["fingerprints"].items()}


def _kill_shard_replica(client, shard: int) -> int:
    import ray

    victim = client.status()["shards"][shard]
    ray.kill(ray.get_actor(victim["actor_name"], namespace="serve"), no_restart=True)
    return victim["pid"]


def _wait(check, timeout=180, what=""):
    t0 = time.time()
    while not (value := check()):
        assert time.time() - t0 < timeout, f"timed out waiting for {what}"
        time.sleep(0.2)
    return value


# ----------------------------------------------------------------------------- the canary gate
GATE_DATA = os.path.join(locations.TEST_DATA, "gate_embeddings.npz")


@pytest.fixture(scope="module")
def gate(tmp_path_factory):
    """``({"bct": parquet, "independent": parquet}, arrays)``: a glyph gallery embedded by a
    trained old model and two trained new models, BCT against it and an independent one
    (tests/data/make_gate_embeddings.py made the arrays)."""
    from raycompat.embeddings.gallery import GalleryEmbeddings
    from raycompat.serving.gallery_source import write_gallery_parquet

    with np.load(GATE_DATA) as z:
        arrays = {k: z[k] for k in z.files}
    root = tmp_path_factory.mktemp("gate")
    out = {}
    for new in ("bct", "independent"):
        data = GalleryEmbeddings(
            gallery_labels=arrays["g_lab"],
            gallery_old=arrays["old_g"],
            gallery_new=arrays[f"{new}_g"],
            query_labels=arrays["q_lab"],
            query_old=arrays["old_q"],
            query_new=arrays[f"{new}_q"],
            compatible_dim=arrays["old_g"].shape[1],
        )
        out[new] = write_gallery_parquet(str(root / f"{new}.parquet"), data)
    return out, arrays


def _gated_backfill(client, arrays, new, source):
    """Register the canary (``new``'s queries, by class, with the old model's), start a random
    backfill of vectors from ``source`` with the default canary and guards; returns once it
    stopped."""
    res = client.register_canary(
        arrays[f"{new}_q"], classes=arrays["q_lab"].tolist(), old_vectors=arrays["old_q"]
    )
    assert res["queries"] == arrays["q_lab"].size and res["old_vectors"], res
    client.start_backfill(policy="random", seed=0, source=source, restart=True)
    _wait(lambda: client.status()["backfill"]["state"] in ("paused", "done"), what="a stop")


def _log_lines(pid: int, needle: str) -> list[str]:
    """Lines of the Ray worker logs of process ``pid`` that contain ``needle``."""
    import glob

    import ray

    logs = ray._private.worker._global_node.get_logs_dir_path()
    lines = []
    for path in glob.glob(os.path.join(logs, f"worker-*-{pid}.*")):
        with open(path, errors="replace") as fh:
            lines += [line for line in fh if needle in line]
    return lines


def test_the_canary_gate_pauses_an_incompatible_model_and_lets_bct_finish(
    serve_port, token_file, tmp_path, gate, capsys
):
    """One app serves the glyph gallery with the independent model's new vectors; the canary
    pauses that backfill early (a resume needs ``override``).  Rolled back to its deployed
    state, the app backfills BCT's vectors (a pipeline output, ``source="pipeline"``) to the
    end, no guard tripped, and its canary history equals the simulator's offline canary curve
    of the BCT gallery."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from raycompat.backfill_store.commands import main as backfill_store_main
    from raycompat.simulator.job import BackfillJobOptions, run

    parquets, arrays = gate
    n = arrays["g_lab"].size
    item_ids = load_parquet(parquets["bct"]).gallery_ids
    assert np.array_equal(item_ids, load_parquet(parquets["independent"]).gallery_ids)
    bct_new = str(tmp_path / "bct_new.parquet")
    vectors = np.ascontiguousarray(arrays["bct_g"], np.float32)
    flat = pa.array(vectors.reshape(-1))
    pq.write_table(
        pa.table({"item_id": item_ids,
                  "new": pa.FixedSizeListArray.from_arrays(flat, vectors.shape[1])}),
        bct_new,
    )  # fmt: skip
    state = tmp_path / "state"
    # one shard: the canary gate is the backfill controller's, whatever the shards
    _, client = deploy(serve_port, state, parquets["independent"], token_file, app="gate",
                       prefix="/gate", num_shards=1,
                       pipeline_output=bct_new)  # fmt: skip
    try:
        _gated_backfill(client, arrays, "independent", source="gallery")
        bf = client.status()["backfill"]
        paused, point = bf["paused_by"], bf["canary"]["last"]
        assert bf["state"] == "paused" and paused and bf["position"] < 0.1 * n, bf
        assert paused["guard"] == point["guard"] and paused["reason"] == point["reason"]
        print(f"\nGATE independent: paused at {bf['position']} of {n} items upgraded by "
              f"{paused['guard']}: mAP@10 {point['map']:.4f} "
              f"(t=0 {point['reference_map']:.4f}, difference [{point['delta_low']:.4f}, "
              f"{point['delta_high']:.4f}]), NFR@1 {point['nfr']:.4f} "
              f"[{point['nfr_low']:.4f}, {point['nfr_high']:.4f}]")  # fmt: skip
        metrics = client.metrics()
        assert f'raycompat_serving_backfill_paused_by{{guard="{paused["guard"]}"}} 1.0' in metrics
        assert 'raycompat_serving_canary_nfr{bound="low"}' in metrics
        assert _log_lines(bf["pid"], "backfill paused by the canary guard")
        r = call(client, "POST", "/admin/backfill/resume", {})
        assert r.status_code == 409 and "override" in r.json()["error"], r.text
        assert call(client, "POST", "/admin/backfill/resume", {"override": True}).status_code == 200
        assert client.wait_backfill(n)["state"] == "done"
        bf = client.status()["backfill"]
        assert bf["override"] and not bf["paused_by"] and bf["canary"]["last"]["position"] == n
        assert _log_lines(bf["pid"], "resumed at position")
        reset_backfill(client)  # every item back to its deployed (old) vector
        _gated_backfill(client, arrays, "bct", source="pipeline")
        bf = client.status()["backfill"]
        history, store = bf["canary"]["history"], bf["store"]
        assert bf["state"] == "done" and not bf["paused_by"], bf
        assert not [p for p in history if p["guard"]] and history[-1]["position"] == n
        worst = min(history, key=lambda p: p["delta_high"])
        print(f"GATE bct: done, {len(history)} canary points, no guard tripped; the lowest "
              f"mAP difference [{worst['delta_low']:.4f}, {worst['delta_high']:.4f}] at "
              f"{worst['position']}, the highest NFR@1 "
              f"{max(p['nfr'] for p in history):.4f}")  # fmt: skip
    finally:
        undeploy("gate")
    # the canary, its reference and its points live in the store: backfill-store reads them
    assert backfill_store_main(["--store", store, "--status"]) == 0
    st = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert st["driver"]["what"] == "live index" and st["canary"]["reference"] == "old-old"
    assert st["canary"]["points"] == len(history) and st["canary"]["last"] == history[-1]
    opts = BackfillJobOptions(embeddings=parquets["bct"], policies="random", modes="compatible",
                              canary=store,
                              out=str(tmp_path / "sim"), plots=False, quiet=True)  # fmt: skip
    paths = run(opts)
    (curve,) = json.loads(open(paths["canary"]).read())["curves"]
    assert curve["policy"] == "random" and curve["reference"] == "old-old"
    assert curve["points"] == [{k: p[k] for k in curve["points"][0]} for p in history]


# ----------------------------------------------------------------------------- the upgrade app
def test_model_identity_rollback_under_a_shard_kill_stale_and_finalize(up):
    client, state, data, _ = up
    fp = _fingerprints(client.status())
    client.start_backfill(policy="random", seed=1, batch_size=25, until=300)
    _status_counts_agree_with_the_position(client, 300)
    order = backfill_order(client)
    st = client.status()
    assert st["items_by_model"] == {fp["old"]: 300, fp["new"]: 300}
    assert st["kept"] == {"items": 300}
    _refused_upserts(client, fp, int(order[400]))

    # roll back the last 200 upgraded items, slowly; a shard replica dies in the middle
    r = call(client, "POST", "/admin/backfill/rollback", {"to": 100, "batch_size": 10, "rate": 40})
    assert r.status_code == 200 and r.json()["state"] == "rolling_back", r.text
    _wait(lambda: client.status()["backfill"]["rollback"]["done"] >= 60, what="rollback")
    old_pid = _kill_shard_replica(client, 0)
    assert client.pause_backfill()["state"] == "paused"

    def settled():
        try:
            st = client.status()
        except ServingHTTPError:  # a 503 while shard 0 has no replica
            return None
        bf = st["backfill"]
        return st if st["shards"][0]["pid"] != old_pid and not bf["rollback_in_flight"] else None

    st = _wait(settled, what="the shard's replacement and the rollback batch")
    rb = st["backfill"]["rollback"]
    assert rb["state"] == "paused" and 60 <= rb["done"] < 200, rb
    items = _items(APP)  # every item exactly once, in one representation
    assert len(items) == 600 and sum(st["items"].values()) == 600
    back = {i for i in order[:300].tolist() if items[i] == 0}
    assert back == set(order[300 - rb["done"] : 300].tolist()) and rb["rolled_back"] == rb["done"]
    print(f"\nROLLBACK: {rb['done']} of 200 acknowledged when paused after the kill; "
          f"{len(back)} back in 'old', {st['items']['new']} new")  # fmt: skip
    _old_vectors_are_back(data, sorted(back)[:20])

    # finalize would drop the old vectors the paused rollback has still to return
    r = call(client, "POST", "/admin/backfill/finalize", {})
    assert r.status_code == 409, r.text
    assert (
        "rollback is unfinished" in r.json()["error"]
        and f"{rb['done']} of 200" in r.json()["error"]
    )
    assert client.status()["kept"]["items"] == 300 - rb["done"]  # nothing dropped

    bf = client.resume_backfill()  # the rollback goes on, then the backfill waits at 100
    assert bf["state"] == "rolling_back"
    _wait(lambda: client.status()["backfill"]["rollback"]["state"] == "done", what="the end")
    st = client.status()
    assert st["backfill"]["state"] == "paused" and st["backfill"]["position"] == 100
    assert st["items_by_model"] == {fp["old"]: 500, fp["new"]: 100} and st["kept"]["items"] == 100
    assert {i for i, c in _items(APP).items() if c == 2} == set(order[:100].tolist())
    assert _stale(client, fp["new"]) == order[100:].tolist()
    assert _stale(client, fp["old"], limit=1000) == order[:100].tolist()
    r = call(client, "GET", "/admin/stale", params={"model": "f" * 16})
    assert r.status_code == 404 and fp["new"] in r.json()["error"]

    r = call(client, "POST", "/admin/backfill/finalize", {})
    assert r.status_code == 200 and r.json()["dropped"] == 100, r.text
    st = client.status()
    assert st["kept"] == {"items": 0}
    metrics = client.metrics()
    assert "raycompat_serving_kept_items 0.0" in metrics
    assert f'raycompat_serving_items_by_model{{model="{fp["new"]}"}} 100.0' in metrics
    assert 'raycompat_serving_backfill_state{state="finalizing"} 0.0' in metrics
    r = call(client, "POST", "/admin/backfill/rollback", {})  # nothing kept: nothing can move
    assert r.status_code == 409 and "finalized at position 100" in r.json()["error"], r.text
    assert "100 old vector(s) dropped" in r.json()["error"]
    st = client.status()
    assert st["backfill"]["state"] == "paused" and st["items"]["new"] == 100


def _status_counts_agree_with_the_position(client, until: int) -> None:
    """While the backfill runs to ``until``, every /status read with the walk held
    (``counts_consistent``) counts exactly ``position`` new items (it used to read the shards
    before the controller: "paused at 150 with 148 new")."""
    agreed = 0
    while True:
        st = client.status()
        bf = st["backfill"]
        if bf["counts_consistent"]:
            assert st["items"]["new"] == bf["position"] and bf["in_flight"] is None, bf
            agreed += 1
        if bf["state"] == "paused" and bf["position"] == until:
            assert bf["counts_consistent"] and agreed, bf
            return
        assert bf["state"] == "running", bf
        time.sleep(0.05)


def _refused_upserts(client, fp: dict, item: int) -> None:
    """409 for an unknown fingerprint, a dimension or a representation not the model's."""
    vec = [0.5] * 24
    cases = [
        ({"model": "0123456789abcdef"}, ["0123456789abcdef", "24 dims", fp["new"]]),
        ({"model": fp["old"]}, [fp["old"], "16 dims", "has 24"]),
        ({"model": fp["adapted"]}, [fp["adapted"], "'adapted'", "'new'"]),
    ]
    for extra, named in cases:
        body = {"items": [{"id": item, "representation": "new", "vector": vec, **extra}]}
        r = call(client, "POST", "/admin/upsert", body)
        assert r.status_code == 409 and all(n in r.json()["error"] for n in named), r.text
    good = {"id": item, "representation": "new", "vector": vec, "model": fp["new"]}
    assert call(client, "POST", "/admin/upsert", {"items": [good]}).status_code == 200
    back = {"id": item, "representation": "old", "vector": [0.5] * 16, "model": fp["old"]}
    assert call(client, "POST", "/admin/upsert", {"items": [back]}).status_code == 200


def _old_vectors_are_back(data, ids: list[int]) -> None:
    from ray import serve

    row = {int(i): r for r, i in enumerate(data.gallery_ids.tolist())}
    for s in (0, 1):
        h = serve.get_deployment_handle(f"shard-{s}", app_name=APP)
        reps, vecs = h.lookup.remote(ids).result()
        for i, rep, v in zip(ids, reps, vecs, strict=True):
            if rep is not None:
                assert rep == "old"
                assert np.array_equal(v, l2_normalize(data.gallery_old[row[i]][None])[0])


def _stale(client, model: str, limit: int = 37) -> list[int]:
    ids, cursor = [], 0
    while cursor is not None:
        r = call(client, "GET", "/admin/stale", params={"model": model, "cursor": cursor,
                                                        "limit": limit})  # fmt: skip
        assert r.status_code == 200, r.text
        page = r.json()
        assert page["order"] == "backfill" and len(page["ids"]) <= limit
        ids += page["ids"]
        cursor = page["next_cursor"]
    assert len(set(ids)) == len(ids)
    return ids


def test_bodies_of_pause_and_canary_and_status_hides_replica_tags(up):
    client, _, _, _ = up
    headers = {"Authorization": f"Bearer {TOKEN}", "content-type": "application/json"}
    for path in ("/admin/backfill/pause", "/admin/backfill/finalize"):
        for raw in (b"garbage", b"[]", b'{"x": 1}', b"null"):
            r = requests.post(client.base + path, data=raw, timeout=60, headers=headers)
            assert r.status_code == 422, (path, raw, r.status_code, r.text)
            assert r.json()["error"]
        assert call(client, "POST", path).status_code in (200, 409)
        assert call(client, "POST", path, {}).status_code in (200, 409)
    bad_canaries = [  # the canary's bad input: 4xx naming the problem
        ({"vectors": [[0.5] * 24], "classes": ["no-such-class"]}, 404, "no-such-class"),
        ({"vectors": [[0.5] * 24], "relevant_ids": [[5]]}, 404, "[5]"),
        ({"vectors": [[0.5] * 16], "classes": ["3"]}, 422, "dimension mismatch"),
        ({"vectors": [[0.5] * 24], "classes": ["3", "4"]}, 422, "'classes' has 2 rows"),
        ({"vectors": [[0.5] * 24]}, 422, "exactly one of 'relevant_ids' or 'classes'"),
    ]
    for body, status, named in bad_canaries:
        r = call(client, "POST", "/admin/canary", body)
        assert r.status_code == status and named in r.json()["error"], r.text
    api = requests.get(client.base + "/openapi.json", timeout=60).json()
    assert (
        "nothing of the request is applied" in api["paths"]["/admin/upsert"]["post"]["description"]
    )
    public = requests.get(client.base + "/status", timeout=60)
    assert public.status_code == 200
    text = public.text
    admin = client.status()
    tags = [r["replica"] for s in admin["shards"] for r in s["replicas"]]
    assert tags and all(t and t not in text for t in tags) and '"replica"' not in text
    assert admin["router"]["replica"] and admin["router"]["pid"]


def test_two_router_replicas_by_default_and_a_survivor_answers_when_one_dies(up):
    """The default on a cluster with CPUs is two router replicas; when one dies, the next
    request is answered by the other (with one replica it would wait for Serve to start a
    replacement).  A stream of upserts runs across the kill: every acknowledged one is served
    afterwards (its vector, normalised again by the store), and every item is on one shard in
    one representation."""
    import threading

    import ray
    from ray import serve
    from ray.util.state import list_actors

    from raycompat.serving.placement import shard_of

    client, _, _, _ = up
    gcs = ray.get_runtime_context().gcs_address
    routers = [
        a
        for a in list_actors(address=gcs, filters=[("state", "=", "ALIVE")], limit=10_000)
        if a.class_name == f"ServeReplica:{APP}:router"
    ]
    assert len(routers) == 2, routers
    # the counters are the sum over both routers (Ray's metrics agent): whichever one answers
    # a scrape, they never go down, and they reach every search sent
    searches = 'raycompat_serving_requests_total{endpoint="/search",status="200"}'
    before = [metric_value(client.metrics(), searches)]
    for j in range(6):
        client.search(np.eye(1, 24, j), k=3)
    seen = wait_for_metric(client, searches, before[-1] + 6)
    seen += [metric_value(client.metrics(), searches) for _ in range(6)]
    assert before + seen == sorted(before + seen) and seen[-1] >= before[-1] + 6, (before, seen)
    victim, survivor = routers
    old = np.asarray(sorted(i for i, c in _items(APP).items() if c == 0))[-40:]
    rng = np.random.default_rng(7)
    vecs = rng.standard_normal((old.size, 24)).astype(np.float32)
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    acked, outcomes, stop = {}, [], threading.Event()

    def stream():
        for j, (i, v) in enumerate(zip(old.tolist(), vecs, strict=True)):
            if stop.is_set():
                return
            item = {"id": i, "representation": "new", "vector": v.tolist()}
            r = call(client, "POST", "/admin/upsert", {"items": [item]})
            outcomes.append(r.status_code)
            if r.status_code == 200:
                acked[i] = j
            else:  # a request the proxy still sent to the dead router: JSON 503, retryable
                assert r.status_code == 503 and "error" in r.json(), r.text

    writer = threading.Thread(target=stream)
    writer.start()
    _wait(lambda: len(outcomes) >= 5, timeout=60, what="upserts before the kill")
    ray.kill(ray.get_actor(victim.name, namespace="serve"), no_restart=True)
    for _ in range(20):  # a request the proxy still sends to the dead replica is a 503
        try:
            first = client.status()["router"]
            break
        except ServingHTTPError as exc:
            assert exc.status == 503, exc
    assert first["pid"] == survivor.pid != victim.pid  # not a replacement: nobody waited
    answered = {client.status()["router"]["pid"] for _ in range(10)}
    assert victim.pid not in answered
    writer.join(120)
    stop.set()
    assert len(outcomes) == old.size and len(acked) >= old.size - 5, outcomes
    ids = np.asarray(sorted(acked))
    on = shard_of(ids, 2)
    for s in (0, 1):
        h = serve.get_deployment_handle(f"shard-{s}", app_name=APP)
        reps, got = h.lookup.remote(ids[on == s]).result()
        assert reps == ["new"] * int((on == s).sum())
        want = vecs[[acked[i] for i in ids[on == s].tolist()]]
        assert np.allclose(np.asarray(got, np.float32), want, rtol=0, atol=1e-6)  # unit again
    assert len(_items(APP)) == client.status()["items"]["old"] + client.status()["items"]["new"]


def test_an_upsert_refused_by_a_full_disk_applies_nothing_and_is_retried_whole(up):
    """The store on a full disk: an upsert over both shards is one commit, refused whole with
    the store's reason (503, nothing applied on any shard); /status still answers, and the
    same upsert retried once there is space applies everything."""
    from ray import serve

    from raycompat.serving.placement import shard_of

    client, _, _, fs = up
    if fs is None:
        pytest.skip("cannot mount a tmpfs here")
    old = np.asarray(sorted(i for i, c in _items(APP).items() if c == 0))  # 6 old items a shard
    ids = np.concatenate([old[shard_of(old, 2) == s][:6] for s in (0, 1)])
    on = shard_of(ids, 2)
    rng = np.random.default_rng(0)
    vecs = rng.standard_normal((12, 24)).round(3)
    items = [
        {"id": int(i), "representation": "new", "vector": v.tolist()}
        for i, v in zip(ids, vecs, strict=True)
    ]
    new_before = client.status()["items"]["new"]
    fill(fs)
    try:
        r = call(client, "POST", "/admin/upsert", {"items": items})
        error = r.json()["error"]
        assert r.status_code == 503 and "nothing of the upsert was applied" in error, r.text
        assert "no space left on device" in error.lower() and "refused the write" in error
        assert client.status()["items"]["new"] == new_before
        for s in (0, 1):
            h = serve.get_deployment_handle(f"shard-{s}", app_name=APP)
            reps, _ = h.lookup.remote(ids[on == s]).result()
            assert reps == ["old"] * int((on == s).sum())
    finally:
        os.unlink(os.path.join(fs, "filler"))
    assert client.upsert(items)["applied"] == 12
    assert client.status()["items"]["new"] == new_before + 12
