"""--storage: local paths and pyarrow URIs, checked before any work starts."""

from __future__ import annotations

import os

import pytest

from raycompat.config import ConfigError
from raycompat.storage import StorageError, local_copy, open_storage, resolve_location


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


def test_one_form_of_a_place(tmp_path, monkeypatch):
    """A relative path, a ``~`` path and a file:// URI resolve to one form each; joins, parents
    and the read / write helpers work alike on every filesystem."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    rel = resolve_location("emb/query")
    assert rel.uri == rel.root == str(tmp_path / "emb" / "query") and rel.local and rel.on_disk
    assert resolve_location("~/runs").uri == str(tmp_path / "home" / "runs")
    uri = resolve_location(f"file://{tmp_path}/b/../bucket/")
    assert (uri.uri, uri.root) == (f"file://{tmp_path}/bucket", str(tmp_path / "bucket"))
    assert not uri.local and uri.on_disk
    assert uri.child("g", "x").uri == f"file://{tmp_path}/bucket/g/x"
    assert uri.child("g").parent().uri == uri.uri and rel.parent().uri == str(tmp_path / "emb")
    for place in (rel, uri):
        assert place.kind() == "missing" and place.listdir() == []
        place.make_dirs()
        place.write_bytes("a.json", b'{"k": 1}')
        assert place.listdir() == ["a.json"] and place.is_file("a.json")
        assert place.read_json("a.json") == {"k": 1} and place.read_json("none.json") is None
        place.remove("a.json")
        assert place.kind() == "folder" and place.listdir() == []


def test_one_storage_error_for_jobs_and_the_live_index(capsys):
    """The live index's StorageError is this one; a job stops on it with one line, exit 2."""
    from raycompat.console import job_main
    from raycompat.serving import config as serving_config

    assert serving_config.StorageError is StorageError and issubclass(StorageError, ConfigError)

    @job_main
    def job() -> int:
        raise StorageError("no space left on device at /s/upserts.log")

    assert job() == 2
    assert capsys.readouterr().err == "error: no space left on device at /s/upserts.log\n"


def test_state_directory_is_a_local_folder(tmp_path, monkeypatch):
    from raycompat.serving.config import state_directory

    monkeypatch.chdir(tmp_path)
    assert state_directory("state") == str(tmp_path / "state")
    assert state_directory(f"file://{tmp_path}/s/") == str(tmp_path / "s")
    with pytest.raises(StorageError, match="^state_dir mock:///s: the live index's state must"):
        state_directory("mock:///s")


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
