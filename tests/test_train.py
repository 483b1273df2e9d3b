"""The Ray Train loop on the session's real local cluster: DDP sync, worker-kill resume,
and configuration errors."""
from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from raycompat.config import ConfigError
from raycompat.data import build_scenario
from raycompat.train import TrainConfig, fit

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tiny_scenario():
    return build_scenario("extended-class", num_train_classes=12, images_per_class=16,
                          num_eval_classes=6, queries_per_class=1, gallery_per_class=3,
                          num_distractor_classes=4, distractors_per_class=2, seed=3)


def tiny_config(scenario, tmp_path, **overrides) -> TrainConfig:
    values = dict(method="independent", backbone="test_resnet", embed_dim=16, head="cosface",
                  epochs=2, batch_size=32, lr=0.05, scenario=scenario.to_dict(), split="new_train",
                  num_workers=1, threads_per_worker=1, storage_path=str(tmp_path / "runs"),
                  run_name="tiny", diagnostics_dir=str(tmp_path / "diag"), log_every=1000)
    values.update(overrides)
    return TrainConfig.from_dict(values)


def test_two_worker_ddp_keeps_parameters_identical(ray_cluster, tiny_scenario, tmp_path):
    cfg = tiny_config(tiny_scenario, tmp_path, num_workers=2, epochs=2, run_name="ddp")
    run = fit(cfg, export_to=str(tmp_path / "model"))
    assert [h["epoch"] for h in run.history] == [1, 2]
    assert all(h["num_workers"] == 2 for h in run.history)
    diag = tmp_path / "diag"
    digests = {}
    for epoch in (1, 2):
        ranks = [(diag / f"digest_rank{r}_epoch{epoch}.txt").read_text() for r in (0, 1)]
        assert ranks[0] == ranks[1], f"workers diverged at epoch {epoch}"
        digests[epoch] = ranks[0]
    assert digests[1] != digests[2], "parameters did not change between epochs"
    bundle = run.load()
    assert bundle.manifest["method"] == "independent"
    assert bundle.manifest["train_config"]["num_workers"] == 2


def test_killed_worker_resumes_from_last_checkpoint(ray_cluster, tiny_scenario, tmp_path):
    cfg = tiny_config(tiny_scenario, tmp_path, epochs=5, run_name="kill", max_failures=2)
    outcome = {}
    thread = threading.Thread(target=lambda: outcome.update(run=fit(cfg)), daemon=True)
    thread.start()
    run_dir = tmp_path / "runs" / "kill"
    deadline = time.time() + 240
    while not glob.glob(str(run_dir / "epoch_0002")) and time.time() < deadline:
        time.sleep(0.2)
    assert glob.glob(str(run_dir / "epoch_0002")), "no checkpoint of epoch 2 appeared"
    pid = int((tmp_path / "diag" / "pid_rank0.txt").read_text())
    os.kill(pid, signal.SIGKILL)
    thread.join(timeout=300)
    assert not thread.is_alive(), "training did not finish after the worker was killed"
    run = outcome["run"]
    new_pid = int((tmp_path / "diag" / "pid_rank0.txt").read_text())
    assert new_pid != pid, "the worker was not restarted"
    assert [h["epoch"] for h in run.history] == [1, 2, 3, 4, 5]
    starts = [h["start_epoch"] for h in run.history]
    # Epochs 1-2 (at least) ran in the first attempt from scratch; the rest after a resume
    # from a checkpoint, never from scratch again.
    assert starts[0] == 0 and starts[-1] >= 2, starts


def test_bad_configuration_names_the_key():
    with pytest.raises(ConfigError, match="unknown method 'bcx'.*allowed methods"):
        TrainConfig.from_dict({"method": "bcx", "scenario": {"splits": {"new_train": {}}}})
    with pytest.raises(ConfigError, match="unknown option 'epochz'"):
        TrainConfig.from_dict({"epochz": 3})
    with pytest.raises(ConfigError, match="'variant' = 'gamma' is not allowed.*'sys', 'beta', 'kd'"):
        TrainConfig.from_dict({"method": "bct", "method_options": {"variant": "gamma"},
                               "old_model": "x", "scenario": {"splits": {"new_train": {}}}})
    with pytest.raises(ConfigError, match="needs old_model"):
        TrainConfig.from_dict({"method": "bct", "scenario": {"splits": {"new_train": {}}}})


def test_train_job_reports_config_error_without_traceback():
    proc = subprocess.run([sys.executable, os.path.join(REPO, "jobs", "train.py"), "--method", "nope"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "unknown method 'nope'" in proc.stderr and "Traceback" not in proc.stderr
    help_text = subprocess.run([sys.executable, os.path.join(REPO, "jobs", "train.py"), "--help"],
                               capture_output=True, text=True, timeout=120).stdout
    assert "bct:" in help_text and "variant='sys'" in help_text and "independent:" in help_text
