"""Nothing overwritten by accident: model bundles and report folders already at ``--out`` are
refused unless ``--overwrite`` (or resumed when the config is identical), failed runs leave
no empty folder, and a new model trained against another old model is refused."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import locations
import pytest

from raycompat.config import ConfigError
from raycompat.data import build_scenario
from raycompat.models.fingerprint import bundle_fingerprint, check_predecessor
from raycompat.outputs import STAMP, OutputOptions, config_record, resolve_job_output
from raycompat.pipeline.bundles import make_random_bundles
from raycompat.storage import StorageError
from raycompat.train import TrainConfig
from raycompat.train.export import check_bundle_target, scenario_fingerprint

REPO = locations.REPO


# -- model bundles ------------------------------------------------------------------------
def train_config(**overrides) -> dict:
    return dict(TrainConfig().to_dict(), **overrides)


def saved_bundle(path, train_config: dict | None, **manifest) -> str:
    """A bundle folder as the export check sees it: its manifest (the weights are not read)."""
    os.makedirs(path, exist_ok=True)
    if train_config is not None:
        manifest["train_config"] = {k: v for k, v in train_config.items() if k != "scenario"}
    with open(os.path.join(path, "manifest.json"), "w") as fh:
        json.dump(manifest, fh)
    return str(path)


def test_bundle_target_new_identical_and_overwrite(tmp_path):
    assert check_bundle_target(str(tmp_path / "nothing"), train_config(), False) == "new"
    (tmp_path / "empty").mkdir()
    assert check_bundle_target(str(tmp_path / "empty"), train_config(), False) == "new"
    there = saved_bundle(tmp_path / "model", train_config(epochs=16, run_name="a"))
    # where and how the run executes does not change the model
    same = train_config(epochs=16, run_name="b", storage_path="/elsewhere", log_every=7)
    assert check_bundle_target(there, same, False) == "identical"
    assert check_bundle_target(there, train_config(epochs=1), True) == "overwrite"


def test_bundle_trained_otherwise_is_refused_naming_the_path(tmp_path):
    there = saved_bundle(tmp_path / "old", train_config(epochs=16))
    with pytest.raises(ConfigError) as err:
        check_bundle_target(there, train_config(epochs=1), False)
    message = str(err.value)
    assert message.startswith(f"{there} holds a model bundle trained with a different config")
    assert "epochs 16 vs 1" in message and "--overwrite" in message


def test_bundle_data_compared_by_fingerprint(tmp_path):
    scenario = {"name": "s", "splits": {"new_train": {"labels": [0, 1]}}}
    there = saved_bundle(
        tmp_path / "m", train_config(), data={"fingerprint": scenario_fingerprint(scenario)}
    )
    assert check_bundle_target(there, train_config(scenario=scenario), False) == "identical"
    other = dict(scenario, name="t")
    with pytest.raises(ConfigError, match="scenario"):
        check_bundle_target(there, train_config(scenario=other), False)


@pytest.mark.parametrize("kind", ["file", "folder of other files", "bundle not trained here"])
def test_non_bundles_are_refused_unless_overwrite(tmp_path, kind):
    path = tmp_path / "target"
    if kind == "file":
        path.write_text("x")
    elif kind == "folder of other files":
        path.mkdir()
        (path / "notes.txt").write_text("x")
    else:
        saved_bundle(path, None, method="random-init")
    with pytest.raises(ConfigError, match=f"^{path} holds "):
        check_bundle_target(str(path), train_config(), False)
    assert check_bundle_target(str(path), train_config(), True) == "overwrite"


def test_fit_refuses_before_training(tmp_path):
    """``fit`` checks the export location before Ray Train starts: no run folder appears."""
    from raycompat.train import fit

    scenario = build_scenario(
        "extended-class",
        num_train_classes=4,
        images_per_class=4,
        num_eval_classes=2,
        queries_per_class=1,
        gallery_per_class=1,
        num_distractor_classes=1,
        distractors_per_class=1,
        seed=0,
    )
    cfg = TrainConfig.from_dict(
        dict(
            method="independent",
            backbone="test_resnet",
            embed_dim=8,
            epochs=1,
            batch_size=8,
            scenario=scenario.to_dict(),
            storage_path=str(tmp_path / "runs"),
        )
    )
    there = saved_bundle(tmp_path / "model", dict(cfg.to_dict(), epochs=16))
    with pytest.raises(ConfigError, match=r"\(epochs 16 vs 1\)"):
        fit(cfg, export_to=there)
    assert not (tmp_path / "runs").exists()
    assert (
        json.loads((tmp_path / "model" / "manifest.json").read_text())["train_config"]["epochs"]
        == 16
    )


# -- report folders -----------------------------------------------------------------------
def resolve(out, config, overwrite=False):
    return resolve_job_output(
        "quickstart",
        out=str(out),
        storage=None,
        name="main",
        default_out="unused",
        config=config,
        overwrite=overwrite,
    )


def test_report_folder_identical_config_resumes(tmp_path):
    out = tmp_path / "report"
    first = resolve(out, {"epochs": 2, "address": "auto"})
    stamp = {"job": "quickstart", "config": {"epochs": 2}, "out": str(out)}
    assert json.loads((out / STAMP).read_text()) == stamp
    (out / "report.md").write_text("# report\n")
    # the address only says where the job runs: the same results
    again = resolve(out, {"epochs": 2, "address": None})
    assert again.local == first.local and (out / "report.md").is_file()


def test_report_folder_other_config_refused_unless_overwrite(tmp_path):
    out = tmp_path / "report"
    resolve(out, {"epochs": 2, "lr": 0.1})
    (out / "report.md").write_text("# report\n")
    with pytest.raises(ConfigError) as err:
        resolve(out, {"epochs": 3, "lr": 0.1})
    assert str(err.value) == (
        f"{out} holds a quickstart report made with other options (epochs 2 vs 3): "
        "pass --overwrite to write into it anyway, or another --out"
    )
    resolve(out, {"epochs": 3, "lr": 0.1}, overwrite=True)
    assert json.loads((out / STAMP).read_text())["config"] == {"epochs": 3, "lr": 0.1}
    resolve(out, {"epochs": 3, "lr": 0.1})  # now the identical config


def test_report_folder_of_another_job_or_program_refused(tmp_path):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "data.csv").write_text("1,2\n")
    with pytest.raises(ConfigError, match=f"^{foreign} holds files \\(data.csv\\) that no job"):
        resolve(foreign, {"epochs": 2})
    other = tmp_path / "other"
    resolve_job_output(
        "reproduce", out=str(other), storage=None, name="r", default_out="x", config={}
    )
    (other / "report.md").write_text("# report\n")
    with pytest.raises(ConfigError, match="the output of job 'reproduce', not 'quickstart'"):
        resolve(other, {})
    (tmp_path / "file").write_text("x")
    with pytest.raises(StorageError, match="is a file"):
        resolve(tmp_path / "file", {}, overwrite=True)


def test_output_options_carry_overwrite_and_leave_out_their_own_fields(tmp_path):
    out = tmp_path / "r"
    out.mkdir()
    (out / "report.md").write_text("old")
    opts = OutputOptions(out=str(out))
    with pytest.raises(ConfigError, match="--overwrite"):
        opts.resolve("quickstart", "unused", config={"epochs": 1})
    OutputOptions(out=str(out), overwrite=True).resolve("quickstart", "unused", config={})

    @dataclasses.dataclass(frozen=True)
    class Options:
        output: OutputOptions = OutputOptions()
        epochs: int = 2
        verbose: bool = False
        parallel: int = 2

    assert config_record(Options(verbose=True), ignore=("parallel",)) == {"epochs": 2}


def test_uri_destination_holding_another_report_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYCOMPAT_STAGING", str(tmp_path / "staging"))
    uri = f"file://{tmp_path}/bucket/report"
    o = resolve(uri, {"epochs": 2})
    with open(o.path("report.md"), "w") as fh:
        fh.write("# report\n")
    o.publish()
    with pytest.raises(ConfigError, match=f"^{uri} holds a quickstart report"):
        resolve(uri, {"epochs": 3})  # named as given, not as the staging folder
    shutil.rmtree(tmp_path / "staging")  # another machine: nothing staged yet
    with pytest.raises(ConfigError, match="epochs 2 vs 3"):
        resolve(uri, {"epochs": 3})
    assert resolve(uri, {"epochs": 2}).remote


@pytest.mark.subprocess
def test_failed_run_leaves_no_empty_folder(tmp_path):
    """The folder a job created is removed at exit when the job wrote nothing into it."""
    script = (
        "import sys\n"
        "from raycompat.outputs import resolve_job_output\n"
        "for name in sys.argv[1:]:\n"
        "    o = resolve_job_output('backfill', out=name, storage=None, name='x',"
        " default_out='y', config={})\n"
        "    if name.endswith('written'):\n"
        "        open(o.path('curves.json'), 'w').write('{}')\n"
        "raise SystemExit('failed')\n"
    )
    existing = tmp_path / "existing"
    existing.mkdir()
    names = [str(tmp_path / "created"), str(tmp_path / "written"), str(existing)]
    proc = subprocess.run(
        [sys.executable, "-c", script, *names], cwd=REPO, capture_output=True, text=True
    )
    assert proc.returncode == 1 and "failed" in proc.stderr
    assert not (tmp_path / "created").exists()
    assert (tmp_path / "written" / "curves.json").is_file()
    assert existing.is_dir()  # not created by the job: left as it was found


def test_cleanup_if_empty(tmp_path):
    o = resolve(tmp_path / "a", {})
    os.makedirs(o.path("runs"))
    assert o.cleanup_if_empty() and not os.path.exists(o.local)
    o = resolve(tmp_path / "b", {})
    (tmp_path / "b" / "report.md").write_text("x")
    assert not o.cleanup_if_empty() and os.path.isdir(o.local)


def simulate_in(folder, monkeypatch, capsys, *flags) -> tuple[int, str]:
    """simulate-backfill (in memory, no Ray) run from working directory ``folder`` with the
    same small settings; returns ``(exit status, stderr)``."""
    from raycompat.simulator.job import main

    monkeypatch.chdir(folder)
    capsys.readouterr()
    small = ["--policies", "random", "--modes", "compatible", "--grid-step", "50", "--k", "5"]
    code = main([*flags, *small, "--engine", "memory", "--no-plots", "--quiet"])
    return code, capsys.readouterr().err


def test_same_relative_flags_from_another_folder_are_refused(tmp_path, monkeypatch, capsys):
    """Two folders with their own emb.parquet and the same relative flags naming one report
    folder (``--out ../results``): the second run's inputs are other files, so it is refused
    and the first run's curves.json is kept."""
    from simulator_inputs import write_parquet

    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir(), second.mkdir()
    write_parquet(first / "emb.parquet", n_gallery=60)
    write_parquet(second / "emb.parquet", n_gallery=40, seed=1)
    flags = ["--embeddings", "emb.parquet", "--out", "../results"]
    assert simulate_in(first, monkeypatch, capsys, *flags)[0] == 0
    curves = tmp_path / "results" / "curves.json"
    assert json.loads(curves.read_text())["n_items"] == 60
    code, err = simulate_in(second, monkeypatch, capsys, *flags)
    assert code == 2, err
    assert err == (
        f"error: {tmp_path / 'results'} holds a backfill report made with other options "
        f"(embeddings {first / 'emb.parquet'} vs {second / 'emb.parquet'}): "
        "pass --overwrite to write into it anyway, or another --out\n"
    )
    assert json.loads(curves.read_text())["n_items"] == 60


def test_identical_run_with_absolute_paths_resumes(tmp_path, monkeypatch, capsys):
    """The run given absolute paths instead of relative ones is the same run: accepted."""
    from simulator_inputs import write_parquet

    write_parquet(tmp_path / "emb.parquet")
    relative = ["--embeddings", "emb.parquet", "--out", "out"]
    assert simulate_in(tmp_path, monkeypatch, capsys, *relative)[0] == 0
    absolute = ["--embeddings", str(tmp_path / "emb.parquet"), "--out", str(tmp_path / "out")]
    code, err = simulate_in(tmp_path / "out", monkeypatch, capsys, *absolute)
    assert code == 0, err
    assert json.loads((tmp_path / "out" / "curves.json").read_text())["n_items"] == 60
    stamp = json.loads((tmp_path / "out" / STAMP).read_text())
    assert stamp["config"]["embeddings"] == str(tmp_path / "emb.parquet")


def test_quickstart_refuses_a_foreign_folder_before_starting_ray(tmp_path, capsys):
    """In this process, which may not start Ray (tests/conftest.py): exit 2 naming the files,
    nothing touched."""
    from raycompat.quickstart import main

    out = tmp_path / "out"
    out.mkdir()
    (out / "thesis.tex").write_text("x")
    assert main(["--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"error: {out} holds files (thesis.tex)" in err and "Traceback" not in err
    assert os.listdir(out) == ["thesis.tex"]


# -- predecessor fingerprints --------------------------------------------------------------
@pytest.fixture(scope="module")
def two_pairs(tmp_path_factory):
    """Two (old, new) pairs of random bundles; each new one records its own old one."""
    root = tmp_path_factory.mktemp("pairs")
    kw = dict(backbone="test_resnet", old_dim=8, new_dim=8, num_classes=4, psi_hidden=8)
    return [make_random_bundles(str(root / f"pair{s}"), seed=s, **kw) for s in (0, 1)]


def test_predecessor_match(two_pairs):
    (old_a, new_a), _ = two_pairs
    manifest = json.loads(open(os.path.join(new_a, "manifest.json")).read())
    assert manifest["predecessor"]["fingerprint"] == bundle_fingerprint(old_a)
    assert check_predecessor(old_a, new_a, allow_unrelated=False) is None


def test_predecessor_mismatch_is_an_error_unless_allowed(two_pairs):
    (old_a, new_a), (old_b, _) = two_pairs
    fp_a, fp_b = bundle_fingerprint(old_a), bundle_fingerprint(old_b)
    assert fp_a != fp_b
    with pytest.raises(ConfigError) as err:
        check_predecessor(old_b, new_a, allow_unrelated=False)
    assert str(err.value) == (
        f"new model {new_a} was trained against old model {fp_a} ({old_a}), but "
        f"--old-model {old_b} is {fp_b}: pass --allow-unrelated to use them together anyway"
    )
    warning = check_predecessor(old_b, new_a, allow_unrelated=True)
    assert warning is not None and fp_a in warning and "--allow-unrelated" in warning


def test_predecessor_not_recorded_is_a_warning(two_pairs, tmp_path):
    (old_a, new_a), _ = two_pairs
    legacy = tmp_path / "legacy"
    shutil.copytree(new_a, legacy)
    manifest = json.loads((legacy / "manifest.json").read_text())
    del manifest["predecessor"]["fingerprint"]
    (legacy / "manifest.json").write_text(json.dumps(manifest))
    warning = check_predecessor(old_a, str(legacy), allow_unrelated=False)
    assert warning is not None and "records no predecessor fingerprint" in warning


@pytest.mark.subprocess
def test_embed_gallery_refuses_unrelated_models(two_pairs, tmp_path):
    (old_a, new_a), (old_b, _) = two_pairs
    cmd = [sys.executable, os.path.join("jobs", "embed_gallery.py"), "--out", str(tmp_path / "g")]
    proc = subprocess.run(
        cmd + ["--old-model", old_b, "--new-model", new_a, "--items", "8"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"error: new model {new_a} was trained against old model" in proc.stderr
    assert "--allow-unrelated" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "g").exists()


@pytest.mark.subprocess
def test_failed_first_gallery_run_leaves_no_folder(tmp_path):
    """embed-gallery's output folder, empty when the job opened it, is removed at exit when
    the run wrote no shard (only its manifest); a folder with a shard stays."""
    script = (
        "import sys\n"
        "from raycompat.pipeline.location import resolve_output\n"
        "from raycompat.pipeline.writer import remove_at_exit_if_unwritten\n"
        "for name in sys.argv[1:]:\n"
        "    out = resolve_output(name)\n"
        "    assert remove_at_exit_if_unwritten(out)\n"
        "    out.write_bytes('_manifest.json', b'{}')\n"
        "    if name.endswith('sharded'):\n"
        "        out.write_bytes('part-000000.parquet', b'')\n"
        "raise SystemExit('failed')\n"
    )
    names = [str(tmp_path / "manifest_only"), str(tmp_path / "sharded")]
    proc = subprocess.run(
        [sys.executable, "-c", script, *names], cwd=REPO, capture_output=True, text=True
    )
    assert proc.returncode == 1 and "failed" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "manifest_only").exists()
    assert (tmp_path / "sharded" / "part-000000.parquet").is_file()
