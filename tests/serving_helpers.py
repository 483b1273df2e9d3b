"""What the Serve tests share: the admin token, a labelled gallery, deploying an app (and taking
it down), resetting a shared app between tests, the test sizes, and a tmpfs that outlives one
test."""

import os
import subprocess
import time

import numpy as np

from raycompat.embeddings.gallery import GalleryEmbeddings

TOKEN = "test-admin-token-0123456789"
APP = "raycompat-test"

#: ``RAYCOMPAT_TEST_SCALE=full`` runs the Serve tests at the sizes they had before they were cut
#: for a 15-minute suite (more fault-injection rounds, more fuzz examples); the default is small.
FULL_SCALE = os.environ.get("RAYCOMPAT_TEST_SCALE", "").strip().lower() == "full"


def scaled(small, full):
    """``full`` under ``RAYCOMPAT_TEST_SCALE=full``, else ``small`` (the default run)."""
    return full if FULL_SCALE else small


def labelled_embeddings(n_items=600, n_queries=60, classes=30, d_old=16, d_new=24, seed=0):
    """Clustered old/new/adapted embeddings; the new model's first d_old dims are compatible."""
    rng = np.random.default_rng(seed)
    c_old = rng.standard_normal((classes, d_old))
    c_new = np.concatenate(
        [
            c_old + 0.3 * rng.standard_normal((classes, d_old)),
            rng.standard_normal((classes, d_new - d_old)),
        ],
        axis=1,
    )
    g_lab = rng.integers(0, classes, n_items)
    q_lab = rng.integers(0, classes, n_queries)

    def draw(centers, lab, s):
        return (centers[lab] + s * rng.standard_normal((lab.size, centers.shape[1]))).astype(
            np.float32
        )

    g_new = draw(c_new, g_lab, 0.9)
    return GalleryEmbeddings(
        gallery_labels=g_lab,
        gallery_old=draw(c_old, g_lab, 1.2),
        gallery_new=g_new,
        gallery_adapted=(g_new + 0.8 * rng.standard_normal(g_new.shape)).astype(np.float32),
        query_labels=q_lab,
        query_old=draw(c_old, q_lab, 1.2),
        query_new=draw(c_new, q_lab, 0.9),
        gallery_ids=np.arange(n_items, dtype=np.int64) * 7 + 3,
        query_ids=np.arange(n_queries, dtype=np.int64) + 10_000_000,
    )


def cpu_index():
    """The exact index on the CPU, named: ``device="auto"`` (the default) imports torch in every
    shard replica only to find no GPU, about half of a replica's start-up CPU on this machine."""
    from raycompat.index.ann import index_options

    return index_options(device="cpu")


def deploy(port, state_dir, gallery, token_file=None, app=APP, prefix="/", **kw):

    from raycompat.serving.app import build_app
    from raycompat.serving.client import ServingClient
    from raycompat.serving.config import serving_config
    from raycompat.serving.deploy import run_application

    kw.setdefault("router_replicas", 1)  # the default (0: two where there are CPUs) costs more
    kw.setdefault("index", cpu_index())
    cfg = serving_config(
        gallery=gallery,
        state_dir=str(state_dir),
        port=port,
        app_name=app,
        token_file=token_file,
        route_prefix=prefix,
        **kw,
    )
    run_application(cfg, build_app(cfg))
    client = ServingClient(f"http://127.0.0.1:{port}{prefix.rstrip('/')}", token=TOKEN)
    client.wait_ready()
    return cfg, client


def undeploy(app: str, wait: bool = False) -> None:
    """Delete an application.  Without ``wait`` it returns at once and Serve stops the replicas
    in the background (each waits out its 2 s graceful-shutdown loop): for an app whose name
    and state directory no later deploy reuses.  ``wait``: before its state directory is
    deployed again or changed (the replicas hold its locks until they stop)."""
    from ray import serve

    serve.delete(app, _blocking=wait)


def reset_backfill(client, timeout: float = 120.0) -> dict:
    """Return a shared app to its deployed state between tests: any backfill paused, every
    upgraded item rolled back to the vector it was deployed with (the live index's rollback
    restores each kept vector exactly), no ``new`` item left.  Returns ``/status``."""
    t0 = time.time()
    while True:
        st = client.status()
        state = st["backfill"]["state"]
        if state == "running":
            client.pause_backfill()  # a batch in flight may still land: looked at again below
        elif state != "rolling_back":
            if not st["kept"]["items"]:
                assert st["items"]["new"] == 0, f"new items without old vectors: {st['items']}"
                return st
            client.rollback_backfill(to=None)
        assert time.time() - t0 < timeout, f"no reset within {timeout} s: {st['backfill']}"
        time.sleep(0.1)


def mount_tmpfs(path: str, size_bytes: int) -> bool:
    """Mount a tmpfs of ``size_bytes`` at ``path`` (created); False where mounting is not
    permitted.  For a fixture wider than one test (tests use conftest's ``tiny_fs``)."""
    os.makedirs(path, exist_ok=True)
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={int(size_bytes)}", "tmpfs", path],
        capture_output=True,
    )
    return r.returncode == 0


def umount(path: str) -> None:
    subprocess.run(["umount", "-l", path], capture_output=True)


def fill(path: str, name: str = "filler", leave: int = 0) -> None:
    """Leave ``leave`` bytes free on the filesystem of ``path`` (writing the file ``name``;
    0: a full disk), as conftest's ``tiny_fs.fill`` does for one test's tmpfs."""
    vfs = os.statvfs(path)
    size = max(0, vfs.f_bavail * vfs.f_frsize - leave)
    try:
        with open(os.path.join(path, name), "wb", buffering=0) as fh:
            fh.write(b"\0" * size)
            while not leave:
                fh.write(b"\0" * 4096)
    except OSError:  # the disk is full: what was wanted
        pass


def metric_value(text: str, sample: str) -> float:
    """The value of the Prometheus sample ``sample`` (name and labels as written), 0 if absent."""
    for line in text.splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def wait_for_metric(client, sample: str, at_least: float, timeout_s: float = 30.0) -> list:
    """Scrape ``/metrics`` until ``sample`` reaches ``at_least`` (counters reach it through
    Ray's metrics agents, within a report interval); returns every value read, in order."""
    seen = []
    deadline = time.monotonic() + timeout_s
    while True:
        seen.append(metric_value(client.metrics(), sample))
        if seen[-1] >= at_least or time.monotonic() > deadline:
            return seen
        time.sleep(0.5)


def backfill_order(client) -> np.ndarray:
    """The order of the index's backfill (item ids), read from the store it serves: the
    backfill's record and order are records in the store."""
    from raycompat.stores import open_store
    from raycompat.stores.backfill import BackfillRecords

    records = BackfillRecords(open_store(client.status()["backfill"]["store"]))
    return records.read_order(records.load()["order"])
