"""Searching a half-upgraded store in every query mode (raycompat.stores.search) equals the
simulator at every grid point of a backfill, on real LanceDB and real Milvus Lite
(docs/stores.md#searching-in-a-query-mode)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from serving_helpers import labelled_embeddings
from test_stores_behaviour import BACKENDS, uri_of

from raycompat.index.search import l2_normalize
from raycompat.metrics import correct_at_k
from raycompat.serving.live_eval import compare_curves, live_metrics
from raycompat.simulator import simulate_backfill
from raycompat.stores import (
    STORE_MODES,
    GalleryBlock,
    StoreError,
    StoreQueries,
    create_store,
    search,
)
from raycompat.upgrade.grid import backfill_counts
from raycompat.upgrade.modes import SERVED_MODES, apply_bundle_modules
from raycompat.upgrade.policies.base import PolicyInputs, policy_order

FRACTIONS = [0.0, 0.3, 0.7, 1.0]


@pytest.fixture(scope="module")
def bundle():
    """A new model's bundle with DMU's psi, FCT's h and RM's rho and psi_rev (random MLPs)."""
    import torch

    from raycompat.models import ForwardTransformation, ModelBundle, ProjectionMLP

    torch.manual_seed(5)
    mods = {
        "psi": ProjectionMLP(16, 24, hidden_dim=32, num_blocks=1, role="psi"),
        "fct": ForwardTransformation(16, 24, hidden_dim=32),
        "rho": ProjectionMLP(24, 20, hidden_dim=32, num_blocks=1, role="rho"),
        "psi_rev": ProjectionMLP(20, 16, hidden_dim=32, num_blocks=1, role="psi_rev"),
    }
    return ModelBundle(mods, dict(method="test")).eval()


@pytest.fixture(scope="module")
def data(bundle):
    """Clustered embeddings, the stored vectors L2-normalised, psi/h/rho applied as the
    simulator applies them."""
    raw = labelled_embeddings(n_items=240, n_queries=40, classes=12, seed=2)
    unit = {a: l2_normalize(getattr(raw, a)) for a in ("gallery_old", "gallery_new")}
    raw = dataclasses.replace(raw, gallery_adapted=None, **unit)
    return apply_bundle_modules(raw, bundle)


def test_the_store_modes_are_the_served_modes():
    assert set(STORE_MODES) == set(SERVED_MODES)


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_mode_equals_the_simulator_at_every_grid_point(backend, tmp_path, data, bundle):
    k = data.n_items  # the full ranking: the revisited mAP is compared too
    modes = list(STORE_MODES)
    sim = simulate_backfill(data, ["random"], modes, fractions=FRACTIONS, k=k, seed=7)
    order = policy_order("random", PolicyInputs(n_items=data.n_items, data=data, seed=7))
    counts = backfill_counts(np.asarray(FRACTIONS), data.n_items)
    block = GalleryBlock(data.gallery_ids, data.gallery_labels, data.gallery_old)
    queries = StoreQueries(new=data.query_new, old=data.query_old)
    with create_store(uri_of(backend, tmp_path), [block], old_model="m-old", new_dim=24) as store:
        top = store.search("old", l2_normalize(data.query_old), 1).ids[:, 0]
        label_of = dict(zip(data.gallery_ids.tolist(), data.gallery_labels.tolist(), strict=True))
        hits = [[label_of[t] == q] for t, q in zip(top.tolist(), data.query_labels, strict=True)]
        ref = correct_at_k(np.array(hits), 1)
        got = {m: {} for m in modes}
        done = 0
        for n in counts.tolist():
            rows = order[done:n]
            store.write_new(
                data.gallery_ids[rows], data.gallery_new[rows], "m-new", np.arange(done, n)
            )
            done = n
            assert store.count_upgraded() == n
            for mode in modes:
                res = search(store, queries, k, mode, bundle=bundle)
                for name, value in live_metrics(res.ids, data, k, ref)[0].items():
                    got[mode].setdefault(name, []).append(value)
    for mode in modes:
        cmp = compare_curves({"metrics": got[mode]}, sim.curve("random", mode), tol=1e-12)
        assert cmp["equal"] and len(cmp["max_abs_diff"]) == 4, (mode, cmp)
        assert got[mode][f"mAP@{k}"][0] != got[mode][f"mAP@{k}"][-1], mode  # not vacuous


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_mode_search_says_what_it_needs(backend, tmp_path, data, bundle):
    block = GalleryBlock(data.gallery_ids, data.gallery_labels, data.gallery_old)
    with create_store(uri_of(backend, tmp_path), [block], old_model="m-old", new_dim=24) as store:
        q = StoreQueries(new=data.query_new)
        cases = [
            (dict(mode="cold"), "cold has no mixed form"),
            (dict(mode="nope"), "unknown store search mode 'nope'"),
            (dict(mode="adapted"), r"needs the new model's bundle with module\(s\) \['psi'\]"),
            (dict(mode="naive_merge"), r"needs the old model's queries \(queries.old\)"),
        ]
        for kw, why in cases:
            with pytest.raises(StoreError, match=why):
                search(store, q, 5, bundle=None, **kw)
        short = StoreQueries(new=data.query_new[:, :8])
        with pytest.raises(StoreError, match="the new queries have 8 dims, D_old is 16"):
            search(store, short, 5)
        with pytest.raises(StoreError, match="queries.new: expected a 2-D array"):
            search(store, StoreQueries(new=data.query_new[0]), 5)
