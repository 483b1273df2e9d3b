"""Jobs submitted with `ray job submit --working-dir .` to a real two-node cluster on this
machine (`ray start --head` + `ray start --address`), as the product card says users run them.

The head has 2 CPUs and the second node 2 CPUs plus its own resource; a training run with 2
workers x 2 CPUs cannot fit on one node, so Ray places one worker on each, and the run records
the node id of every rank (`worker_nodes` in each epoch's metrics).
"""
from __future__ import annotations

import glob
import json
import os

import pytest

from multinode import LocalMultiNodeCluster

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--backbone", "test_resnet", "--embed-dim", "16", "--epochs", "1", "--train-classes", "12",
        "--images-per-class", "8", "--eval-classes", "4", "--gallery-per-class", "2",
        "--distractor-classes", "2", "--batch-size", "16"]


@pytest.fixture(scope="module")
def two_node_cluster():
    cluster = LocalMultiNodeCluster(head_cpus=2, head_resources={"head_node": 1})
    try:
        cluster.start_head()
        cluster.add_node(cpus=2, resources={"second_node": 1})
        yield cluster
    finally:
        cluster.stop()


def _run_job(cluster, name: str, entrypoint: list[str], timeout: float = 600) -> str:
    job_id = cluster.submit(entrypoint, REPO, submission_id=f"{name}-{os.getpid()}")
    status, seen = cluster.wait_for_job(job_id, timeout)
    logs = cluster.job_logs(job_id)
    assert status == "SUCCEEDED", f"{name}: {seen}\n{logs[-4000:]}"
    assert seen[0] in ("PENDING", "RUNNING")    # it was polled while it ran
    return logs


def test_two_nodes_joined(two_node_cluster):
    nodes = two_node_cluster.nodes()
    assert len(nodes) == 2
    custom = sorted(k for n in nodes for k in n["resources_total"] if k in ("head_node", "second_node"))
    assert custom == ["head_node", "second_node"]


def test_train_ract_job_runs_on_both_nodes(two_node_cluster, tmp_path):
    store = tmp_path / "store"
    logs = _run_job(two_node_cluster, "train-ract", [
        "python", "jobs/train_ract.py", *TINY, "--workers", "2", "--cpus-per-worker", "2",
        "--storage", str(store), "--out", str(store / "models" / "ract")])
    manifest = json.loads((store / "models" / "ract" / "manifest.json").read_text())
    assert manifest["method"] == "ract" and manifest["predecessor"]
    histories = glob.glob(str(store / "ract-*" / "checkpoint_*" / "history.json")) + \
        glob.glob(str(store / "**" / "history.json"), recursive=True)
    assert histories, f"no history.json under {store}\n{logs[-2000:]}"
    node_ids = {n["node_id"] for n in two_node_cluster.nodes()}
    for path in set(histories):
        for epoch in json.loads(open(path).read()):
            assert set(epoch["worker_nodes"]) == node_ids, (path, epoch["worker_nodes"])


def test_simulate_backfill_job(two_node_cluster, tmp_path):
    from test_backfill_job import write_parquet

    store = tmp_path / "store"
    store.mkdir()
    embeddings = write_parquet(store / "embeddings.parquet")
    _run_job(two_node_cluster, "simulate-backfill", [
        "python", "jobs/simulate_backfill.py", "--embeddings", str(embeddings),
        "--policies", "random,sequential", "--modes", "compatible,cold",
        "--items-per-s-per-gpu", "100", "--out", str(store / "backfill")], timeout=300)
    curves = json.loads((store / "backfill" / "curves.json").read_text())
    assert {(c["policy"], c["mode"]) for c in curves["curves"]} >= {("random", "compatible"),
                                                                     ("sequential", "compatible")}
    assert glob.glob(str(store / "backfill" / "*.png"))
