"""One real local Ray cluster shared by the whole test session."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
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
