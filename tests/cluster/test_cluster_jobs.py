"""Jobs submitted with `ray job submit --working-dir .` to a real two-node cluster on this
machine (`ray start --head` + `ray start --address`), as the product card says users run them.

The head has 2 CPUs and the second node 2 CPUs plus its own resource; a training run with 2
workers and `--placement strict-spread` gets one worker on each node, and the run records the
node id of every rank (`worker_nodes` in each epoch's metrics). The gallery pipeline's
new-embedder actors ask for the head's custom resource and its old-embedder actors for the
second node's, so its embedding work must run on both nodes; every shard records the node ids
of each embedding stage.
"""

from __future__ import annotations

import glob
import json
import os

import locations
import pyarrow.parquet as pq
import pytest
from multinode import LocalMultiNodeCluster

# a head and a worker node on this machine (`ray start`), jobs through `ray job submit`: a
# job starts its own driver, Ray Train or Ray Data on both nodes (300 s, not the default 120)
pytestmark = [pytest.mark.cluster2, pytest.mark.subprocess, pytest.mark.timeout(300)]

REPO = locations.REPO
TINY = [
    "--backbone",
    "test_resnet",
    "--embed-dim",
    "16",
    "--epochs",
    "1",
    "--train-classes",
    "12",
    "--images-per-class",
    "8",
    "--eval-classes",
    "4",
    "--gallery-per-class",
    "2",
    "--distractor-classes",
    "2",
    "--batch-size",
    "16",
]


@pytest.fixture(scope="module")
def two_node_cluster():
    cluster = LocalMultiNodeCluster(head_cpus=2, head_resources={"head_node": 1})
    try:
        cluster.start_head()
        cluster.add_node(cpus=2, resources={"second_node": 1})
        yield cluster
    finally:
        cluster.stop()


def _submit(cluster, name: str, entrypoint: list[str]) -> str:
    return cluster.submit(entrypoint, REPO, submission_id=f"{name}-{os.getpid()}")


def _wait(cluster, name: str, job_id: str, timeout: float = 600) -> tuple[str, list[str]]:
    status, seen = cluster.wait_for_job(job_id, timeout)
    logs = cluster.job_logs(job_id)
    assert status == "SUCCEEDED", f"{name}: {seen}\n{logs[-4000:]}"
    return logs, seen


def _run_job(cluster, name: str, entrypoint: list[str], timeout: float = 600) -> str:
    logs, seen = _wait(cluster, name, _submit(cluster, name, entrypoint), timeout)
    assert seen[0] in ("PENDING", "RUNNING")  # it was polled while it ran
    return logs


def test_two_nodes_joined(two_node_cluster):
    nodes = two_node_cluster.nodes()
    assert len(nodes) == 2
    custom = sorted(
        k for n in nodes for k in n["resources_total"] if k in ("head_node", "second_node")
    )
    assert custom == ["head_node", "second_node"]


def _simulate_job(tmp_path) -> tuple[list[str], dict]:
    from simulator_inputs import write_dataset

    store = tmp_path / "store"
    dataset = write_dataset(store / "embeddings", shards=4, row_group=15)
    return [
        "python",
        "jobs/simulate_backfill.py",
        dataset,
        "--engine",
        "ray",
        "--policies",
        "random,uncertainty:entropy",
        "--modes",
        "compatible,cold",
        "--items-per-s-per-gpu",
        "100",
        "--out",
        str(store / "backfill"),
    ], {"store": store, "dataset": dataset}


GALLERY_SCENARIO = [
    "--train-classes",
    "10",
    "--eval-classes",
    "4",
    "--queries-per-class",
    "1",
    "--gallery-per-class",
    "3",
    "--distractor-classes",
    "3",
    "--distractors-per-class",
    "2",
]
EMBED_ITEMS, EMBED_CHUNK = 120, 40


def _embed_job(tmp_path) -> tuple[list[str], dict]:
    store = f"file://{tmp_path}/store"
    return [
        "python",
        "jobs/embed_gallery.py",
        "--random-init",
        str(tmp_path / "models"),
        "--storage",
        store,
        "--name",
        "tiny",
        "--columns",
        "old,new",
        "--items",
        str(EMBED_ITEMS),
        *GALLERY_SCENARIO,
        "--chunk-size",
        str(EMBED_CHUNK),
        "--render-batch-size",
        "16",
        "--preprocess-batch-size",
        "16",
        "--new-batch-size",
        "16",
        "--old-batch-size",
        "16",
        "--progress-every",
        "1000",
        "--new-resources",
        json.dumps({"head_node": 0.01}),
        "--old-resources",
        json.dumps({"second_node": 0.01}),
    ], {"store": store, "out": tmp_path / "store" / "embeddings" / "tiny"}


def _train_ract_job(tmp_path) -> tuple[list[str], dict]:
    store = tmp_path / "store"
    return [
        "python",
        "jobs/train_ract.py",
        *TINY,
        "--workers",
        "2",
        "--placement",
        "strict-spread",
        "--storage",
        str(store),
        "--out",
        str(store / "models" / "ract"),
    ], {"store": store}


SERVE_TOKEN = "cluster-secret-0123456789"


def _serve_job(tmp_path) -> tuple[list[str], dict]:
    from multinode import free_port

    port = free_port()
    token = tmp_path / "token"
    token.write_text(SERVE_TOKEN + "\n")
    return [
        "python",
        "jobs/serve_index.py",
        "--gallery",
        "synthetic:300:8:12:5",
        "--num-shards",
        "1",
        "--shard-replicas",
        "2",
        "--shard-replicas-per-node",
        "1",
        "--port",
        str(port),
        "--state-dir",
        str(tmp_path / "state"),
        "--token-file",
        str(token),
        "--app-name",
        "cluster_index",
    ], {"port": port}


class SubmittedJobs:
    """The simulate, serve, embed and train jobs, submitted in waves as the first of their
    tests asks for one: the simulation and the index together (the Serve replicas ask for no
    CPU); the embedding job when the simulation has ended, since its Ray Data tasks take a CPU
    each and Ray's SPREAD is best effort (beside them, the simulation's 28 tasks all ran on one
    node once, a CI run of 2026-11-28); the training job when the embedding job has ended, so
    that it runs beside the index's test (HTTP calls and a short job) instead of after it. Its
    strict-spread placement takes one CPU on each node, which nothing else holds by then."""

    WAVES = (
        (None, ("simulate-backfill", _simulate_job), ("serve-index", _serve_job)),
        ("simulate-backfill", ("embed-gallery", _embed_job)),
        ("embed-gallery", ("train-ract", _train_ract_job)),
    )

    def __init__(self, cluster, tmp_path_factory):
        self.cluster, self.tmp = cluster, tmp_path_factory
        self.jobs: dict[str, tuple[str, dict]] = {}
        self.ended: set[str] = set()
        self._submit_after(None)

    def _submit_after(self, ended: str | None) -> None:
        for after, *jobs in self.WAVES:
            if after == ended:
                for name, make in jobs:
                    entrypoint, facts = make(self.tmp.mktemp(name))
                    self.jobs[name] = (_submit(self.cluster, name, entrypoint), facts)

    def finished(self, name: str) -> tuple[str, dict]:
        """``(logs, facts)`` of a job that succeeded, waiting for the jobs before it."""
        for after, *jobs in self.WAVES:
            if after is not None and name in (n for n, _ in jobs):
                self.finished(after)
        job_id, facts = self.jobs[name]
        logs, _ = _wait(self.cluster, name, job_id, timeout=300)
        if name not in self.ended:
            self.ended.add(name)
            self._submit_after(name)
        return logs, facts


@pytest.fixture(scope="module")
def submitted(two_node_cluster, tmp_path_factory):
    return SubmittedJobs(two_node_cluster, tmp_path_factory)


def test_simulate_backfill_job_scores_blocks_on_both_nodes(two_node_cluster, submitted):
    """`ray job submit -- python jobs/simulate_backfill.py DATASET --engine ray`: the row groups
    are scored on both nodes, and the curves equal the in-memory simulator's."""
    import numpy as np

    from raycompat.embeddings.gallery import load_parquet
    from raycompat.simulator.memory_engine import simulate_backfill

    _, facts = submitted.finished("simulate-backfill")
    store, dataset = facts["store"], facts["dataset"]
    curves = json.loads((store / "backfill" / "curves.json").read_text())
    ran = curves["stats"]["distributed"]["blocks_per_node"]
    assert set(ran) == {n["node_id"] for n in two_node_cluster.nodes()}, ran
    mem = simulate_backfill(
        load_parquet(dataset), ["random", "uncertainty:entropy"], ["compatible", "cold"]
    )
    for got, want in zip(curves["curves"], mem.curves, strict=True):
        assert (got["policy"], got["mode"]) == (want.policy, want.mode)
        for m, values in want.metrics.items():
            assert np.array_equal(np.array(got["metrics"][m]), values, equal_nan=True), m
    assert glob.glob(str(store / "backfill" / "*.png"))
    assert "Where it ran" in (store / "backfill" / "curves.md").read_text()


def test_embed_gallery_job_embeds_on_both_nodes(two_node_cluster, submitted):
    """`python jobs/embed_gallery.py` submitted to the two-node cluster, writing to a file://
    URI --storage: parquet shards with every id once, the documented schema, and the new / old
    embedder actors pinned to the head / second node by custom resources."""
    logs, facts = submitted.finished("embed-gallery")
    store, out, items = facts["store"], facts["out"], EMBED_ITEMS
    shards = sorted(glob.glob(str(out / "part-*.parquet")))
    assert len(shards) == items // EMBED_CHUNK, (
        f"{os.listdir(out) if out.is_dir() else 'no output'}\n{logs[-3000:]}"
    )
    assert {"_manifest.json", "_summary.json"} <= set(os.listdir(out))
    table = pq.read_table(f"{store}/embeddings/tiny").sort_by("item_id")
    assert table.column("item_id").to_pylist() == list(range(items))  # every id exactly once
    assert [(f.name, str(f.type)) for f in table.schema] == [
        ("item_id", "int64"),
        ("label", "int64"),
        ("split", "string"),
        ("class_name", "string"),
        ("old", "fixed_size_list<element: float>[64]"),
        ("new", "fixed_size_list<element: float>[128]"),
    ]
    assert sorted(set(table.column("split").to_pylist())) == ["distractor", "gallery", "query"]
    by_resource = {
        r: n["node_id"]
        for n in two_node_cluster.nodes()
        for r in n["resources_total"]
        if r in ("head_node", "second_node")
    }
    head, second = by_resource["head_node"], by_resource["second_node"]
    for path in shards:
        nodes = json.loads(pq.read_metadata(path).metadata[b"raycompat.chunk"])["nodes"]
        assert nodes == {"new": [head], "old": [second]}, (path, nodes)
    summary = json.loads((out / "_summary.json").read_text())
    assert summary["nodes"] == {"new": {head: items}, "old": {second: items}}
    assert {n for per_node in summary["nodes"].values() for n in per_node} == {head, second}
    assert summary["out"] == f"{store}/embeddings/tiny"
    assert "embedding stages ran on Ray nodes" in logs


def test_serve_index_job_leaves_the_index_running(two_node_cluster, submitted):
    """`python jobs/serve_index.py` submitted to the cluster deploys the live index and ends;
    the index keeps answering HTTP after the job has finished (search, admin upsert with the
    token), until a second job with --stop removes it."""
    import urllib.error
    import urllib.request

    logs, facts = submitted.finished("serve-index")
    port = facts["port"]
    assert "the index keeps running" in logs, logs[-3000:]
    base = f"http://127.0.0.1:{port}"

    def call(path, body=None, auth=False):
        req = urllib.request.Request(
            base + path,
            data=None if body is None else json.dumps(body).encode(),
            headers={
                "Content-Type": "application/json",
                **({"Authorization": f"Bearer {SERVE_TOKEN}"} if auth else {}),
            },
        )
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())

    status = call("/status", auth=True)  # the job has ended: the index still answers
    assert status["items"]["old"] == 300 and status["items"]["new"] == 0, status
    # each shard's two replicas run on the two nodes, caches of one store named by its URI
    nodes = [{r["node_id"] for r in s["replicas"]} for s in status["shards"]]
    assert [len(n) for n in nodes] == [2], status["shards"]
    hits = call("/search", {"vectors": [[1.0] + [0.0] * 11], "k": 3})["results"][0]
    assert len(hits) == 3 and all(h["representation"] == "old" for h in hits)
    up = call(
        "/admin/upsert",
        {"items": [{"id": hits[0]["id"], "representation": "new", "vector": [1.0] + [0.0] * 11}]},
        auth=True,
    )
    assert up["applied"] == 1, up
    replicas = [r for s in call("/status", auth=True)["shards"] for r in s["replicas"]]
    assert len(replicas) == 2 and all(r["seq"] >= up["seq"] for r in replicas), replicas
    assert (
        call("/search", {"vectors": [[1.0] + [0.0] * 11], "k": 1})["results"][0][0][
            "representation"
        ]
        == "new"
    )
    _run_job(
        two_node_cluster,
        "serve-index-stop",
        ["python", "jobs/serve_index.py", "--stop", "--app-name", "cluster_index"],
        timeout=120,
    )
    with pytest.raises(urllib.error.HTTPError) as err:
        call("/status")
    assert err.value.code == 404


def test_train_ract_job_runs_on_both_nodes(two_node_cluster, submitted):
    """`python jobs/train_ract.py --workers 2 --placement strict-spread`: one DDP worker on each
    node (every epoch records the node id of every rank)."""
    logs, facts = submitted.finished("train-ract")
    store = facts["store"]
    manifest = json.loads((store / "models" / "ract" / "manifest.json").read_text())
    assert manifest["method"] == "ract" and manifest["predecessor"]
    histories = glob.glob(str(store / "ract-*" / "checkpoint_*" / "history.json")) + glob.glob(
        str(store / "**" / "history.json"), recursive=True
    )
    assert histories, f"no history.json under {store}\n{logs[-2000:]}"
    node_ids = {n["node_id"] for n in two_node_cluster.nodes()}
    for path in set(histories):
        for epoch in json.loads(open(path).read()):
            assert set(epoch["worker_nodes"]) == node_ids, (path, epoch["worker_nodes"])
