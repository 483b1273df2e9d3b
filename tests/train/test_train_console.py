"""What a training run prints: Ray Train's per-report INFO lines off unless the job is
verbose, and the verbose switch handed to the Ray Train workers."""

from __future__ import annotations

import torch

from raycompat.train.loop import class_targets
from raycompat.train.trainer import console_settings


def test_ray_train_info_lines_are_off_unless_verbose(monkeypatch):
    monkeypatch.delenv("RAYCOMPAT_VERBOSE", raising=False)
    logging_config, env = console_settings()
    assert logging_config.log_level == "WARNING" and env == {"RAYCOMPAT_VERBOSE": "0"}
    monkeypatch.setenv("RAYCOMPAT_VERBOSE", "1")
    logging_config, env = console_settings()
    assert logging_config.log_level == "INFO" and env == {"RAYCOMPAT_VERBOSE": "1"}


def test_class_targets_map_class_ids_to_head_rows():
    new_target, old_target = class_targets([2, 5, 7], [5, 9, 2])
    assert new_target.tolist() == [-1, -1, 0, -1, -1, 1, -1, 2]
    # class 9 of the old head lies beyond the new classes' table: left out
    assert old_target.tolist() == [-1, -1, 2, -1, -1, 0, -1, -1]
    assert old_target.dtype == torch.long
