"""Methods inside the real Ray Train loop (the session's shared Ray cluster), and the
train_ract job's command line. RACT runs on 2 workers (DDP); MCL, AdvBCT, BT^2, d-Simplex and
FCT in Ray Train's local mode (the same loop and hooks in this process, no controller or worker
processes to start: about 25 s less each on 2 cores).
Every method's 2-worker DDP gradients, per-epoch passes and training steps against one
process are tests/methods/test_methods_distributed.py's (gloo, in process)."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import locations
import pytest
import torch

from raycompat.data import Scenario, build_scenario
from raycompat.models import ClassifierHead, Embedder, ModelBundle
from raycompat.models.fingerprint import bundle_fingerprint, check_predecessor
from raycompat.train import TrainConfig, fit

REPO = locations.REPO
DIM = 16


@pytest.fixture(scope="module")
def scenario() -> Scenario:
    return build_scenario(
        "extended-class",
        num_train_classes=8,
        images_per_class=8,
        num_eval_classes=4,
        queries_per_class=1,
        gallery_per_class=2,
        num_distractor_classes=2,
        distractors_per_class=1,
        seed=5,
    )


def random_bundle(path, classes, seed: int, head: str = "cosface", split: str | None = None) -> str:
    """An untrained (seeded) test_resnet bundle: enough to be a frozen old/initial model
    (``split``: the training split its manifest names, which advbct's boundary reads)."""
    torch.manual_seed(seed)
    modules = {
        "embedder": Embedder("test_resnet", DIM, in_chans=1),
        "head": ClassifierHead(DIM, len(classes), kind=head),
    }
    return ModelBundle(
        modules,
        {
            "classes": [int(c) for c in classes],
            "backbone": "test_resnet",
            "method": "independent",
            **({"data": {"split": split}} if split else {}),
        },
    ).save(str(path))


def config(scenario, tmp_path, **overrides) -> TrainConfig:
    values = dict(
        backbone="test_resnet",
        embed_dim=DIM,
        head="cosface",
        epochs=1,
        batch_size=32,
        lr=0.05,
        scenario=scenario.to_dict(),
        split="new_train",
        num_workers=2,
        threads_per_worker=1,
        storage_path=str(tmp_path / "runs"),
        log_every=1000,
    )
    values.update(overrides)
    return TrainConfig.from_dict(values)


def test_ract_on_two_workers_then_mcl_in_the_ray_train_loop(ray_cluster, scenario, tmp_path):
    old = random_bundle(tmp_path / "old", scenario.splits["old_train"].classes, seed=0)
    ract = fit(
        config(
            scenario,
            tmp_path,
            method="ract",
            old_model=old,
            run_name="ract",
            method_options={"tau": 0.05},
        ),
        export_to=str(tmp_path / "ract"),
    )
    assert ract.history[-1]["num_workers"] == 2 and ract.history[-1]["loss/compat"] > 0
    # the new model records which old model it was trained against (checked by embed-gallery)
    predecessor = ract.load().manifest["predecessor"]
    assert predecessor["fingerprint"] == bundle_fingerprint(old)
    assert check_predecessor(old, ract.bundle_path) is None
    # mcl on the frozen RACT model (init_model) and the old one: only rho / psi_rev train.
    mcl = fit(
        config(
            scenario,
            tmp_path,
            method="mcl",
            old_model=old,
            init_model=ract.bundle_path,
            run_name="mcl",
            method_options={"psi_rev_hidden": 32, "psi_rev_blocks": 1},
            num_workers=0,  # local mode
        ),
        export_to=str(tmp_path / "mcl"),
    )
    bundle = mcl.load()
    assert set(bundle.modules) == {"embedder", "head", "rho", "psi_rev"}
    assert bundle.manifest["method"] == "mcl"
    frozen = ModelBundle.load(ract.bundle_path)
    for key, value in frozen.embedder.state_dict().items():
        assert torch.equal(bundle.embedder.state_dict()[key], value), key
    x = torch.randn(3, 1, 32, 32)
    with torch.no_grad():
        rev = bundle.modules["psi_rev"](bundle.modules["rho"](bundle.embedder(x)))
    assert rev.shape == (3, DIM)


# The field's methods in the real Ray Train loop. Their loss terms against a direct
# computation are test_field_methods.py's; every method's 2-worker DDP gradients, per-epoch
# passes and training steps against one process are test_methods_distributed.py's (gloo, in
# process). Here: the plug-in inside Ray Train's loop. advbct stands for the per-epoch-pass
# baselines (its boundary pass is lce's, plus the discriminator and the radii); lwf, fd, lce and
# unibct run the same loop hooks.
FIELD_TERMS = {"advbct": ["bound", "adv", "elastic_radius"]}


def test_advbct_trains_in_the_ray_train_loop_with_a_wider_embedding(
    ray_cluster, scenario, tmp_path
):
    """A dimension change too: the new embedding is wider than the old (the prefix rule)."""
    method, workers = "advbct", 0  # local mode
    classes = scenario.splits["old_train"].classes
    old = random_bundle(tmp_path / "old", classes, seed=0, split="old_train")  # the boundary's
    run = fit(
        config(
            scenario,
            tmp_path,
            method=method,
            old_model=old,
            embed_dim=DIM + 8,
            num_workers=workers,
            run_name=f"{method}-{workers}",
        ),
        export_to=str(tmp_path / method),
    )
    last = run.history[-1]
    assert last["num_workers"] == 1  # local mode: one worker
    for term in FIELD_TERMS[method] + ["cls", "loss"]:
        assert math.isfinite(last[f"loss/{term}"]), (term, last)
    assert last[f"loss/{FIELD_TERMS[method][0]}"] > 0
    bundle = run.load()
    # nothing of these methods is needed at inference (advbct's discriminator and radii included)
    assert set(bundle.modules) == {"embedder", "head"}
    assert bundle.manifest["method"] == method and bundle.manifest["compatible_dim"] == DIM


@pytest.fixture(scope="module")
def field_bundles(scenario, tmp_path_factory) -> dict[str, str]:
    """The frozen models the bt2, dsimplex and fct runs share: an old model, one with the
    dsimplex head (K = DIM + 1), and an independent new model (bt2's phi'_n, fct's phi_n)."""
    root = tmp_path_factory.mktemp("field")
    old_classes = scenario.splits["old_train"].classes
    return {
        "old": random_bundle(root / "old", old_classes, seed=0),
        "old_simplex": random_bundle(root / "simplex", old_classes, seed=0, head="dsimplex"),
        "independent": random_bundle(root / "new", scenario.splits["new_train"].classes, 1),
    }


@pytest.mark.parametrize("method", ["bt2", "dsimplex", "fct"])
def test_bt2_dsimplex_fct_train_in_the_ray_train_loop(
    ray_cluster, scenario, tmp_path, field_bundles, method
):
    """What each exports (bt2's basis transform, dsimplex's vertices, fct's h), inside Ray
    Train's loop, in Ray Train's local mode (the same loop and hooks in this process; their
    2-worker DDP gradients against one process, fct's frozen phi_n under DDP included, are
    test_methods_distributed.py's), which spares each run's controller and worker processes
    (about 25 s each on 2 cores)."""
    workers = 0
    paths = field_bundles
    run_values = {
        "bt2": dict(
            old_model=paths["old"],
            method_options={"extra_dim": 8, "independent_model": paths["independent"]},
        ),
        "dsimplex": dict(
            old_model=paths["old_simplex"],
            head="dsimplex",
            method_options={"classes": DIM + 1, "loss": "hoc"},
        ),
        "fct": dict(
            old_model=paths["old"],
            init_model=paths["independent"],
            method_options={"hidden": 32},
        ),
    }[method]
    run = fit(
        config(
            scenario,
            tmp_path,
            method=method,
            num_workers=workers,
            run_name=f"{method}-{workers}",
            **run_values,
        ),
        export_to=str(tmp_path / method),
    )
    last = run.history[-1]
    terms = {"bt2": ["pseudo_cls", "old_cosine", "new_cosine"], "dsimplex": ["hoc"]}
    for term in terms.get(method, ["fct"]) + ["loss"]:
        assert last["num_workers"] == max(workers, 1), last  # local mode: one worker
        assert math.isfinite(last[f"loss/{term}"]), last
    bundle = run.load()
    x = torch.randn(3, 1, 32, 32)
    with torch.no_grad():
        emb = bundle.embedder(x)
    assert bundle.manifest["compatible_dim"] == DIM
    if method == "bt2":  # the deployed embedding: D_n + A dims, the first D_o compatible
        assert bundle.manifest["modules"]["embedder"]["type"] == "bt2"
        assert emb.shape == (3, DIM + 8) and bundle.manifest["embed_dim"] == DIM + 8
    elif method == "dsimplex":  # the old classes keep their simplex labels, the others follow
        old = ModelBundle.load(paths["old_simplex"])
        labels = dict(zip(bundle.classes, bundle.head.vertices, strict=True))
        assert [labels[c] for c in old.classes] == old.head.vertices
        assert sorted(labels.values()) == list(range(len(labels)))
    else:  # phi_n frozen: the independent model; h exported as 'fct'
        assert set(bundle.modules) == {"embedder", "head", "fct"}
        frozen = ModelBundle.load(paths["independent"])
        with torch.no_grad():
            assert torch.equal(emb, frozen.embedder(x))


@pytest.mark.subprocess
def test_train_ract_job_help_and_early_config_error(capsys):
    from raycompat.train.ract_job import main

    with pytest.raises(SystemExit) as exited:  # its help, in this process (the same parser)
        main(["--help"])
    assert exited.value.code == 0
    help_text = capsys.readouterr().out
    assert "ract:" in help_text and "mcl:" in help_text
    job = os.path.join(REPO, "jobs", "train_ract.py")  # the command line itself
    proc = subprocess.run(
        [sys.executable, job, "--opt", "tau=0"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2 and "'tau' = 0.0 must be >=" in proc.stderr
    assert "Traceback" not in proc.stderr and "training the old model" not in proc.stdout
