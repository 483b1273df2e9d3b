"""A writer killed with SIGKILL mid-run loses no acknowledged batch and leaves no batch half
written, on every backend (docs/stores.md#write)."""

from __future__ import annotations

import importlib.util
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from stores_kill_child import batch_vector

from raycompat.stores import GalleryBlock, create_store, open_store


def _backend(name: str, *packages: str):
    missing = [p for p in packages if importlib.util.find_spec(p) is None]
    return pytest.param(
        name,
        marks=pytest.mark.skipif(bool(missing), reason=f"{name} store needs {', '.join(missing)}"),
    )


LANCE = _backend("lance", "lancedb")
MILVUS = _backend("milvus", "pymilvus", "milvus_lite")
CHILD = Path(__file__).with_name("stores_kill_child.py")
REPO = Path(__file__).resolve().parents[2]
GROUPS, BATCH, KILL_AFTER = 12, 20, 30


def _uri(backend: str, tmp_path: Path) -> str:
    if backend == "lance":
        return f"lance://{tmp_path}/lancedb/gallery"
    return f"milvus://{tmp_path}/milvus.db/gallery"


def _acked_batches(proc: subprocess.Popen, wanted: int, timeout_s: float) -> list[int]:
    """Batch numbers the child printed (whole lines only) until ``wanted`` or it ends."""
    fd, buf, acked = proc.stdout.fileno(), b"", []
    deadline = time.monotonic() + timeout_s
    while len(acked) < wanted:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            raise AssertionError(f"child acknowledged only {len(acked)} batches in {timeout_s} s")
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        buf += chunk
        *lines, buf = buf.split(b"\n")
        acked += [int(line) for line in lines]
    return acked


def _check(groups_seen: dict[int, int], acked: list[int]) -> None:
    last = max(acked)
    for group in range(GROUPS):
        done = [b for b in acked if b % GROUPS == group]
        stored = groups_seen.get(group, -1)
        if done:
            assert stored >= max(done), f"group {group}: acknowledged batch {max(done)} lost"
        assert stored <= last + 1, f"group {group}: batch {stored} was never started"


@pytest.mark.subprocess
@pytest.mark.parametrize("backend", [LANCE, MILVUS])
def test_sigkill_during_writes_keeps_every_acknowledged_batch_whole(backend, tmp_path):
    n = GROUPS * BATCH
    rng = np.random.default_rng(0)
    ids = rng.choice(10 * n, size=n, replace=False).astype(np.int64)
    old = rng.standard_normal((n, 8)).astype(np.float32)
    uri = _uri(backend, tmp_path)
    create_store(uri, GalleryBlock(ids, ids % 5, old), old_model="m0", new_dim=8).close()
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    )
    with open(tmp_path / "child.err", "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, str(CHILD), uri, str(GROUPS), str(BATCH)],
            stdout=subprocess.PIPE,
            stderr=err,
            env=env,
        )
        try:
            acked = _acked_batches(proc, KILL_AFTER, timeout_s=120)
            time.sleep(float(rng.uniform(0, 0.02)))
            running = proc.poll() is None
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        acked += _acked_batches(proc, 10**9, timeout_s=5)
    assert len(acked) >= KILL_AFTER and running, (tmp_path / "child.err").read_text()[-2000:]
    with open_store(uri) as store:
        (block,) = store.read_blocks(
            ("id", "new", "new_model", "position", "upgraded"), block_rows=n
        )
    seen = {}
    order_ids = np.sort(ids)
    for group in range(GROUPS):
        rows = np.isin(block["id"], order_ids[group::GROUPS][:BATCH])
        models = set(block["new_model"][rows])
        assert len(models) == 1, f"group {group} half written: {sorted(models)}"
        (model,) = models
        if model == "":
            assert not block["upgraded"][rows].any()
            continue
        b = int(model[1:])
        assert block["upgraded"][rows].all() and (block["new"][rows] == batch_vector(b, 8)).all()
        np.testing.assert_array_equal(
            np.sort(block["position"][rows]), b * BATCH + np.arange(BATCH)
        )
        seen[group] = b
    _check(seen, acked)


@pytest.mark.subprocess
@pytest.mark.parametrize("backend", [MILVUS])
def test_milvus_lite_file_held_by_another_process_is_refused_by_name(backend, tmp_path):
    uri = _uri(backend, tmp_path)
    ids = np.arange(20, dtype=np.int64)
    old = np.ones((20, 4), dtype=np.float32)
    code = "import sys; from raycompat.stores import open_store; open_store(sys.argv[1])"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    with create_store(uri, GalleryBlock(ids, ids, old), old_model="m0", new_dim=4):
        child = subprocess.run(
            [sys.executable, "-c", code, uri], capture_output=True, text=True, env=env, timeout=120
        )
    assert child.returncode != 0
    assert "StoreError" in child.stderr and "another process holds it" in child.stderr
    assert "milvus.db" in child.stderr
    with open_store(uri) as store:  # released by close: this process opens it again
        assert store.count() == 20
