"""Configuration errors are caught on the driver, before any worker starts, and name the bad
key and what is allowed: a few bad keys and values per method, and the TrainConfig fields that
would otherwise fail deep inside timm, torch or the renderer."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import locations
import pytest

from raycompat.config import ConfigError
from raycompat.data import build_scenario
from raycompat.train import TrainConfig

REPO = locations.REPO


@pytest.fixture(scope="module")
def scenario():
    return build_scenario(
        "open-class",
        num_train_classes=10,
        images_per_class=6,
        num_eval_classes=4,
        queries_per_class=1,
        gallery_per_class=2,
        num_distractor_classes=2,
        distractors_per_class=1,
        seed=1,
    ).to_dict()


@pytest.fixture(scope="module")
def old_bundle(tmp_path_factory):
    """A bundle directory's manifest (all the driver reads): embed_dim 32, lcnet_050."""
    path = tmp_path_factory.mktemp("old")
    (path / "manifest.json").write_text(
        json.dumps({"embed_dim": 32, "backbone": "lcnet_050", "in_chans": 1})
    )
    return str(path)


def config(scenario, old_bundle, **values):
    base = dict(
        method="bct",
        backbone="lcnet_050",
        embed_dim=32,
        batch_size=16,
        scenario=scenario,
        old_model=old_bundle,
    )
    base.update(values)
    return TrainConfig.from_dict(base)


@pytest.mark.parametrize(
    "method, options, message",
    [
        (
            "bct",
            {"variant": "gamma"},
            r"'variant' = 'gamma' is not allowed; allowed values: \['sys', 'beta', 'kd'\]",
        ),
        (
            "bct",
            {"kd_scal": 3},
            r"unknown option 'kd_scal'; allowed options: "
            r"\['kd_scale', 'lambda_compat', 'variant'\]",
        ),
        ("l2", {"lambda_compat": -1}, r"'lambda_compat' = -1.0 must be >= 0"),
        (
            "contrastive",
            {"form": "npair"},
            r"'form' = 'npair' is not allowed; allowed values: \['contrastive', 'triplet'\]",
        ),
        ("contrastive", {"tau": "warm"}, r"'tau' must be a number, got 'warm'"),
        ("ract", {"tau": 0}, r"'tau' = 0.0 must be >="),
        ("ract", {"margin": -0.8}, r"'margin' = -0.8 must be >= 0"),
        (
            "dmu",
            {"discriminativeness": "margin"},
            r"allowed values: \['entropy', 'least_confidence'\]",
        ),
        ("dmu", {"psi_hidden": 0}, r"'psi_hidden' = 0 must be >= 1"),
        ("dmu", {"psi_hidden": 2.5}, r"'psi_hidden' must be an integer, got 2.5"),
        ("mcl", {"distance": "manhattan"}, r"allowed values: \['squared_l2', 'l2', 'cosine'\]"),
        ("mcl", {"hard_mining": "maybe"}, r"'hard_mining' must be true or false"),
        ("rqt", {"psi_rev_blocks": -1}, r"'psi_rev_blocks' = -1 must be >= 0"),
        ("cl", {"temperature": 0}, r"'temperature' = 0.0 must be >="),
        ("p2s", {"tau": -0.07}, r"'tau' = -0.07 must be >="),
        ("ndpp", {"k": 0}, r"'k' = 0 must be >= 1"),
        (
            "ndpp",
            {"alpha": 0.01},
            r"unknown option 'alpha'; allowed options: \['alpha_new', 'alpha_old', 'k', ",
        ),
        ("odpp", {"gamma": -1}, r"'gamma' = -1.0 must be >= 0"),
        ("odpp", {"perturb_epochs": "many"}, r"'perturb_epochs' must be an integer, got 'many'"),
        ("independent", {"variant": "sys"}, r"method independent: unknown option 'variant'"),
    ],
)
def test_bad_method_options_name_the_key(scenario, old_bundle, method, options, message):
    extra = {"init_model": old_bundle} if method in ("mcl", "rqt", "cl") else {}
    with pytest.raises(ConfigError, match=message):
        config(scenario, old_bundle, method=method, method_options=options, **extra)


@pytest.mark.parametrize(
    "values, message",
    [
        (
            {"backbone": "resnet9000"},
            r"backbone 'resnet9000' is not a timm model name; similar names",
        ),
        (
            {"head": "sphereface"},
            r"'head' = 'sphereface' is not allowed; allowed values: "
            r"\['softmax', 'cosface', 'arcface', 'dsimplex'\]",
        ),
        ({"optimizer": "adam"}, r"allowed values: \['sgd', 'adamw'\]"),
        ({"resolution": 4}, r"resolution must be >= 8 pixels, got 4"),
        ({"head_scale": 0.0}, r"head_scale must be > 0"),
        ({"seed": -1}, r"seed must be >= 0"),
        ({"epochs": 0}, r"'epochs' = 0 must be >= 1"),
        (
            {"batch_size": 1000},
            r"split 'new_train' has \d+ images: fewer than one batch \(batch_size 1000\)",
        ),
        ({"batch_size": 15, "num_workers": 2}, r"batch_size 15 must be divisible by num_workers 2"),
        ({"split": "train_9"}, r"split 'train_9' is not in the scenario; allowed splits: \["),
        ({"embed_dim": 16}, r"embed_dim 16 is smaller than the old model's 32"),
        (
            {"method": "l2", "embed_dim": 64},
            r"method 'l2' needs embed_dim == the old model's \(32\), got 64",
        ),
        ({"old_model": "/nonexistent/old"}, r"old_model '/nonexistent/old' is not a model bundle"),
        (
            {"pretrained_path": "/nonexistent/w.pth"},
            r"pretrained_path '/nonexistent/w.pth': no such file",
        ),
        ({"method": "mcl"}, r"method 'mcl' needs init_model"),
        ({"lr": "fast"}, r"'lr' must be a number, got 'fast'"),
        (
            {"method": "independent", "head": "dsimplex", "embed_dim": 4, "old_model": None},
            r"embed_dim 4 has K = 5 simplex vertices, but split 'new_train' has \d+ classes",
        ),
        (
            {"method": "dsimplex", "head": "dsimplex", "method_options": {"classes": 33}},
            r"needs an old model trained with the same simplex head \(dsimplex, K = 33\)",
        ),
    ],
)
def test_bad_train_config_values_name_the_key(scenario, old_bundle, values, message):
    with pytest.raises(ConfigError, match=message):
        config(scenario, old_bundle, **values)


def test_init_model_must_match_the_new_model(scenario, old_bundle):
    with pytest.raises(
        ConfigError,
        match=r"init_model .* has backbone='lcnet_050', but this run has "
        r"backbone='resnet10t': they must match",
    ):
        config(scenario, old_bundle, method="mcl", init_model=old_bundle, backbone="resnet10t")
    assert (
        config(scenario, old_bundle, method="mcl", init_model=old_bundle).init_model == old_bundle
    )


@pytest.mark.subprocess
def test_train_job_rejects_a_bad_method_option_before_ray_starts(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(REPO, "jobs", "train.py"),
            "--method",
            "ract",
            "--old-model",
            str(tmp_path),
            "--opt",
            "tau=abc",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    assert "'tau' must be a number, got 'abc'" in proc.stderr
    assert "Traceback" not in proc.stderr and "ray" not in proc.stdout.lower()


def test_placement_reaches_ray_train_and_leaves_the_run_name_alone(scenario, old_bundle, tmp_path):
    """``--placement strict-spread`` becomes Ray Train's ``STRICT_SPREAD``; like the CPUs per
    worker it says where the workers run, not what they train, so the run name is unchanged."""
    from raycompat.storage import open_storage
    from raycompat.train.runs import default_run_name
    from raycompat.train.trainer import _trainer

    packed = config(scenario, old_bundle, num_workers=2)
    spread = config(scenario, old_bundle, num_workers=2, placement="strict-spread")
    assert default_run_name("bct", packed) == default_run_name("bct", spread)
    for cfg, want in ((packed, "PACK"), (spread, "STRICT_SPREAD")):
        scaling = _trainer(cfg, open_storage(str(tmp_path))).scaling_config
        assert scaling.placement_strategy == want
    with pytest.raises(ConfigError, match="placement.*'pack', 'spread', 'strict-spread'"):
        config(scenario, old_bundle, placement="anywhere")
