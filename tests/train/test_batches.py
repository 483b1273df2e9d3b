"""Class-balanced P x K batches (issue 61, point 1): every global batch holds K images of each
of P distinct classes, seeded per epoch, sliced whole classes per DDP worker; the RM methods
(mcl, cl) train with them by default, the others with uniformly random batches. Batches balanced
between old and new classes (point 5): d-Simplex's by default, as its released trainer."""

from __future__ import annotations

import numpy as np
import pytest
from torch.utils.data import DistributedSampler

from raycompat.config import ConfigError
from raycompat.train import TrainConfig
from raycompat.train.batches import ClassBalancedBatches, OldNewBatches
from raycompat.train.data import TrainingSet
from raycompat.train.loop import _build_loader

# 20 classes of 3 to 12 images (150 items)
SIZES = [3 + (c * 7) % 10 for c in range(20)]
LABELS = np.repeat(np.arange(20), SIZES)
# the first batch of seed 0, epoch 0, P = 4 classes x K = 2 images: classes 18, 17, 19, 2
FIRST = [141, 137, 132, 130, 147, 148, 14, 19]


def class_counts(labels) -> dict[int, int]:
    values, counts = np.unique(labels, return_counts=True)
    return dict(zip(values.tolist(), counts.tolist(), strict=True))


def test_every_batch_holds_k_images_of_each_of_p_classes():
    batches = ClassBalancedBatches(LABELS, 16, 4, seed=3)
    got = batches.global_batches()
    assert len(got) == len(batches) == LABELS.size // 16 == 9
    seen = set()
    for batch in got:
        counts = class_counts(LABELS[batch])
        assert len(counts) == 4 and set(counts.values()) == {4}
        for c in counts:  # a class of 4 images or more never repeats an image within a batch
            members = batch[LABELS[batch] == c]
            assert len(set(members.tolist())) == min(4, SIZES[c])
        seen |= set(counts)
    assert seen == set(range(20))  # 9 batches x 4 classes cycle through all 20 classes


def test_batches_are_a_function_of_seed_and_epoch():
    batches = ClassBalancedBatches(LABELS, 8, 2, seed=0)
    first = [b.tolist() for b in batches.global_batches()]
    assert first == [b.tolist() for b in ClassBalancedBatches(LABELS, 8, 2).global_batches()]
    assert first[0] == FIRST
    batches.set_epoch(1)
    assert [b.tolist() for b in batches.global_batches()] != first
    assert [b.tolist() for b in ClassBalancedBatches(LABELS, 8, 2, seed=1).global_batches()] != (
        first
    )


def test_workers_slice_each_global_batch_into_whole_classes():
    whole = ClassBalancedBatches(LABELS, 16, 4, seed=2).global_batches()
    ranks = [list(ClassBalancedBatches(LABELS, 16, 4, rank=r, world=2, seed=2)) for r in (0, 1)]
    assert len(ranks[0]) == len(ranks[1]) == len(whole)
    for batch, a, b in zip(whole, *ranks, strict=True):
        assert a + b == batch.tolist()
        for part in (a, b):
            assert set(class_counts(LABELS[part]).values()) == {4}


def test_a_class_smaller_than_k_repeats_its_images():
    labels = np.array([0] * 2 + [1] * 6 + [2] * 6)
    for batch in ClassBalancedBatches(labels, 12, 4, seed=0).global_batches():
        assert class_counts(labels[batch]) == {0: 4, 1: 4, 2: 4}
        small = batch[labels[batch] == 0]
        assert set(small.tolist()) == {0, 1}


@pytest.mark.parametrize(
    "batch_size,k,world,message",
    [
        (16, 3, 1, "must be a multiple of 3 x 1"),
        (16, 4, 3, "must be a multiple of 4 x 3"),
        (96, 4, 1, "needs 24 classes, the split has 20"),
    ],
)
def test_impossible_batches_are_refused(batch_size, k, world, message):
    with pytest.raises(ConfigError, match=message):
        ClassBalancedBatches(LABELS, batch_size, k, world=world)


def training_set() -> TrainingSet:
    return TrainingSet(LABELS, lambda i, v: np.zeros((8, 8), np.uint8), (8, 8), views=2)


@pytest.mark.parametrize("method,k", [("mcl", 4), ("cl", 4), ("rqt", 0), ("bct", 0)])
def test_the_loop_draws_the_methods_batches(method, k):
    cfg = TrainConfig(method=method, batch_size=16, seed=0)
    assert cfg.class_batch_size() == k
    sampler, loader = _build_loader(cfg, training_set(), 0, 1)
    labels = [batch[2].numpy() for batch in loader]
    assert len(labels) == LABELS.size // 16
    balanced = [set(class_counts(b).values()) == {4} and len(set(b)) == 4 for b in labels]
    if k:
        assert isinstance(sampler, ClassBalancedBatches) and all(balanced)
    else:
        assert isinstance(sampler, DistributedSampler) and not all(balanced)


def test_random_batches_stay_selectable_for_mcl():
    cfg = TrainConfig(method="mcl", batch_size=16, batch_images_per_class=0)
    sampler, _ = _build_loader(cfg, training_set(), 0, 1)
    assert cfg.class_batch_size() == 0 and isinstance(sampler, DistributedSampler)
    cfg = TrainConfig(method="bct", batch_size=16, batch_images_per_class=2)
    sampler, loader = _build_loader(cfg, training_set(), 0, 1)
    assert isinstance(sampler, ClassBalancedBatches)
    assert all(set(class_counts(b[2].numpy()).values()) == {2} for b in loader)


def test_run_names_follow_the_batches_trained():
    from raycompat.train.runs import default_run_name

    def name(**values):
        return default_run_name("run", TrainConfig(batch_size=16, **values))

    # random batches, what every run trained before P x K batches: the name is unchanged
    assert name(method="bct") == name(method="bct", batch_images_per_class=0)
    assert name(method="bct") != name(method="bct", batch_images_per_class=4)
    # mcl's own P x K batches are named, as if given
    assert name(method="mcl") == name(method="mcl", batch_images_per_class=4)
    assert name(method="mcl") != name(method="mcl", batch_images_per_class=0)


OLD_CLASSES = list(range(5))  # 5 of the 20 classes: 35 of the 150 items
FIRST_OLD = [10, 4, 19, 25, 6, 27, 1, 15]  # seed 0, epoch 0


def test_old_new_batches_draw_a_fixed_share_from_the_old_classes():
    batches = OldNewBatches(LABELS, 16, OLD_CLASSES, 0.5, seed=0)
    got = batches.global_batches()
    assert len(got) == len(batches) == LABELS.size // 16
    for old, new in got:
        assert np.isin(LABELS[old], OLD_CLASSES).all() and len(old) == 8
        assert not np.isin(LABELS[new], OLD_CLASSES).any() and len(new) == 8
    # the 35 old-class items are drawn once per cycle: every one within the first 5 batches
    assert set(np.concatenate([old for old, _ in got[:5]]).tolist()) == set(
        np.flatnonzero(LABELS < 5).tolist()
    )
    assert got[0][0].tolist() == FIRST_OLD


def test_old_new_batches_keep_their_shares_on_every_worker():
    whole = OldNewBatches(LABELS, 16, OLD_CLASSES, 0.5, seed=4).global_batches()
    ranks = [list(OldNewBatches(LABELS, 16, OLD_CLASSES, 0.5, r, 2, seed=4)) for r in (0, 1)]
    for (old, new), a, b in zip(whole, *ranks, strict=True):
        assert sorted(a + b) == sorted(old.tolist() + new.tolist())
        for part in (a, b):
            assert np.isin(LABELS[part], OLD_CLASSES).sum() == 4


def test_dsimplex_trains_on_old_new_balanced_batches():
    cfg = TrainConfig(method="dsimplex", head="dsimplex", batch_size=16, old_model="old")
    assert cfg.old_batch_fraction() == 0.5 and cfg.batches() == {"batch_old_fraction": 0.5}
    sampler, loader = _build_loader(cfg, training_set(), 0, 1, OLD_CLASSES)
    assert isinstance(sampler, OldNewBatches)
    assert [int(np.isin(b[2].numpy(), OLD_CLASSES).sum()) for b in loader] == [8] * 9
    cfg = TrainConfig(method="dsimplex", batch_size=16, old_model="old", batch_old_fraction=0)
    assert isinstance(_build_loader(cfg, training_set(), 0, 1, OLD_CLASSES)[0], DistributedSampler)


def test_the_old_models_training_split_gets_a_pass_of_its_own():
    """advbct's boundary: the loop hands methods a pass over the old model's own training split
    (its manifest's split), every item once, the new head's rows as targets."""
    from types import SimpleNamespace

    import torch

    from raycompat.data import build_scenario
    from raycompat.train.loop import _old_split_pass_loader, class_targets

    scenario = build_scenario(
        "extended-data",
        num_train_classes=6,
        images_per_class=10,
        num_eval_classes=2,
        queries_per_class=1,
        gallery_per_class=2,
        num_distractor_classes=1,
        distractors_per_class=1,
        seed=3,
    ).to_dict()
    cfg = TrainConfig(method="advbct", batch_size=8, scenario=scenario, in_chans=1)
    classes = sorted(set(scenario["splits"]["new_train"]["labels"]))
    new_target, old_target = class_targets(classes, classes)
    old = SimpleNamespace(manifest={"data": {"split": "old_train"}})
    loader = _old_split_pass_loader(cfg, old, new_target, old_target, 1, torch.device("cpu"))
    labels = torch.cat([b.labels for b in loader()]).tolist()
    assert labels == scenario["splits"]["old_train"]["labels"]
    assert len(labels) < len(scenario["splits"]["new_train"]["labels"])
    batch = next(iter(loader()))
    assert batch.x_old is not None and (batch.new_targets == new_target[batch.labels]).all()
    unknown = SimpleNamespace(manifest={"data": {"split": "elsewhere"}})
    assert _old_split_pass_loader(cfg, unknown, new_target, old_target, 1, "cpu") is None
