"""--storage: local paths and pyarrow URIs, checked before any work starts."""

from __future__ import annotations

import os

import pytest

from raycompat.storage import StorageError, local_copy, open_storage


def test_local_and_uri_locations(tmp_path):
    local = open_storage(str(tmp_path / "runs"))  # created; its parent must exist
    assert local.local and os.path.isdir(local.uri)
    uri = open_storage(
        f"file://{tmp_path}/b/runs"
    )  # URIs: created recursively, like a bucket prefix
    assert not uri.local and uri.join("models", "m") == f"file://{tmp_path}/b/runs/models/m"
    src = tmp_path / "src" / "sub"
    src.mkdir(parents=True)
    (src / "w.txt").write_text("weights")
    where = uri.upload_dir(str(tmp_path / "src"), "models", "m")
    assert (tmp_path / "b" / "runs" / "models" / "m" / "sub" / "w.txt").read_text() == "weights"
    assert open(os.path.join(local_copy(where), "sub", "w.txt")).read() == "weights"
    assert not [
        p for p in os.listdir(tmp_path / "b" / "runs") if p.startswith(".raycompat-write-check")
    ]


@pytest.mark.parametrize(
    "location, message",
    [
        (
            "/nonexistent-raycompat-parent/x/runs",
            "parent folder /nonexistent-raycompat-parent/x does not exist",
        ),
        ("/proc/raycompat-runs", "is not writable"),
        ("file:///proc/raycompat-runs", "is not writable"),
        ("nosuchscheme://bucket/runs", "not a location pyarrow can open"),
        ("", "must not be empty"),
    ],
)
def test_bad_locations_fail_at_once(location, message):
    with pytest.raises(StorageError, match=message.replace("(", r"\(")):
        open_storage(location if location else " ")


def test_storage_that_is_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(StorageError, match="not a folder|not writable"):
        open_storage(str(tmp_path / "f"))


def test_training_writes_to_a_uri_storage(ray_cluster, tmp_path):
    """Checkpoints and the exported bundle under a file:// URI (pyarrow's filesystem path,
    as for s3:// or gs://); the bundle loads back from its URI."""
    from raycompat.data import build_scenario
    from raycompat.models import ModelBundle
    from raycompat.train import TrainConfig, fit

    scenario = build_scenario(
        "extended-class",
        num_train_classes=8,
        images_per_class=8,
        num_eval_classes=4,
        queries_per_class=1,
        gallery_per_class=2,
        num_distractor_classes=0,
        seed=11,
    )
    store = f"file://{tmp_path}/store"
    cfg = TrainConfig.from_dict(
        dict(
            method="independent",
            backbone="test_resnet",
            embed_dim=8,
            head="cosface",
            epochs=1,
            batch_size=16,
            lr=0.05,
            scenario=scenario.to_dict(),
            split="new_train",
            num_workers=1,
            threads_per_worker=1,
            storage_path=store,
            run_name="uri-run",
            log_every=1000,
        )
    )
    run = fit(cfg, export_to=f"{store}/models/uri-run")
    assert run.bundle_path == f"{store}/models/uri-run"
    assert run.checkpoint_path.startswith(f"{store}/uri-run/")
    assert (tmp_path / "store" / "models" / "uri-run" / "manifest.json").is_file()
    assert ModelBundle.load(run.bundle_path).manifest["method"] == "independent"
    assert [h["epoch"] for h in run.history] == [1]


def test_training_refuses_unwritable_storage_before_starting(ray_cluster):
    from raycompat.data import build_scenario
    from raycompat.train import TrainConfig, fit

    scenario = build_scenario(
        "extended-class",
        num_train_classes=8,
        images_per_class=8,
        num_eval_classes=4,
        queries_per_class=1,
        gallery_per_class=2,
        num_distractor_classes=0,
        seed=11,
    )
    cfg = TrainConfig.from_dict(
        dict(
            method="independent",
            backbone="test_resnet",
            embed_dim=8,
            epochs=1,
            batch_size=16,
            scenario=scenario.to_dict(),
            split="new_train",
            storage_path="/proc/raycompat-runs",
            run_name="never",
        )
    )
    with pytest.raises(StorageError, match="/proc/raycompat-runs is not writable"):
        fit(cfg)
