"""The ``raycompat`` console command: its help lists every job, an unknown job or a bad option
of a job exits 2 with ``error:`` on stderr (no Ray started, no traceback)."""

from __future__ import annotations

import subprocess
import sys

import locations
import pytest

from raycompat.cli import JOBS

REPO = locations.REPO
ALL_JOBS = (
    "quickstart",
    "reproduce",
    "scenario",
    "import-model",
    "train",
    "train-old",
    "train-ract",
    "embed-gallery",
    "simulate-backfill",
    "plan-upgrade",
    "hot-refresh",
    "serve-index",
    "backfill-store",
)


def raycompat(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "raycompat.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_help_lists_every_job_with_its_summary():
    proc = raycompat("--help")
    assert proc.returncode == 0, proc.stderr
    listed = {line.split()[0]: line for line in proc.stdout.splitlines() if line.startswith("  ")}
    assert set(listed) == set(ALL_JOBS) == set(JOBS)
    assert "Main job" in listed["quickstart"] and "RACT" in listed["train-ract"]


def test_unknown_job_prints_usage_and_exits_2():
    proc = raycompat("trian")
    assert proc.returncode == 2
    assert "error: unknown job 'trian'" in proc.stderr and "train-old" in proc.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (("quickstart", "--train-clases", "3"), "unrecognized arguments: --train-clases"),
        (("train-ract", "--head", "foo"), "option 'head' = 'foo' is not allowed"),
        (("reproduce", "--scale", "huge"), "option 'scale' = 'huge' is not allowed"),
        (
            ("serve-index", "--gallery", "synthetic:5", "--store", "milvus:///tmp/x.db/g"),
            "which the milvus backend does not keep",
        ),
        (("backfill-store", "--store", "faiss://db/t", "--status"), "no store backend for scheme"),
    ],
)
def test_bad_option_of_a_job_exits_2(args, message):
    proc = raycompat(*args)
    assert proc.returncode == 2, proc.stdout[-2000:]
    assert "error:" in proc.stderr and message in proc.stderr
    assert "Traceback" not in proc.stderr and "Started a local Ray instance" not in proc.stderr
