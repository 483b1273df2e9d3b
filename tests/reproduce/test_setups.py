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
    for label in ("independent", "bct", "rqt", "contrastive", "ract", "p2s", "lwf"):
        v = VARIANTS[label]
        assert v.training_values("released") == v.training_values("premise") == dict(v.training)
        assert v.method_options(SCALE, "released") == v.method_options(SCALE, "premise")
