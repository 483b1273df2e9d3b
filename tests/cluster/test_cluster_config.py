"""cluster.yaml and the on-prem variant against the autoscaler schema and checks shipped
with Ray."""

from __future__ import annotations

import os

import locations
import pytest
import yaml

ROOT = locations.REPO
CONFIGS = ["cluster.yaml", os.path.join("deploy", "cluster-onprem.yaml")]


def _load(name: str) -> dict:
    with open(os.path.join(ROOT, name)) as f:
        return yaml.safe_load(f)


@pytest.mark.parametrize("name", CONFIGS)
def test_config_passes_rays_validator(name):
    """`ray up` bootstraps the file with prepare_config (provider defaults, on-prem node
    types) and then checks it with validate_config (ray-schema.json), as done here."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(_load(name))
    validate_config(prepared)
    assert prepared["head_node_type"] in prepared["available_node_types"]
    assert any("pip install" in c and "-e" in c for c in prepared["setup_commands"])
    assert "~/raycompat" in prepared["file_mounts"]


def test_gpu_cluster_has_gpu_worker_types_with_bounds():
    config = _load("cluster.yaml")
    assert config["provider"]["type"] not in ("local", "fake_multinode")
    gpu_types = {
        name: t
        for name, t in config["available_node_types"].items()
        if t["resources"].get("GPU", 0) > 0
    }
    assert gpu_types and config["head_node_type"] not in gpu_types
    for t in gpu_types.values():
        assert 0 <= t["min_workers"] <= t["max_workers"] <= config["max_workers"]


def test_onprem_config_lists_machines():
    from ray.autoscaler._private.util import prepare_config

    config = _load(os.path.join("deploy", "cluster-onprem.yaml"))
    assert config["provider"]["type"] == "local"
    prepared = prepare_config(config)
    (node_type,) = prepared["available_node_types"].values()  # one type: the listed machines
    assert (
        node_type["min_workers"]
        == node_type["max_workers"]
        == len(config["provider"]["worker_ips"])
    )


def test_validator_rejects_a_broken_config():
    """The check above can fail: an unknown top-level key is refused by the schema."""
    import jsonschema
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = prepare_config(_load("cluster.yaml"))
    config["max_wrokers"] = 3
    with pytest.raises(jsonschema.ValidationError):
        validate_config(config)
