"""The reproduction trains each method as its released code (or paper) sets it up, and
``--setup premise`` as the premise run of 2026-11-29 did (issue 61): the training values of
every variant whose setup differs, under both setups."""

from __future__ import annotations

import pytest

from raycompat.config import ConfigError, parse_options
from raycompat.reproduce.plan import VARIANTS, ReproduceOptions, ScaleOptions

SCALE = ScaleOptions()


def test_setup_option_defaults_to_released():
    assert ReproduceOptions().setup == "released"
    assert parse_options(ReproduceOptions, {"setup": "premise"}).setup == "premise"
    with pytest.raises(ConfigError, match="allowed values"):
        parse_options(ReproduceOptions, {"setup": "paper"})


@pytest.mark.parametrize("label", ["mcl", "cl"])
def test_rm_contrastive_methods_train_on_class_balanced_batches(label):
    v = VARIANTS[label]
    assert v.training_values("released")["batch_images_per_class"] == 4
    assert v.training_values("premise")["batch_images_per_class"] == 0
    assert "temperature" not in v.method_options(SCALE)  # T = 1, the method's default
    warm = v.method_options(ScaleOptions(rm_temperature=0.1))
    assert warm["temperature"] == 0.1


def test_variants_without_a_setup_of_their_own_train_as_before():
    for label in ("independent", "bct", "rqt", "p2s", "ndpp", "lwf", "lce", "bt2"):
        v = VARIANTS[label]
        assert v.training_values("released") == v.training_values("premise") == dict(v.training)
        assert v.method_options(SCALE, "released") == v.method_options(SCALE, "premise")


def sequential_plan(setup: str, tmp_path) -> dict:
    """The sequential chains of a tiny plan (planned only: nothing trains)."""
    import dataclasses

    from raycompat.outputs import OutputOptions
    from raycompat.reproduce.plan import DEFAULT_SIZES
    from raycompat.reproduce.runner import Reproduction

    sizes = dataclasses.replace(
        DEFAULT_SIZES, train_classes=16, images_per_class=8, backbone="test_resnet"
    )
    training = ScaleOptions(embed_dim=32, batch_size=32, new_epochs=1, old_epochs=1, workers=0)
    opts = ReproduceOptions(
        output=OutputOptions(out=str(tmp_path)),
        scenarios=("sequential",),
        methods=("dsimplex",),
        sequential_methods=("dsimplex",),
        sizes=sizes,
        training=training,
        setup=setup,
    ).validated()
    return Reproduction(opts, str(tmp_path), log=lambda *a: None).plan_sequential()["chains"]


def test_every_dsimplex_generation_starts_from_its_predecessor(tmp_path):
    chain = sequential_plan("released", tmp_path)["dsimplex"]
    assert chain[0].values["init_model"] is None and chain[0].values["lr"] == 0.1
    for before, gen in zip(chain[:-1], chain[1:], strict=True):
        v = gen.values
        assert v["init_model"] == v["old_model"] == before.path
        assert (v["lr"], v["batch_old_fraction"]) == (1e-3, 0.5)
    # the independent chain (the paragons) is as before
    for gen in sequential_plan("released", tmp_path)["independent"]:
        assert gen.values["init_model"] is None and "batch_old_fraction" not in gen.values


def test_the_premise_setup_trains_every_generation_from_scratch(tmp_path):
    chain = sequential_plan("premise", tmp_path)["dsimplex"]
    for gen in chain[1:]:
        v = gen.values
        assert v["init_model"] is None and v["lr"] == 0.1 and v["batch_old_fraction"] == 0.0


def test_fct_switches_its_batchnorm_to_eval_halfway_as_released():
    v = VARIANTS["fct"]
    assert v.method_options(SCALE, "released")["batchnorm"] == "switch"
    assert v.method_options(SCALE, "premise")["batchnorm"] == "eval"
    assert v.training_values("released") == {"optimizer": "adamw", "lr": 5e-4}


def test_dmu_is_compared_with_a_bct_of_its_own_head():
    released, premise = ReproduceOptions(), ReproduceOptions(setup="premise")
    for scenario in ("extended-data", "open-class", "architecture", "sequential"):
        labels = [v.label for v in released.method_plan(scenario)]
        assert labels[labels.index("dmu") + 1] == "bct-arcface", scenario
        assert "bct-arcface" not in [v.label for v in premise.method_plan(scenario)]
        assert "DMU's reference" in dict(premise.skipped(scenario))["bct-arcface"]
    ref = VARIANTS["bct-arcface"]
    assert (ref.method, ref.head, dict(ref.options)) == ("bct", "arcface", {"variant": "sys"})
    assert VARIANTS["dmu"].head == "arcface" and VARIANTS["bct"].head is None  # cosface
    # chosen already: not planned twice
    both = ReproduceOptions(methods=("dmu", "bct-arcface"))
    assert [v.label for v in both.method_plan("extended-data")].count("bct-arcface") == 1


def test_unibct_trains_with_the_released_arcface_and_refines_a_trained_model():
    v = VARIANTS["unibct"]
    released, premise = v.method_options(SCALE, "released"), v.method_options(SCALE, "premise")
    assert (released["margin"], released["refine_from"]) == (0.3, 0.5)
    assert (premise["margin"], premise["refine_from"]) == (0.0, 0.0)


def test_advbct_takes_its_boundary_from_the_old_split_as_released():
    v = VARIANTS["advbct"]
    released, premise = v.method_options(SCALE, "released"), v.method_options(SCALE, "premise")
    assert released == {"boundary_split": "old", "discriminator": "released", "threshold": 0.5}
    assert premise == {"boundary_split": "new", "discriminator": "joint", "threshold": 1.0}


@pytest.mark.parametrize("label", ["ract", "contrastive"])
def test_ract_and_its_baseline_train_a_plain_linear_classifier(label):
    v = VARIANTS[label]
    assert v.training_values("released") == {"head": "softmax"}
    assert v.training_values("premise") == {}  # the scale's CosFace head, as the premise run


def test_ract_models_are_planned_with_the_softmax_head(tmp_path):
    """The planned training values (what names the model), not only the variant's."""
    import dataclasses

    from raycompat.outputs import OutputOptions
    from raycompat.reproduce.plan import DEFAULT_SIZES
    from raycompat.reproduce.runner import Reproduction

    sizes = dataclasses.replace(
        DEFAULT_SIZES, train_classes=16, images_per_class=8, backbone="test_resnet"
    )
    for setup, head in (("released", "softmax"), ("premise", "cosface")):
        opts = ReproduceOptions(
            output=OutputOptions(out=str(tmp_path)),
            scenarios=("extended-data",),
            methods=("ract", "contrastive", "bct"),
            sizes=sizes,
            training=ScaleOptions(embed_dim=32, batch_size=32, workers=0),
            setup=setup,
        ).validated()
        rep = Reproduction(opts, str(tmp_path / setup), log=lambda *a: None)
        rep.plan_all()
        assert rep.models["extended-data/ract"].values["head"] == head
        assert rep.models["extended-data/contrastive"].values["head"] == head
        assert rep.models["extended-data/bct"].values["head"] == "cosface"
