"""Several candidate new models simulated in one pass (docs/simulator.md, "Several candidates").

A user choosing an upgrade simulates several new models against the same old gallery.  Each
candidate is a :class:`~raycompat.backfill.gallery.GalleryEmbeddings` that shares the old
vectors, the labels and the ids and has its own new vectors.  :func:`simulate_candidates` plans
every candidate's curves as :func:`~raycompat.backfill.simulator.simulate_backfill` does, then
runs the engine once over all of them: a score side is named per candidate (``new-old@bct``),
except ``old-old``, which every candidate shares, so the old-old reference is scored once.  The
engine is exact whatever other curves share its pass, so each candidate's result equals its
single-candidate run, number for number (``tests/backfill/test_candidates.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from raycompat.backfill.assembly import EngineResult
from raycompat.backfill.gallery import BackfillInputError, GalleryEmbeddings
from raycompat.backfill.rank_plan import CurveSpec

__all__ = ["simulate_candidates", "candidate_side", "check_candidates", "CandidatePlan"]

SHARED_SIDES = ("old-old",)


def candidate_side(name: str, side: str) -> str:
    """The engine's name of ``side`` for candidate ``name`` (``old-old`` is shared)."""
    return side if side in SHARED_SIDES else f"{side}@{name}"


def check_candidates(candidates: Mapping[str, object], what: str = "candidate") -> list[str]:
    """The candidate names, checked: at least one, no empty name, no ``@`` in a name."""
    names = list(candidates)
    if not names:
        raise BackfillInputError(f"give at least one {what}")
    for n in names:
        if not n or "@" in n or "/" in n:
            raise BackfillInputError(f"{what} name {n!r}: not empty, without '@' or '/'")
    return names


def check_same_old(candidates: Mapping[str, GalleryEmbeddings]) -> None:
    """Every candidate has the first one's old vectors, labels and ids (else its name)."""
    names = list(candidates)
    first = candidates[names[0]]
    for n in names[1:]:
        d = candidates[n]
        for attr in ("gallery_old", "query_old", "gallery_labels", "query_labels", "gallery_ids"):
            a, b = getattr(first, attr), getattr(d, attr)
            if (a is None) != (b is None) or (a is not None and not np.array_equal(a, b)):
                raise BackfillInputError(
                    f"candidate {n!r}: its {attr} differ from candidate {names[0]!r}'s; "
                    "candidates share the old gallery, the queries and the labels"
                )


@dataclass
class CandidatePlan:
    """One candidate's curves, planned as the single-candidate simulator plans them."""

    name: str
    plan: object  # simulator._Plan
    inputs: object  # PolicyInputs
    orders: dict
    policy_seconds: dict
    curves: list[CurveSpec]
    static: dict
    derived: set

    def engine_curves(self) -> list[CurveSpec]:
        """Its scored curves, keyed ``(name, key)`` on its own sides."""
        side = lambda s: None if s is None else candidate_side(self.name, s)  # noqa: E731
        return [
            replace(c, key=(self.name, c.key), old_side=side(c.old_side), new_side=side(c.new_side))
            for c in self.curves
            if c.key not in self.derived
        ]

    def own(self, res: EngineResult) -> EngineResult:
        """Its part of the engine's result, under the single-candidate keys and side names."""
        curves = [replace(c, key=c.key[1]) for c in res.curves if c.key[0] == self.name]
        stats = dict(res.stats)
        sides = res.stats.get("sides", {})
        stats["sides"] = {_plain(s): v for s, v in sides.items() if _owner(s) in (self.name, None)}
        return replace(res, curves=curves, stats=stats, debug=dict(res.debug))


def share_equal_orders(planned: Sequence[CandidatePlan]) -> None:
    """Let candidates whose policy orders are equal share one array (a random or sequential
    order does not depend on the vectors): the engine then builds one segmentation for all of
    them (:func:`raycompat.backfill.rank_plan.plan_ranks` keys them by array), and the driver
    keeps one copy of the order instead of one per candidate."""
    seen: list[np.ndarray] = []
    for cp in planned:
        swap: dict[int, np.ndarray] = {}
        for key, order in cp.orders.items():
            if not isinstance(order, np.ndarray):
                continue
            equal = (o for o in seen if o.shape == order.shape and np.array_equal(o, order))
            same = next(equal, None)
            if same is None:
                seen.append(order)
            elif same is not order:
                cp.orders[key], swap[id(order)] = same, same
        cp.curves[:] = [replace(c, order=swap.get(id(c.order), c.order)) for c in cp.curves]


def _owner(side: str) -> str | None:
    return side.rsplit("@", 1)[1] if "@" in side else None


def _plain(side: str) -> str:
    return side.rsplit("@", 1)[0]


def simulate_candidates(
    candidates: Mapping[str, GalleryEmbeddings],
    policies: Sequence[str] | str = ("random", "sequential"),
    modes: Sequence[str] | str = ("compatible",),
    *,
    fractions: Sequence[float] | None = None,
    grid_step: float = 5.0,
    k: int = 100,
    seed: int = 0,
    cost=None,
    references=None,
    learned_sample_fraction: float = 0.02,
    rank_merge_distance: str = "sq_l2",
    device=None,
    block_bytes: int | None = None,
    progress: Callable[[str], None] | None = None,
    debug: bool = False,
    bootstrap=None,
    policy_options=None,
    reference_cache=None,
) -> dict:
    """``{name: SimulationResult}``: :func:`~raycompat.backfill.simulator.simulate_backfill`
    of every candidate (arguments as there), with one engine pass for all of them."""
    from raycompat.backfill import simulator as sim
    from raycompat.backfill.blocks import ENGINE_BLOCK_BYTES

    t_all = time.perf_counter()
    say = progress or (lambda msg: None)
    names = check_candidates(candidates)
    check_same_old(candidates)
    first = candidates[names[0]]
    want_oo = first.query_old is not None
    use_cache = reference_cache is not None and want_oo
    key = sim.memory_reference_key(first, k) if use_cache else None
    n_pairs = sim.n_positive_pairs(first.query_labels, first.gallery_labels) if use_cache else 0
    cached = reference_cache.lookup(key, n_pairs) if use_cache else None
    planned, sides = [], {}
    for n in names:
        say(f"candidate {n}: planning")
        cp, builder = _plan_candidate(
            n, candidates[n], policies, modes, fractions, grid_step, k, seed,
            learned_sample_fraction, rank_merge_distance, device, policy_options, want_oo,
            cached is not None, say,
        )  # fmt: skip
        planned.append(cp)
        for c in cp.curves:
            if c.key not in cp.derived:
                for s in c.sides():
                    sides.setdefault(candidate_side(n, s), builder.side(s))
    share_equal_orders(planned)
    curves = [c for cp in planned for c in cp.engine_curves()]
    say(f"scoring {len(sides)} side(s) for {len(names)} candidate(s): {', '.join(sides)}")
    from raycompat.backfill.assembly import compute_ranks

    res = compute_ranks(
        sides,
        curves,
        first.query_labels,
        first.gallery_labels,
        device=device,
        block_bytes=block_bytes or ENGINE_BLOCK_BYTES,
        debug=debug,
    )
    return _results(
        planned, res, candidates, cached, key, reference_cache, references, cost, bootstrap, t_all
    )


def _plan_candidate(
    name, data, policies, modes, fractions, grid_step, k, seed, learned_sample_fraction,
    rank_merge_distance, device, policy_options, want_oo, old_old_cached, say,
):  # fmt: skip
    """One candidate's plan, orders and curves (as :func:`simulate_backfill` makes them)."""
    from raycompat.backfill import simulator as sim
    from raycompat.backfill.modes import SideBuilder
    from raycompat.backfill.policies import PolicyInputs, PolicyOptions

    builder = SideBuilder(data)
    inputs = PolicyInputs(
        n_items=data.n_items,
        data=data,
        head=None,
        seed=seed,
        learned_sample_fraction=learned_sample_fraction,
        rank_merge_distance=rank_merge_distance,
        device=device,
        sides=builder,
        options=policy_options or PolicyOptions(),
        reads=None,
    )
    plan = sim._check_inputs(data, policies, modes, k, fractions, grid_step, None, inputs)
    orders, seconds = sim._build_orders(plan, inputs, lambda msg: say(f"candidate {name}: {msg}"))
    curves, static, derived = sim._curve_specs(plan, orders, data.n_items, want_oo, old_old_cached)
    cp = CandidatePlan(name, plan, inputs, orders, seconds, curves, static, derived)
    return cp, builder


def _results(planned, res, candidates, cached, key, cache, references, cost, bootstrap, t_all):
    """Each candidate's :class:`SimulationResult` from its part of the engine's result."""
    from raycompat.backfill import simulator as sim
    from raycompat.backfill.reference_cache import with_reference

    out = {}
    for i, cp in enumerate(planned):
        data = candidates[cp.name]
        own = cp.own(res)
        stats = {"policy_seconds": cp.policy_seconds, "t_start": t_all}
        static = cp.static
        if cache is not None and key is not None and (cached is not None or i == 0):
            info = {"n_items": data.n_items, "n_queries": data.n_queries, "k": cp.plan.k}
            derived = [c for c in cp.curves if c.key in cp.derived]
            static = with_reference(cache, key, cached, own, static, derived, info)
        if cache is not None and key is not None:
            stats["reference_cache"] = cache.report(key)
        stats["candidates"] = [p.name for p in planned]
        ranked = sim.RankedCurves(cp.plan, cp.curves, static, own, cp.inputs, cp.orders,
                                  data.item_costs)  # fmt: skip
        result = ranked.result(data.n_queries, None, references, cost, stats)
        if bootstrap is not None:
            result.add_intervals(bootstrap)
        out[cp.name] = result
    return out
