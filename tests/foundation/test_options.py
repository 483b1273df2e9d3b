"""The options module (raycompat.config) through the jobs' option dataclasses: flags round trip
to the same dataclass, nested scenario sizes, each job's defaults, and the errors a bad flag or
value gives (an argparse error naming an unknown flag, a ConfigError naming a bad value)."""

from __future__ import annotations

import dataclasses

import pytest

from raycompat.config import ConfigError, options_from_args
from raycompat.data import ScenarioSizes
from raycompat.quickstart import QuickstartOptions
from raycompat.quickstart import build_parser as quickstart_parser
from raycompat.reproduce.job import parse_reproduce_options
from raycompat.reproduce.plan import SCALES, VARIANTS, ReproduceOptions
from raycompat.train import job as train_job
from raycompat.train import old_job, ract_job


def quickstart(argv: list[str]) -> QuickstartOptions:
    return options_from_args(QuickstartOptions, quickstart_parser().parse_args(argv))


def train(module, argv: list[str]):
    defaults = {
        train_job: train_job.TRAIN_DEFAULTS,
        old_job: old_job.OLD_DEFAULTS,
        ract_job: ract_job.RACT_DEFAULTS,
    }[module]
    return train_job.parse_train_options(module.build_parser(), argv, defaults)


def test_no_flags_give_the_jobs_defaults():
    assert quickstart([]) == QuickstartOptions()
    assert (
        quickstart([]).sizes.train_classes == 480 and quickstart([]).sizes.backbone == "test_resnet"
    )
    assert quickstart([]).seeds == 2 and quickstart([]).sizes.old_fraction == 0.07
    assert quickstart([]).output.name == "main" and quickstart([]).verbose is False
    assert train(train_job, []) == train_job.TRAIN_DEFAULTS
    assert train(train_job, []).sizes == ScenarioSizes()  # train's sizes are the library defaults
    assert train(old_job, []).split == "old_train" and train(old_job, []).method == "independent"
    ract = train(ract_job, [])
    assert (ract.method, ract.epochs, ract.batch_size) == ("ract", 3, 64)
    assert (ract.sizes.backbone, ract.sizes.train_classes, ract.sizes.eval_classes) == (
        "lcnet_050",
        40,
        20,
    )
    assert ract.sizes.queries_per_class == train_job.TRAIN_SIZES.queries_per_class
    assert parse_reproduce_options([]).sizes == SCALES["default"].sizes
    assert parse_reproduce_options([]).output.name == "report"


def test_flags_round_trip_to_the_same_dataclass():
    argv = [
        "--out",
        "/tmp/qs",
        "--storage",
        "s3://b/p",
        "--name",
        "exp",
        "--address",
        "auto",
        "--scenario",
        "open-class",
        "--train-classes",
        "30",
        "--images-per-class",
        "7",
        "--eval-classes",
        "9",
        "--queries-per-class",
        "1",
        "--gallery-per-class",
        "3",
        "--distractor-classes",
        "0",
        "--distractors-per-class",
        "0",
        "--resolution",
        "24",
        "--backbone",
        "resnet10t",
        "--data-seed",
        "5",
        "--embed-dim",
        "32",
        "--head",
        "arcface",
        "--old-epochs",
        "2",
        "--new-epochs",
        "1",
        "--batch-size",
        "16",
        "--lr",
        "0.05",
        "--workers",
        "2",
        "--gpus",
        "0.5",
        "--seed",
        "4",
        "--verbose",
    ]
    got = quickstart(argv)
    want = dataclasses.replace(
        QuickstartOptions(),
        address="auto",
        embed_dim=32,
        head="arcface",
        old_epochs=2,
        new_epochs=1,
        batch_size=16,
        lr=0.05,
        workers=2,
        gpus=0.5,
        seed=4,
        verbose=True,
        output=dataclasses.replace(
            QuickstartOptions().output, out="/tmp/qs", storage="s3://b/p", name="exp"
        ),
        sizes=ScenarioSizes(
            scenario="open-class",
            train_classes=30,
            images_per_class=7,
            eval_classes=9,
            queries_per_class=1,
            gallery_per_class=3,
            distractor_classes=0,
            distractors_per_class=0,
            old_fraction=0.07,  # the main job's default, not ScenarioSizes'
            resolution=24,
            backbone="resnet10t",
            data_seed=5,
        ),
    )
    assert got == want


def test_nested_size_flags_keep_the_jobs_other_defaults():
    opts = train(
        ract_job,
        [
            "--train-classes",
            "12",
            "--opt",
            "tau=0.05",
            "--opt",
            "margin=0.2",
            "--pretrained",
            "/w.pth",
            "--epochs",
            "1",
        ],
    )
    assert opts.sizes == dataclasses.replace(ract_job.RACT_DEFAULTS.sizes, train_classes=12)
    assert opts.method_options == ("tau=0.05", "margin=0.2") and opts.pretrained_path == "/w.pth"
    assert opts.epochs == 1 and opts.batch_size == 64 and opts.method == "ract"


def test_reproduce_scale_preset_then_flags():
    cluster = parse_reproduce_options(
        ["--scale", "cluster", "--train-classes", "50", "--psi-hidden", "32"]
    )
    assert cluster.sizes == dataclasses.replace(SCALES["cluster"].sizes, train_classes=50)
    assert cluster.training == dataclasses.replace(SCALES["cluster"].training, psi_hidden=32)
    assert cluster.training.workers == 4 and cluster.sizes.backbone == "resnet18"
    opts = parse_reproduce_options(
        [
            "--scenarios",
            "extended-data, sequential",
            "--methods",
            "bct,dmu",
            "--sequential-methods",
            "all",
        ]
    )
    assert opts.scenarios == ("extended-data", "sequential") and opts.methods == ("bct", "dmu")
    assert opts.sequential_methods == tuple(VARIANTS)  # 'all'
    assert ReproduceOptions.at_scale("cluster").training == SCALES["cluster"].training


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--train-clases", "3"], "--train-clases"),
        (["--epochs", "1"], "--epochs"),  # a train flag is not a main-job flag
    ],
)
def test_unknown_flag_is_an_argparse_error_naming_it(capsys, argv, flag):
    with pytest.raises(SystemExit) as exit_info:
        quickstart_parser().parse_args(argv)
    assert exit_info.value.code == 2
    assert "unrecognized arguments: " + flag in capsys.readouterr().err


@pytest.mark.parametrize(
    "module, argv",
    [
        (quickstart_parser, ["--train", "3"]),
        (train_job.build_parser, ["--train-class", "3"]),
        (old_job.build_parser, ["--method", "bct"]),  # the old model takes no method
    ],
)
def test_abbreviated_or_foreign_flag_is_refused(capsys, module, argv):
    with pytest.raises(SystemExit) as exit_info:
        module().parse_args(argv)
    assert exit_info.value.code == 2
    assert argv[0] in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--train-classes", "0"], r"option 'train_classes' = 0 must be >= 1"),
        (
            ["--head", "foo"],
            r"option 'head' = 'foo' is not allowed; allowed values: \['softmax', 'cosface'",
        ),
        (["--lr", "fast"], r"option 'lr' must be a number, got 'fast'"),
        (["--lr", "inf"], r"option 'lr' must be a finite number, got 'inf'"),
        (["--lr", "nan"], r"option 'lr' must be a finite number, got 'nan'"),
        (["--distractor-classes", "-1"], r"option 'distractor_classes' = -1 must be >= 0"),
        (["--scenario", "open"], r"--scenario 'open' is neither an allocation"),
    ],
)
def test_bad_value_is_a_config_error_naming_the_option(argv, message):
    with pytest.raises(ConfigError, match=message):
        quickstart(argv)
    with pytest.raises(ConfigError, match=message):
        train(train_job, argv)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--methods", "bcx"], r"--methods: 'bcx' is not allowed"),
        (
            ["--scale", "huge"],
            r"option 'scale' = 'huge' is not allowed; "
            r"allowed values: \['default', 'premise', 'cluster'\]",
        ),
        (
            ["--arch-backbone", "resnet9000"],
            r"--arch-backbone 'resnet9000' is not a timm model name",
        ),
        (
            ["--batch-size", "10", "--workers", "3"],
            r"--batch-size 10 must be divisible by --workers 3",
        ),
    ],
)
def test_reproduce_bad_values_name_the_option(argv, message):
    with pytest.raises(ConfigError, match=message):
        parse_reproduce_options(argv)


def test_tuples_from_comma_lists():
    opts = parse_reproduce_options(["--scenarios", "open-class,sequential", "--methods", "none"])
    assert opts.scenarios == ("open-class", "sequential") and opts.methods is None
    # a repeated --opt is one item per flag, commas inside a value kept
    opts = train(train_job, ["--opt", "fractions=0.25,0.5", "--opt", "tau=1"])
    assert opts.method_options == ("fractions=0.25,0.5", "tau=1")


def test_flags_of_a_dataclass_nested_two_deep():
    """serve-index's flags: ServingConfig is a group of the job's options and IndexOptions a
    group of ServingConfig; a flag of the inner one reaches it, the rest keep their defaults."""
    from raycompat.index.ann import IndexOptions
    from raycompat.serving import job as serve_job

    args = serve_job.build_parser().parse_args(
        ["--index", "hnsw", "--ef-search", "32", "--num-shards", "3", "--shard-replicas", "2"]
    )
    opts = options_from_args(serve_job.ServeIndexOptions, args)
    assert opts.serving.index == dataclasses.replace(IndexOptions(), kind="hnsw", ef_search=32)
    assert opts.serving.num_shards == 3 and opts.serving.shard_replicas == 2
