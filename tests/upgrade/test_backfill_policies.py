"""Backfill policies: valid seeded permutations, RACT uncertainty, hinge benefit, learned."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raycompat.embeddings.gallery import BackfillInputError, GalleryEmbeddings
from raycompat.models import ClassifierHead
from raycompat.models.uncertainty_head import UncertaintyHead
from raycompat.simulator.memory_engine import simulate_backfill
from raycompat.upgrade.modes import SideBuilder
from raycompat.upgrade.policies import (
    POLICIES,
    check_order,
    disagreement,
    hinge_benefit,
    hinge_benefit_order,
    learned_order,
    order_by_score,
    parse_policies,
    policy_class,
    random_order,
    sequential_order,
    uncertainty_order,
    uncertainty_scores,
)


def unit(a):
    return (a / np.linalg.norm(a, axis=1, keepdims=True)).astype(np.float32)


def synthetic(seed=0, n=400, n_q=40, d=8, n_labels=10):
    rng = np.random.default_rng(seed)
    mu = unit(rng.standard_normal((n_labels, d)))
    gl, ql = rng.integers(0, n_labels, n), rng.integers(0, n_labels, n_q)
    go = unit(mu[gl] + 0.8 * rng.standard_normal((n, d)))
    gn = unit(mu[gl] + 0.3 * rng.standard_normal((n, d)))
    qo = unit(mu[ql] + 0.8 * rng.standard_normal((n_q, d)))
    qn = unit(mu[ql] + 0.3 * rng.standard_normal((n_q, d)))
    return GalleryEmbeddings(
        gallery_labels=gl,
        query_labels=ql,
        gallery_old=go,
        gallery_new=gn,
        query_old=qo,
        query_new=qn,
    ), mu


def test_every_policy_is_a_seeded_permutation():
    data, mu = synthetic()
    head = UncertaintyHead(weight=mu.astype(np.float64), kind="cosface", scale=10.0)
    n = data.n_items
    logless = [p for p in POLICIES if not policy_class(p).needs_query_log]  # the others: with
    a = simulate_backfill(  # a query log, tests/simulator/test_backfill_cost_demand.py
        data, logless, ["compatible", "naive_merge"], head=head, seed=3, grid_step=25
    )
    b = simulate_backfill(
        data, logless, ["compatible", "naive_merge"], head=head, seed=3, grid_step=25
    )
    c = simulate_backfill(
        data, ["random", "learned"], ["compatible"], head=head, seed=4, grid_step=25
    )
    for key, order in a.orders.items():
        assert np.array_equal(np.sort(order), np.arange(n)), key
        assert np.array_equal(order, b.orders[key]), key  # deterministic per seed
    assert not np.array_equal(
        a.orders[("random", "compatible")], c.orders[("random", "compatible")]
    )
    assert not np.array_equal(
        a.orders[("learned", "compatible")], c.orders[("learned", "compatible")]
    )
    assert np.array_equal(random_order(50, 1), random_order(50, 1))
    assert np.array_equal(sequential_order(5), np.arange(5))
    with pytest.raises(ValueError):
        check_order(np.array([0, 0, 1]), 3)


def test_parse_policies_names_the_allowed_ones():
    assert parse_policies("random, uncertainty:margin") == ("random", "uncertainty:margin")
    with pytest.raises(BackfillInputError, match="allowed: random, sequential"):
        parse_policies("random,bogus")


def test_uncertainty_matches_hand_computed_softmax():
    # two classes, softmax head, 2-D features: logits = f @ W^T + b
    w = np.array([[2.0, 0.0], [0.0, 1.0], [-1.0, -1.0]])
    b = np.array([0.0, 0.5, 0.0])
    f = np.array([[1.0, 0.0], [0.0, 0.0], [3.0, 1.0], [0.2, 0.4]], dtype=np.float32)
    head = UncertaintyHead(weight=w, bias=b, kind="softmax")
    logits = f.astype(np.float64) @ w.T + b
    p = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    ps = -np.sort(-p, axis=1)
    want = {
        "least_confidence": 1 - ps[:, 0],  # RACT Eq.9
        "margin": 1 - (ps[:, 0] - ps[:, 1]),  # RACT Eq.10
        "entropy": -(p * np.log(p)).sum(axis=1),  # RACT Eq.11
    }
    for kind, w_scores in want.items():
        got = uncertainty_scores(f, head, kind)
        np.testing.assert_allclose(got, w_scores, rtol=1e-12, atol=1e-15)
        assert np.array_equal(
            uncertainty_order(f, head, kind), np.argsort(-w_scores, kind="stable")
        )


def test_uncertainty_from_a_classifier_head_uses_the_compatible_subspace():
    torch.manual_seed(0)
    head = ClassifierHead(embed_dim=6, num_classes=5, kind="cosface")
    uh = UncertaintyHead.from_classifier_head(head)
    f = np.random.default_rng(0).standard_normal((9, 4)).astype(np.float32)  # D_old = 4 < D_new = 6
    # by hand: cosine logits against the first 4 columns of W, scaled by s
    w = head.weight.detach().numpy().astype(np.float64)[:, :4]
    f64 = f.astype(np.float64)
    cos = (f64 / np.linalg.norm(f64, axis=1, keepdims=True)) @ (
        w / np.linalg.norm(w, axis=1, keepdims=True)
    ).T
    z = head.scale * cos
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    np.testing.assert_allclose(
        uncertainty_scores(f, uh, "least_confidence"), 1 - p.max(1), rtol=1e-10
    )
    # with full dims it equals the head's own inference logits
    f6 = np.random.default_rng(1).standard_normal((3, 6)).astype(np.float32)
    ref = (
        torch.softmax(head.inference_logits(torch.from_numpy(f6)).double(), dim=1)
        .max(1)
        .values.detach()
        .numpy()
    )
    np.testing.assert_allclose(uncertainty_scores(f6, uh, "least_confidence"), 1 - ref, rtol=1e-5)


def test_ties_are_broken_by_lower_index():
    assert order_by_score([0.5, 0.9, 0.5, 0.9]).tolist() == [1, 3, 0, 2]


def test_hinge_benefit_uses_the_new_embeddings_and_beats_random():
    data, _ = synthetic(seed=1)
    b = SideBuilder(data)
    o1 = hinge_benefit_order(
        b.side("new-old"), b.side("new-new"), data.query_labels, data.gallery_labels
    )
    # change the new embeddings: the hinge-benefit order (and only it) changes
    rng = np.random.default_rng(9)
    data2 = data.with_arrays(
        gallery_new=unit(data.gallery_new + rng.standard_normal(data.gallery_new.shape))
    )
    b2 = SideBuilder(data2)
    o2 = hinge_benefit_order(
        b2.side("new-old"), b2.side("new-new"), data2.query_labels, data2.gallery_labels
    )
    assert not np.array_equal(o1, o2)
    benefit = hinge_benefit(
        b.side("new-old"), b.side("new-new"), data.query_labels, data.gallery_labels
    )
    assert benefit.shape == (data.n_items,) and np.isfinite(benefit).all()
    res = simulate_backfill(data, ["random", "hinge-benefit"], ["compatible"], grid_step=10, k=20)
    auc = {c.policy: c.summary["mAP"]["auc"] for c in res.curves}
    assert auc["hinge-benefit"] > auc["random"]


def test_learned_predictor_recovers_a_predictable_disagreement():
    # disagreement of an item grows with its first old-feature coordinate: learnable
    rng = np.random.default_rng(5)
    n, d = 3000, 6
    old = unit(rng.standard_normal((n, d)))
    noise = (0.05 + 0.9 * (old[:, 0] + 1) / 2)[:, None] * rng.standard_normal((n, d))
    new = unit(old + noise)
    truth = disagreement(new, old)
    order, model, sample = learned_order(
        old,
        lambda ids: disagreement(new[ids], old[ids]),
        seed=0,
        sample_fraction=0.05,
        return_model=True,
    )
    assert np.array_equal(np.sort(order), np.arange(n))
    assert np.array_equal(order[: sample.size], sample)  # sample goes first
    rest = np.setdiff1d(np.arange(n), sample)
    from raycompat.upgrade.policies import LearnedPredictor

    pred = model.predict(LearnedPredictor.features(old[rest]))
    corr = np.corrcoef(pred, truth[rest])[0, 1]
    best = np.corrcoef(old[rest, 0], truth[rest])[0, 1]  # the true driver (noise limits it)
    rand = np.corrcoef(rng.random(rest.size), truth[rest])[0, 1]
    assert corr > 0.35 and corr > 0.8 * best and abs(rand) < 0.1
    # the items it backfills first really disagree more than a random order's
    first = order[sample.size : sample.size + n // 5]
    rnd = random_order(n, 0)[: n // 5]
    assert truth[first].mean() > truth[rnd].mean() + 0.05


def test_policy_inputs_are_checked():
    data, _ = synthetic()
    with pytest.raises(BackfillInputError, match="classifier head"):
        simulate_backfill(data, ["uncertainty:margin"], ["compatible"])
    with pytest.raises(BackfillInputError, match="unknown mode 'warm'"):
        simulate_backfill(data, ["random"], ["warm"])


def test_the_former_oracle_name_says_what_it_became():
    from raycompat.embeddings.gallery import BackfillInputError
    from raycompat.upgrade.policies import parse_policies

    with pytest.raises(BackfillInputError, match="'oracle' was renamed 'hinge-benefit'.*not an"):
        parse_policies("random,oracle")
