"""What the whole test session shares: one real local Ray cluster, one Ray Serve instance, the
tiny main job's models and reports (trained once per run of the suite, and cached on disk under
the pytest cache keyed by their configuration and the package's source), and the small
galleries and files several directories use.

Only a test that asks for ``ray_cluster`` (or a fixture built on it) may start Ray: any other
test that calls ``ray.init`` fails with its name, as Ray's own unit tests forbid it
(``disallow_ray_init``), so that pure functions stay testable without a cluster.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import sys

import pytest

# With PYTHONDONTWRITEBYTECODE set (as in this machine's environment) every process the suite
# starts -- each Ray worker, actor, Serve replica and job -- compiles the package's modules from
# source again (the whole package: about 0.9 CPU-seconds); the suite writes the bytecode once.
if os.environ.pop("PYTHONDONTWRITEBYTECODE", None) is not None:
    sys.dont_write_bytecode = False
os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
# the jobs the tests run start their embedded Ray without its dashboard (no job uses it; about
# 3.5 CPU-seconds per cluster on this machine): raycompat.cluster.DASHBOARD_ENV
os.environ.setdefault("RAYCOMPAT_RAY_DASHBOARD", "0")
os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
# Ray Train starts an actor per run that watches for the preemption of cloud spot nodes: on
# this machine it only costs a Python process (~2 CPU-seconds) per training run
os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
# Ray Train's controller looks at its workers every 2 s by default: a tiny run that ends in a
# second would wait for the next look (Ray passes the driver's environment to its processes)
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")
# as raycompat.cluster.connect does: Serve's proxy answers its own errors as JSON
os.environ.setdefault(
    "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH", "raycompat.serving.proxy.proxy_middlewares"
)
# What an idle session cluster with Serve costs (2026-11-28, one app of one replica, 60 s): 11.7
# CPU-seconds a minute with Ray's defaults, about 9 with the three settings below. Serve's
# controller runs its control loop every 0.1 s, every replica and handle exports Ray's cached
# metrics every 0.1 s, the dashboard agent samples every process every 5 s; none of these is
# what a test looks at (our /metrics is the index's own; replica health checks keep their own
# period), so the suite runs them less often.
os.environ.setdefault("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", "0.25")
os.environ.setdefault("RAY_SERVE_METRICS_EXPORT_INTERVAL_MS", "1000")
os.environ.setdefault("REPORTER_UPDATE_INTERVAL_MS", "60000")
# The Ray Train worker and controller actors need a few logical CPUs on this 2-core machine.
TEST_RAY_CPUS = 4


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    if not ray.is_initialized():
        ray.init(
            address="local", num_cpus=TEST_RAY_CPUS, logging_level="warning", log_to_driver=True
        )
    yield ray
    ray.shutdown()


@pytest.fixture(autouse=True)
def _ray_only_where_asked(request, monkeypatch):
    """A test that does not ask for ``ray_cluster`` must not start Ray (in this process)."""
    import ray

    if "ray_cluster" in request.fixturenames:
        return

    def refuse(*args, **kwargs):
        raise RuntimeError(
            f"{request.node.nodeid} starts Ray without asking for it: add the ray_cluster "
            "fixture (one shared cluster), or test the pure function without Ray"
        )

    monkeypatch.setattr(ray, "init", refuse)


# ----------------------------------------------------------------------------- test order
def _cluster_need(item) -> int:
    """0: no shared cluster, 1: the session's Ray cluster, 2: its Serve as well."""
    names = set(getattr(item, "fixturenames", ()))
    return 2 if "serve_port" in names else 1 if "ray_cluster" in names else 0


def pytest_collection_modifyitems(session, config, items):
    """Whole modules in three groups, each in collection order: those that start no shared
    cluster, those that use the session's Ray, those that deploy on its Serve. The session
    cluster's daemons (about 7 CPU-seconds a minute when idle, 2026-11-29) start with the second
    group and Serve (about 9 with the cluster, above) with the third, instead of running under
    every test after the first module that needs them. (One pytest-xdist worker per group was
    hardly faster: 885.72 s against 915.22 s in one run each, 2026-11-29; beside the other
    worker the two-node cluster tests took 500 s instead of 200.)"""
    need: dict = {}
    for item in items:
        need[item.module] = max(need.get(item.module, 0), _cluster_need(item))
    items.sort(key=lambda item: need[item.module])  # stable: collection order within a group


# ----------------------------------------------------------------------------- disk cache
def source_digest() -> str:
    """SHA-256 of every ``.py`` file of the package and of ``pyproject.toml``: what a cached
    model or report was made by (a changed line retrains)."""
    from locations import REPO

    digest = hashlib.sha256()
    root = os.path.join(REPO, "raycompat")
    for folder, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(folder, name)
            digest.update(os.path.relpath(path, root).encode())
            with open(path, "rb") as fh:
                digest.update(fh.read())
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as fh:
        digest.update(fh.read())
    return digest.hexdigest()


@pytest.fixture(scope="session")
def disk_cache(request, tmp_path_factory):
    """``folder(kind, config) -> (path, complete)``: a folder kept between runs of the suite
    under the pytest cache (``.pytest_cache/d/raycompat``), keyed by ``config`` and the package's
    source. ``complete`` says that an earlier run finished it (:func:`mark_complete`); an
    unfinished folder is emptied. Without the cache plugin (``-p no:cacheprovider``), a folder
    of this session."""
    cache = getattr(request.config, "cache", None)
    root = (
        str(cache.mkdir("raycompat"))
        if cache is not None
        else str(tmp_path_factory.mktemp("raycompat-cache"))
    )
    source = source_digest()

    held: list = []

    def folder(kind: str, config: dict) -> tuple[str, bool]:
        blob = json.dumps({"config": config, "source": source}, sort_keys=True)
        path = os.path.join(root, f"{kind}-{hashlib.sha256(blob.encode()).hexdigest()[:16]}")
        # one process builds a folder at a time (pytest-xdist workers): the lock is held until
        # the folder is complete (mark_complete) or this session ends
        lock = open(path + ".lock", "a")
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.isfile(os.path.join(path, COMPLETE)):
            lock.close()
            return path, True
        _BUILDING[path] = lock
        held.append(path)
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path)
        return path, False

    yield folder
    for path in held:
        if path in _BUILDING:
            _BUILDING.pop(path).close()


#: folders this process is building, with their locks (released by mark_complete)
_BUILDING: dict = {}


#: the file that marks a cached folder finished
COMPLETE = ".complete"


def mark_complete(path: str) -> None:
    with open(os.path.join(path, COMPLETE), "w") as fh:
        fh.write("done\n")
    if path in _BUILDING:
        _BUILDING.pop(path).close()


# ----------------------------------------------------------------------------- the main job
#: the smallest main job: a few glyph classes, one epoch per model, two training seeds, its
#: training in Ray Train's local mode (in the test's process); its models (``<out>/models``,
#: ``<out>/models/seed1``) are the suite's shared tiny trained models
TINY_MAIN_JOB = [
    "--seeds", "2",
    "--old-fraction", "0.5",
    "--train-classes", "8",
    "--images-per-class", "4",
    "--eval-classes", "4",
    "--queries-per-class", "1",
    "--gallery-per-class", "2",
    "--distractor-classes", "2",
    "--distractors-per-class", "1",
    "--backbone", "test_resnet",
    "--embed-dim", "8",
    "--old-epochs", "1",
    "--new-epochs", "1",
    "--batch-size", "8",
    "--workers", "0",  # Ray Train's local mode: Ray Train's DDP runs are tests/train's
]  # fmt: skip


@pytest.fixture(scope="session")
def main_job(ray_cluster, disk_cache):
    """``(out, storage, report)`` of the tiny main job (:data:`TINY_MAIN_JOB`), run through its
    command line with up to four Ray Train runs at a time: old, BCT and independent models for
    two seeds, the Ray Data pipeline, the evaluation and the backfill curves."""
    from raycompat.quickstart import main

    path, complete = disk_cache("main-job", {"flags": TINY_MAIN_JOB})
    out, storage = os.path.join(path, "out"), os.path.join(path, "storage")
    if not complete:
        flags = [*TINY_MAIN_JOB, "--parallel", "4", "--model-stages", "tasks"]
        flags += ["--out", out, "--storage", storage]
        assert main(flags) == 0
        mark_complete(path)
    with open(os.path.join(out, "report.json")) as fh:
        return out, storage, json.load(fh)


@pytest.fixture
def tiny_fs(tmp_path):
    """``mount(size_bytes) -> path``: a tmpfs of that size (a full disk on demand), unmounted
    after the test.  Skips where mounting is not permitted (not root)."""
    import subprocess

    mounts = []

    def mount(size_bytes: int, name: str = "fs") -> str:
        path = tmp_path / name
        path.mkdir()
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={int(size_bytes)}", "tmpfs", str(path)],
            capture_output=True,
            text=True,
        )
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
        mounts.append(path)
        return str(path)

    mount.fill = fill_disk
    yield mount
    for path in mounts:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def fill_disk(path: str, leave: int = 0, spare: int = 0, name: str = "filler") -> None:
    """Leave ``leave`` bytes free on the filesystem of ``path`` (writing the file ``name``),
    plus a file ``spare`` of ``spare`` bytes that a test can delete to free space."""
    if spare:
        with open(os.path.join(path, "spare"), "wb") as fh:
            fh.write(b"\0" * spare)
    vfs = os.statvfs(path)
    size = max(0, vfs.f_bavail * vfs.f_frsize - leave)
    try:
        with open(os.path.join(path, name), "wb", buffering=0) as fh:
            fh.write(b"\0" * size)
            while not leave:
                fh.write(b"\0" * 4096)
    except OSError:  # the disk is full: what was wanted
        pass


# ----------------------------------------------------------------------------- Ray Serve
# One Serve instance for the whole session, shared by every test module that deploys an app.
@pytest.fixture(scope="session")
def serve_port(ray_cluster):
    from ray import serve

    from raycompat.serving.app import free_port
    from raycompat.serving.config import serving_config
    from raycompat.serving.proxy import serve_http_options

    port = free_port()
    # what serve-index starts: request timeout and the JSON error middleware in the proxy
    serve.start(http_options=serve_http_options(serving_config(gallery="synthetic:1", port=port)))
    yield port
    serve.shutdown()


@pytest.fixture(scope="session")
def gallery_parquet(tmp_path_factory):
    from serving_helpers import labelled_embeddings

    from raycompat.serving.gallery_source import write_gallery_parquet

    path = str(tmp_path_factory.mktemp("gallery") / "embeddings.parquet")
    return write_gallery_parquet(path, labelled_embeddings())


@pytest.fixture(scope="session")
def token_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("secret") / "token"
    from serving_helpers import TOKEN

    p.write_text(TOKEN + "\n")
    return str(p)


# ----------------------------------------------------------------------------- profiling
# RAYCOMPAT_TEST_CPU=FILE: one JSON line per test phase with its wall seconds and the busy
# CPU-seconds of the whole machine (/proc/stat) meanwhile -- Ray's workers, Serve replicas and
# job processes included, which pytest's --durations cannot tell apart from waiting.
_CPU_LOG = os.environ.get("RAYCOMPAT_TEST_CPU")


def _machine_cpu() -> tuple[float, float]:
    """(busy, idle) CPU-seconds of the machine since boot."""
    with open("/proc/stat") as fh:
        fields = [int(v) for v in fh.readline().split()[1:]]
    tick = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + fields[4]
    return (sum(fields[:8]) - idle) / tick, idle / tick


if _CPU_LOG:
    import time as _time

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        busy0, idle0 = _machine_cpu()
        start = _time.time()
        yield
        busy1, idle1 = _machine_cpu()
        with open(_CPU_LOG, "a") as fh:
            fh.write(
                json.dumps(
                    {
                        "test": item.nodeid,
                        "wall": round(_time.time() - start, 2),
                        "busy": round(busy1 - busy0, 2),
                        "idle": round(idle1 - idle0, 2),
                    }
                )
                + "\n"
            )
