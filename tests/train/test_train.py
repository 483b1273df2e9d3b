"""The Ray Train loop on the session's real local cluster: DDP sync, worker-kill resume,
and configuration errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import locations
import pytest

from raycompat.config import ConfigError
from raycompat.data import build_scenario
from raycompat.train import TrainConfig, fit

REPO = locations.REPO


@pytest.fixture(scope="module")
def tiny_scenario():
    return build_scenario(
        "extended-class",
        num_train_classes=12,
        images_per_class=16,
        num_eval_classes=6,
        queries_per_class=1,
        gallery_per_class=3,
        num_distractor_classes=4,
        distractors_per_class=2,
        seed=3,
    )


def tiny_config(scenario, tmp_path, **overrides) -> TrainConfig:
    values = dict(
        method="independent",
        backbone="test_resnet",
        embed_dim=16,
        head="cosface",
        epochs=2,
        batch_size=32,
        lr=0.05,
        scenario=scenario.to_dict(),
        split="new_train",
        num_workers=1,
        threads_per_worker=1,
        storage_path=str(tmp_path / "runs"),
        run_name="tiny",
        diagnostics_dir=str(tmp_path / "diag"),
        log_every=1000,
    )
    values.update(overrides)
    return TrainConfig.from_dict(values)


def test_two_ddp_workers_on_a_uri_storage_stay_identical_and_resume_after_a_kill(
    ray_cluster, tmp_path
):
    """2 DDP workers, checkpoints and the exported bundle under a file:// URI (pyarrow's
    filesystem path, as for s3:// or gs://).  Rank 0 is SIGKILLed once Ray Train has registered
    the epoch-2 checkpoint: the run restarts its workers (FailureConfig) and goes on from that
    checkpoint, not from scratch; the workers' parameter digests agree at every epoch, and the
    bundle loads back from its URI."""
    scenario = build_scenario(
        "extended-data",
        num_train_classes=12,
        images_per_class=32,
        num_eval_classes=4,
        queries_per_class=1,
        gallery_per_class=2,
        num_distractor_classes=0,
        seed=5,
    )
    store = f"file://{tmp_path}/store"
    cfg = tiny_config(scenario, tmp_path, epochs=4, run_name="kill", max_failures=2,
                      num_workers=2, storage_path=store)  # fmt: skip
    outcome = {}
    export = f"{store}/models/ddp"
    thread = threading.Thread(
        target=lambda: outcome.update(run=fit(cfg, export_to=export)), daemon=True
    )
    thread.start()
    # Ray Train's controller records each registered checkpoint in this snapshot file.
    snapshot = tmp_path / "store" / "kill" / "checkpoint_manager_snapshot.json"
    deadline = time.time() + 240
    while time.time() < deadline and not (
        snapshot.exists() and "epoch_0002" in snapshot.read_text()
    ):
        time.sleep(0.05)
    assert snapshot.exists() and "epoch_0002" in snapshot.read_text(), "no registered checkpoint"
    pid = int((tmp_path / "diag" / "pid_rank0.txt").read_text())
    os.kill(pid, signal.SIGKILL)
    thread.join(timeout=300)
    assert not thread.is_alive(), "training did not finish after the worker was killed"
    assert "run" in outcome, "fit() raised instead of recovering"
    run = outcome["run"]
    assert int((tmp_path / "diag" / "pid_rank0.txt").read_text()) != pid, "worker not restarted"
    assert [h["epoch"] for h in run.history] == [1, 2, 3, 4]
    assert all(h["num_workers"] == 2 for h in run.history)
    starts = [h["start_epoch"] for h in run.history]
    # The first attempt started from scratch; the epochs after the kill ran in an attempt that
    # resumed from a registered checkpoint (epoch 2 or later), never from scratch again.
    assert starts[0] == 0 and starts[-1] >= 2, starts
    assert not any(h["epoch"] <= h["start_epoch"] for h in run.history), starts
    assert run.bundle_path == export and run.checkpoint_path.startswith(f"{store}/kill/")
    # the training time beside the manifest (not in the fingerprint): plan-upgrade's cost
    trained = json.loads((tmp_path / "store" / "models" / "ddp" / "training.json").read_text())
    wall_h = sum(h["epoch_time_s"] for h in run.history) / 3600
    assert (trained["epochs"], trained["workers"], trained["device"]) == (4, 2, "cpu")
    assert trained["device_hours"] == pytest.approx(2 * wall_h, rel=1e-12) and wall_h > 0
    diag = tmp_path / "diag"
    digests = {}
    for epoch in (1, 2, 3, 4):
        ranks = [(diag / f"digest_rank{r}_epoch{epoch}.txt").read_text() for r in (0, 1)]
        assert ranks[0] == ranks[1], f"workers diverged at epoch {epoch}"
        digests[epoch] = ranks[0]
    assert len(set(digests.values())) == 4, "parameters did not change between epochs"
    bundle = run.load()
    assert bundle.manifest["method"] == "independent"
    assert bundle.manifest["train_config"]["num_workers"] == 2


def test_bad_configuration_names_the_key():
    with pytest.raises(ConfigError, match="unknown method 'bcx'.*allowed methods"):
        TrainConfig.from_dict({"method": "bcx", "scenario": {"splits": {"new_train": {}}}})
    with pytest.raises(ConfigError, match="unknown option 'epochz'"):
        TrainConfig.from_dict({"epochz": 3})
    with pytest.raises(
        ConfigError, match="'variant' = 'gamma' is not allowed.*'sys', 'beta', 'kd'"
    ):
        TrainConfig.from_dict(
            {
                "method": "bct",
                "method_options": {"variant": "gamma"},
                "old_model": "x",
                "scenario": {"splits": {"new_train": {}}},
            }
        )
    with pytest.raises(ConfigError, match="needs old_model"):
        TrainConfig.from_dict({"method": "bct", "scenario": {"splits": {"new_train": {}}}})


@pytest.mark.subprocess
def test_train_job_reports_config_error_without_traceback(capsys):
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "jobs", "train.py"), "--method", "nope"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "unknown method 'nope'" in proc.stderr and "Traceback" not in proc.stderr
    from raycompat.train.job import main

    with pytest.raises(SystemExit) as exited:  # its help, in this process (the same parser)
        main(["--help"])
    assert exited.value.code == 0
    help_text = capsys.readouterr().out
    assert "bct:" in help_text and "variant='sys'" in help_text and "independent:" in help_text


TINY_JOB = [
    "--backbone", "test_resnet", "--embed-dim", "16", "--epochs", "1", "--batch-size", "32",
    "--train-classes", "12", "--images-per-class", "8", "--eval-classes", "4",
    "--gallery-per-class", "2", "--distractor-classes", "2", "--distractors-per-class", "1",
]  # fmt: skip


def _default_name(module, base, *flags):
    opts = module.parse_train_options(module.build_parser(), [*TINY_JOB, *flags], base)
    scenario = module.load_scenario(opts)
    if module.__name__.endswith("old_job"):
        return module.old_config(opts, scenario).run_name
    return module.train_config(
        opts, scenario, method=opts.method, split=opts.split, run_name=opts.run_name
    ).run_name


def test_default_run_name_is_a_hash_of_the_configuration(tmp_path):
    """train and train-old name a run by a hash of what decides the model: the same options
    give the same name (a re-run resumes), a changed option another, where and how it runs
    (storage, restarts, CPUs) none; --run-name still wins."""
    from raycompat.train import job, old_job

    storage = ["--storage", str(tmp_path / "runs")]
    first = _default_name(old_job, old_job.OLD_DEFAULTS, *storage)
    assert first.startswith("old-") and len(first) == len("old-") + 10
    assert _default_name(old_job, old_job.OLD_DEFAULTS, *storage) == first
    assert _default_name(old_job, old_job.OLD_DEFAULTS, *storage, "--lr", "0.05") != first
    assert _default_name(old_job, old_job.OLD_DEFAULTS, *storage, "--data-seed", "1") != first
    elsewhere = ["--storage", str(tmp_path / "other"), "--max-failures", "0"]
    assert _default_name(old_job, old_job.OLD_DEFAULTS, *elsewhere, "--cpus-per-worker", "2") == (
        first
    )
    assert _default_name(old_job, old_job.OLD_DEFAULTS, "--run-name", "mine") == "mine"
    independent = ["--method", "independent", *storage]
    new = _default_name(job, job.TRAIN_DEFAULTS, *independent)
    assert new.startswith("independent-") and new == _default_name(
        job, job.TRAIN_DEFAULTS, *independent
    )
    assert new != _default_name(job, job.TRAIN_DEFAULTS, *independent, "--split", "old_train")


def test_rerun_of_an_identical_configuration_resumes(ray_cluster, capsys, tmp_path):
    """train-old twice with the same options: one run folder, and the second run trains no
    epoch again (its checkpoints are the first run's, untouched) and exports the same model;
    a third run on another storage, in Ray Train's local mode (``--workers 0``, the loop in
    this process), trains again and gives that model bit for bit."""
    import json

    from raycompat.train import old_job

    storage, out = tmp_path / "runs", tmp_path / "models" / "old"
    argv = [*TINY_JOB, "--storage", str(storage), "--out", str(out)]
    assert old_job.main(argv) == 0
    runs = [p.name for p in storage.iterdir() if p.is_dir() and p.name.startswith("old-")]
    assert len(runs) == 1, runs
    checkpoints = {p: p.stat().st_mtime_ns for p in (storage / runs[0]).rglob("history.json")}
    snapshot = json.loads((storage / runs[0] / "checkpoint_manager_snapshot.json").read_text())
    assert checkpoints and snapshot  # Ray Train registered the epoch's checkpoint
    first = (out / "manifest.json").read_text()
    assert old_job.main(argv) == 0
    capsys.readouterr()
    again = [p.name for p in storage.iterdir() if p.is_dir() and p.name.startswith("old-")]
    assert again == runs  # the same name: the run resumed, no second run
    now = {p: p.stat().st_mtime_ns for p in (storage / runs[0]).rglob("history.json")}
    assert now == checkpoints  # no epoch trained again
    assert (out / "manifest.json").read_text() == first
    # trained again from nothing (another storage): the same model, bit for bit
    fresh = [*TINY_JOB, "--storage", str(tmp_path / "fresh"), "--out", str(tmp_path / "again")]
    fresh += ["--workers", "0"]
    assert old_job.main(fresh) == 0
    capsys.readouterr()
    for part in sorted(p.name for p in out.iterdir() if p.suffix == ".pt"):
        assert (tmp_path / "again" / part).read_bytes() == (out / part).read_bytes(), part


def test_local_mode_resumes_from_its_own_checkpoints_and_keeps_the_newest(
    ray_cluster, tiny_scenario, tmp_path
):
    """``num_workers=0`` (Ray Train's local mode) runs in this process: it writes a checkpoint
    per epoch under ``<storage>/<run_name>`` (Ray Train keeps none there), keeps the newest
    ``checkpoints_to_keep``, resumes a longer run of the same name from the newest, and leaves
    this process's torch threads and random state as they were."""
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    cfg = tiny_config(tiny_scenario, tmp_path, num_workers=0, epochs=2, threads_per_worker=2)
    first = fit(cfg)
    assert torch.get_num_threads() == 1 and torch.equal(torch.rand(3), expected)
    assert [h["start_epoch"] for h in first.history] == [0, 0]
    assert first.checkpoint_path == str(tmp_path / "runs" / "tiny" / "epoch_0002")
    pid = int((tmp_path / "diag" / "pid_rank0.txt").read_text())
    assert pid == os.getpid()
    longer = fit(tiny_config(tiny_scenario, tmp_path, num_workers=0, epochs=3))
    assert [h["start_epoch"] for h in longer.history] == [0, 0, 2]
    assert longer.history[:2] == first.history
    folders = sorted(p.name for p in (tmp_path / "runs" / "tiny").iterdir())
    assert folders == ["epoch_0002", "epoch_0003"]  # checkpoints_to_keep=2
    assert longer.load().manifest["train_config"]["num_workers"] == 0
