"""The field's baselines (lwf, fd, lce, unibct, advbct, bt2, dsimplex, fct): each loss against a
direct computation on tiny hand-made tensors, written out with loops and plain formulas (one
process), and fct's query mode in the simulator. The 1-vs-2-worker equality is in
test_methods_distributed.py, the Ray Train runs in test_methods_ray.py."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from test_methods_losses import (
    BATCH_LABELS,
    D_NEW,
    D_OLD,
    IN_DIM,
    NEW_CLASSES,
    OLD_CLASSES,
    TRAIN_LABELS,
    ShardLoader,
    TinyEmbedder,
    build,
    features,
    make_batch,
    old_bundle,
    slice_batch,
)

from raycompat.config import ConfigError
from raycompat.methods import (
    MethodContext,
    TrainBatch,
    TrainingModule,
    available_methods,
    build_method,
    method_class,
    parse_method_options,
)
from raycompat.methods.advbct import grl_coefficient, tukey_max
from raycompat.models import ClassifierHead, ModelBundle

pytestmark = pytest.mark.filterwarnings("ignore:Converting a tensor with requires_grad")
FIELD = ["lwf", "fd", "lce", "unibct", "advbct", "bt2", "dsimplex", "fct"]


def cos(a, b) -> float:
    return float(a @ b) / (float(a.norm()) * float(b.norm()))


def log_softmax(values: list[float]) -> list[float]:
    top = max(values)
    total = math.log(sum(math.exp(v - top) for v in values)) + top
    return [v - total for v in values]


def build_with(method, options, train: TrainBatch, old: ModelBundle | None = None, **context):
    """A TrainingModule of the tiny stand-ins over the training set ``train``."""
    old = old if old is not None else old_bundle()
    ctx = MethodContext(
        old=old,
        new_classes=NEW_CLASSES,
        old_classes=OLD_CLASSES,
        compatible_dim=D_OLD,
        device=torch.device("cpu"),
        epoch_pass_loader=ShardLoader(train),
        **context,
    )
    torch.manual_seed(2)
    embedder = TinyEmbedder(IN_DIM, D_NEW)
    head = ClassifierHead(D_NEW, len(NEW_CLASSES), kind="cosface")
    return TrainingModule(embedder, head, build_method(method, options, ctx))


def outlier_training_set() -> TrainBatch:
    """Class 0 has six items, five close together and one pointing the other way (an outlier of
    the old model's distances); classes 1-4 two items each."""
    g = torch.Generator().manual_seed(11)
    labels = torch.tensor([0] * 6 + [1, 2, 3, 4] * 2)
    x_old = torch.randn(len(labels), IN_DIM, generator=g)
    base = 5.0 * torch.randn(IN_DIM, generator=g)
    x_old[:5] = base + 0.3 * torch.randn(5, IN_DIM, generator=g)
    x_old[5] = -base
    return TrainBatch(
        x_new=torch.randn(len(labels), IN_DIM, generator=g),
        labels=labels,
        new_targets=labels.clone(),
        x_old=x_old,
        old_targets=torch.where(labels < len(OLD_CLASSES), labels, -1),
    )


# -- lwf -----------------------------------------------------------------------------------------
def test_lwf_distils_the_old_heads_cosine_softmax():
    module = build("lwf", {"scale": 10.0, "teacher_scale": 5.0})
    batch = make_batch(BATCH_LABELS, seed=3)
    emb, old = features(module, batch)
    rows = module.method.old.head.weight
    want = 0.0
    for i in range(len(BATCH_LABELS)):
        teacher = [math.exp(v) for v in log_softmax([5.0 * cos(old[i], w) for w in rows])]
        student = log_softmax([10.0 * cos(emb[i, :D_OLD], w) for w in rows])
        want -= sum(p * q for p, q in zip(teacher, student, strict=True))
    got = module.method.compat_loss(module, batch, emb)["lwf"]
    assert float(got) == pytest.approx(want / len(BATCH_LABELS), rel=1e-5)


def test_lwf_and_fd_refuse_an_old_model_without_head():
    cfg = SimpleNamespace(old_model="/models/imported", method_options={})
    manifest = {"modules": {"embedder": {}}}
    with pytest.raises(ConfigError, match="needs the old model's classifier head"):
        method_class("lwf").check_config(cfg, manifest)
    with pytest.raises(ConfigError, match="use indicator=new"):
        method_class("fd").check_config(cfg, manifest)
    new_indicator = SimpleNamespace(old_model=cfg.old_model, method_options={"indicator": "new"})
    method_class("fd").check_config(new_indicator, manifest)  # the released code's form: allowed
    headless = ModelBundle({"embedder": old_bundle().embedder}, {"classes": []}).freeze()
    with pytest.raises(ConfigError, match="lwf"):
        build_with("lwf", {}, make_batch(TRAIN_LABELS, seed=7), old=headless)


# -- fd ------------------------------------------------------------------------------------------
def _fd_direct(emb, old, labels, correct, alpha, beta) -> float:
    total = 0.0
    for i in range(len(labels)):
        d = sum((float(emb[i, k]) - float(old[i, k])) ** 2 for k in range(D_OLD)) / D_OLD
        total += (alpha + beta * (1.0 if correct[i] else 0.0)) * d
    return total / len(labels)


def test_fd_weights_samples_the_old_model_classifies_correctly():
    module = build("fd", {"alpha": 0.5, "beta": 2.0})
    batch = make_batch(BATCH_LABELS, seed=3)
    emb, old = features(module, batch)
    head = module.method.old.head
    with torch.no_grad():  # old rows at the batch's class means: most known samples are right
        head.weight.copy_(torch.stack([old[batch.labels == c].mean(dim=0) for c in OLD_CLASSES]))
    correct = []
    for i, y in enumerate(BATCH_LABELS):
        scores = [cos(old[i], w) for w in head.weight]
        correct.append(y in OLD_CLASSES and scores.index(max(scores)) == y)
    assert any(correct) and not all(correct)
    got = module.method.compat_loss(module, batch, emb)["fd"]
    assert float(got) == pytest.approx(_fd_direct(emb, old, BATCH_LABELS, correct, 0.5, 2.0))


def test_fd_new_indicator_uses_the_new_heads_prediction():
    module = build("fd", {"alpha": 1.0, "beta": 5.0, "indicator": "new"})
    batch = make_batch(BATCH_LABELS, seed=3)
    emb, old = features(module, batch)
    with torch.no_grad():
        module.head.weight.copy_(
            torch.stack([emb[batch.labels == c].mean(dim=0) for c in NEW_CLASSES])
        )
    correct = []
    for i, y in enumerate(BATCH_LABELS):
        scores = [cos(emb[i], w) for w in module.head.weight]
        correct.append(scores.index(max(scores)) == y)
    assert any(correct[i] for i, y in enumerate(BATCH_LABELS) if y not in OLD_CLASSES)
    got = module.method.compat_loss(module, batch, emb)["fd"]
    assert float(got) == pytest.approx(_fd_direct(emb, old, BATCH_LABELS, correct, 1.0, 5.0))


def test_fd_normalized_features_compare_unit_vectors():
    module = build("fd", {"alpha": 1.0, "beta": 5.0, "indicator": "new", "features": "normalized"})
    batch = make_batch(BATCH_LABELS, seed=3)
    emb, old = features(module, batch)
    correct = []
    for i, y in enumerate(BATCH_LABELS):
        scores = [cos(emb[i], w) for w in module.head.weight]
        correct.append(scores.index(max(scores)) == y)
    unit_new = emb[:, :D_OLD] / emb[:, :D_OLD].norm(dim=1, keepdim=True)
    unit_old = old / old.norm(dim=1, keepdim=True)
    # summed over the dims, not averaged: 2 - 2 cos per sample
    expected = D_OLD * _fd_direct(unit_new, unit_old, BATCH_LABELS, correct, 1.0, 5.0)
    got = module.method.compat_loss(module, batch, emb)["fd"]
    assert float(got) == pytest.approx(expected)
    raw = module.method.options.__class__(indicator="new")
    assert raw.features == "raw"  # the released code's form stays the default


# -- lce -----------------------------------------------------------------------------------------
def _old_space(module, train):
    with torch.no_grad():
        return F.normalize(module.method.old.embedder(train.x_old), dim=1)


@pytest.mark.parametrize("centre_classes", ["old", "all"])
def test_lce_alignment_and_cosine_boundary_match_direct_computation(centre_classes):
    module = build("lce", {"lambda_align": 10.0, "centre_classes": centre_classes})
    module.method.on_epoch_start(0, module)
    train = make_batch(TRAIN_LABELS, seed=7)
    old_train = _old_space(module, train)
    classes = OLD_CLASSES if centre_classes == "old" else NEW_CLASSES
    centres, bounds = {}, {}
    for c in classes:
        items = [old_train[i] for i, y in enumerate(TRAIN_LABELS) if y == c]
        mean = sum(items) / len(items)
        centres[c] = mean / mean.norm()
        bounds[c] = min(float(f @ centres[c]) for f in items)
        assert float(module.method.boundaries[c]) == pytest.approx(bounds[c], abs=1e-6)
    batch = make_batch(BATCH_LABELS, seed=3)
    emb, _ = features(module, batch)
    terms = module.method.compat_loss(module, batch, emb)
    align = 0.0
    for c in classes:
        row = module.head.weight[c, :D_OLD]
        row = row / row.norm()
        align += sum((float(row[d]) - float(centres[c][d])) ** 2 for d in range(D_OLD))
    assert float(terms["align"]) == pytest.approx(10.0 * align / (len(classes) * D_OLD), rel=1e-5)
    hinges = [
        max(bounds[y] - cos(emb[i, :D_OLD], centres[y]), 0.0)
        for i, y in enumerate(BATCH_LABELS)
        if y in classes
    ]
    assert float(terms["bound"]) == pytest.approx(sum(hinges) / len(hinges), rel=1e-5)
    assert sum(hinges) > 0


# -- unibct --------------------------------------------------------------------------------------
def _refined(old_items, new_items, tau, lam, by_row=True):
    """mean_i [(1 - lam) (I - lam A)^-1 O]_i with A written out entry by entry."""
    n = len(old_items)
    a = torch.zeros(n, n, dtype=torch.float64)
    for i in range(n):
        for j in range(n):
            if i != j:
                a[i, j] = math.exp(float(new_items[i] @ new_items[j]) / tau)
    a = a / (a.sum(dim=1, keepdim=True) if by_row else a.sum(dim=0, keepdim=True))
    propagate = (1 - lam) * torch.linalg.inv(torch.eye(n, dtype=torch.float64) - lam * a)
    refined = propagate @ torch.stack(old_items).double()
    return refined.mean(dim=0).float()


def test_unibct_refined_prototypes_and_loss_match_direct_computation():
    options = {"scale": 10.0, "tau": 0.5, "propagation": 0.5, "margin": 0.0, "refine_from": 0.0}
    module = build("unibct", options)
    module.method.on_epoch_start(0, module)
    train = make_batch(TRAIN_LABELS, seed=7)
    old_train = _old_space(module, train)
    with torch.no_grad():
        new_train = F.normalize(module.embedder(train.x_new), dim=1)
    protos = []
    for c in NEW_CLASSES:  # every class, the ones the old model never saw included
        index = [i for i, y in enumerate(TRAIN_LABELS) if y == c]
        protos.append(_refined([old_train[i] for i in index], new_train[index], 0.5, 0.5))
        plain = sum(old_train[i] for i in index) / len(index)
        # two items: A = [[0, 1], [1, 0]] either way; from three on the refinement moves the mean
        assert torch.allclose(protos[-1], plain, atol=1e-4) == (len(index) < 3)
    protos = torch.stack(protos)
    assert torch.allclose(module.method.prototypes, protos, atol=1e-6)
    batch = make_batch(BATCH_LABELS, seed=3)
    emb, _ = features(module, batch)
    want = 0.0
    for i, y in enumerate(BATCH_LABELS):
        want -= log_softmax([10.0 * cos(emb[i, :D_OLD], p) for p in protos])[y]
    got = module.method.compat_loss(module, batch, emb)["unibct"]
    assert float(got) == pytest.approx(want / len(BATCH_LABELS), rel=1e-5)


def test_unibct_column_softmax_of_the_released_code_gives_the_plain_class_mean():
    """MixBCT's softmax over dim 0 makes A column-stochastic: the refinement cancels out."""
    module = build("unibct", {"affinity": "column", "tau": 0.5, "refine_from": 0.0})
    module.method.on_epoch_start(0, module)
    train = make_batch(TRAIN_LABELS, seed=7)
    old_train = _old_space(module, train)
    with torch.no_grad():
        new_train = F.normalize(module.embedder(train.x_new), dim=1)
    for c in NEW_CLASSES:
        index = [i for i, y in enumerate(TRAIN_LABELS) if y == c]
        plain = sum(old_train[i] for i in index) / len(index)
        direct = _refined([old_train[i] for i in index], new_train[index], 0.5, 0.9, False)
        assert torch.allclose(direct, plain, atol=1e-6)
        assert torch.allclose(module.method.prototypes[c], plain, atol=1e-6)


def test_unibct_schedule_and_per_class_cap():
    train = outlier_training_set()  # class 0: six items
    opts = {"start_epoch": 1, "refine_every": 2, "max_per_class": 4}
    module = build_with("unibct", opts, train)
    method, batch = module.method, make_batch(BATCH_LABELS, seed=3)
    method.on_epoch_start(0, module)  # before start_epoch: no compatibility term, no pass
    emb, _ = features(module, batch)
    assert float(method.compat_loss(module, batch, emb)["unibct"]) == 0.0
    assert int(method.refined_at) == -1 and float(method.prototypes.abs().sum()) == 0.0
    method.on_epoch_start(1, module)
    first = method.prototypes.clone()
    assert int(method.refined_at) == 1
    with torch.no_grad():
        module.embedder.fc.weight.add_(0.5)
    method.on_epoch_start(2, module)  # not a refinement epoch: prototypes kept
    assert torch.equal(method.prototypes, first) and int(method.refined_at) == 1
    method.on_epoch_start(3, module)  # refined with the changed phi_n
    assert int(method.refined_at) == 3 and not torch.allclose(method.prototypes[0], first[0])
    # the cap keeps 4 of class 0's 6 items, picked by a generator seeded with the row (0)
    pick = sorted(torch.randperm(6, generator=torch.Generator().manual_seed(0))[:4].tolist())
    old_train = _old_space(module, train)
    with torch.no_grad():
        new_train = F.normalize(module.embedder(train.x_new), dim=1)
    want = _refined([old_train[i] for i in pick], new_train[pick], 0.05, 0.9)
    assert torch.allclose(method.prototypes[0], want, atol=1e-6)
    every = _refined([old_train[i] for i in range(6)], new_train[:6], 0.05, 0.9)
    assert not torch.allclose(method.prototypes[0], every, atol=1e-4)


def test_unibct_refines_halfway_on_the_trained_model_plain_means_before():
    """Released setup: the old class means until epoch ceil(0.5 E), then refinement with the
    current phi_n; the premise run refined at epoch 0 on the untrained model."""
    train = make_batch(TRAIN_LABELS, seed=7)
    module = build_with("unibct", {"tau": 0.5, "refine_every": 10}, train, epochs=9)
    method = module.method
    assert method.first_refinement == 5
    old_train = _old_space(module, train)
    plain = torch.stack(
        [
            sum(old_train[i] for i, y in enumerate(TRAIN_LABELS) if y == c) / TRAIN_LABELS.count(c)
            for c in NEW_CLASSES
        ]
    )
    for epoch in range(5):
        method.on_epoch_start(epoch, module)
        assert torch.allclose(method.prototypes, plain, atol=1e-6), epoch
        assert int(method.refined_at) == -2 and method._active
    with torch.no_grad():
        module.embedder.fc.weight.add_(0.5)  # the model has trained
    method.on_epoch_start(5, module)
    assert int(method.refined_at) == 5
    with torch.no_grad():
        new_train = F.normalize(module.embedder(train.x_new), dim=1)
    index = [i for i, y in enumerate(TRAIN_LABELS) if y == 0]
    want = _refined([old_train[i] for i in index], new_train[index], 0.5, 0.9)
    assert torch.allclose(method.prototypes[0], want, atol=1e-6)
    assert not torch.allclose(method.prototypes[0], plain[0], atol=1e-4)


def test_unibct_loss_is_arcface_on_the_prototypes_as_released():
    """s = 30, m = 0.3 by default: ``s cos(theta + m)`` on the target prototype."""
    module = build("unibct", {})
    module.method.on_epoch_start(0, module)
    protos = module.method.prototypes
    batch = make_batch(BATCH_LABELS, seed=3)
    emb, _ = features(module, batch)
    want = 0.0
    for i, y in enumerate(BATCH_LABELS):
        logits = [cos(emb[i, :D_OLD], p) for p in protos]
        logits[y] = math.cos(math.acos(logits[y]) + 0.3)
        want -= log_softmax([30.0 * v for v in logits])[y]
    got = module.method.compat_loss(module, batch, emb)["unibct"]
    assert float(got) == pytest.approx(want / len(BATCH_LABELS), rel=1e-5)


# -- advbct --------------------------------------------------------------------------------------
def test_tukey_max_drops_outliers_like_the_released_code():
    values = torch.tensor([0.3, 5.0, 0.1, 0.4, 0.2, 0.7, 0.5, 9.0], dtype=torch.float64)
    rows = torch.tensor([0, 0, 0, 0, 0, 1, 1, -1])
    r_max, kept = tukey_max(values, rows, 3)
    # row 0 sorted [0.1 .. 0.4, 5.0]: q1 = s[1] = 0.2, q3 = s[3] = 0.4, upper fence 0.7
    assert r_max.tolist() == [0.4, 0.7, 0.0] and kept.tolist() == [4, 2, 0]


def test_gradient_reversal_schedule():
    assert grl_coefficient(0.0) == 0.0
    assert grl_coefficient(0.5) == pytest.approx(2 / (1 + math.exp(-5)) - 1)
    assert grl_coefficient(1.0) == pytest.approx(0.99991, abs=1e-5)


def _radius_direct(items) -> tuple[torch.Tensor, float, int]:
    """Centre, r_max and the number of distances kept, as the released ``gen_class_meta``."""
    centre = sum(items) / len(items)
    radius = sorted(float((f - centre).norm()) for f in items)
    kept = radius
    if len(radius) >= 4:
        q1, q3 = radius[int(len(radius) / 4)], radius[int(3 * len(radius) / 4)]
        iqr = q3 - q1
        kept = [r for r in radius if q1 - 1.5 * iqr <= r <= q3 + 1.5 * iqr]
    return centre, max(kept), len(kept)


def test_advbct_boundary_and_adversarial_terms_match_direct_computation():
    """Over the new training set, one normalised discriminator pass (the premise run's setup)."""
    train = outlier_training_set()
    options = {"boundary_split": "new", "discriminator": "joint"}
    module = build_with("advbct", options, train, epochs=4, steps_per_epoch=3)
    method = module.method
    method.on_epoch_start(2, module)
    old_train = _old_space(module, train)
    boundary = {}
    for c in OLD_CLASSES:
        items = [old_train[i] for i in range(len(train.labels)) if int(train.labels[i]) == c]
        centre, r_max, kept = _radius_direct(items)
        assert float(method.max_radius[c]) == pytest.approx(r_max, abs=1e-6)
        assert torch.allclose(method.centres[c], centre, atol=1e-6)
        v = float(method.elastic[c])
        sigmoid = 1 / (1 + math.exp(-v))
        sign = 1.0 if r_max < 0.5 else -1.0
        boundary[c] = (centre, r_max + sign * sigmoid * abs(r_max - 0.5), kept > 1)
    outlier = float((old_train[5] - boundary[0][0]).norm())
    assert float(method.max_radius[0]) < outlier  # the outlier's distance was dropped
    assert not bool(method.has_boundary[3]) and bool(method.has_boundary[0])
    batch = make_batch(BATCH_LABELS, seed=3)
    emb = module.embedder(batch.x_new)
    old = method.old_features(batch.x_old)
    terms = method.compat_loss(module, batch, emb)
    hinges = []
    for i, y in enumerate(BATCH_LABELS):
        if y in boundary and boundary[y][2]:
            n = emb[i, :D_OLD] / emb[i, :D_OLD].norm()
            h = float((n - boundary[y][0]).norm()) - boundary[y][1]
            if h > 0:
                hinges.append(h)
    assert hinges and float(terms["bound"]) == pytest.approx(sum(hinges) / len(hinges), rel=1e-5)
    # L_adv: new features labelled 0, old 1, through one discriminator batch; w_e = (4-2+1)/4
    inputs = torch.cat([F.normalize(emb[:, :D_OLD], dim=1), F.normalize(old, dim=1)])
    logits = method.discriminator(inputs)
    b = len(BATCH_LABELS)
    adv = -sum(log_softmax(logits[i].tolist())[0] for i in range(b)) / b
    adv -= sum(log_softmax(logits[b + i].tolist())[1] for i in range(b)) / b
    assert float(terms["adv"]) == pytest.approx(0.75 * adv, rel=1e-5)
    # the progress advanced by one step: p = (2 * 3 + 1) / (4 * 3)
    alpha, weight = method.schedule()
    assert alpha == pytest.approx(grl_coefficient(7 / 12)) and weight == 0.75


def test_advbct_reverses_the_gradient_to_phi_n_only():
    train = outlier_training_set()
    alpha = 0.3
    options = {"grl_alpha": alpha, "adv_decay": False, "boundary_split": "new"}
    module = build_with("advbct", dict(options, discriminator="joint"), train)
    method = module.method
    method.on_epoch_start(0, module)
    method.discriminator.eval()  # running statistics: the two passes below see the same function
    batch = make_batch(BATCH_LABELS, seed=3)
    emb = module.embedder(batch.x_new).detach().requires_grad_(True)
    adv = method.compat_loss(module, batch, emb)["adv"]
    grad_emb, grad_disc = torch.autograd.grad(adv, [emb, method.discriminator[0].weight])
    # the same loss without the reversal
    plain_emb = emb.detach().clone().requires_grad_(True)
    old = F.normalize(method.old_features(batch.x_old), dim=1)
    logits = method.discriminator(torch.cat([F.normalize(plain_emb[:, :D_OLD], dim=1), old]))
    b = len(BATCH_LABELS)
    plain = F.cross_entropy(logits[:b], torch.zeros(b, dtype=torch.long)) + F.cross_entropy(
        logits[b:], torch.ones(b, dtype=torch.long)
    )
    plain_emb_grad, plain_disc = torch.autograd.grad(
        plain, [plain_emb, method.discriminator[0].weight]
    )
    assert float(plain_emb_grad.abs().sum()) > 0
    assert torch.allclose(grad_emb, -alpha * plain_emb_grad, atol=1e-7)
    assert torch.allclose(grad_disc, plain_disc, atol=1e-7)


def test_advbct_trains_discriminator_and_radius_but_exports_neither():
    module = build("advbct", {"boundary_split": "new"})
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    assert "method.elastic" in trainable and "method.discriminator.0.weight" in trainable
    assert module.method.exports() == {}
    assert module.method.elastic.shape == (len(NEW_CLASSES),)
    module.method.on_epoch_start(0, module)
    terms = module(make_batch(BATCH_LABELS, seed=3))
    assert "elastic_radius" in terms and float(terms["elastic_radius"]) > 0
    total = terms["cls"] + terms["bound"] + terms["adv"]
    assert float(terms["loss"]) == pytest.approx(float(total), rel=1e-6)


def test_advbct_boundary_comes_from_the_old_models_training_split():
    """Released metadata: centres and largest radii over the old model's own training items
    (here the first item of every class and class 0's close ones), not the new training set."""
    train = outlier_training_set()
    old_items = torch.tensor([0, 1, 2, 3, 4, 6, 7, 8, 9])  # class 0 without its outlier (5)
    old_split = slice_batch(train, old_items)
    module = build_with("advbct", {}, train, epochs=4, old_split_pass_loader=ShardLoader(old_split))
    method = module.method
    assert method.options.threshold == 0.5  # the released default
    method.on_epoch_start(0, module)
    old_space = _old_space(module, old_split)
    labels = old_split.labels.tolist()
    for c in OLD_CLASSES:
        centre, r_max, kept = _radius_direct([old_space[i] for i, y in enumerate(labels) if y == c])
        assert torch.allclose(method.centres[c], centre, atol=1e-6)
        assert float(method.max_radius[c]) == pytest.approx(r_max, abs=1e-6)
        assert bool(method.has_boundary[c]) == (kept > 1)
    everything = build_with("advbct", {"boundary_split": "new"}, train, epochs=4)
    everything.method.on_epoch_start(0, everything)
    assert not torch.allclose(method.centres[0], everything.method.centres[0], atol=1e-4)
    with pytest.raises(RuntimeError, match="old model's training split"):
        build_with("advbct", {}, train).method.on_epoch_start(0, None)


def test_advbct_config_needs_the_old_split_in_the_scenario():
    check = method_class("advbct").check_config
    scenario = {"splits": {"old_train": {}, "new_train": {}}, "aliases": {}}
    old = {"data": {"split": "old_train"}}
    cfg = SimpleNamespace(method_options={}, scenario=scenario)
    check(cfg, old)  # found: fine
    with pytest.raises(ConfigError, match="boundary_split=old needs the old model's training"):
        check(cfg, {"data": {"split": "train_1"}})
    check(SimpleNamespace(method_options={"boundary_split": "new"}, scenario=scenario), {})


def test_advbct_discriminator_runs_two_raw_passes_as_released():
    train = outlier_training_set()
    options = {"boundary_split": "new", "adv_decay": False}
    module = build_with("advbct", options, train, epochs=2, steps_per_epoch=1)
    method = module.method
    method.on_epoch_start(0, module)
    module.train()
    batch = make_batch(BATCH_LABELS, seed=3)
    emb = module.embedder(batch.x_new)
    terms = method.compat_loss(module, batch, emb)
    b = len(BATCH_LABELS)
    # each domain its own pass (its own BatchNorm statistics), raw features
    new_logits = method.discriminator(emb[:, :D_OLD])
    old_logits = method.discriminator(method.old_features(batch.x_old))
    adv = -sum(log_softmax(new_logits[i].tolist())[0] for i in range(b)) / b
    adv -= sum(log_softmax(old_logits[i].tolist())[1] for i in range(b)) / b
    assert float(terms["adv"]) == pytest.approx(adv, rel=1e-5)
    joint = build_with("advbct", dict(options, discriminator="joint"), train, epochs=2)
    joint.method.discriminator.load_state_dict(method.discriminator.state_dict())
    joint.method.on_epoch_start(0, joint)
    other = joint.method.compat_loss(joint, batch, joint.embedder(batch.x_new))["adv"]
    assert float(other) != pytest.approx(adv, rel=1e-3)


# -- bt2 -----------------------------------------------------------------------------------------
def _basis_direct(basis, z):
    """BT^2's wiring written out with explicit matrices: (v, b, e)."""
    n_dim, o_dim, a_dim, c = basis.new_dim, basis.old_dim, basis.extra_dim, basis.scale
    u = torch.relu(z) @ basis.fc3.weight.t() + basis.fc3.bias
    u = u / u.norm(dim=1, keepdim=True)
    v = z[:, :n_dim] / z[:, :n_dim].norm(dim=1, keepdim=True)
    head = u[:, :a_dim] / u[:, :a_dim].norm(dim=1, keepdim=True)
    m = torch.cat([head, (c * v) @ basis.q1.weight.t()], dim=1)
    return v, m[:, :o_dim] @ basis.q2.weight.t(), m[:, o_dim:]


def test_bt2_basis_is_orthogonal_and_keeps_a_compatible_prefix():
    from raycompat.models import BasisTransform

    torch.manual_seed(0)
    basis = BasisTransform(new_dim=5, old_dim=4, extra_dim=2, scale=2.0)
    for q in (basis.q1.weight, basis.q2.weight):
        assert torch.allclose(q @ q.t(), torch.eye(q.shape[0]), atol=1e-5)
    z = torch.randn(3, 9)
    with torch.no_grad():
        parts = basis.parts(z)
        v, b, e = _basis_direct(basis, z)
    assert parts["out"].shape == (3, 5 + 2) and basis.out_dim == 7
    assert torch.allclose(parts["v"], v, atol=1e-6)
    assert torch.allclose(parts["out"][:, :4], b, atol=1e-6)  # the first D_o dims are b
    assert torch.allclose(parts["out"][:, 4:], e, atol=1e-6)
    # Q1, Q2 orthogonal: |concat(b, e)|^2 = |normalize(u[:A])|^2 + C^2 |v|^2 = 1 + 4
    assert torch.allclose(parts["out"].norm(dim=1), torch.full((3,), 5**0.5), atol=1e-5)
    with pytest.raises(ValueError, match=r"D_n \+ A = 1 \+ 2 must be >= D_o = 4"):
        BasisTransform(new_dim=1, old_dim=4, extra_dim=2)
    with pytest.raises(ValueError, match=r"A = 5 must be in \[1, D_o = 4\]"):
        BasisTransform(new_dim=5, old_dim=4, extra_dim=5)


def _cosface_log_softmax(emb, rows, target, s=32.0, m=0.4) -> float:
    logits = [s * (cos(emb, w) - (m if k == target else 0.0)) for k, w in enumerate(rows)]
    return log_softmax(logits)[target]


def test_bt2_loss_matches_direct_computation():
    module = build("bt2", {"extra_dim": 3, "lambda_compat": 0.5})
    independent = ModelBundle({"embedder": TinyEmbedder(IN_DIM, D_NEW)}, {}).freeze()
    module.method.__dict__["independent"] = independent  # what independent_model=PATH loads
    method = module.method
    assert module.embedder.fc.out_features == D_NEW + D_OLD  # the backbone emits z
    method.on_epoch_start(0, module)
    train = make_batch(TRAIN_LABELS, seed=7)
    with torch.no_grad():
        old_train = method.old.embedder(train.x_old)
    unit = old_train / old_train.norm(dim=1, keepdim=True)
    pseudo = torch.stack([unit[train.labels == c].mean(dim=0) for c in NEW_CLASSES])
    # means of the normalised old features, every class (the released code's ResNet normalises)
    assert torch.allclose(method.pseudo_classifier, pseudo, atol=1e-6)
    raw = build("bt2", {"extra_dim": 3, "pseudo_features": "raw"}).method
    raw.on_epoch_start(0, None)
    raw_means = torch.stack([old_train[train.labels == c].mean(dim=0) for c in NEW_CLASSES])
    assert torch.allclose(raw.pseudo_classifier, raw_means, atol=1e-6)
    batch = make_batch(BATCH_LABELS, seed=3)
    terms = module(batch)
    with torch.no_grad():
        v, b, _ = _basis_direct(method.basis, module.embedder(batch.x_new))
        old = method.old.embedder(batch.x_old)
        ind = independent.embedder(batch.x_new)
    n = len(BATCH_LABELS)
    cls = -sum(
        _cosface_log_softmax(v[i], module.head.weight, y) for i, y in enumerate(BATCH_LABELS)
    )
    b_hat = [b[i] / b[i].norm() for i in range(n)]
    pseudo_ce = -sum(
        log_softmax([float(b_hat[i] @ p) for p in pseudo])[y] for i, y in enumerate(BATCH_LABELS)
    )
    old_cos = 1.0 - sum(cos(old[i], b[i]) for i in range(n)) / n
    new_cos = 1.0 - sum(cos(ind[i], v[i]) for i in range(n)) / n
    assert float(terms["cls"]) == pytest.approx(cls / n, rel=1e-5)
    assert float(terms["pseudo_cls"]) == pytest.approx(10.0 * pseudo_ce / n, rel=1e-5)
    assert float(terms["old_cosine"]) == pytest.approx(5.0 * old_cos, rel=1e-5)
    assert float(terms["new_cosine"]) == pytest.approx(1.0 * new_cos, rel=1e-5)
    total = cls / n + 0.5 * (10.0 * pseudo_ce / n + 5.0 * old_cos + new_cos)
    assert float(terms["loss"]) == pytest.approx(total, rel=1e-5)
    method.__dict__["independent"] = None  # without phi'_n: lambda_1 = 0, no such term
    assert "new_cosine" not in module(batch)


def test_bt2_bundle_gives_the_deployed_embedding(tmp_path):
    from raycompat.models import BasisEmbedder, BasisTransform, Embedder

    torch.manual_seed(0)
    base = Embedder("test_resnet", 6 + 4, in_chans=1)
    deployed = BasisEmbedder(base, BasisTransform(new_dim=6, old_dim=4, extra_dim=2)).eval()
    path = ModelBundle({"embedder": deployed}, {"compatible_dim": 4}).save(str(tmp_path / "b"))
    loaded = ModelBundle.load(path)
    assert loaded.manifest["modules"]["embedder"]["type"] == "bt2" and loaded.embed_dim == 8
    x = torch.randn(2, 1, 32, 32)
    with torch.no_grad():
        want = deployed.basis(base(x))
        assert torch.allclose(loaded.embedder(x), want, atol=1e-5)


def test_bt2_config_checks_dims_and_the_independent_model(tmp_path):
    check = method_class("bt2").check_config
    cfg = SimpleNamespace(embed_dim=8, old_model="/models/old", method_options={"extra_dim": 4})
    with pytest.warns(UserWarning, match="lambda_1 = 0"):
        check(cfg, {"embed_dim": 6})
    cfg.method_options = {}  # A = 32 by default
    with pytest.raises(ConfigError, match=r"A = 32 must be in \[1, D_o = 6\].*'/models/old'"):
        check(cfg, {"embed_dim": 6})
    cfg.method_options = {"extra_dim": 4, "independent_model": "models/new"}
    with pytest.raises(ConfigError, match="must be an absolute path or a URI"):
        check(cfg, {"embed_dim": 6})
    other = ModelBundle({"head": ClassifierHead(4, 2)}, {"embed_dim": 12}).save(str(tmp_path / "n"))
    cfg.method_options = {"extra_dim": 4, "independent_model": other}
    with pytest.raises(ConfigError, match="embeds 12 dims, but v has embed_dim 8"):
        check(cfg, {"embed_dim": 6})


# -- dsimplex ------------------------------------------------------------------------------------
def test_simplex_vertices_construction_and_row_order():
    from raycompat.models.heads import continued_vertices, simplex_vertices

    k = 5
    rows = simplex_vertices(k)
    # by hand: I_4 with a row of (1 - sqrt(5)) / 4 appended, centred, row-normalised
    hand = [[1.0 if j == i else 0.0 for j in range(k - 1)] for i in range(k - 1)]
    hand.append([(1.0 - math.sqrt(k)) / (k - 1)] * (k - 1))
    means = [sum(r[j] for r in hand) / k for j in range(k - 1)]
    hand = [[r[j] - means[j] for j in range(k - 1)] for r in hand]
    hand = torch.tensor([[x / math.sqrt(sum(y * y for y in r)) for x in r] for r in hand])
    assert torch.allclose(rows, hand, atol=1e-6)
    gram = rows @ rows.t()
    assert torch.allclose(gram.diagonal(), torch.ones(k), atol=1e-6)  # unit rows
    off = gram[~torch.eye(k, dtype=torch.bool)]
    assert torch.allclose(off, torch.full_like(off, -1.0 / (k - 1)), atol=1e-6)
    # class label y on row K-1-y; labels continue across generations in order of arrival
    head = ClassifierHead(k - 1, 3, kind="dsimplex", vertices=[2, 0, 1])
    assert torch.equal(head.weight, rows[[2, 4, 3]])
    assert not list(head.parameters())  # fixed: nothing trains
    assert continued_vertices([1, 3, 5, 7], [3, 5, 9], [0, 1, 2]) == [3, 0, 1, 4]
    assert continued_vertices([4, 2]) == [0, 1]
    with pytest.raises(ValueError, match="K = 5 simplex vertices, but a class needs vertex"):
        ClassifierHead(k - 1, 2, kind="dsimplex", vertices=[0, 5])


def test_dsimplex_heads_of_three_generations_share_every_class_vertex():
    """A sequential chain (nested class sets in arrival order): each generation's head keeps the
    vertex of every class its predecessor knows, and the chain passes the config checks."""
    from raycompat.models.heads import continued_vertices

    generations = [[2, 7], [2, 5, 7, 9], [1, 2, 5, 7, 8, 9]]  # sorted class ids per generation
    heads, known = [], ([], None)
    for classes in generations:
        vertices = continued_vertices(classes, *known)
        heads.append(ClassifierHead(6, len(classes), kind="dsimplex", vertices=vertices))
        known = (classes, vertices)
    assert [h.vertices for h in heads] == [[0, 1], [0, 2, 1, 3], [4, 0, 2, 1, 5, 3]]
    for c in (2, 7):  # phi_1's classes: one vertex in all three heads
        rows = [h.weight[g.index(c)] for h, g in zip(heads, generations, strict=True)]
        assert torch.equal(rows[0], rows[1]) and torch.equal(rows[1], rows[2])
    check = method_class("dsimplex").check_config
    for j in (1, 2):  # generation j + 1 against generation j's bundle manifest
        old = {"modules": {"head": heads[j - 1].spec}, "classes": generations[j - 1]}
        scenario = {"splits": {f"train_{j + 1}": {"labels": generations[j]}}}
        cfg = SimpleNamespace(
            head="dsimplex",
            embed_dim=6,
            old_model="/m/gen",
            split=f"train_{j + 1}",
            scenario=scenario,
            method_options={"classes": 7},
        )
        check(cfg, old)


def _dsimplex(options):
    return build("dsimplex", dict({"classes": D_OLD + 1}, **options), D_OLD, "dsimplex")


def spec_simplex(k: int) -> torch.Tensor:
    """The fixed head of CoReS as FIELD_METHODS writes it: ``I_(K-1)`` with a row of
    ``(1 - sqrt(K)) / (K - 1)`` appended, the column mean subtracted, rows normalised."""
    rows = torch.cat([torch.eye(k - 1), torch.full((1, k - 1), (1 - math.sqrt(k)) / (k - 1))])
    rows = rows - rows.mean(dim=0, keepdim=True)
    return rows / rows.norm(dim=1, keepdim=True)


def test_dsimplex_cores_is_cross_entropy_over_every_vertex():
    """CoReS's CE runs over all K vertices of ``Linear(K-1, K)``, the vertices kept for classes
    still to come included (negatives): class y on row K-1-y. Here 5 classes of K = 7, so a
    softmax over the 5 rows of this generation's classes alone gives another loss."""
    module = _dsimplex({})
    k = D_OLD + 1
    assert module.head.num_classes == len(set(BATCH_LABELS)) < k
    batch = make_batch(BATCH_LABELS, seed=3)
    terms = module(batch)
    emb = module.embedder(batch.x_new)
    every = spec_simplex(k)
    want = sum(
        -log_softmax([float(emb[i] @ w) for w in every])[k - 1 - y]
        for i, y in enumerate(BATCH_LABELS)
    ) / len(BATCH_LABELS)
    assert set(terms) == {"cls", "loss"}
    assert float(terms["loss"]) == pytest.approx(want, rel=1e-5)
    # the softmax over this generation's rows only (what the head computed before) differs
    own = sum(
        -log_softmax([float(emb[i] @ every[k - 1 - c]) for c in range(5)])[y]
        for i, y in enumerate(BATCH_LABELS)
    ) / len(BATCH_LABELS)
    assert abs(own - want) > 1e-3
    # a bundle keeps only the rows: the free vertices are derived, not saved
    assert "future_weight" not in module.head.state_dict()
    assert torch.allclose(module.head.weight, every[[k - 1 - c for c in range(5)]], atol=1e-6)


def test_dsimplex_cross_entropy_of_six_classes_on_eight_vertices_in_cores_and_hoc(tmp_path):
    """6 classes of K = 8: the CE (CoReS's loss and HOC's ``lambda * CE`` term) is the softmax of
    ``Linear(K-1, K)`` over the specification's 8 vertices, class y on row K-1-y, the two free
    vertices as negatives; a saved and reloaded head gives the same training logits."""
    k, classes, labels = 8, list(range(6)), [0, 5, 1, 3, 3, 4, 2, 5, 1, 0]
    torch.manual_seed(1)
    old = ModelBundle(
        {
            "embedder": TinyEmbedder(IN_DIM, k - 1),
            "head": ClassifierHead(k - 1, 3, kind="dsimplex"),
        },
        {"classes": [0, 1, 2]},
    ).freeze()
    batch = make_batch(labels, seed=5)

    def module(options):
        ctx = MethodContext(old, classes, [0, 1, 2], k - 1, torch.device("cpu"))
        torch.manual_seed(2)
        head = ClassifierHead(k - 1, len(classes), kind="dsimplex")
        method = build_method("dsimplex", dict(options, classes=k), ctx)
        return TrainingModule(TinyEmbedder(IN_DIM, k - 1), head, method)

    cores = module({})
    emb = cores.embedder(batch.x_new).double()
    logits = emb @ spec_simplex(k).double().t()  # all K rows
    want = float(F.cross_entropy(logits, k - 1 - batch.labels))
    assert float(cores(batch)["loss"]) == pytest.approx(want, abs=1e-6)
    own = float(F.cross_entropy(logits[:, [k - 1 - c for c in classes]], batch.labels))
    assert abs(own - want) > 0.1  # the softmax over the 6 known rows only
    hoc = module({"loss": "hoc", "hoc_lambda": 0.25})
    terms = hoc(batch)
    assert float(terms["cls"]) == pytest.approx(want, abs=1e-6)
    total = 0.25 * want + 0.75 * float(terms["hoc"])
    assert float(terms["loss"]) == pytest.approx(total, abs=1e-6)
    saved = ModelBundle({"head": cores.head}, {"classes": classes}).save(str(tmp_path / "gen"))
    loaded = ModelBundle.load(saved)
    assert torch.equal(loaded.head(emb.float()), cores.head(emb.float()))


def test_dsimplex_hoc_zeroes_same_class_terms_like_the_released_code():
    module = _dsimplex({"loss": "hoc", "mu": 3.0, "hoc_lambda": 0.25})
    batch = make_batch(BATCH_LABELS, seed=3)
    terms = module(batch)
    emb = module.embedder(batch.x_new)
    with torch.no_grad():
        old = module.method.old.embedder(batch.x_old)
    n, zeroed, removed = len(BATCH_LABELS), 0.0, 0.0
    for i, y in enumerate(BATCH_LABELS):
        logits = [3.0 * cos(old[i], emb[j]) for j in range(n)]
        # same-class entries (j = i included) become exp(0) = 1 terms, not dropped ones
        kept = [logits[j] if BATCH_LABELS[j] != y else 0.0 for j in range(n)]
        others = [logits[j] for j in range(n) if BATCH_LABELS[j] != y]
        zeroed += math.log(sum(math.exp(v) for v in kept)) - logits[i]
        removed += math.log(sum(math.exp(v) for v in others)) - logits[i]
    assert float(terms["hoc"]) == pytest.approx(zeroed / n, rel=1e-5)
    assert abs(zeroed - removed) > 0.1
    total = 0.25 * float(terms["cls"]) + 0.75 * zeroed / n
    assert float(terms["loss"]) == pytest.approx(total, rel=1e-5)


def test_dsimplex_config_refuses_another_simplex_naming_both():
    check = method_class("dsimplex").check_config
    scenario = {"splits": {"new_train": {"labels": [0, 1, 2, 3, 4, 5]}}}

    def cfg(**values):
        base = dict(head="dsimplex", embed_dim=6, old_model="/m/old", split="new_train")
        base.update(method_options={"classes": 7}, scenario=scenario)
        return SimpleNamespace(**dict(base, **values))

    def old(kind="dsimplex", dim=6, vertices=(0, 1, 2)):
        head = {"kind": kind, "embed_dim": dim, "vertices": list(vertices)}
        return {"modules": {"head": head}, "classes": [0, 1, 2]}

    check(cfg(), old())  # six classes on seven vertices
    with pytest.raises(ConfigError, match="pass --head dsimplex .*head 'cosface'"):
        check(cfg(head="cosface"), old())
    with pytest.raises(ConfigError, match="embed_dim 8 must be K - 1 = 6 .*classes K = 7"):
        check(cfg(embed_dim=8), old())
    with pytest.raises(ConfigError, match="same simplex head .*K = 7.*has head 'arcface'$"):
        check(cfg(), old(kind="arcface"))
    with pytest.raises(ConfigError, match="same simplex head .*K = 7.*head 'dsimplex' with K = 9"):
        check(cfg(), old(dim=8))
    with pytest.raises(ConfigError, match="K = 7 simplex vertices, but the chain has 8 classes"):
        check(cfg(), old(vertices=(0, 1, 4)))  # labels 0..4 taken, three new classes


# -- fct -----------------------------------------------------------------------------------------
def test_fct_transformation_shapes_and_mse_on_frozen_models():
    module = build("fct", {"hidden": 16, "batchnorm": "eval"})
    h = module.method.transformation
    linears = [
        (m.in_features, m.out_features) for m in h.modules() if isinstance(m, torch.nn.Linear)
    ]
    # p1: D_o -> 2 D_o -> 2 D_n; mixer: 2 D_n -> H -> H -> D_n
    assert linears == [(6, 12), (12, 16), (16, 16), (16, 16), (16, 8)]
    assert module.method.exports() == {"fct": h}
    trainable = {n.split(".")[0] for n, p in module.named_parameters() if p.requires_grad}
    assert trainable == {"method"}  # phi_n and its head are frozen
    module.train()
    assert not h.training and module.method.training  # eval mode throughout
    before = {n: b.clone() for n, b in h.named_buffers()}
    batch = make_batch(BATCH_LABELS, seed=3)
    terms = module(batch)
    with torch.no_grad():
        target = module.embedder(batch.x_new)
        mapped = h(module.method.old.embedder(batch.x_new))  # the same view for both models
    want = sum(
        (float(mapped[i, d]) - float(target[i, d])) ** 2
        for i in range(len(BATCH_LABELS))
        for d in range(D_NEW)
    )
    assert float(terms["fct"]) == pytest.approx(want / (len(BATCH_LABELS) * D_NEW), rel=1e-5)
    assert all(torch.equal(b, before[n]) for n, b in h.named_buffers())  # stored statistics
    trained = build("fct", {"hidden": 16, "batchnorm": "train"})
    trained.train()
    assert trained.method.transformation.training


@pytest.mark.parametrize("epochs,train_epochs", [(4, 2), (5, 3), (1, 1)])
def test_fct_batchnorm_uses_batch_statistics_for_the_first_half_then_freezes(epochs, train_epochs):
    """The released ``switch_mode_to_eval``: train mode while ``epoch < epochs / 2``."""
    batch = make_batch(BATCH_LABELS, seed=3)
    module = build_with("fct", {"hidden": 16}, batch, epochs=epochs)
    h = module.method.transformation
    modes = []
    for epoch in range(epochs):
        module.method.on_epoch_start(epoch, module)
        module.train()  # as the loop, after the epoch start
        before = {n: b.clone() for n, b in h.named_buffers()}
        module(batch)
        moved = any(not torch.equal(b, before[n]) for n, b in h.named_buffers())
        assert moved == h.training  # running statistics move in train mode only
        modes.append(h.training)
    assert modes == [True] * train_epochs + [False] * (epochs - train_epochs)


def test_fct_query_mode_scores_old_items_through_h():
    from raycompat.embeddings.gallery import GalleryEmbeddings
    from raycompat.models import ForwardTransformation
    from raycompat.simulator.memory_engine import simulate_backfill
    from raycompat.upgrade.modes import apply_bundle_modules

    g = torch.Generator().manual_seed(5)
    gallery_labels = torch.arange(12) % 4
    query_labels = torch.tensor([0, 1, 2, 3, 1])
    torch.manual_seed(3)
    h = ForwardTransformation(4, 6, hidden_dim=8).eval()
    data = GalleryEmbeddings(
        gallery_labels=gallery_labels.numpy(),
        gallery_old=torch.randn(12, 4, generator=g).numpy(),
        gallery_new=torch.randn(12, 6, generator=g).numpy(),
        query_labels=query_labels.numpy(),
        query_new=torch.randn(5, 6, generator=g).numpy(),
    )
    data = apply_bundle_modules(data, ModelBundle({"fct": h}, {}))
    with torch.no_grad():
        mapped = h(torch.from_numpy(data.gallery_old))
    assert torch.allclose(torch.from_numpy(data.gallery_fct), mapped, atol=1e-5)
    mapped = torch.from_numpy(data.gallery_fct)  # FeatureMap's float64 pass, as the simulator
    result = simulate_backfill(data, ["random"], ["fct"], fractions=[0.0, 0.5, 1.0], k=100)
    curve = result.curves[0]
    assert curve.mode == "fct"

    def mean_ap(gallery) -> float:
        q = F.normalize(torch.from_numpy(data.query_new), dim=1)
        scores = q @ F.normalize(gallery, dim=1).t()
        total = 0.0
        for i, y in enumerate(query_labels.tolist()):
            order = sorted(range(12), key=lambda j: (-float(scores[i, j]), j))
            hits, ap = 0, 0.0
            for rank, j in enumerate(order, start=1):
                if int(gallery_labels[j]) == y:
                    hits += 1
                    ap += hits / rank
            total += ap / int((gallery_labels == y).sum())
        return total / len(query_labels)

    values = curve.metrics["mAP@100"]
    assert values[0] == pytest.approx(mean_ap(mapped), abs=1e-9)  # t = 0: new vs h(old)
    assert values[-1] == pytest.approx(mean_ap(torch.from_numpy(data.gallery_new)), abs=1e-9)
    assert values[0] != pytest.approx(values[-1])


# -- registry, options, --help -------------------------------------------------------------------
@pytest.mark.parametrize(
    "method,options,match",
    [
        ("fd", {"indicator": "both"}, r"allowed values: \['old', 'new'\]"),
        ("lce", {"centre_classes": "new"}, r"allowed values: \['old', 'all'\]"),
        ("unibct", {"propagation": 1.0}, "'propagation' = 1.0 must be < 1"),
        ("unibct", {"affinity": "sym"}, r"allowed values: \['row', 'column'\]"),
        ("advbct", {"grl_alpha": "fast"}, "'grl_alpha' must be a number"),
        ("lwf", {"tau": 2}, r"unknown option 'tau'"),
        ("bt2", {"extra_dim": 0}, "'extra_dim' = 0 must be >= 1"),
        ("dsimplex", {"classes": 1}, "'classes' = 1 must be >= 2"),
        ("dsimplex", {"hoc_lambda": 1.5}, "'hoc_lambda' = 1.5 must be <= 1"),
        ("dsimplex", {"loss": "ce"}, r"allowed values: \['cores', 'hoc'\]"),
        ("fct", {"batchnorm": "sync"}, r"allowed values: \['switch', 'eval', 'train'\]"),
    ],
)
def test_bad_options_name_the_key(method, options, match):
    with pytest.raises(ConfigError, match=match):
        parse_method_options(method, options)


def test_every_field_method_is_registered_and_in_train_help():
    from raycompat.train.job import methods_help  # the epilog of jobs/train.py --help

    assert set(FIELD) <= set(available_methods())
    text = methods_help()
    for name in FIELD:
        assert f"  {name}: {method_class(name).description}" in text, name
