"""The live index through real HTTP on Ray Serve: bad input and auth, offline == online against
the simulator, durability under a replica kill, and a schemathesis fuzz of the OpenAPI schema.

Deploying an app costs seconds (a new process per replica), so the tests share apps where they
can: ``api`` (small limits) for the input and auth tests, ``live`` (compatible mode) for the tests
that backfill and kill replicas -- each of them starts with :func:`reset_backfill`, which rolls
every upgraded item back to its deployed vector -- ``rank_merge_app`` for both rank_merge
policies, and ``disk_app`` (a tiny tmpfs) for the full-disk and fault-injection tests.  A
module's apps run until the module ends (about 0.8 CPU-seconds a minute per replica, idle), so
each app's tests are together, in this order: ``api`` first (its last test stops it), ``disk_app``
last.  The tests that need an app of their own (another mode or gallery, a state directory on
a tiny tmpfs, a deploy that must fail) deploy it and delete it without waiting for its replicas
to stop.  An app has one shard unless a test checks what needs two (the layout of a 2-shard
index, results merged across shards, one shard killed or frozen while the other serves,
resharding), and each 2-shard app says which: the router merges the shards' top-k the same way
in every mode, so the ``live`` app's 2 shards test that merge for the 1-shard apps of the other
modes.  ``RAYCOMPAT_TEST_SCALE=full`` restores the earlier sizes (serving_helpers.scaled)."""

import base64
import contextlib
import io
import os
import threading
import time
import types

import locations
import numpy as np
import pytest
import requests
from serving_helpers import (
    TOKEN,
    backfill_order,
    cpu_index,
    deploy,
    fill,
    labelled_embeddings,
    mount_tmpfs,
    reset_backfill,
    scaled,
    umount,
    undeploy,
    wait_for_metric,
)

from raycompat.embeddings.gallery import load_parquet
from raycompat.serving.client import ServingHTTPError
from raycompat.serving.gallery_source import write_gallery_parquet
from raycompat.simulator.memory_engine import simulate_backfill


@pytest.fixture(scope="module")
def api_index(serve_port, gallery_parquet, token_file, tmp_path_factory):
    """``(flags, exit status, stdout)`` of `serve-index` deploying on the running Serve the
    index of the input, auth and fuzz tests: 2 shards with small limits, 1 router, the router's
    shard timeout at 3 s (the proxy test, the app's last, freezes a shard, then stops
    the index with ``--stop``).  2 shards: test_search_status_metrics_and_openapi checks that
    ``--num-shards 2`` splits the gallery over both, and the proxy test freezes shard 0 while
    shard 1 answers."""
    from raycompat.serving.job import main

    flags = ["--gallery", gallery_parquet, "--token-file", token_file,
             "--state-dir", str(tmp_path_factory.mktemp("api_state")), "--app-name", "api",
             "--route-prefix", "/api", "--num-shards", "2", "--router-replicas", "1",
             "--max-k", "50", "--max-queries", "4", "--max-image-bytes", "4096",
             "--max-upsert-items", "8", "--max-body-bytes", str(64 << 10),
             "--shard-timeout-s", "3", "--index-device", "cpu",
             "--metrics-interval-s", "1"]  # fmt: skip
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main([*flags, "--port", str(serve_port), "--wait-s", "120"])
    yield flags, code, out.getvalue()
    undeploy("api")  # where the proxy test did not stop it


@pytest.fixture(scope="module")
def api(api_index, serve_port):
    from raycompat.serving.client import ServingClient

    _, code, out = api_index
    assert code == 0, out
    return ServingClient(f"http://127.0.0.1:{serve_port}/api", token=TOKEN)


def post(client, path, body=None, raw=None, token=None):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    if raw is not None:
        headers["content-type"] = "application/json"
        return requests.post(client.base + path, data=raw, headers=headers, timeout=30)
    return requests.post(client.base + path, json=body, headers=headers, timeout=30)


def png_b64(size=8):
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.full((size, size), 128, np.uint8)).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


@pytest.mark.serve
def test_search_status_metrics_and_openapi(api, gallery_parquet):
    data = load_parquet(gallery_parquet)
    ids, scores, reps = api.search(data.query_new[:3], k=5)
    assert (
        (ids >= 0).all() and (np.diff(scores, axis=1) <= 0).all() and set(reps.ravel()) == {"old"}
    )
    assert set(ids.ravel()) <= set(data.gallery_ids.tolist())
    st = api.status()
    assert st["items"] == {"old": 600, "adapted": 0, "new": 0} and len(st["shards"]) == 2
    assert (
        sum(s["items"]["old"] for s in st["shards"]) == 600
        and min(s["items"]["old"] for s in st["shards"]) > 0
    )
    # the counters reach /metrics through Ray's metrics agent, within --metrics-interval-s
    searches = 'raycompat_serving_requests_total{endpoint="/search",status="200"}'
    assert wait_for_metric(api, searches, 1)[-1] >= 1
    text = api.metrics()
    assert "raycompat_serving_items{" in text and "raycompat_serving_request_seconds_bucket" in text
    spec = requests.get(api.base + "/openapi.json", timeout=10).json()
    for path in (
        "/search",
        "/status",
        "/metrics",
        "/admin/upsert",
        "/admin/backfill/start",
        "/admin/backfill/pause",
        "/admin/backfill/resume",
    ):
        assert path in spec["paths"], path
    search_schema = spec["components"]["schemas"]["SearchRequest"]["properties"]["k"]
    assert search_schema["maximum"] == 50
    assert requests.get(api.base + "/healthz", timeout=10).json() == {"ok": True}


BAD_SEARCH = [
    ("{bad json", "malformed JSON"),
    ('{"vectors": [[1, 2, 3]], "k": 5}', "dimension mismatch"),
    ('{"vectors": [[NaN' + ", 0" * 23 + ']], "k": 5}', "finite number"),
    ('{"vectors": [[Infinity' + ", 0" * 23 + ']], "k": 5}', "finite number"),
    ('{"vectors": [[' + ", ".join(["0"] * 24) + ']], "k": 5}', "zero vector"),
    ('{"vectors": [[' + ", ".join(["1"] * 24) + ']], "k": 0}', "body.k"),
    ('{"vectors": [[' + ", ".join(["1"] * 24) + ']], "k": 51}', "body.k"),
    ('{"vectors": [[' + ", ".join(["1"] * 24) + ']], "k": -3}', "body.k"),
    ('{"vectors": ' + str([[1.0] * 24] * 5) + ', "k": 5}', "body.vectors"),
    ('{"vectors": [[1, 2], [1, 2, 3]], "k": 5}', "dimension mismatch"),
    ('{"k": 5}', "exactly one of"),
    ('{"vectors": [[1]], "images": ["AAAA"], "k": 5}', "exactly one of"),
    ('{"images": ["%%%not base64"], "k": 5}', "base64"),
    (
        '{"images": ["' + base64.b64encode(b"not an image at all").decode() + '"], "k": 5}',
        "PNG or JPEG",
    ),
    ('{"vectors": [[' + ", ".join(["1"] * 16) + ']], "k": 5, "model": "older"}', "body.model"),
    ('{"vectors": [["a"]], "k": 5}', "body.vectors[0][0]"),
    ("[1, 2, 3]", "body"),
    ('{"vectors": [[' + ", ".join(["1"] * 24) + ']], "k": true}', "body.k"),
    ('{"vectors": [[' + ", ".join(["1"] * 24) + ']], "k": "10"}', "body.k"),
    ('{"vectors": [["1"' + ", 1" * 23 + "]]}", "body.vectors[0][0]"),
    ('{"vectors": [[true' + ", 1" * 23 + "]]}", "body.vectors[0][0]"),
    ('{"vectors": ' + "[" * 10_000 + "]" * 10_000 + "}", "nested too deeply"),
    ('{"vectors": [[1e39' + ", 0" * 23 + ']], "k": 5}', "overflow"),
]


@pytest.mark.serve
@pytest.mark.parametrize("raw,needle", BAD_SEARCH)
def test_bad_search_input_is_a_4xx_naming_the_problem(api, raw, needle):
    r = post(api, "/search", raw=raw)
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    body = r.json()
    assert needle in body["error"] or any(
        needle in p["field"] or needle in p["message"] for p in body["problems"]
    ), body


@pytest.mark.serve
def test_image_input_errors(api):
    # no new model configured: image search is refused with a 400 naming the reason
    r = post(api, "/search", {"images": [png_b64()], "k": 3})
    assert r.status_code == 400 and "new model" in r.json()["error"]
    big = base64.b64encode(b"\x89PNG" + b"0" * 5000).decode()
    r = post(api, "/search", {"images": [big], "k": 3})
    assert r.status_code == 422 and "body.images" in r.json()["error"]


@pytest.mark.serve
def test_admin_auth_and_upsert_errors(api):
    vec = [0.5] * 24
    item = {"id": 3, "representation": "new", "vector": vec}
    assert post(api, "/admin/upsert", {"items": [item]}).status_code == 401
    r = post(api, "/admin/upsert", {"items": [item]}, token="wrong-token-xxxxxxxxxxxx")
    assert r.status_code == 401 and "invalid admin token" in r.json()["error"]
    r = requests.post(
        api.base + "/admin/backfill/start", json={}, headers={"Authorization": "Basic abc"}
    )
    assert r.status_code == 401
    for path in ("/admin/backfill/pause", "/admin/backfill/resume"):
        assert post(api, path, {}).status_code == 401
    r = post(api, "/admin/upsert", {"items": [dict(item, id=4)]}, token=TOKEN)
    assert (
        r.status_code == 404 and "unknown item id" in r.json()["error"] and "4" in r.json()["error"]
    )
    r = post(api, "/admin/upsert", {"items": [dict(item, vector=[1.0] * 16)]}, token=TOKEN)
    assert r.status_code == 422 and "dimension mismatch" in r.json()["error"]
    r = post(api, "/admin/upsert", {"items": [dict(item, representation="newest")]}, token=TOKEN)
    assert r.status_code == 422 and "representation" in r.json()["error"]
    r = post(api, "/admin/upsert", {"items": [item, item]}, token=TOKEN)
    assert r.status_code == 422 and "duplicate" in r.json()["error"]
    r = post(api, "/admin/upsert", {"items": [item] * 9}, token=TOKEN)
    assert r.status_code == 422 and "body.items" in r.json()["error"]
    r = post(api, "/admin/backfill/start", {"policy": "uncertainty:margin"}, token=TOKEN)
    assert r.status_code == 400 and "head" in r.json()["error"]
    r = post(api, "/admin/backfill/start", {"policy": "best"}, token=TOKEN)
    assert r.status_code == 422 and "body.policy" in r.json()["error"]
    for bad, where in (({"restart": "yes"}, "body.restart"), ({"seed": "1"}, "body.seed")):
        r = post(api, "/admin/backfill/start", bad, token=TOKEN)
        assert r.status_code == 422 and where in r.json()["error"], r.text
    r = post(api, "/admin/upsert", {"items": [dict(item, id="3")]}, token=TOKEN)
    assert r.status_code == 422 and "body.items[0].id" in r.json()["error"]
    # a good upsert: item 3 moves to 'new' atomically, then back to 'old'; nothing else changes
    assert api.upsert([item])["applied"] == 1
    st = api.status()["items"]
    assert st == {"old": 599, "adapted": 0, "new": 1}
    ids, _, reps = api.search(np.asarray([vec]), k=1)
    assert ids[0, 0] == 3 and reps[0, 0] == "new"
    assert api.upsert([{"id": 3, "representation": "old", "vector": [0.25] * 16}])["applied"] == 1
    assert api.status()["items"] == {"old": 600, "adapted": 0, "new": 0}


@pytest.mark.serve
def test_admin_token_and_body_size_are_checked_before_the_body_is_read(api):
    # without the token: 401 at once, whatever the body (not a 400/422 from parsing it)
    r = post(api, "/admin/upsert", raw=b"{not json" * 1000)
    assert r.status_code == 401 and r.headers["WWW-Authenticate"] == "Bearer"
    big = b'{"items": [' + b"0," * 100_000 + b"0]}"  # 200 kB, over the 64 KiB limit
    r = post(api, "/admin/upsert", raw=big)
    assert r.status_code == 401
    # with the token, or on a public path: 413 from Content-Length, naming the limit
    r = post(api, "/admin/upsert", raw=big, token=TOKEN)
    assert r.status_code == 413 and "65,536 bytes" in r.json()["error"]
    r = post(api, "/search", raw=big)
    assert r.status_code == 413 and r.json()["problems"][0]["field"] == "body"

    def chunks():  # no Content-Length: counted while it arrives
        for _ in range(50):
            yield b" " * 4096

    r = requests.post(
        api.base + "/search", data=chunks(), headers={"content-type": "application/json"}
    )
    assert r.status_code == 413 and "exceeds the limit of 65,536 bytes" in r.json()["error"]
    ok = post(api, "/search", {"vectors": [[0.5] * 24], "k": 3})
    assert ok.status_code == 200
    # the scheme is case-insensitive (RFC 7235), the token is not
    lower = {"Authorization": f"bearer {TOKEN}"}
    r = requests.post(api.base + "/admin/backfill/pause", headers=lower, timeout=30)
    assert r.status_code == 200
    upper = {"Authorization": f"Bearer {TOKEN.upper()}"}
    assert requests.post(api.base + "/admin/backfill/pause", headers=upper).status_code == 401
    # /docs and /redoc load scripts from a CDN: off unless api_docs; the schema stays
    assert requests.get(api.base + "/docs").status_code == 404
    assert requests.get(api.base + "/redoc").status_code == 404
    assert requests.get(api.base + "/openapi.json").status_code == 200


@pytest.mark.serve
def test_binds_loopback_only(api):
    from raycompat.serving.config import serving_config

    assert serving_config(gallery="synthetic:10").host == "127.0.0.1"
    assert api.base.startswith("http://127.0.0.1:")


@pytest.mark.serve
def test_old_vectors_are_refused_outside_naive_merge(api):
    r = post(api, "/search", {"vectors": [[0.1] * 24], "old_vectors": [[0.1] * 16], "k": 3})
    assert r.status_code == 422 and "naive_merge" in r.text, r.text


# ----------------------------------------------------------------------------- fuzz
@pytest.mark.serve
def test_fuzz_openapi_no_5xx(api):
    """Positive and negative cases generated from /openapi.json for every operation (admin calls
    with the token, so validation is reached); no response may be a 5xx.  12 examples per
    operation by default, 30 at full scale (more of hypothesis' space of each operation)."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from schemathesis.generation.modes import GenerationMode

    schema = schemathesis.openapi.from_url(api.base + "/openapi.json")
    server_errors, calls, codes = [], [0], {}
    for result in schema.get_all_operations():
        op = result.ok()
        strategy = st.one_of(
            op.as_strategy(GenerationMode.POSITIVE), op.as_strategy(GenerationMode.NEGATIVE)
        )

        @settings(
            max_examples=scaled(12, 30),
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(case=strategy)
        def check(case):
            calls[0] += 1
            r = case.call(
                base_url=api.base, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30
            )
            codes[r.status_code] = codes.get(r.status_code, 0) + 1
            if r.status_code >= 500:
                server_errors.append((case.method, case.path, r.status_code, r.text[:200]))

        check()
    print(f"\nFUZZ: {calls[0]} generated requests, status codes {dict(sorted(codes.items()))}")
    assert calls[0] > 100 and any(400 <= c < 500 for c in codes) and 200 in codes
    assert not server_errors, server_errors[:5]


# ----------------------------------------------------------------------------- Serve's proxy
@pytest.mark.serve
def test_serve_index_refuses_another_port_when_serve_runs_and_deploys_on_its_own(
    api_index, serve_port, capsys
):
    """With Serve already running, `serve-index` on another port exits 2 naming the running
    address; on the running address it deploys and answers (the ``api`` index of the tests
    above; it stops with ``--stop``:
    test_requests_in_flight_when_replicas_die_get_json_503_with_retry_after)."""
    from raycompat.serving.app import free_port
    from raycompat.serving.job import main

    flags, code, out = api_index
    other = free_port()
    assert main([*flags, "--port", str(other)]) == 2
    err = capsys.readouterr().err
    assert f"Serve is already running on this cluster with HTTP at 127.0.0.1:{serve_port}" in err
    assert f"--port {serve_port}" in err and "Traceback" not in err
    assert code == 0 and f"serving at http://127.0.0.1:{serve_port}/api" in out, out
    st = requests.get(f"http://127.0.0.1:{serve_port}/api/status", timeout=30).json()
    assert sum(st["items"].values()) == 600


def _replica_of(app: str, deployment: str):
    import ray
    from ray.util.state import list_actors

    actors = list_actors(  # this session's cluster, even when another one runs here
        address=ray.get_runtime_context().gcs_address,
        filters=[("state", "=", "ALIVE"), ("class_name", "=", f"ServeReplica:{app}:{deployment}")],
    )
    return ray.get_actor(actors[0].name, namespace="serve"), actors[0].pid


def _post_search(base, q, out, stop=None, timeout=120):
    """POST /search until ``stop`` (once if ``stop`` is None); append ``(status, json?,
    retry-after?, seconds)``."""
    sess = requests.Session()
    while True:
        t = time.time()
        r = sess.post(base + "/search", json={"vectors": q, "k": 5}, timeout=timeout)
        is_json = r.headers.get("content-type", "").startswith("application/json")
        out.append((r.status_code, is_json, r.headers.get("retry-after"), time.time() - t))
        if stop is None or stop.is_set():
            return


@pytest.mark.serve
def test_requests_in_flight_when_replicas_die_get_json_503_with_retry_after(api_index, serve_port):
    """A router killed with a request in flight, shards that stop answering, and an app stopped
    (`serve-index --stop`) under load: every answer is JSON, every failure a 503 with
    Retry-After (never a plain-text 500), and no request hangs."""
    import signal

    import ray

    from raycompat.serving.client import ServingClient
    from raycompat.serving.job import main

    client = ServingClient(f"http://127.0.0.1:{serve_port}/api", token=TOKEN)
    q = np.random.default_rng(0).standard_normal((2, 24)).tolist()
    out: list = []
    try:
        _, shard_pid = _replica_of("api", "shard-0")
        os.kill(shard_pid, signal.SIGSTOP)  # the shard hangs: requests wait in the router
        try:
            _post_search(client.base, q, out)  # the router's shard timeout: 503
            th = threading.Thread(target=_post_search, args=(client.base, q, out))
            th.start()
            time.sleep(0.5)
            router, _ = _replica_of("api", "router")
            ray.kill(router, no_restart=True)  # with that request in flight
            th.join(timeout=150)
        finally:
            os.kill(shard_pid, signal.SIGCONT)
        assert len(out) == 2 and all(o[:3] == (503, True, "1") for o in out), out
        client.wait_ready()
        stop = threading.Event()
        threads = [threading.Thread(target=_post_search, args=(client.base, q, out, stop))
                   for _ in range(3)]  # fmt: skip
        for th in threads:
            th.start()
        time.sleep(0.5)
        shard, _ = _replica_of("api", "shard-0")
        ray.kill(shard, no_restart=True)
        assert main(["--stop", "--app-name", "api"]) == 0
        stop.set()
        for th in threads:
            th.join(timeout=150)
        assert not any(th.is_alive() for th in threads)
    finally:
        undeploy("api")
    codes = sorted({o[0] for o in out})
    print(f"\nPROXY: {len(out)} requests, codes {codes}, slowest {max(o[3] for o in out):.1f} s")
    assert all(o[1] for o in out), "a plain-text answer"
    assert all(o[0] in (200, 404, 503) for o in out), codes
    assert all(o[2] == "1" for o in out if o[0] == 503)


# ----------------------------------------------------------------------------- without Serve


def test_fct_needs_a_new_model_with_an_fct_module(gallery_parquet, rank_merge_bundle, tmp_path):
    from raycompat.config import ConfigError
    from raycompat.serving.app import build_app
    from raycompat.serving.config import serving_config

    for new_model, named in ((None, "fct.*new_model"), (rank_merge_bundle, "no fct module")):
        kw = {"new_model": new_model} if new_model else {}
        with pytest.raises(ConfigError, match=named):
            build_app(
                serving_config(gallery=gallery_parquet, state_dir=str(tmp_path), mode="fct", **kw)
            )


def test_rank_merge_needs_rho_and_psi_rev(gallery_parquet, tmp_path):
    from raycompat.config import ConfigError
    from raycompat.serving.app import build_app
    from raycompat.serving.config import serving_config

    with pytest.raises(ConfigError, match="rank_merge.*new_model"):
        build_app(
            serving_config(gallery=gallery_parquet, state_dir=str(tmp_path), mode="rank_merge")
        )


@pytest.mark.parametrize("mode", ["compatible", "adapted", "fct", "rank_merge", "naive_merge"])
def test_hot_refresh_tiny_training_plan_ends_with_the_served_model(mode):
    """Every served mode's default training trains the bundle it then serves, after the models
    that bundle depends on, each config checked the way the trainer checks it."""
    from raycompat.data import build_scenario, default_catalog
    from raycompat.hot_refresh import HotRefreshOptions, new_model_name, tiny_training_plan
    from raycompat.train import TrainConfig

    scenario = build_scenario(
        "extended-class",
        catalog=default_catalog(),
        num_train_classes=40,
        images_per_class=8,
        num_eval_classes=4,
        queries_per_class=1,
        gallery_per_class=2,
        num_distractor_classes=2,
        distractors_per_class=1,
        seed=0,
    )
    plan = tiny_training_plan(mode, 8, 6)
    names = [p[0] for p in plan]
    assert names[0] == "old" and names[-1] == new_model_name(HotRefreshOptions(mode=mode))
    for i, (_name, method, split, epochs, pred, init) in enumerate(plan):
        assert all(dep in names[:i] for dep in (pred, init) if dep)  # dependencies come first
        TrainConfig.from_dict(
            dict(
                method=method,
                backbone="test_resnet",
                epochs=epochs,
                split=split,
                batch_size=64,
                scenario=scenario.to_dict(),
                old_model="/x/old" if pred else None,
                init_model="/x/new" if init else None,
            ),
            check_paths=False,
        )


@pytest.mark.parametrize(
    "job, args, named",
    [
        ("hot_refresh.py", ["--polcy", "random"], "unrecognized arguments: --polcy"),
        ("hot_refresh.py", ["--eval", "12"], "unrecognized arguments: --eval"),  # no abbreviations
        ("hot_refresh.py", ["--policy", "fastest"], "option 'policy' = 'fastest' is not allowed"),
        ("hot_refresh.py", ["--fractions", "0,2"], "--fractions '0,2'"),
        ("serve_index.py", ["--num-shard", "2"], "unrecognized arguments: --num-shard"),
        ("serve_index.py", ["--num-shards", "0"], "option 'num_shards' = 0 must be >= 1"),
        ("serve_index.py", ["--index", "annoy"], "option 'kind' = 'annoy' is not allowed"),
        (
            "serve_index.py",
            ["--gallery", "synthetic:100", "--shard-autoscaling", '{"max_replica": 2}'],
            "option 'shard_autoscaling': unknown key 'max_replica'",
        ),
        (
            "serve_index.py",
            ["--proxy-location", "Nowhere"],
            "option 'proxy_location' = 'Nowhere' is not allowed",
        ),
    ],
)
@pytest.mark.subprocess
def test_hot_refresh_and_serve_index_bad_flags_exit_2_on_stderr(tmp_path, job, args, named):
    """A misspelt flag or a bad value stops the job before Ray starts: exit status 2, one
    `error:` line naming it on stderr, nothing on stdout, nothing written."""
    import subprocess
    import sys

    repo = locations.REPO
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    out = tmp_path / "out"
    extra = ["--out", str(out)] if job == "hot_refresh.py" else ["--state-dir", str(out)]
    r = subprocess.run(
        [sys.executable, os.path.join(repo, "jobs", job), *extra, *args],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stdout == ""
    assert named in r.stderr and "error:" in r.stderr and "Traceback" not in r.stderr
    assert not out.exists()


# ----------------------------------------------------------------------------- the hot_refresh job
@pytest.fixture
def one_router(monkeypatch):
    """The hot_refresh job deploys the default router count, two on this cluster (a process
    each); its tests check the report, so they run one.  The default of two is checked by
    test_serving_upgrade.py::test_two_router_replicas_by_default_and_a_survivor_answers_..."""
    monkeypatch.setattr("raycompat.serving.app.router_replicas", lambda cfg, cluster_cpus=None: 1)


@pytest.mark.serve
def test_hot_refresh_job_live_equals_simulator_with_storage(serve_port, one_router, tmp_path):
    """`run_hot_refresh` (what `python jobs/hot_refresh.py` runs) on a glyph scenario embedded
    by random-init models -- weak embeddings full of near-ties -- writing to `--storage`: the
    curve measured through HTTP equals the simulator's exactly at every fraction."""
    import dataclasses
    import json

    from raycompat.hot_refresh import TINY_SIZES, HotRefreshOptions, run_hot_refresh
    from raycompat.pipeline.bundles import make_random_bundles

    models = tmp_path / "models"
    make_random_bundles(
        str(models),
        backbone="test_resnet",
        old_dim=24,
        new_dim=24,
        num_classes=8,
        psi_hidden=32,
        resolution=32,
    )
    store = tmp_path / "store"
    opts = HotRefreshOptions(
        models=str(models),
        new_name="new",
        storage=str(store),
        name="tiny",
        port=serve_port,
        policy="sequential",
        k=20,
        num_shards=1,  # the curves and the report; merging across shards: the live app's tests
        index=cpu_index(),
        batch_size=23,
        fractions="0,0.3,0.6,1",
        sizes=dataclasses.replace(
            TINY_SIZES,
            eval_classes=12,
            queries_per_class=2,
            gallery_per_class=5,
            distractor_classes=4,
            distractors_per_class=3,
        ),
    )
    report = run_hot_refresh(opts, log=lambda m: None)
    out = store / "hot_refresh" / "tiny"
    assert report["out"] == str(out)
    assert json.loads((out / "report.json").read_text())["comparison"]["equal"] is True
    assert "-> **equal**" in (out / "report.md").read_text()
    cmp = report["comparison"]
    assert cmp["equal"], cmp
    assert report["live"]["counts"] == report["simulator"]["counts"] == [0, 22, 43, 72]
    m = report["live"]["metrics"]["mAP@20"]
    assert m[0] != m[-1]  # the backfill changed the ranking
    assert report["final_status"]["items"]["new"] == 72
    band = report["simulator"]["bands"]["mAP@20"]  # the simulated curve's bootstrap band
    sim = report["simulator"]["metrics"]["mAP@20"]
    assert all(lo <= v <= hi for lo, v, hi in zip(band["low"], sim, band["high"], strict=True))
    # the live curve's band, from the live searches' per-query values: inside it, and (the
    # same per-query values, the same draws) the simulator's band
    for metric in ("mAP@20", "top1", "NFR@1"):
        live_band, values = report["live"]["bands"][metric], report["live"]["metrics"][metric]
        lows, highs = live_band["low"], live_band["high"]
        # a point whose resamples are undefined past 1 % (NFR with few old-old successes) has
        # no interval: its bounds are NaN (None in report.json), and only then
        resamples = opts.bootstrap.resamples
        for lo, v, hi, dropped in zip(lows, values, highs, live_band["dropped"], strict=True):
            refused = dropped > 0.01 * resamples
            assert refused == (lo is None or lo != lo), (metric, lo, dropped)
            assert refused or lo <= v <= hi, (metric, lo, v, hi)
        sim_band = report["simulator"]["bands"][metric]
        for side in ("low", "high"):
            assert live_band[side] == pytest.approx(sim_band[side], abs=1e-9, nan_ok=True), (
                metric,
                side,
            )
    markdown = (out / "report.md").read_text()
    row = next(ln for ln in markdown.splitlines() if ln.startswith("| 30% |"))
    assert row.count("[") >= 5  # recall, mAP@20 and top1 live and simulated, with intervals
    assert "![live vs simulator](live_vs_simulator.png)" in markdown
    assert (out / "live_vs_simulator.png").read_bytes()[:4] == b"\x89PNG"
    # the exact index: the served results are the exact top-k at every fraction
    assert report["live"]["recall"] == [1.0, 1.0, 1.0, 1.0]
    assert report["live"]["bands"]["recall@20"] == {
        "low": [1.0] * 4,
        "high": [1.0] * 4,
        "dropped": [0] * 4,
    }


@pytest.mark.serve
def test_hot_refresh_with_an_approximate_index_reports_recall_and_the_difference(
    serve_port, one_router, tmp_path
):
    """An IVF index with one list probed of four and no extra candidates: the report gives
    recall@k of the served results against exact search at every fraction and the live curve
    beside the exact simulated one, without asserting them equal."""
    from raycompat.hot_refresh import HotRefreshOptions, run_hot_refresh
    from raycompat.index.ann import index_options
    from raycompat.simulator.memory_engine import simulate_backfill

    data = labelled_embeddings(n_items=400, n_queries=40, classes=20)
    parquet = write_gallery_parquet(str(tmp_path / "emb.parquet"), data)
    opts = HotRefreshOptions(
        embeddings=parquet,
        out=str(tmp_path / "out"),
        port=serve_port,
        policy="random",
        k=5,
        num_shards=1,  # the approximate index is per shard: one shows it
        fractions="0,0.5,1",
        index=index_options(
            kind="ivf_flat", nlist=4, nprobe=1, rerank=1, train_min=40, device="cpu"
        ),
    )
    report = run_hot_refresh(opts, log=lambda m: None)
    recall = report["live"]["recall"]
    print(f"\nAPPROXIMATE hot refresh: recall@5 {recall}, mAP@5 live {report['live']['metrics']}")
    assert len(recall) == 3 and all(0.0 < r <= 1.0 for r in recall) and min(recall) < 1.0
    band = report["live"]["bands"]["recall@5"]
    assert all(lo <= r <= hi for lo, r, hi in zip(band["low"], recall, band["high"], strict=True))
    sim = simulate_backfill(data, ["random"], ["compatible"], fractions=[0, 0.5, 1], k=5)
    assert report["simulator"]["metrics"]["mAP@5"] == pytest.approx(
        sim.curve("random", "compatible").metrics["mAP@5"]
    )
    markdown = (tmp_path / "out" / "report.md").read_text()
    assert "an approximate index, `ivf_flat`" in markdown and "Recall@5 of the served" in markdown


@pytest.fixture(scope="module")
def fct_bundle(tmp_path_factory):
    """A new model bundle with FCT's h (16 -> 24, hidden 32) as its ``fct`` module, random
    weights."""
    import torch

    from raycompat.models import ClassifierHead, Embedder, ForwardTransformation, ModelBundle

    torch.manual_seed(4)
    mods = {
        "embedder": Embedder("test_resnet", 24),
        "head": ClassifierHead(24, 30, "cosface"),
        "fct": ForwardTransformation(16, 24, hidden_dim=32),
    }
    path = str(tmp_path_factory.mktemp("fct_model") / "fct")
    ModelBundle(
        mods, dict(in_chans=1, resolution=32, classes=list(range(30)), method="fct")
    ).eval().save(path)
    return path


@pytest.mark.serve
def test_fct_offline_equals_online(serve_port, gallery_parquet, fct_bundle, token_file, tmp_path):
    """fct served: items start as ``adapted`` holding h(phi_o(g)) from the new bundle's fct
    module (not the parquet's psi column); the live curve equals the simulator's fct curve."""
    from raycompat.models import ModelBundle
    from raycompat.serving.live_eval import compare_curves, live_backfill_curve
    from raycompat.upgrade.modes import apply_bundle_modules

    data = apply_bundle_modules(load_parquet(gallery_parquet), ModelBundle.load(fct_bundle))
    fractions = [0.0, 0.4, 1.0]
    k = 30
    sim = simulate_backfill(data, ["sequential"], ["fct"], fractions=fractions, k=k, seed=3)
    _, client = deploy(
        serve_port,
        tmp_path / "state",
        gallery_parquet,
        token_file,
        app="fct",
        prefix="/fct",
        num_shards=1,  # an fct shard loads the new bundle (its fct module), seconds of CPU
        mode="fct",
        new_model=fct_bundle,
    )
    try:
        st = client.status()
        assert st["items"] == {"old": 0, "adapted": data.n_items, "new": 0}
        assert "new_model's fct" in [m["source"] for m in st["fingerprints"].values()]
        live = live_backfill_curve(
            client,
            data,
            fractions,
            policy="sequential",
            seed=3,
            k=k,
            batch_size=64,
            log=lambda m: None,
        )
    finally:
        undeploy("fct")
    cmp = compare_curves(live, sim.curve("sequential", "fct"), tol=1e-12)
    assert cmp["equal"], cmp
    psi_curve = simulate_backfill(data, ["sequential"], ["adapted"], fractions=[0.0], k=k)
    assert (
        live["metrics"][f"mAP@{k}"][0]
        != psi_curve.curve("sequential", "adapted").metrics[f"mAP@{k}"][0]
    )  # h, not the stored psi column, is what the adapted items hold


@pytest.mark.serve
def test_naive_merge_offline_equals_online_and_needs_old_vectors(
    serve_port, gallery_parquet, token_file, tmp_path
):
    """naive_merge served: each request carries the old model's query embeddings too; old-state
    items are scored old-old, new-state items new-new, merged. Live == simulator; a request
    without old_vectors (or with the wrong count) is a 422 naming the field."""
    from raycompat.serving.live_eval import compare_curves, live_backfill_curve

    data = load_parquet(gallery_parquet)
    fractions = [0.0, 0.25, 0.5, 1.0]
    k = 40
    sim = simulate_backfill(data, ["sequential"], ["naive_merge"], fractions=fractions, k=k, seed=2)
    _, client = deploy(
        serve_port,
        tmp_path / "state",
        gallery_parquet,
        token_file,
        app="naive-merge",
        prefix="/naive-merge",
        num_shards=1,  # the merge of old-old and new-new scores is the router's, not the shards'
        mode="naive_merge",
    )
    try:
        base = client.base
        q = data.query_new[:2].tolist()
        r = requests.post(base + "/search", json={"vectors": q, "k": 3}, timeout=30)
        assert r.status_code == 422 and "old_vectors" in r.text, r.text
        r = requests.post(
            base + "/search",
            json={"vectors": q, "old_vectors": data.query_old[:1].tolist(), "k": 3},
            timeout=30,
        )
        assert r.status_code == 422 and "1 rows" in r.text, r.text
        live = live_backfill_curve(
            client,
            data,
            fractions,
            policy="sequential",
            seed=2,
            k=k,
            batch_size=50,
            log=lambda m: None,
        )
    finally:
        undeploy("naive-merge")
    cmp = compare_curves(live, sim.curve("sequential", "naive_merge"), tol=1e-12)
    assert cmp["equal"], cmp
    assert live["metrics"][f"mAP@{k}"][0] != live["metrics"][f"mAP@{k}"][-1]


# ----------------------------------------------------------------------------- state layout
def _all_items(n_shards: int, app: str) -> dict[int, tuple[int, int]]:
    """``{item id: (shard, representation code)}`` over every shard of ``app``."""
    from ray import serve

    out = {}
    for s in range(n_shards):
        ids, codes = serve.get_deployment_handle(f"shard-{s}", app_name=app).items.remote().result()
        for i, c in zip(ids.tolist(), codes.tolist(), strict=True):
            assert i not in out, f"item {i} on shards {out[i][0]} and {s}"
            out[i] = (s, c)
    return out


@pytest.mark.serve
def test_resharding_is_a_restart_with_another_num_shards(
    serve_port, gallery_parquet, token_file, tmp_path
):
    """The shards are caches of the store: a 1-shard index restarted with 2 shards serves the
    same items, representations and results (nothing moved, every item on exactly one shard),
    and the backfill resumes where it stopped."""
    from raycompat.serving.placement import shard_of

    state = tmp_path / "state"
    data = load_parquet(gallery_parquet)
    q = data.query_new[:5]
    _, client = deploy(serve_port, state, gallery_parquet, token_file, app="lay", prefix="/lay",
                       num_shards=1)  # fmt: skip
    try:
        client.start_backfill(policy="random", seed=3, batch_size=50, until=250)
        client.wait_backfill(250)
        before = _all_items(1, "lay")
        ids_before, scores_before, _ = client.search(q, k=40)
    finally:
        undeploy("lay", wait=True)
    _, client = deploy(serve_port, state, gallery_parquet, token_file, app="lay2",
                       prefix="/lay2", num_shards=2)  # fmt: skip
    try:
        after = _all_items(2, "lay2")
        assert {i: c for i, (_, c) in after.items()} == {i: c for i, (_, c) in before.items()}
        assert all(s == shard_of([i], 2)[0] for i, (s, _) in after.items())
        assert {s for s, _ in after.values()} == {0, 1}
        ids_after, scores_after, _ = client.search(q, k=40)
        assert np.array_equal(ids_after, ids_before) and np.array_equal(scores_after, scores_before)
        assert client.status()["items"] == {"old": 350, "adapted": 0, "new": 250}
        client.resume_backfill(clear_until=True)
        assert client.wait_backfill(600)["state"] == "done"
        assert client.status()["items"] == {"old": 0, "adapted": 0, "new": 600}
    finally:
        undeploy("lay2")


@pytest.mark.serve
def test_a_store_that_fails_to_read_is_named_and_never_served_partly(
    serve_port, gallery_parquet, token_file, tmp_path
):
    """The store's version files moved away: a search is a 503 naming the store's error (never
    an answer from part of the gallery), /status names it or the shard is down while Serve
    replaces the unhealthy replica; with the files back, every item is served again."""
    store = tmp_path / "store"
    _, client = deploy(serve_port, tmp_path / "state", gallery_parquet, token_file, app="cor",
                       prefix="/cor", num_shards=1, store=str(store))  # fmt: skip
    versions = store / "gallery.lance" / "_versions"
    q = load_parquet(gallery_parquet).query_new[:3]
    try:
        assert client.status()["items"]["old"] == 600
        client.upsert([{"id": 3, "representation": "new", "vector": [0.5] * 24}])
        os.rename(versions, str(versions) + ".away")
        r = post(client, "/search", {"vectors": q.tolist(), "k": 5})
        assert r.status_code == 503 and "shard 0" in r.json()["error"], r.text
        try:
            error = client.status()["shards"][0]["store"]["error"]
            assert error and "gallery.lance" in error, error
        except ServingHTTPError as exc:  # Serve took the unhealthy replica down meanwhile
            assert exc.status == 503 and "shard 0" in str(exc.body), exc.body
        os.rename(str(versions) + ".away", versions)
        t0 = time.time()
        while True:
            try:
                st = client.status()
                if not st["shards"][0]["store"]["error"]:
                    break
            except ServingHTTPError:
                pass
            assert time.time() - t0 < 120, "the shard never read the store again"
            time.sleep(0.5)
        assert st["items"] == {"old": 599, "adapted": 0, "new": 1}
        ids, _, _ = client.search(q, k=600)
        assert sorted(ids[0].tolist()) == sorted(load_parquet(gallery_parquet).gallery_ids)
    finally:
        undeploy("cor")


# ----------------------------------------------------------------------------- faults on disk
def _state_files(root: str) -> list[str]:
    return [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs]


def _shard_handle(app: str, shard: int):
    from ray import serve

    return serve.get_deployment_handle(f"shard-{shard}", app_name=app)


def _wait_restarted(client, shard: int, old_pid: int, timeout: float = 120.0) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        try:
            st = client.status()
            pid = next(s["pid"] for s in st["shards"] if s["shard"] == shard)
            if pid != old_pid:
                return
        except Exception:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"shard {shard} did not restart")


# ----------------------------------------------------------------------------- the shared live app
LIVE = "live"


@pytest.fixture(scope="module")
def live_gallery(tmp_path_factory):
    """``(parquet, data)``: 300 labelled items and 40 queries for the ``live`` app.  What its
    tests check (offline == online over the full ranking, kills under query load, rates) does
    not depend on the gallery's size; 300 items keep the full-ranking answers small."""
    data = labelled_embeddings(n_items=300, n_queries=40, classes=20)
    path = write_gallery_parquet(str(tmp_path_factory.mktemp("live") / "embeddings.parquet"), data)
    return path, load_parquet(path)


def _random_bundle(path, d_new=24, d_old=16, resolution=16):
    import torch

    from raycompat.models import ClassifierHead, Embedder, ModelBundle

    torch.manual_seed(0)
    modules = {
        "embedder": Embedder("test_resnet", d_new, in_chans=1),
        "head": ClassifierHead(d_new, 5, kind="cosface"),
    }
    ModelBundle(modules, {"compatible_dim": d_old, "in_chans": 1, "resolution": resolution}).save(
        str(path)
    )
    return str(path)


@pytest.fixture(scope="module")
def live(serve_port, live_gallery, tmp_path_factory):
    """One compatible-mode app of 2 shards for the tests that backfill and kill replicas (each
    starts with :func:`reset_backfill`); 2 shards: a shard is killed while the other serves,
    every item must be on exactly one of them, and offline == online over the full ranking
    checks the merge of both shards' results.  The admin token comes from the environment where the
    app is deployed (no token file); the image budget fits 40 images of 4096x4096; a snapshot
    every 150 upserted items.  Its other sources of new vectors: a new model (random weights)
    that the embedder pool and the router's image queries use, the glyph (class, instance) of
    every item for the pool to render (``items``), and a pipeline output holding the negated
    model embeddings of those glyphs."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from raycompat.serving.auth import TOKEN_ENV
    from raycompat.serving.embedder_pool import ModelEmbedder

    path, data = live_gallery
    root = tmp_path_factory.mktemp("live_app")
    bundle = _random_bundle(root / "new_model")
    n = data.n_items
    classes, instances = np.arange(n) % 40, np.arange(n) // 40  # distinct glyph items
    new = ModelEmbedder(bundle).embed_glyphs(classes, instances)  # what the pool computes
    items = str(root / "items.parquet")
    pq.write_table(
        pa.table({"item_id": data.gallery_ids, "label": classes, "instance": instances}), items
    )
    flipped = -new  # the "pipeline" wrote other vectors: we can tell them apart
    pipeline = str(root / "pipeline.parquet")
    pq.write_table(
        pa.table(
            {
                "item_id": data.gallery_ids,
                "new": pa.FixedSizeListArray.from_arrays(pa.array(flipped.reshape(-1)), 24),
            }
        ),
        pipeline,
    )
    state = root / "state"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(TOKEN_ENV, TOKEN)
        _, client = deploy(serve_port, state, path, None, app=LIVE, prefix="/live",
                           num_shards=2,
                           max_request_pixels=40 * 4096 * 4096, new_model=bundle, items=items,
                           pipeline_output=pipeline)  # fmt: skip
    glyphs = types.SimpleNamespace(classes=classes, instances=instances, new=new, flipped=flipped)
    yield types.SimpleNamespace(client=client, state=str(state), data=data, glyphs=glyphs)
    undeploy(LIVE)


@pytest.mark.serve
def test_a_heavy_image_request_does_not_stall_healthz(live):
    """Images are decoded off the router's event loop: /healthz answers while a search with 32
    images of 4096x4096 pixels is being decoded, in a small part of the time that decoding
    takes (no wall-clock bound: the heavy request is the yardstick); a request over the pixel
    budget is refused from the images' headers.  (Without a new model the decoded images are
    refused: test_image_input_errors.)"""
    from PIL import Image

    client = live.client
    buf = io.BytesIO()
    Image.fromarray(np.full((4096, 4096), 77, np.uint8)).save(buf, format="PNG")
    image = base64.b64encode(buf.getvalue()).decode()
    over = post(client, "/search", {"images": [image] * 41, "k": 3})
    assert over.status_code == 400 and "budget of 671,088,640" in over.json()["error"]
    heavy: dict = {}

    def search():
        heavy["response"] = post(client, "/search", {"images": [image] * 32, "k": 3})
        heavy["done"] = time.perf_counter()

    worker = threading.Thread(target=search)
    worker.start()
    time.sleep(0.5)  # the router is decoding
    t0 = time.perf_counter()
    health = requests.get(client.base + "/healthz", timeout=30)
    t1 = time.perf_counter()
    still_decoding = worker.is_alive()
    worker.join()
    assert health.status_code == 200 and still_decoding
    # behind the decoding, /healthz would answer about when the heavy request does
    assert t1 - t0 < 0.5 * (heavy["done"] - t0), (t1 - t0, heavy["done"] - t0)
    # decoded, then embedded by the new model and searched
    assert heavy["response"].status_code == 200, heavy["response"].text
    assert len(heavy["response"].json()["results"]) == 32


@pytest.mark.serve
def test_backfill_keeps_a_low_rate_and_resume_clears_until(live):
    """A rate below batch_size items/s is kept (batches shrink to one second's worth, never a
    burst of batch_size); ``"until": null`` on resume clears an earlier until.  The admin token
    comes from the environment and reaches no actor: the router gets its hash; /status shows
    process ids, actor names and paths to the admin only."""
    import ray
    from ray.util.state import list_actors

    client, data = live.client, live.data
    reset_backfill(client)
    actors = list_actors(
        address=ray.get_runtime_context().gcs_address,
        filters=[("state", "=", "ALIVE")],
        detail=True,
        limit=10000,
    )
    assert actors and not any(TOKEN in str(a) for a in actors)
    public = requests.get(client.base + "/status", timeout=30).json()
    assert not {"pid", "actor_id", "actor_name"} & set(public["shards"][0])
    assert public["backfill"].get("pid") is None  # the response model's null
    assert public["backfill"].get("actor_name") is None
    admin = client.status()
    assert "pid" in admin["shards"][0] and "actor_name" in admin["shards"][0]
    t0 = time.perf_counter()
    client.start_backfill(policy="sequential", rate=4.0, batch_size=64, until=20, restart=True)
    time.sleep(1.5)
    moved = client.status()["backfill"]["position"]
    # an upper bound (a slow machine only moves fewer): 4 items/s from t0, one batch ahead
    assert moved <= 4.0 * (time.perf_counter() - t0) + 4, moved
    client.pause_backfill()
    client.resume_backfill(rate=1e6)  # absent until: kept
    assert client.wait_backfill(20)["position"] == 20
    assert client.status()["backfill"]["until"] == 20
    client.resume_backfill(clear_until=True)  # "until": null: cleared, runs to the end
    bf = client.wait_backfill(data.n_items)
    assert bf["state"] == "done" and bf["until"] is None


@pytest.mark.serve
def test_backfill_from_embedder_pool_and_pipeline_output_and_image_queries(live):
    """New vectors from the embedder actor pool (glyphs rendered + embedded by Ray actors holding
    the new model) and from a pipeline parquet output; image queries embedded by the router."""
    from PIL import Image

    from raycompat.data import GlyphRenderer, default_catalog
    from raycompat.index.search import l2_normalize

    client, data, g = live.client, live.data, live.glyphs
    n = data.n_items
    reset_backfill(client)
    client.start_backfill(
        policy="random", seed=0, batch_size=16, until=40, source="embedder", restart=True
    )
    client.wait_backfill(40, timeout=240)
    order = backfill_order(client)
    first = np.searchsorted(data.gallery_ids, order[:40])  # rows of the first 40 items
    ids, scores, reps = client.search(l2_normalize(g.new[first]), k=1)
    assert (
        (ids[:, 0] == order[:40]).all()
        and (reps[:, 0] == "new").all()
        and (scores[:, 0] > 0.999).all()
    )
    # image queries: the router decodes the PNG and embeds it with the new model
    renderer = GlyphRenderer(default_catalog(), resolution=16, seed=0)
    imgs = renderer.render_batch(g.classes[first[:4]], g.instances[first[:4]])
    b64 = []
    for im in imgs:
        buf = io.BytesIO()
        Image.fromarray(im).save(buf, format="PNG")
        b64.append(base64.b64encode(buf.getvalue()).decode())
    res = client.search_images(b64, k=1)
    assert [r[0]["id"] for r in res["results"]] == order[:4].tolist()
    # a restarted backfill from the pipeline's output replaces every vector
    client.start_backfill(policy="sequential", batch_size=32, source="pipeline", restart=True)
    client.wait_backfill(n, timeout=240)
    assert client.status()["items"] == {"old": 0, "adapted": 0, "new": n}
    ids, scores, _ = client.search(l2_normalize(g.flipped[:10]), k=1)
    assert (ids[:, 0] == data.gallery_ids[:10]).all() and (scores[:, 0] > 0.999).all()


# ----------------------------------------------------------------------------- offline == online
@pytest.mark.serve
@pytest.mark.parametrize(
    "mode,policy",
    [("compatible", "random"), ("compatible", "hinge-benefit"), ("adapted", "sequential")],
)
@pytest.mark.serve
def test_offline_equals_online(
    request, serve_port, live_gallery, token_file, tmp_path, mode, policy
):
    """The live curve over the full ranking (revisited mAP too) equals the simulator's at every
    fraction.  The compatible mode on the shared ``live`` app (rolled back between policies),
    the adapted mode on an app of its own (one shard: the shards' results are merged as in the
    compatible mode, whose 2 shards the ``live`` app has)."""
    from raycompat.serving.live_eval import compare_curves, live_backfill_curve

    path, data = live_gallery
    fractions = [0.0, 0.2, 0.5, 0.85, 1.0]
    k = data.n_items  # the full ranking: revisited mAP is compared too
    sim = simulate_backfill(data, [policy], [mode], fractions=fractions, k=k, seed=7)
    if mode == "compatible":
        client = request.getfixturevalue("live").client
        reset_backfill(client)
    else:
        _, client = deploy(serve_port, tmp_path / "state", path, token_file, app=mode,
                           prefix=f"/{mode}", num_shards=1, mode=mode)  # fmt: skip
    try:
        live = live_backfill_curve(
            client, data, fractions, policy=policy, seed=7, k=k, batch_size=37, log=lambda m: None
        )
    finally:
        if mode != "compatible":
            undeploy(mode)
    curve = sim.curve(policy, mode)
    assert live["counts"] == [0, 60, 150, 255, 300] == curve.counts.tolist()
    cmp = compare_curves(live, curve, tol=1e-12)
    assert set(cmp["max_abs_diff"]) == {f"mAP@{k}", "mAP", "top1", "NFR@1"}
    assert cmp["equal"], cmp
    m = np.asarray(live["metrics"][f"mAP@{k}"])
    assert m[-1] != m[0]  # the backfill changed the ranking (the comparison is not vacuous)


# ----------------------------------------------------------------------------- durability
def _replica_actor(client, deployment: str):
    """The Serve replica actor of a deployment, by the name the replica reports in /status."""
    import ray

    st = client.status()
    if deployment == "backfill":
        name = st["backfill"]["actor_name"]
    else:
        name = next(s["actor_name"] for s in st["shards"] if f"shard-{s['shard']}" == deployment)
    return ray.get_actor(name, namespace="serve"), name


@pytest.mark.serve
# about 20 s on a quiet machine; its own wait for the backfill through the outage allows 240 s
# (a loaded machine restarts the replica slowly), so the default limit of 120 s would cut it
@pytest.mark.timeout(300)
def test_kill_shard_replica_during_live_backfill_under_query_load(live):
    """A shard replica killed during a live backfill under query load: failures are 503s, no
    answer misses or repeats an item, the replacement loads its rows from the store, and every
    item ends in the right representation (an admin upsert acknowledged just before the kill
    included)."""
    import ray

    from raycompat.index.search import l2_normalize
    from raycompat.serving.placement import shard_of

    client, data = live.client, live.data
    reset_backfill(client)
    n = data.n_items
    outcomes = []  # (time, status code or exception name)
    dup_or_missing = []
    stop = threading.Event()

    def load():
        sess = requests.Session()
        q = data.query_new[:4].tolist()
        while not stop.is_set():
            t = time.time()
            try:
                r = sess.post(client.base + "/search", json={"vectors": q, "k": n}, timeout=60)
                outcomes.append((t, r.status_code, time.time() - t))
                if r.status_code == 200:
                    for row in r.json()["results"]:
                        ids = [h["id"] for h in row]
                        if len(ids) != n or len(set(ids)) != n:
                            dup_or_missing.append(len(set(ids)))
            except requests.RequestException as exc:
                outcomes.append((t, type(exc).__name__, time.time() - t))

    threads = [threading.Thread(target=load) for _ in range(2)]
    try:
        client.start_backfill(policy="random", seed=1, rate=150.0, batch_size=10, restart=True)
        for th in threads:
            th.start()
        t0 = time.time()  # each /status holds the walk a moment: poll at a pace it can keep
        while (bf := client.status()["backfill"])["position"] < n // 4:
            assert time.time() - t0 < 120, f"the backfill did not reach {n // 4}: {bf}"
            time.sleep(0.2)
        # an admin upsert acknowledged just before the crash: item moved back to 'old'
        done_ids = set(backfill_order(client)[: n // 6].tolist())
        victim = sorted(done_ids)[0]
        special = np.linspace(-1, 1, 16).tolist()
        assert (
            client.upsert([{"id": int(victim), "representation": "old", "vector": special}])[
                "applied"
            ]
            == 1
        )
        before = client.status()["shards"]
        actor, name = _replica_actor(client, "shard-0")
        t_kill = time.time()
        ray.kill(actor, no_restart=True)
        # wait for the backfill to finish through the outage (the controller retries the dead shard)
        t0 = time.time()
        while True:
            try:
                bf = client.status()["backfill"]
                if bf["state"] == "done":
                    break
                assert bf["state"] != "error", bf
            except Exception:
                pass
            assert time.time() - t0 < 240, "backfill did not finish after the replica kill"
            time.sleep(0.2)
        time.sleep(1.0)
    finally:
        stop.set()
        for th in threads:
            if th.is_alive() or th.ident:
                th.join(timeout=60)
    st = client.status()
    shard0 = next(s for s in st["shards"] if s["shard"] == 0)
    assert shard0["pid"] != next(s for s in before if s["shard"] == 0)["pid"]  # a new replica
    assert shard0["store"]["load_s"] > 0 and shard0["store"]["error"] is None  # from the store
    # every item present, in the right representation: all new except the victim (old)
    assert st["items"] == {"old": 1, "adapted": 0, "new": n - 1}, st["items"]
    ids, scores, reps = client.search(np.asarray([special]), k=1, model="old")
    assert ids[0, 0] == victim and reps[0, 0] == "old" and scores[0, 0] > 0.9999
    all_ids = np.concatenate([_shard_handle(LIVE, s).items.remote().result()[0] for s in (0, 1)])
    assert sorted(all_ids.tolist()) == sorted(data.gallery_ids.tolist())
    # new vectors are the pipeline's (parquet) vectors: each item is its own top-1
    sample = np.asarray(sorted(set(data.gallery_ids.tolist()) - {victim})[:40])
    rows = np.searchsorted(data.gallery_ids, sample)
    ids, scores, reps = client.search(l2_normalize(data.gallery_new[rows]), k=1)
    assert (ids[:, 0] == sample).all() and (reps[:, 0] == "new").all()
    # the shared app again as deployed: the victim's own old vector back (what the shards
    # loaded), then the rollback of every upgraded item
    row = int(np.searchsorted(data.gallery_ids, victim))
    first = {"id": int(victim), "representation": "old", "vector": data.gallery_old[row].tolist()}
    assert client.upsert([first])["applied"] == 1
    reps, vecs = _shard_handle(LIVE, int(shard_of([victim], 2)[0])).lookup.remote([victim]).result()
    assert reps == ["old"] and np.array_equal(vecs[0], l2_normalize(data.gallery_old[row][None])[0])
    failed = [o for o in outcomes if o[1] != 200]
    during = [o for o in outcomes if o[0] >= t_kill]
    before_lat = [o[2] for o in outcomes if o[0] < t_kill]
    print(
        f"\nOUTAGE: {len(outcomes)} queries, {len(failed)} failed "
        f"({len(during)} sent after the kill); "
        f"codes {sorted({str(o[1]) for o in failed})}; "
        f"failure window {max((o[0] for o in failed), default=t_kill) - t_kill:.2f} s; "
        f"latency before the kill median {np.median(before_lat):.3f} s, after the kill median "
        f"{np.median([o[2] for o in during]):.3f} s max {max(o[2] for o in during):.3f} s; "
        f"controller upsert retries {st['backfill'].get('upsert_retries')}; "
        f"shard-0 loaded from the store in {shard0['store']['load_s']:.3f} s"
    )
    assert not dup_or_missing, dup_or_missing[:5]
    assert all(
        o[1] == 503 or isinstance(o[1], str) for o in failed
    )  # outage answers 503, never 500
    assert outcomes and outcomes[-1][1] == 200


@pytest.mark.serve
def test_backfill_controller_crash_resumes_from_checkpoint(live):
    """The upgrade's driver (the controller replica) killed mid-walk (batches of 10 every
    50 ms): Serve starts a new one, which reads the record and the order from the store, moves
    past any batch the store holds beyond the record (``recovered``) and finishes.  Every
    /status read with the walk held counts exactly ``position`` new items, before and after;
    at the end every item of the order sits in the store at its own position with the new
    model's fingerprint (none written twice under another position, none left old)."""
    import ray

    from raycompat.stores import open_store

    client, data = live.client, live.data
    reset_backfill(client)
    client.start_backfill(policy="sequential", rate=200.0, batch_size=10, restart=True)
    agreed = 0
    while (st := client.status())["backfill"]["position"] < 100:
        if st["backfill"]["counts_consistent"]:
            assert st["items"]["new"] == st["backfill"]["position"], st["backfill"]
            agreed += 1
        time.sleep(0.02)
    assert agreed, "no /status read agreed with the position"
    actor, _ = _replica_actor(client, "backfill")
    ray.kill(actor, no_restart=True)
    t0 = time.time()
    while True:
        try:
            st = client.status()
            bf = st["backfill"]
            if bf["counts_consistent"]:
                assert st["items"]["new"] == bf["position"], bf
            if bf.get("resumed_from_checkpoint") and bf["state"] == "done":
                break
        except ServingHTTPError:  # the controller is being replaced
            pass
        assert time.time() - t0 < 180, "the controller did not resume"
        time.sleep(0.2)
    assert client.status()["items"] == {"old": 0, "adapted": 0, "new": data.n_items}
    rec = bf.get("recovered")
    assert rec is None or rec["to"] > rec["from"], rec
    order = backfill_order(client)
    with open_store(bf["store"]) as store:
        rows = {
            int(i): (int(p), m)
            for blk in store.read_blocks(("id", "position", "new_model"))
            for i, p, m in zip(blk["id"], blk["position"], blk["new_model"], strict=True)
        }
        base = int(store.read_state()["position_base"])
    fp = {m for _, m in rows.values()}
    assert len(fp) == 1 and "" not in fp and None not in fp, fp
    assert [rows[int(i)][0] for i in order] == list(range(base, base + order.size))


# ----------------------------------------------------------------------------- rank_merge


@pytest.fixture(scope="module")
def rank_merge_bundle(tmp_path_factory):
    """A new model bundle with RM's rho (24 -> 20) and psi_rev (20 -> 16) modules, random
    weights."""
    import torch

    from raycompat.models import ClassifierHead, Embedder, ModelBundle, ProjectionMLP

    torch.manual_seed(3)
    mods = {
        "embedder": Embedder("test_resnet", 24),
        "head": ClassifierHead(24, 30, "cosface"),
        "rho": ProjectionMLP(24, 20, hidden_dim=32, num_blocks=1, role="rho"),
        "psi_rev": ProjectionMLP(20, 16, hidden_dim=32, num_blocks=1, role="psi_rev"),
    }
    path = str(tmp_path_factory.mktemp("rm_model") / "mcl")
    ModelBundle(
        mods, dict(in_chans=1, resolution=32, classes=list(range(30)), method="mcl")
    ).eval().save(path)
    return path


@pytest.fixture(scope="module")
def rank_merge_app(serve_port, gallery_parquet, rank_merge_bundle, token_file, tmp_path_factory):
    """The rank_merge app of both policies' tests (each starts with :func:`reset_backfill`):
    one shard, since the router maps the queries through rho and psi_rev and merges the shards'
    results as in every mode."""
    _, client = deploy(serve_port, tmp_path_factory.mktemp("rank_merge_state"), gallery_parquet,
                       token_file, app="rank-merge", prefix="/rank-merge", num_shards=1,
                       mode="rank_merge", new_model=rank_merge_bundle)  # fmt: skip
    yield client
    undeploy("rank-merge")


@pytest.mark.serve
@pytest.mark.parametrize("policy", ["random", "hinge-benefit"])
def test_rank_merge_offline_equals_online(
    rank_merge_app, gallery_parquet, rank_merge_bundle, policy
):
    """rank_merge served: the router maps each query through rho and psi_rev, new items hold
    rho(phi_n(g)) of the store's unit vector phi_n(g) (a store holds unit vectors, and this
    gallery's are not); the live curve equals the simulator's rank_merge curve of that gallery
    exactly."""
    from raycompat.index.search import l2_normalize
    from raycompat.models import ModelBundle
    from raycompat.serving.live_eval import compare_curves, live_backfill_curve
    from raycompat.upgrade.modes import apply_bundle_modules

    stored = load_parquet(gallery_parquet)
    stored = stored.with_arrays(gallery_new=l2_normalize(stored.gallery_new))
    data = apply_bundle_modules(stored, ModelBundle.load(rank_merge_bundle))
    fractions = [0.0, 0.3, 0.6, 1.0]
    k = 50
    sim = simulate_backfill(data, [policy], ["rank_merge"], fractions=fractions, k=k, seed=5)
    client = rank_merge_app
    st = reset_backfill(client)
    assert st["dims"]["new"] == 20 and st["dims"]["old"] == 16
    live = live_backfill_curve(
        client, data, fractions, policy=policy, seed=5, k=k, batch_size=41, log=lambda m: None
    )
    hits = client.search(data.query_new[:3], k=5)
    assert client.status()["items"]["new"] == data.n_items
    curve = sim.curve(policy, "rank_merge")
    cmp = compare_curves(live, curve, tol=1e-12)
    assert cmp["equal"], cmp
    m = np.asarray(live["metrics"][f"mAP@{k}"])
    assert m[-1] != m[0]
    assert (hits[2] == "new").all()  # after the backfill every hit is a new item


# ----------------------------------------------------------------------------- the shared disk app
# last in the file: a module's apps run until its end, and this one's tests come last
DISK = "disk"


@pytest.fixture(scope="module")
def disk_app(serve_port, gallery_parquet, token_file, tmp_path_factory):
    """``(client, tmpfs, state dir)``: a 2-shard app whose state directory (and the store in
    it) is on a 16 MiB tmpfs, for the full-disk test and the fault-injection test (each starts
    with :func:`reset_backfill` and frees the disk).  2 shards: the fault injection kills one
    while the other goes on serving, the upserts and the backfill."""
    fs = str(tmp_path_factory.mktemp("disk") / "fs")
    if not mount_tmpfs(fs, 16 << 20):
        pytest.skip("cannot mount a tmpfs here")
    state = os.path.join(fs, "state")
    _, client = deploy(serve_port, state, gallery_parquet, token_file, app=DISK, prefix="/disk",
                       num_shards=2)  # fmt: skip
    yield client, fs, state
    undeploy(DISK, wait=True)  # its replicas read the store until they stop
    umount(fs)


@pytest.mark.serve
def test_a_full_disk_lands_in_status_and_metrics_and_resume_restarts_the_backfill(
    disk_app, gallery_parquet
):
    """The store on a tiny tmpfs that fills up mid-backfill: the controller reports state
    ``error`` naming the store and "no space left on device" (in /status and /metrics), an
    upsert is refused with that message and nothing of it applied, no temporary file is left,
    and once there is space again ``resume`` finishes the backfill."""
    from raycompat.serving.placement import shard_of

    client, fs, state = disk_app
    data = load_parquet(gallery_parquet)
    reset_backfill(client)
    try:
        client.start_backfill(policy="sequential", rate=400.0, batch_size=20, restart=True)
        while client.status()["backfill"]["position"] < 60:
            time.sleep(0.05)
        fill(fs)
        t0 = time.time()
        while (bf := client.status()["backfill"])["state"] != "error":
            assert bf["state"] == "running" and time.time() - t0 < 60, bf
            time.sleep(0.1)
        assert "no space left on device" in bf["error"].lower(), bf["error"]
        err = bf["error"]  # the batch's write, or the record's (in the store too), refused
        refused = "refused the write" in err or "refused the backfill record" in err
        assert "store lance://" + state in err and refused, err
        metrics = requests.get(client.base + "/metrics", timeout=30).text
        assert 'raycompat_serving_backfill_state{state="error"} 1.0' in metrics
        tail = data.gallery_ids[-200:]  # last in the sequential order: still old
        victims = tail[shard_of(tail, 2) == 0][:60]  # one shard; a record of several pages
        items = [{"id": int(i), "representation": "new", "vector": [1.0] * 24} for i in victims]
        fill(fs, name="filler2")  # what the failed batch's rollback freed
        r = post(client, "/admin/upsert", {"items": items}, token=TOKEN)
        assert r.status_code == 503 and "Retry-After" in r.headers, r.text
        assert "no space left on device" in r.json()["error"].lower()
        assert "nothing of the upsert was applied" in r.json()["error"]
        assert not [f for f in _state_files(state) if f.endswith(".tmp")]
        os.unlink(os.path.join(fs, "filler"))
        os.unlink(os.path.join(fs, "filler2"))
        bf = client.resume_backfill()
        assert bf["state"] == "running" and bf["error"] is None and bf["worker_alive"]
        assert client.wait_backfill(600)["state"] == "done"
        st = client.status()
        assert st["items"] == {"old": 0, "adapted": 0, "new": 600}
        assert [s["store"]["error"] for s in st["shards"]] == [None, None]
        reps, _ = _shard_handle(DISK, 0).lookup.remote(victims).result()
        assert set(reps) == {"new"}  # the refused upsert never landed
    finally:
        for name in ("filler", "filler2"):
            if os.path.exists(os.path.join(fs, name)):
                os.unlink(os.path.join(fs, name))


def _upsert_stream(client, pool, rng, stop, log):
    """Post admin upserts of 1-8 items of one shard until ``stop``; log every outcome as
    ``(kind, items)``: ``acked``, ``failed`` (the answer says nothing was applied) or
    ``unknown`` (the shard or the connection died mid-call)."""
    from raycompat.index.search import l2_normalize

    sess = requests.Session()
    headers = {"Authorization": f"Bearer {TOKEN}"}
    while not stop.is_set():
        ids = rng.choice(pool[int(rng.integers(len(pool)))], int(rng.integers(1, 9)), replace=False)
        rep = ("old", "new")[int(rng.integers(2))]
        dim = 16 if rep == "old" else 24
        raw = rng.standard_normal((ids.size, dim))
        vecs = l2_normalize(raw.astype(np.float32))
        body = {"items": [{"id": int(i), "representation": rep, "vector": v.tolist()}
                          for i, v in zip(ids, raw, strict=True)]}  # fmt: skip
        items = [(int(i), rep, v) for i, v in zip(ids, vecs, strict=True)]
        try:
            r = sess.post(client.base + "/admin/upsert", json=body, headers=headers, timeout=60)
        except requests.RequestException:
            log.append(("unknown", items))
            continue
        if r.status_code == 200:
            log.append(("acked", items))
        elif r.status_code == 503 and "nothing of the upsert was" in r.json().get("error", ""):
            log.append(("failed", items))
        else:
            log.append(("unknown", items))


def _check_against_acknowledged(app, n_shards, pool_ids, model, log) -> dict:
    """The served state of every pool item equals its last acknowledged upsert, or one of the
    upserts after it whose outcome is unknown; never a failed one.  Updates ``model``."""
    from raycompat.serving.placement import shard_of

    maybe: dict[int, list] = {}
    counts = {"acked": 0, "failed": 0, "unknown": 0}
    for kind, items in log:
        counts[kind] += 1
        for i, rep, v in items:
            if kind == "acked":
                model[i], maybe[i] = (rep, v), []
            elif kind == "unknown":
                maybe.setdefault(i, []).append((rep, v))
    where = shard_of(pool_ids, n_shards)
    for s in range(n_shards):
        ids = pool_ids[where == s]
        reps, vecs = _shard_handle(app, s).lookup.remote(ids).result()
        for i, rep, v in zip(ids.tolist(), reps, vecs, strict=True):
            allowed = [model[i]] + maybe.get(i, [])
            match = [a for a in allowed if a[0] == rep and np.allclose(a[1], v, atol=1e-6)]
            seen = [(kind, r) for kind, items in log for j, r, _ in items if j == i]
            assert match, f"item {i}: served {rep}, acknowledged {model[i][0]}; this round {seen}"
            model[i] = match[0]
    return counts


ROUNDS = scaled(3, 20)


def _until_logged(log: list, kind: str, n: int, timeout_s: float = 30.0) -> None:
    """Wait until the upsert stream logged ``n`` outcomes of ``kind`` (a slow machine takes
    longer to get there; the round's kill comes after), at most ``timeout_s``."""
    end = time.monotonic() + timeout_s
    while sum(k == kind for k, _ in log) < n and time.monotonic() < end:
        time.sleep(0.05)


@pytest.mark.serve
@pytest.mark.timeout(scaled(120, 480))  # at full scale: 20 rounds of a kill and a restart
def test_fault_injection_the_served_set_equals_the_acknowledged_set(disk_app, gallery_parquet):
    """Rounds of admin upserts during a live backfill with the store on a tiny tmpfs, each
    ending with a SIGKILL of every shard replica at a random point (every other round on a full
    disk).  After every restart the items and representations equal exactly what was
    acknowledged (never a refused upsert), and the backfill keeps every checkpointed item
    upgraded.  3 rounds by default (1 on a full disk); 20 at full scale."""
    import signal

    from raycompat.index.search import l2_normalize
    from raycompat.serving.placement import shard_of

    client, fs, state = disk_app
    data = load_parquet(gallery_parquet)
    rng = np.random.default_rng(18)
    reset_backfill(client)
    try:
        client.start_backfill(
            policy="random", seed=2, rate=40.0, batch_size=5, until=500, restart=True
        )
        order = backfill_order(client)
        pool_ids = np.sort(order[500:])  # only admin upserts touch these
        where = shard_of(pool_ids, 2)
        pool = [pool_ids[where == s] for s in range(2)]
        rows = np.searchsorted(data.gallery_ids, pool_ids)
        old = l2_normalize(data.gallery_old[rows])
        model = {int(i): ("old", v) for i, v in zip(pool_ids, old, strict=True)}
        totals = {"acked": 0, "failed": 0, "unknown": 0, "restarts": 0}
        for rnd in range(ROUNDS):
            full = rnd % 2 == 1
            if full:
                fill(fs, leave=int(rng.integers(0, 16 << 10)))
            log, stop = [], threading.Event()
            th = threading.Thread(target=_upsert_stream, args=(client, pool, rng, stop, log))
            th.start()
            _until_logged(log, "failed" if full else "acked", 2 if full else 6)
            time.sleep(float(rng.uniform(0.0, 0.5)))  # the kill at a random point after it
            pids = {s["shard"]: s["pid"] for s in client.status()["shards"]}
            for pid in pids.values():  # every shard replica
                os.kill(pid, signal.SIGKILL)
            time.sleep(float(rng.uniform(0.0, 0.5)))
            stop.set()
            th.join(timeout=120)
            if full:
                os.unlink(os.path.join(fs, "filler"))
            for shard, pid in pids.items():
                _wait_restarted(client, shard, pid)
                totals["restarts"] += 1
            for k, v in _check_against_acknowledged(DISK, 2, pool_ids, model, log).items():
                totals[k] += v
            bf = client.status()["backfill"]
            if bf["state"] == "error":
                client.resume_backfill()
            _check_backfilled(order[: bf["position"]])
        client.resume_backfill(rate=1e6)
        assert client.wait_backfill(500)["position"] == 500
        _check_backfilled(order[:500])
        print(f"\nFAULT INJECTION: {ROUNDS} rounds, {totals}")
        calm = sum(1 for r in range(ROUNDS) if r % 2 == 0)  # the rounds with space on disk
        assert totals["acked"] >= 6 * calm and totals["failed"] >= 2
    finally:
        if os.path.exists(os.path.join(fs, "filler")):
            os.unlink(os.path.join(fs, "filler"))


def _check_backfilled(ids: np.ndarray) -> None:
    from raycompat.serving.placement import shard_of

    where = shard_of(ids, 2)
    for s in range(2):
        reps, _ = _shard_handle(DISK, s).lookup.remote(ids[where == s]).result()
        assert set(reps) <= {"new"}, f"a checkpointed backfill item is not new on shard {s}"
