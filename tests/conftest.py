"""One real local Ray cluster shared by the whole test session."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
# as raycompat.cluster.connect does: Serve's proxy answers its own errors as JSON
os.environ.setdefault(
    "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH", "raycompat.serving.proxy.proxy_middlewares"
)
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
