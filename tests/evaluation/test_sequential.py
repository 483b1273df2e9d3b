"""Sequential upgrades (docs/methods.md, "Sequential upgrades"): every cross pair
phi_j -> phi_i (i <= j) is evaluated, and DMU's psi is chained (psi_3(psi_2(phi_1(g))))
for the adapted galleries."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raycompat.evaluation import (
    EmbeddedSet,
    chain_adapt,
    evaluate_pair,
    sequential_cross_evaluate,
    transform,
)
from raycompat.models import PsiMLP

DIM = 8


def _data(seed=0, classes=6, queries=2, gallery=5):
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(classes, DIM)).astype(np.float32)
    q_labels = np.repeat(np.arange(classes), queries)
    g_labels = np.repeat(np.arange(classes), gallery)
    return rng, centres, q_labels, g_labels


def _generation(name, rng, centres, q_labels, g_labels, noise):
    rotation = np.linalg.qr(rng.normal(size=(DIM, DIM)))[0].astype(np.float32)
    q = (centres[q_labels] + noise * rng.normal(size=(len(q_labels), DIM))) @ rotation
    g = (centres[g_labels] + noise * rng.normal(size=(len(g_labels), DIM))) @ rotation
    return EmbeddedSet(name, q.astype(np.float32), g.astype(np.float32), DIM)


def _psi(seed):
    torch.manual_seed(seed)
    psi = PsiMLP(DIM, DIM, hidden_dim=16).eval()
    # non-trivial BatchNorm statistics, so that eval mode matters
    for m in psi.modules():
        if isinstance(m, torch.nn.BatchNorm1d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
    return psi


def test_every_cross_pair_and_chained_psi():
    rng, centres, q_labels, g_labels = _data()
    gens = [_generation(f"phi_{k}", rng, centres, q_labels, g_labels, 0.3) for k in (1, 2, 3)]
    psis = [None, _psi(2), _psi(3)]
    rows = sequential_cross_evaluate(gens, q_labels, g_labels, psis=psis)

    stored = {
        (r["query_generation"], r["gallery_generation"])
        for r in rows
        if r["gallery_state"] == "stored"
    }
    adapted = {
        (r["query_generation"], r["gallery_generation"])
        for r in rows
        if r["gallery_state"] == "adapted"
    }
    assert stored == {(1, 1), (2, 1), (2, 2), (3, 1), (3, 2), (3, 3)}
    assert adapted == {(2, 1), (3, 1), (3, 2)}
    assert {r["metric"] for r in rows} >= {"mAP@100", "mAP", "top1"}

    def value(j, i, state, metric="mAP@100"):
        (v,) = [
            r["value"]
            for r in rows
            if (r["query_generation"], r["gallery_generation"], r["gallery_state"], r["metric"])
            == (j, i, state, metric)
        ]
        return v

    # phi_3 against phi_1's gallery brought forward by psi_3(psi_2(.)), computed by hand
    with torch.no_grad():
        by_hand = psis[2](psis[1](torch.from_numpy(gens[0].gallery))).numpy()
    np.testing.assert_allclose(
        chain_adapt(gens[0].gallery, psis[1:]), by_hand, rtol=1e-5, atol=1e-6
    )
    expected = evaluate_pair(gens[2].query, by_hand, q_labels, g_labels)["mAP@100"]
    assert value(3, 1, "adapted") == pytest.approx(expected, abs=1e-6)
    # the chain's order matters: psi_2(psi_3(.)) is another gallery
    wrong_order = chain_adapt(gens[0].gallery, [psis[2], psis[1]])
    assert not np.allclose(wrong_order, by_hand)
    # one step (3 <- 2) uses psi_3 only
    one_step = evaluate_pair(
        gens[2].query, transform(psis[2], gens[1].gallery), q_labels, g_labels
    )["mAP@100"]
    assert value(3, 2, "adapted") == pytest.approx(one_step, abs=1e-6)
    # stored cross pairs are plain cross-model searches
    assert value(3, 1, "stored") == pytest.approx(
        evaluate_pair(gens[2].query, gens[0].gallery, q_labels, g_labels, dims=DIM)["mAP@100"],
        abs=1e-6,
    )


def test_incompatible_generations_show_in_cross_pairs_and_a_missing_psi_means_no_adapted_rows():
    rng, centres, q_labels, g_labels = _data(seed=1)
    gens = [_generation(f"phi_{k}", rng, centres, q_labels, g_labels, 0.1) for k in (1, 2, 3)]
    rows = sequential_cross_evaluate(gens, q_labels, g_labels, psis=[None, _psi(0), None])
    adapted = {
        (r["query_generation"], r["gallery_generation"])
        for r in rows
        if r["gallery_state"] == "adapted"
    }
    assert adapted == {(2, 1)}  # the chains through generation 3 lack psi_3
    top1 = {
        (r["query_generation"], r["gallery_generation"]): r["value"]
        for r in rows
        if r["metric"] == "top1" and r["gallery_state"] == "stored"
    }
    # random rotations: every self pair retrieves well, the cross pairs do not
    assert min(top1[(k, k)] for k in (1, 2, 3)) > 0.9
    assert max(top1[p] for p in ((2, 1), (3, 1), (3, 2))) < min(top1[(k, k)] for k in (1, 2, 3))


def test_compatible_subspace_is_the_smallest_in_the_chain():
    rng, centres, q_labels, g_labels = _data(seed=2)
    g1 = _generation("phi_1", rng, centres, q_labels, g_labels, 0.1)
    g1 = EmbeddedSet("phi_1", g1.query[:, :4], g1.gallery[:, :4], 4)
    g2 = _generation("phi_2", rng, centres, q_labels, g_labels, 0.1)
    g2 = EmbeddedSet("phi_2", g2.query, g2.gallery, 4)  # compatible with phi_1 on 4 dims
    g3 = _generation("phi_3", rng, centres, q_labels, g_labels, 0.1)  # compatible_dim 8 with phi_2
    rows = sequential_cross_evaluate([g1, g2, g3], q_labels, g_labels)
    (v,) = [
        r["value"]
        for r in rows
        if (r["query_generation"], r["gallery_generation"], r["metric"]) == (3, 1, "mAP@100")
    ]
    assert v == pytest.approx(
        evaluate_pair(g3.query, g1.gallery, q_labels, g_labels, dims=4)["mAP@100"], abs=1e-6
    )
