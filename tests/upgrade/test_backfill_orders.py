"""One policy registry for offline and live backfill: the simulator's order equals the live
controller's order, element for element, for every registered policy and served mode."""

from __future__ import annotations

import numpy as np
import pytest

from raycompat.embeddings.gallery import BackfillInputError, GalleryEmbeddings
from raycompat.models.uncertainty_head import UncertaintyHead
from raycompat.serving.gallery_source import (
    GallerySource,
    ParquetGallerySource,
    write_gallery_parquet,
)
from raycompat.serving.orders import policy_order_ids
from raycompat.simulator.memory_engine import simulate_backfill
from raycompat.upgrade.modes import MODES, SERVED_MODES, available_modes, mode_spec
from raycompat.upgrade.policies import (
    POLICIES,
    Policy,
    PolicyInputs,
    available_policies,
    parse_policies,
    policy_class,
    policy_order,
)

#: the policies that need no query log (tests/simulator/test_backfill_cost_demand.py has the others)
LOGLESS = tuple(p for p in POLICIES if not policy_class(p).needs_query_log)


def unit(a):
    return (a / np.linalg.norm(a, axis=1, keepdims=True)).astype(np.float32)


def synthetic(seed=0, n=240, n_q=24, d_old=6, d_new=8, n_labels=8):
    """Every array of every mode (adapted, fct, rho, psi_rev), with a dimension change."""
    rng = np.random.default_rng(seed)
    mu = unit(rng.standard_normal((n_labels, d_new)))
    gl, ql = rng.integers(0, n_labels, n), rng.integers(0, n_labels, n_q)
    gn = unit(mu[gl] + 0.3 * rng.standard_normal((n, d_new)))
    qn = unit(mu[ql] + 0.3 * rng.standard_normal((n_q, d_new)))
    qo = unit(mu[ql, :d_old] + 0.8 * rng.standard_normal((n_q, d_old)))
    data = GalleryEmbeddings(
        gallery_labels=gl,
        query_labels=ql,
        query_old=qo,
        query_new=qn,
        gallery_new=gn,
        gallery_old=unit(mu[gl, :d_old] + 0.8 * rng.standard_normal((n, d_old))),
        gallery_adapted=unit(gn + 0.5 * rng.standard_normal((n, d_new))),
        gallery_fct=unit(gn + 0.6 * rng.standard_normal((n, d_new))),
        gallery_rho=unit(gn[:, :5] + 0.2 * rng.standard_normal((n, 5))),
        query_rho=unit(qn[:, :5] + 0.2 * rng.standard_normal((n_q, 5))),
        query_rev=unit(qo + 0.3 * rng.standard_normal((n_q, d_old))),
        gallery_ids=rng.permutation(10 * n)[:n],
    )  # ids are not row numbers
    head = UncertaintyHead(weight=mu.astype(np.float64), kind="cosface", scale=10.0)
    return data, head


class MemoryGallery(GallerySource):
    """A served gallery whose embeddings are in memory (what ParquetGallerySource holds after
    loading)."""

    def __init__(self, data: GalleryEmbeddings):
        self.data, self.n_items = data, data.n_items

    def gallery_ids(self) -> np.ndarray:
        return self.data.gallery_ids.astype(np.int64)


@pytest.mark.parametrize("seed", [0, 5])
def test_simulator_order_equals_live_order_for_every_policy_and_served_mode(seed):
    data, head = synthetic(seed)
    sim = simulate_backfill(
        data,
        LOGLESS,
        SERVED_MODES,
        head=head,
        seed=seed,
        grid_step=50,
        k=10,
        learned_sample_fraction=0.1,
    )
    source = MemoryGallery(data)
    for policy in LOGLESS:
        for mode in SERVED_MODES:
            live = policy_order_ids(
                policy, source, mode=mode, seed=seed, head=head, learned_sample_fraction=0.1
            )
            want = data.gallery_ids[sim.orders[(policy, mode)]]
            assert live.dtype == np.int64 and np.array_equal(live, want), (policy, mode)
    # hinge-benefit depends on the mode, the others do not
    assert not np.array_equal(
        sim.orders[("hinge-benefit", "compatible")], sim.orders[("hinge-benefit", "rank_merge")]
    )
    assert np.array_equal(sim.orders[("random", "compatible")], sim.orders[("random", "adapted")])


def test_live_order_from_a_parquet_gallery(tmp_path):
    data, head = synthetic(1)
    path = write_gallery_parquet(str(tmp_path / "g.parquet"), data)
    source = ParquetGallerySource(path)
    sim = simulate_backfill(
        data,
        ["uncertainty:margin", "learned", "hinge-benefit"],
        ["compatible", "naive_merge"],
        head=head,
        seed=3,
        grid_step=50,
        k=10,
    )
    for (policy, mode), order in sim.orders.items():
        live = policy_order_ids(policy, source, mode=mode, seed=3, head=head)
        assert np.array_equal(live, data.gallery_ids[order]), (policy, mode)


def test_policies_that_need_only_n_work_without_embeddings():
    class IdsOnly(GallerySource):
        n_items = 7

        def gallery_ids(self):
            return np.arange(100, 107)

    assert np.array_equal(policy_order_ids("sequential", IdsOnly()), np.arange(100, 107))
    assert np.array_equal(
        policy_order_ids("random", IdsOnly(), seed=2), 100 + np.random.default_rng(2).permutation(7)
    )
    with pytest.raises(BackfillInputError, match="'hinge-benefit' needs the gallery's embeddings"):
        policy_order_ids("hinge-benefit", IdsOnly())


def test_unknown_policy_names_it_and_lists_the_registry():
    with pytest.raises(BackfillInputError) as err:
        policy_order("fastest", PolicyInputs(n_items=3))
    msg = str(err.value)
    assert "'fastest'" in msg and f"allowed: {', '.join(available_policies())}" in msg
    with pytest.raises(BackfillInputError, match="'fastest'"):
        parse_policies("random,fastest")


def test_registries_derive_the_name_lists():
    assert (
        POLICIES
        == tuple(available_policies())
        == (
            "random",
            "sequential",
            "uncertainty:least_confidence",
            "uncertainty:margin",
            "uncertainty:entropy",
            "hinge-benefit",
            "learned",
            "cost-aware",
            "demand",
            "upgrade-on-read",
        )
    )
    assert all(
        issubclass(cls, Policy) and cls.name == name for name, cls in available_policies().items()
    )
    assert MODES == ("compatible", "adapted", "fct", "rank_merge", "naive_merge", "cold")
    assert (
        SERVED_MODES == tuple(m for m in MODES if mode_spec(m).served)
        and "cold" not in SERVED_MODES
    )
    assert mode_spec("rank_merge", "sq_l2_raw").old_side == "rev-old:l2raw"
    data, _ = synthetic(0)
    assert available_modes(data) == MODES
    data.gallery_fct = None  # no h(phi_o(g)): every mode but fct
    assert available_modes(data) == tuple(m for m in MODES if m != "fct")
    assert "fct" in available_modes(data.with_arrays(gallery_fct=data.gallery_new))
    assert available_modes(data.with_arrays(gallery_adapted=None, query_rev=None)) == (
        "compatible",
        "naive_merge",
        "cold",
    )


def test_missing_inputs_are_named_by_both_callers():
    data, _ = synthetic(0)
    with pytest.raises(BackfillInputError, match="classifier head"):
        policy_order_ids("uncertainty:entropy", MemoryGallery(data))
    with pytest.raises(BackfillInputError, match="classifier head"):
        simulate_backfill(data, ["uncertainty:entropy"], ["compatible"])
    no_target = data.with_arrays(
        gallery_new=None,
        query_new=None,
        query_rho=None,
        query_rev=None,
        gallery_rho=None,
        gallery_adapted=None,
    )
    with pytest.raises(BackfillInputError, match="'learned' needs gallery_new"):
        policy_order_ids("learned", MemoryGallery(no_target))
