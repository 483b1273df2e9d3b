"""The backfill simulator: policies x query modes -> exact curves, AUCs, regression, cost.

For a gallery with embeddings (:class:`~raycompat.embeddings.gallery.GalleryEmbeddings`,
in memory or from parquet), a set of policies
(:mod:`~raycompat.upgrade.policies`), query modes
(:mod:`~raycompat.upgrade.modes`) and a grid of backfill fractions
(default 0, 5, ..., 100 %; rounding rule in :mod:`~raycompat.upgrade.grid`),
:func:`simulate_backfill` computes at every grid point (docs/methods.md, "Metrics"):

* ``mAP@k`` (GLDv2 AP@k, default k = 100), ``mAP`` (revisited full mAP),
  ``top1`` (CMC top-1) and ``NFR@1`` (RACT Eq.12, against old-old correctness);
* per curve and metric: the AUC over t in [0, 1] (trapezoids, RM), the AUC gain
  (RM Table 1) when ``AUC(old-old)`` and ``AUC(new*-new*)`` are known, and the
  regression statistics of RACT Eq.3 (points below the t = 0 value and drops
  between consecutive points; for NFR "worse" means higher);
* a simulated wall-clock axis from a :class:`~raycompat.upgrade.cost.CostModel`: the time
  the backfill job needs to re-embed ``n(t)`` items, for every mode (``cold`` too: it
  re-embeds in the background and serves the new model only at t = 1); with items' costs
  (``data.item_costs``, a cost column) the summed cost of the first ``n(t)`` items of each
  curve's order over the rate (``cold``: in gallery order);
* with a query log (:mod:`~raycompat.upgrade.query_log`): the ``demand`` and
  ``upgrade-on-read`` policies, and mAP@k and NFR@1 weighted by query frequency over the log's
  queries that are evaluation queries, ``M_w = sum_q f_q M_q / sum_q f_q``, beside the
  unweighted ones (``Curve.weighted``; intervals resample the log's distinct queries).

When the AUC gain is undefined (no new* reference, a lower-is-better metric, a partial grid,
or new*-new* not better than old-old) it is ``None`` and ``auc_gain_note`` says why.

Uncertainty (docs/methods.md, "Uncertainty"): every curve keeps its per-query terms
(``Curve.samples``, :class:`~raycompat.metrics.bootstrap.Sample`), and with ``bootstrap``
options every metric gets a band at every grid point and an interval on its AUC, resampling the
query classes (seeded).

All curves come from one call of :func:`raycompat.simulator.assembly.compute_ranks`
(one blockwise scoring pass per distinct score side, shared by every policy and
mode), and equal a brute-force masked exact search at every grid point.

References: ``old-old`` (``M(phi_o, phi_o)``), ``new-new`` and, when the
compatible subspace exists, ``new-old`` are computed on the same data (static
searches; free when a curve already uses the side).  ``AUC(old-old)`` is the
old-old value (a flat curve); ``new*-new*`` (the paragon, trained without a
compatibility term) must be given in ``references`` to get AUC gains.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from raycompat.embeddings.gallery import GalleryEmbeddings
from raycompat.index.blocks import ENGINE_BLOCK_BYTES
from raycompat.simulator.assembly import compute_ranks
from raycompat.simulator.reference_cache import array_digest, reference_key
from raycompat.simulator.results import SimulationResult
from raycompat.simulator.run_plan import SimulationSpec, memory_orders, simulate
from raycompat.upgrade.modes import SideBuilder
from raycompat.upgrade.query_log import memory_log_searches

__all__ = ["MemoryEngine", "backfill_curve_rows", "memory_reference_key", "simulate_backfill"]


@dataclass
class MemoryEngine:
    """The in-memory engine (:class:`~raycompat.simulator.run_plan.Engine`): every row in this
    process, one scoring pass per distinct side on CPU threads or a GPU
    (:func:`~raycompat.simulator.assembly.compute_ranks`)."""

    data: GalleryEmbeddings
    device: Any = None
    block_bytes: int = ENGINE_BLOCK_BYTES
    debug: bool = False
    say: Callable[[str], None] = field(default=lambda msg: None, repr=False)

    def __post_init__(self):
        self.builder = SideBuilder(self.data)
        self.policy_block_bytes = self.block_bytes
        d = self.data
        self.n_items, self.n_queries = d.n_items, d.n_queries
        self.query_labels, self.gallery_labels = d.query_labels, d.gallery_labels
        self.item_costs = d.item_costs

    def log_searches(self, log, k: int, distance: str):
        return memory_log_searches(log, self.data, self.builder, k, distance)

    def orders(self, plan, inputs, say):
        return memory_orders(plan, inputs, say)

    def reference_key(self, k: int) -> str:
        return memory_reference_key(self.data, k)

    def rank(self, curves):
        """Ranks of every positive on every curve: one scoring pass per distinct side."""
        sides = {s: self.builder.side(s) for c in curves for s in c.sides()}
        self.say(
            f"scoring {len(sides)} side(s): {', '.join(sides)} "
            f"({self.data.n_items} items x {self.data.n_queries} queries)"
        )
        last: dict[str, int] = {}

        def progress(side, frac):
            pct = int(frac * 10)
            if last.get(side) != pct:
                last[side] = pct
                self.say(f"  side {side}: {100 * frac:.0f}%")

        return compute_ranks(
            sides,
            curves,
            self.data.query_labels,
            self.data.gallery_labels,
            device=self.device,
            block_bytes=self.block_bytes,
            debug=self.debug,
            progress=progress,
        )

    def stats(self) -> dict:
        return {}


def simulate_backfill(
    data: GalleryEmbeddings,
    policies: Sequence[str] | str = ("random", "sequential"),
    modes: Sequence[str] | str = ("compatible",),
    *,
    device=None,
    block_bytes: int = ENGINE_BLOCK_BYTES,
    progress: Callable[[str], None] | None = None,
    debug: bool = False,
    **spec,
) -> SimulationResult:
    """Exact backfill curves of ``data`` (validated on construction) for every policy x mode
    (see the module docstring). ``spec``: the other fields of
    :class:`~raycompat.simulator.run_plan.SimulationSpec` (``fractions``, ``grid_step``, ``k``,
    ``seed``, ``head``, ``cost``, ``references``, ``reference_correct``, ``bootstrap``,
    ``query_log``, ``policy_options``, ``reference_cache``, ...). ``device``: the scoring
    passes' torch device (default: CUDA if available); ``progress``: one-line messages;
    ``debug``: the engine checks that every item is counted once at every point. The items'
    costs (``cost-aware``, the time axis) are ``data.item_costs``."""
    say = progress or (lambda msg: None)
    engine = MemoryEngine(data, device, block_bytes, debug, say)
    return simulate(SimulationSpec(policies=policies, modes=modes, **spec), engine, say)


def memory_reference_key(data: GalleryEmbeddings, k: int) -> str:
    """The reference cache key of in-memory embeddings (:func:`reference_key`)."""
    digest = array_digest([np.asarray(data.gallery_old, np.float32)])
    return reference_key(digest, data.gallery_labels, data.query_old, data.query_labels, k)


def backfill_curve_rows(
    data: GalleryEmbeddings, policies=("random", "sequential"), modes=("compatible",), **kwargs
) -> dict[str, Any]:
    """In-memory embeddings -> ``{"rows": [...], "summary": [...], "references": {...}}``.

    ``rows`` are flat ``{policy, mode, fraction, metric, value, items_backfilled,
    seconds}`` dicts (the main job stores them in its report under ``curves``);
    ``summary`` has the AUC / AUC gain / regression statistics per curve and metric.
    Keyword arguments go to :func:`simulate_backfill`.
    """
    r = simulate_backfill(data, policies, modes, **kwargs)
    return {
        "rows": r.rows(),
        "summary": r.summary_rows(),
        "references": r.references,
        "cost_model": None if r.cost is None else r.cost.to_dict(),
        "k": r.k,
        "fractions": [float(x) for x in r.fractions],
    }
