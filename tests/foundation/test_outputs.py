"""Job output locations (raycompat.outputs): --out / --storage / --name, checked at start."""

from __future__ import annotations

import os

import locations
import pytest

from raycompat.outputs import resolve_job_output
from raycompat.storage import StorageError

REPO = locations.REPO


def test_default_out_is_a_local_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    o = resolve_job_output(
        "quickstart", out=None, storage=None, name="main", default_out="quickstart_out"
    )
    assert o.local == o.destination == str(tmp_path / "quickstart_out")
    assert o.runs == str(tmp_path / "quickstart_out" / "runs") and not o.remote
    assert os.path.isdir(o.local) and o.publish() == o.local


def test_storage_gives_report_and_runs_locations(tmp_path):
    o = resolve_job_output(
        "reproduce",
        out=None,
        storage=str(tmp_path / "store"),
        name="exp",
        default_out="reproduce_out",
    )
    assert o.local == str(tmp_path / "store" / "reproduce" / "exp")
    assert o.runs == str(tmp_path / "store" / "runs")


def test_uri_destination_is_staged_and_published(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYCOMPAT_STAGING", str(tmp_path / "staging"))
    o = resolve_job_output(
        "quickstart",
        out=None,
        storage=f"file://{tmp_path}/bucket",
        name="run1",
        default_out="quickstart_out",
        config={"seed": 0},
    )
    assert o.remote and o.destination == f"file://{tmp_path}/bucket/quickstart/run1"
    assert o.runs == f"file://{tmp_path}/bucket/runs"  # Ray Train takes the URI itself
    assert o.local.startswith(str(tmp_path / "staging"))
    with open(o.path("report.md"), "w") as f:
        f.write("# report\n")
    assert o.publish() == o.destination
    assert (tmp_path / "bucket" / "quickstart" / "run1" / "report.md").read_text() == "# report\n"
    # the same URI maps to the same staging folder: a re-run with the same options resumes
    again = resolve_job_output(
        "quickstart", out=o.destination, storage=None, name="x", default_out="y", config={"seed": 0}
    )
    assert again.local == o.local


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(out=None, storage="/proc/raycompat"), "--storage /proc/raycompat is not writable"),
        (
            dict(out=None, storage="/nonexistent-parent/x"),
            "the parent folder /nonexistent-parent does not exist",
        ),
    ],
)
def test_unusable_locations_are_named(kw, message):
    with pytest.raises(StorageError, match=message.replace("/", "/")):
        resolve_job_output("quickstart", name="main", default_out="quickstart_out", **kw)


def test_missing_parents_of_out_are_created(tmp_path, monkeypatch):
    """``--out emb/query`` where ``emb/`` does not exist: the parents are created (a local path
    relative to the working directory, and a URI)."""
    monkeypatch.chdir(tmp_path)
    o = resolve_job_output("backfill", out="emb/query", storage=None, name="x", default_out="y")
    assert o.local == o.destination == str(tmp_path / "emb" / "query")
    assert os.path.isdir(o.local) and os.listdir(o.local) == ["job.json"]
    monkeypatch.setenv("RAYCOMPAT_STAGING", str(tmp_path / "staging"))
    uri = f"file://{tmp_path}/bucket/a/b/report"
    o = resolve_job_output("backfill", out=uri, storage=None, name="x", default_out="y")
    assert o.destination == uri and (tmp_path / "bucket" / "a" / "b").is_dir()
    with open(o.path("curves.json"), "w") as fh:
        fh.write("{}")
    o.publish()
    assert (tmp_path / "bucket" / "a" / "b" / "report" / "curves.json").read_text() == "{}"


def test_out_under_a_file_is_named(tmp_path):
    (tmp_path / "file").write_text("x")
    out = tmp_path / "file" / "x" / "out"
    with pytest.raises(StorageError, match=f"^--out {out}: cannot create it: "):
        resolve_job_output("quickstart", out=str(out), storage=None, name="m", default_out="q")


@pytest.mark.parametrize("job", ["quickstart", "reproduce"])
def test_jobs_refuse_unwritable_storage_before_starting_ray(job, capsys):
    """The job's command line in this process, which may not start Ray (tests/conftest.py):
    exit 2 with one ``error:`` line, before any cluster starts."""
    import importlib

    main = importlib.import_module(f"raycompat.{job}" + (".job" if job == "reproduce" else "")).main
    assert main(["--storage", "/proc/raycompat"]) == 2
    err = capsys.readouterr().err
    assert "--storage /proc/raycompat is not writable" in err and "Traceback" not in err
