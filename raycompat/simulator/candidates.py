"""Several candidate new models simulated in one pass (docs/simulator.md, "Several candidates").

A user choosing an upgrade simulates several new models against the same old gallery.  Each
candidate is a :class:`~raycompat.embeddings.gallery.GalleryEmbeddings` that shares the old
vectors, the labels and the ids and has its own new vectors.  :func:`simulate_candidates` plans
every candidate's curves as :func:`~raycompat.simulator.memory_engine.simulate_backfill` does, then
runs the engine once over all of them: a score side is named per candidate (``new-old@bct``),
except ``old-old``, which every candidate shares, so the old-old reference is scored once.  The
engine is exact whatever other curves share its pass, so each candidate's result equals its
single-candidate run, number for number (``tests/simulator/test_candidates.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from raycompat.embeddings.gallery import BackfillInputError, GalleryEmbeddings
from raycompat.index.blocks import ENGINE_BLOCK_BYTES
from raycompat.simulator.assembly import EngineResult, compute_ranks
from raycompat.simulator.rank_plan import CurveSpec
from raycompat.simulator.run_plan import (
    Engine,
    PlannedRun,
    SimulationSpec,
    finish_run,
    plan_run,
)

__all__ = [
    "CandidatePlan",
    "candidate_results",
    "candidate_side",
    "check_candidates",
    "plain_side",
    "plan_candidates",
    "share_equal_orders",
    "side_owner",
    "simulate_candidates",
]

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
    """One candidate's run, planned as the single-candidate simulator plans it
    (:func:`~raycompat.simulator.run_plan.plan_run`)."""

    name: str
    run: PlannedRun

    @property
    def orders(self) -> dict:
        return self.run.orders

    @property
    def curves(self) -> list[CurveSpec]:
        return self.run.curves

    def engine_curves(self) -> list[CurveSpec]:
        """Its scored curves, keyed ``(name, key)`` on its own sides."""
        side = lambda s: None if s is None else candidate_side(self.name, s)  # noqa: E731
        return [
            replace(c, key=(self.name, c.key), old_side=side(c.old_side), new_side=side(c.new_side))
            for c in self.run.scored_curves()
        ]

    def own(self, res: EngineResult) -> EngineResult:
        """Its part of the engine's result, under the single-candidate keys and side names."""
        curves = [replace(c, key=c.key[1]) for c in res.curves if c.key[0] == self.name]
        stats = dict(res.stats)
        sides = res.stats.get("sides", {})
        stats["sides"] = {
            plain_side(s): v for s, v in sides.items() if side_owner(s) in (self.name, None)
        }
        return replace(res, curves=curves, stats=stats, debug=dict(res.debug))


def share_equal_orders(planned: Sequence[CandidatePlan]) -> None:
    """Let candidates whose policy orders are equal share one array (a random or sequential
    order does not depend on the vectors): the engine then builds one segmentation for all of
    them (:func:`raycompat.simulator.rank_plan.plan_ranks` keys them by array), and the driver
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
        cp.run.curves[:] = [replace(c, order=swap.get(id(c.order), c.order)) for c in cp.curves]


def side_owner(side: str) -> str | None:
    """The candidate an engine side name belongs to (``None``: a shared side)."""
    return side.rsplit("@", 1)[1] if "@" in side else None


def plain_side(side: str) -> str:
    """An engine side name without its candidate (``new-old@bct`` -> ``new-old``)."""
    return side.rsplit("@", 1)[0]


def simulate_candidates(
    candidates: Mapping[str, GalleryEmbeddings],
    policies: Sequence[str] | str = ("random", "sequential"),
    modes: Sequence[str] | str = ("compatible",),
    *,
    heads: Mapping[str, object] | None = None,
    device=None,
    block_bytes: int | None = None,
    progress: Callable[[str], None] | None = None,
    debug: bool = False,
    **spec,
) -> dict:
    """``{name: SimulationResult}``: :func:`~raycompat.simulator.memory_engine.simulate_backfill`
    of every candidate (``spec`` as there; ``heads``: each candidate's classifier, for the
    uncertainty policies), with one engine pass for all of them."""
    from raycompat.simulator.memory_engine import MemoryEngine

    t_start = time.perf_counter()
    say = progress or (lambda msg: None)
    names = check_candidates(candidates)
    check_same_old(candidates)
    base = SimulationSpec(policies=policies, modes=modes, **spec)
    block_bytes = block_bytes or ENGINE_BLOCK_BYTES
    engines = {n: MemoryEngine(candidates[n], device, block_bytes, debug, say) for n in names}
    planned = plan_candidates(base, engines, heads, say)
    share_equal_orders(planned)
    sides = {
        candidate_side(cp.name, s): engines[cp.name].builder.side(s)
        for cp in planned
        for c in cp.run.scored_curves()
        for s in c.sides()
    }
    say(f"scoring {len(sides)} side(s) for {len(names)} candidate(s): {', '.join(sides)}")
    first = candidates[names[0]]
    res = compute_ranks(
        sides,
        [c for cp in planned for c in cp.engine_curves()],
        first.query_labels,
        first.gallery_labels,
        device=device,
        block_bytes=block_bytes,
        debug=debug,
    )
    return candidate_results(planned, res, engines, t_start)


def plan_candidates(
    base: SimulationSpec, engines: Mapping[str, Engine], heads, say
) -> list[CandidatePlan]:
    """Every candidate planned as a single run (its head, if given), the first candidate's
    reference lookup shared by all (they share the old gallery)."""
    if base.head is not None:
        raise BackfillInputError("candidates have a head each: give 'heads', not 'head'")
    planned: list[CandidatePlan] = []
    lookup = None
    for name, engine in engines.items():
        say(f"candidate {name}: planning")
        spec = replace(base, head=(heads or {}).get(name))
        tagged = lambda msg, n=name: say(f"candidate {n}: {msg}")  # noqa: E731
        run = plan_run(spec, engine, tagged, lookup)
        lookup = run.lookup
        planned.append(CandidatePlan(name, run))
    return planned


def candidate_results(planned: Sequence[CandidatePlan], res, engines, t_start: float) -> dict:
    """Each candidate's :class:`SimulationResult` from its part of the engine's result; the
    old-old reference is stored in the cache once (by the first candidate)."""
    names = [cp.name for cp in planned]
    out = {}
    for i, cp in enumerate(planned):
        stats = {"policy_seconds": cp.run.policy_seconds, "t_start": t_start}
        extra = {"candidates": names}
        out[cp.name] = finish_run(
            cp.run, cp.own(res), engines[cp.name], stats, store=i == 0, extra_stats=extra
        )
    return out
