"""Serving pieces without Serve: scoring sides per served mode, admin token checks, Prometheus
text, request validation, HTTP error bodies and the serving plan."""

import dataclasses
import json
import pickle

import numpy as np
import pytest
from pydantic import ValidationError

from raycompat.config import ConfigError
from raycompat.index.canonical import pair_scores
from raycompat.index.search import l2_normalize
from raycompat.upgrade.modes import SERVED_MODES


# ----------------------------------------------------------------------------- scoring
def _all_pairs(queries, gallery):
    """Canonical scores of every (query, item) pair, ``[Q, N]``."""
    nq, ng = queries.shape[0], gallery.shape[0]
    return pair_scores(np.repeat(queries, ng, axis=0), np.tile(gallery, (nq, 1))).reshape(nq, ng)


def _simulator_sides(rng, rho, psi_rev, n=40, q=6, d_old=8, d_new=12):
    """Raw embeddings and the simulator's score sides by name (docs/methods.md "Query strategies"):
    ``(query, gallery)`` arrays, normalised after the compatible cut."""
    f32 = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    e = dict(
        g_old=f32(n, d_old),
        g_new=f32(n, d_new),
        g_adapted=f32(n, d_new),
        q_new=f32(q, d_new),
        q_old=f32(q, d_old),
        g_fct=f32(n, d_new),  # FCT's h(phi_o(g))
    )
    n_ = l2_normalize
    sides = {
        "old-old": (n_(e["q_old"]), n_(e["g_old"])),
        "new-old": (n_(np.ascontiguousarray(e["q_new"][:, :d_old])), n_(e["g_old"])),
        "new-new": (n_(e["q_new"]), n_(e["g_new"])),
        "new-adapted": (n_(e["q_new"]), n_(e["g_adapted"])),
        "new-fct": (n_(e["q_new"]), n_(e["g_fct"])),
        "rev-old": (n_(psi_rev(rho(e["q_new"]))), n_(e["g_old"])),
        "rho-rho": (n_(rho(e["q_new"])), n_(rho(e["g_new"]))),
    }
    return e, sides


@pytest.mark.parametrize("mode", SERVED_MODES)
def test_served_scores_equal_the_simulators_canonical_scores(mode):
    """Per served mode, the router's query side for each stored representation and the shards'
    stored vectors give the canonical scores of the simulator's sides for that mode, bit for bit."""
    from raycompat.serving.scoring import initial_representation, query_sides, stored_new
    from raycompat.upgrade.modes import mode_spec

    rng = np.random.default_rng(len(mode))
    w_rho = rng.standard_normal((12, 10)).astype(np.float32)
    w_rev = rng.standard_normal((10, 8)).astype(np.float32)
    rho = lambda v: np.asarray(v, np.float32) @ w_rho  # noqa: E731 - stand-ins for the bundle's modules
    psi_rev = lambda v: np.asarray(v, np.float32) @ w_rev  # noqa: E731
    e, sim = _simulator_sides(rng, rho, psi_rev)
    served = query_sides(
        e["q_new"],
        "new",
        8,
        (rho, psi_rev) if mode == "rank_merge" else None,
        e["q_old"] if mode == "naive_merge" else None,
    )
    stored = {
        "old": l2_normalize(e["g_old"]),
        "adapted": l2_normalize(e["g_fct"] if mode == "fct" else e["g_adapted"]),
        "new": stored_new(e["g_new"], rho if mode == "rank_merge" else None),
    }
    spec = mode_spec(mode)
    for rep, side_name in ((initial_representation(mode), spec.old_side), ("new", spec.new_side)):
        assert np.array_equal(_all_pairs(served[rep], stored[rep]), _all_pairs(*sim[side_name])), (
            rep
        )


def test_old_model_queries_score_old_items_only():
    from raycompat.serving.scoring import initial_representation, query_sides

    q = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    sides = query_sides(q, "old", 8)
    assert list(sides) == ["old"] and np.array_equal(sides["old"], l2_normalize(q))
    cut = query_sides(np.concatenate([q, q], axis=1), "new", 8)
    assert np.array_equal(cut["old"], l2_normalize(q)) and cut["new"].shape == (3, 16)
    assert [initial_representation(m) for m in SERVED_MODES] == [
        "old",
        "adapted",
        "adapted",
        "old",
        "old",
    ]
    with pytest.raises(ValueError, match="not served"):
        initial_representation("cold")


# ----------------------------------------------------------------------------- auth
GOOD = "a-long-enough-admin-token"


def test_admin_token_from_file_or_environment(tmp_path):
    from raycompat.serving.auth import TOKEN_ENV, load_admin_token

    f = tmp_path / "token"
    f.write_text(f"  {GOOD}  \nsecond line\n")
    assert (
        load_admin_token(str(f), env={TOKEN_ENV: "another-token-from-env"}) == GOOD
    )  # the file wins
    assert load_admin_token(None, env={TOKEN_ENV: f" {GOOD}\n"}) == GOOD
    assert load_admin_token(None, env={}) is None
    with pytest.raises(ConfigError, match="not found"):
        load_admin_token(str(tmp_path / "missing"), env={})
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="empty"):
        load_admin_token(str(tmp_path / "empty"), env={})
    with pytest.raises(ConfigError, match="at least 16"):
        load_admin_token(None, env={TOKEN_ENV: "short"})


@pytest.mark.parametrize(
    "header,token,why",
    [
        (f"Bearer {GOOD}", GOOD, None),
        (f"bearer {GOOD} ", GOOD, None),
        (f"Bearer {GOOD}", None, "disabled"),
        (None, GOOD, "missing"),
        ("", GOOD, "missing"),
        (f"Basic {GOOD}", GOOD, "must be 'Bearer"),
        ("Bearer", GOOD, "must be 'Bearer"),
        ("Bearer wrong-token-of-enough-length", GOOD, "invalid admin token"),
        ("Bearer \u00e9t\u00e9-token-with-unicode", GOOD, "invalid admin token"),
    ],
)
def test_bearer_check(header, token, why):
    from raycompat.serving.auth import check_bearer

    got = check_bearer(header, token)
    assert (got is None) if why is None else (why in got), got


# ----------------------------------------------------------------------------- metrics
def _ray_exposition(worker: str, search_200: int, seconds: list[float]) -> str:
    """A node agent's Prometheus text as Ray writes it: our families with Ray's and Serve's
    labels (one replica's worker)."""
    ray_labels = (
        f'Component="core_worker",WorkerId="{worker}",application="index",'
        f'deployment="router",replica="router#{worker}"'
    )
    bounds = (0.001, 0.01, 0.1)
    lines = [
        "# HELP ray_raycompat_serving_requests_total HTTP requests by endpoint and status code.",
        "# TYPE ray_raycompat_serving_requests_total counter",
        f'ray_raycompat_serving_requests_total{{{ray_labels},endpoint="/search",status="200"}} '
        f"{search_200}.0",
        f'ray_raycompat_serving_requests_total{{{ray_labels},endpoint="/status",status="503"}} 1.0',
        "# HELP ray_raycompat_serving_request_seconds Request latency in the router.",
        "# TYPE ray_raycompat_serving_request_seconds histogram",
    ]
    for b in bounds:
        n = sum(x <= b for x in seconds)
        lines.append(
            f'ray_raycompat_serving_request_seconds_bucket{{{ray_labels},endpoint="/search",'
            f'le="{b}"}} {n}.0'
        )
    lines += [
        f'ray_raycompat_serving_request_seconds_bucket{{{ray_labels},endpoint="/search",'
        f'le="+Inf"}} {len(seconds)}.0',
        f'ray_raycompat_serving_request_seconds_count{{{ray_labels},endpoint="/search"}} '
        f"{len(seconds)}.0",
        f'ray_raycompat_serving_request_seconds_sum{{{ray_labels},endpoint="/search"}} '
        f"{sum(seconds)}",
        "# HELP ray_serve_num_http_requests_total Ray's own.",
        "# TYPE ray_serve_num_http_requests_total counter",
        f"ray_serve_num_http_requests_total{{{ray_labels}}} 99.0",
    ]
    return "\n".join(lines) + "\n"


def test_metrics_sum_every_replica_and_render_as_prometheus_text():
    """Two router replicas' counters (Ray's agents export each replica's series): /metrics
    shows their sum under our names, Ray's and Serve's labels summed over, with the gauges."""
    from prometheus_client.parser import text_string_to_metric_families

    from raycompat.serving.metrics import render_cluster_metrics, sum_over_replicas

    texts = [_ray_exposition("a", 2, [0.0005, 0.05]), _ray_exposition("b", 3, [0.005])]
    gauges = [
        ("items", "Items held.", {"shard": "0", "representation": "old"}, 7),
        ("items", "Items held.", {"shard": "1", "representation": 'we"ird\nname'}, 3),
        ("shards_up", "Shards answering.", {}, 2),
    ]
    text = render_cluster_metrics(sum_over_replicas(texts), gauges)
    fam = {f.name: f for f in text_string_to_metric_families(text)}
    assert "ray_serve_num_http_requests" not in fam and "serve_num_http_requests" not in fam
    reqs = {
        (s.labels["endpoint"], s.labels["status"]): s.value
        for s in fam["raycompat_serving_requests"].samples
    }
    assert reqs == {("/search", "200"): 5.0, ("/status", "503"): 2.0}
    hist = fam["raycompat_serving_request_seconds"]
    assert hist.type == "histogram"
    buckets = [(s.labels["le"], s.value) for s in hist.samples if s.name.endswith("_bucket")]
    assert buckets == [("0.001", 1.0), ("0.01", 2.0), ("0.1", 3.0), ("+Inf", 3.0)]
    assert next(s.value for s in hist.samples if s.name.endswith("_sum")) == pytest.approx(0.0555)
    items = {s.labels["representation"]: s.value for s in fam["raycompat_serving_items"].samples}
    assert items == {"old": 7.0, 'we"ird\nname': 3.0}
    assert fam["raycompat_serving_items"].type == "gauge"
    assert fam["raycompat_serving_shards_up"].samples[0].value == 2


# ----------------------------------------------------------------------------- schemas
@pytest.fixture(scope="module")
def models():
    from raycompat.serving.schemas import Limits, build_models

    return build_models(Limits(max_k=5, max_queries=2, max_image_bytes=30, max_upsert_items=3))


GOOD_SEARCH = [
    {"vectors": [[1, 2]], "k": 5},
    {"vectors": [[1, 2], [3, 4]]},
    {"images": ["AAAA"], "k": 1},
    {"vectors": [[1.0]], "old_vectors": [[0.5]], "model": "new"},
    {"vectors": [[1.0]], "model": "old"},
]
BAD_SEARCH = [
    ({"vectors": [[1]], "k": 6}, "k"),
    ({"vectors": [[1]], "k": 0}, "k"),
    ({"vectors": [[1]] * 3}, "vectors"),
    ({"vectors": [[]]}, "vectors"),
    ({"vectors": [[float("nan")]]}, "vectors"),
    ({"vectors": [[float("inf")]]}, "vectors"),
    ({"vectors": [["a"]]}, "vectors"),
    ({"k": 3}, "exactly one"),
    ({"vectors": [[1]], "images": ["AAAA"]}, "exactly one"),
    ({"images": ["A" * 41]}, "images"),
    ({"images": ["AAAA"], "model": "old"}, "new model"),
    ({"vectors": [[1]], "model": "older"}, "model"),
    ({"old_vectors": [[1]], "images": ["AAAA"]}, "old_vectors"),
    ({"vectors": [[1]], "top": 3}, "top"),
]


@pytest.mark.parametrize("body", GOOD_SEARCH)
def test_search_request_accepts_good_input(models, body):
    req = models.SearchRequest.model_validate(body)
    assert req.k == body.get("k", 10)


@pytest.mark.parametrize("body,needle", BAD_SEARCH)
def test_search_request_rejects_bad_input_naming_it(models, body, needle):
    with pytest.raises(ValidationError) as err:
        models.SearchRequest.model_validate(body)
    assert any(
        needle in ".".join(map(str, e["loc"])) or needle in e["msg"] for e in err.value.errors()
    )


def test_admin_requests_validate(models):
    item = {"id": 3, "representation": "new", "vector": [0.5, 0.5]}
    assert models.UpsertRequest.model_validate({"items": [item] * 3}).items[0].id == 3
    for bad in (
        {"items": [item] * 4},
        {"items": []},
        {"items": [dict(item, id=-1)]},
        {"items": [dict(item, representation="newest")]},
        {"items": [dict(item, extra=1)]},
    ):
        with pytest.raises(ValidationError):
            models.UpsertRequest.model_validate(bad)
    assert (
        models.BackfillStartRequest.model_validate({"policy": "sequential", "batch_size": 3}).rate
        is None
    )
    for bad in (
        {"batch_size": 4},
        {"policy": "best"},
        {"rate": 0},
        {"source": "disk"},
        {"until": -1},
    ):
        with pytest.raises(ValidationError):
            models.BackfillStartRequest.model_validate(bad)
    assert models.BackfillResumeRequest.model_validate({"until": 10}).until == 10
    schema = models.SearchRequest.model_json_schema()
    assert schema["properties"]["k"]["maximum"] == 5


# ----------------------------------------------------------------------------- errors
def test_validation_errors_become_one_line_naming_the_field():
    from raycompat.serving.errors import problem_field, validation_error

    assert (
        problem_field(("body", "vectors", 0, 2)) == "body.vectors[0][2]" and problem_field(()) == ""
    )
    head, problems = validation_error(
        [
            {"loc": ("body", "k"), "msg": "too big", "type": "less_than_equal"},
            {"loc": ("body", "vectors", 1), "msg": "bad", "type": "x"},
        ]
    )
    assert head == "invalid request: body.k: too big"
    assert problems == [
        {"field": "body.k", "message": "too big"},
        {"field": "body.vectors[1]", "message": "bad"},
    ]
    head, _ = validation_error(
        [
            {
                "loc": ("body", 4),
                "msg": "JSON decode error",
                "type": "json_invalid",
                "ctx": {"error": "Expecting value"},
            }
        ]
    )
    assert head == "malformed JSON: Expecting value"


def test_error_mapping_statuses():
    from raycompat.serving.embedder_pool import ImageInputError
    from raycompat.serving.errors import error_response, image_error, internal_error, unavailable

    assert (
        image_error(ImageInputError("images[0]: image of 9 bytes exceeds the limit of 4")).status
        == 413
    )
    assert image_error(ImageInputError("images[0]: invalid base64")).status == 400
    e = unavailable("shard 1", TimeoutError())
    assert (e.status, e.message) == (503, "shard 1 unavailable: no answer in time")
    assert e.headers == {"Retry-After": "1"}
    e = unavailable("shard 1", RuntimeError())
    assert e.message == "shard 1 unavailable: RuntimeError"
    r = internal_error(KeyError("secret detail"))
    assert r.status_code == 500
    assert json.loads(r.body) == {"error": "internal error: KeyError", "problems": []}
    r = error_response(409, "busy", [{"field": "body", "message": "busy"}])
    assert json.loads(r.body)["problems"] == [{"field": "body", "message": "busy"}]


# ----------------------------------------------------------------------------- the plan
def test_plan_derives_dims_counts_and_models(tmp_path):
    from raycompat.serving.config import serving_config
    from raycompat.serving.plan import RepDims, build_plan

    new = tmp_path / "new"
    new.mkdir()
    (new / "manifest.json").write_text(json.dumps({"method": "bct", "embed_dim": 12}))
    old = tmp_path / "old"
    old.mkdir()
    cfg = serving_config(
        gallery="synthetic:50:8:12:0",
        state_dir=str(tmp_path / "s"),
        new_model=str(new),
        old_model=str(old),
        max_k=7,
    )
    plan = build_plan(cfg)
    assert plan.dims == RepDims(old=8, adapted=12, new=12)
    assert plan.dims.as_dict() == {"old": 8, "adapted": 12, "new": 12}
    assert (plan.query_dims.old, plan.query_dims.of("new")) == (8, 12)
    assert plan.n_items == 50 and plan.compatible_dim == 8 and plan.initial_representation == "old"
    assert plan.limits.max_k == 7 and plan.limits.max_upsert_items == cfg.max_upsert_items
    models = plan.models_json()
    assert models["old"] == {"path": str(old)}
    assert models["new"]["method"] == "bct" and models["new"]["embed_dim"] == 12
    assert len(models["new"]["manifest_sha256"]) == 16
    assert pickle.loads(pickle.dumps(plan)) == plan  # what Ray Serve ships to every replica
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.config.num_shards = 3
    adapted = build_plan(
        serving_config(gallery="synthetic:50:8:12:0", mode="adapted", compatible_dim=4)
    )
    assert adapted.compatible_dim == 4 and adapted.initial_representation == "adapted"


def test_plan_refuses_inconsistent_options(tmp_path):
    from raycompat.serving.config import serving_config
    from raycompat.serving.plan import build_plan

    with pytest.raises(ConfigError, match="compatible_dim must equal D_old=8, got 4"):
        build_plan(serving_config(gallery="synthetic:50:8:12:0", compatible_dim=4))
    with pytest.raises(ConfigError, match="rank_merge.*new_model"):
        build_plan(serving_config(gallery="synthetic:50:8:12:0", mode="rank_merge"))


def test_serving_config_names_unknown_or_bad_options(tmp_path):
    from raycompat.serving.config import serving_config

    with pytest.raises(ConfigError, match="unknown option 'shard_count'"):
        serving_config(gallery="synthetic:10", shard_count=2)
    with pytest.raises(ConfigError, match="'mode'.*" + ".*".join(SERVED_MODES)):
        serving_config(gallery="synthetic:10", mode="cold")
    with pytest.raises(ConfigError, match="'num_shards'.*>= 1"):
        serving_config(gallery="synthetic:10", num_shards=0)
    with pytest.raises(ConfigError, match="gallery"):
        serving_config()
    with pytest.raises(ConfigError, match="new_model.*not found"):
        serving_config(gallery="synthetic:10", new_model=str(tmp_path / "nowhere"))
    cfg = serving_config({"gallery": "synthetic:10", "num_shards": "3"}, state_dir="rel")
    assert cfg.num_shards == 3 and cfg.state_dir.endswith("/rel") and cfg.state_dir.startswith("/")
    assert cfg.upsert_retry_s == 300.0


def test_autoscaling_configs_are_checked_and_become_serve_options():
    """The JSON of ``shard_autoscaling`` / ``router_autoscaling`` is checked key by key and
    replaces ``num_replicas`` in the deployment options (reaching Serve: test_serving_scale.py)."""
    from raycompat.serving.app import replica_options
    from raycompat.serving.config import serving_config

    with pytest.raises(ConfigError, match="shard_autoscaling.*unknown key 'max_replica'"):
        serving_config(gallery="synthetic:10", shard_autoscaling='{"max_replica": 2}')
    with pytest.raises(ConfigError, match="router_autoscaling.*max_replicas"):
        serving_config(
            gallery="synthetic:10", router_autoscaling={"min_replicas": 3, "max_replicas": 2}
        )
    with pytest.raises(ConfigError, match="must be a JSON object"):
        serving_config(gallery="synthetic:10", shard_autoscaling="[1, 2]")
    cfg = serving_config(gallery="synthetic:10", shard_autoscaling={"max_replicas": 3})
    assert replica_options(cfg.shard_replicas, cfg.shard_autoscaling) == {
        "autoscaling_config": {"max_replicas": 3}
    }
    assert replica_options(2, None) == {"num_replicas": 2}


def test_synthetic_gallery_vectors_are_what_the_shards_load():
    from raycompat.serving.gallery_source import SyntheticGallery

    gal = SyntheticGallery(600, 8, 12, seed=3)
    ids, vecs = gal.initial_vectors("old", 1, 3)
    assert np.array_equal(gal.vectors_of("old", ids), vecs) and vecs.shape == (ids.size, 8)
    assert np.array_equal(gal.vectors_of("new", ids[:5]), gal.new_vectors(ids[:5]))
    assert gal.vectors_of("adapted", ids[:2]).shape == (2, 12)
    with pytest.raises(KeyError, match="unknown item"):
        gal.vectors_of("old", [600])
