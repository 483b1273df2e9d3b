"""The canary gate of the backfill controller: the registered canary, its reference answers and
the history of its points, kept in the store the index serves, beside the upgrade's record
(docs/live-index.md, "Upgrading a live gallery safely"; the numbers:
:mod:`raycompat.upgrade.canary`).  A controller started again on any node finds them there,
and ``raycompat backfill-store --store URI --status`` shows the points.

Records (:class:`raycompat.stores.backfill.BackfillRecords`):

* the canary set (:class:`raycompat.upgrade.canary.CanarySet`, its parquet bytes), under a
  registration id; ``simulate-backfill --canary <store URI>`` reads it;
* the reference answers (per query AP@k and top-1 correctness, and their kind), one per
  registration; measured once, at the first point of a backfill on a gallery that holds no
  new item (``old-old`` when the canary has old-model vectors and the mode stores old
  vectors), else the first point's own answers (``first point``);
* every point measured, per backfill and registration (``<order run>-<registration>``), in
  the order it was measured (a rollback or a resume adds points at positions already seen).
"""

from __future__ import annotations

import time

import numpy as np

from raycompat.upgrade.canary import (
    CanaryOptions,
    CanaryReference,
    CanarySet,
    canary_point,
    canary_positions,
    canary_terms,
    stores_old_vectors,
)

__all__ = ["CanaryGate"]


class CanaryGate:
    """The canary of one index (see the module docstring); not thread-safe: the controller
    calls it under its lock, except :meth:`measure`, which only reads what it is given.
    ``records``: the store's :class:`~raycompat.stores.backfill.BackfillRecords`; ``run``: the
    backfill's order run (``None`` before any)."""

    def __init__(self, records, opts: CanaryOptions, mode: str, run: str | None):
        self.records = records
        self.opts = opts
        self.mode = mode
        self.run = run
        self.canary: CanarySet | None = None
        self.reg: str | None = None  # the registration id
        self.reference: CanaryReference | None = None
        self.history: list[dict] = []
        self.last: tuple | None = None  # (run, position) of the last point measured
        meta = records.live_canary_meta()
        if meta is not None:
            where = f"the canary of {records.store.where}"
            self.canary = CanarySet.from_bytes(records.live_canary(), where)
            self.reg = meta["reg"]
            self.reference = self._read_reference()
            self.history = records.canary_points(self.points_key) if run else []

    @property
    def points_key(self) -> str:
        """Where this backfill's points of this registration are kept."""
        return f"{self.run}-{self.reg}"

    def _read_reference(self) -> CanaryReference | None:
        doc = self.records.canary_reference(f"live-{self.reg}")
        if doc is None:
            return None
        return CanaryReference(doc["kind"], np.asarray(doc["ap"]), np.asarray(doc["correct"]))

    # ------------------------------------------------------------------ commands
    def register(self, canary: CanarySet) -> None:
        """Keep ``canary`` (replacing an earlier one: a new reference and history)."""
        reg = f"{int(time.time() * 1000):x}"
        self.records.put_live_canary(canary.to_bytes(), reg)
        self.canary, self.reg, self.reference, self.history, self.last = (
            canary, reg, None, [], None
        )  # fmt: skip

    def new_run(self, run: str) -> None:
        """A new backfill (its order's ``run``): a new history (the reference stays)."""
        self.run, self.history, self.last = run, [], None

    def record_info(self, total: int) -> dict | None:
        """What the upgrade's record says of the canary (``backfill-store --status`` reads the
        points and the reference by it)."""
        if self.canary is None:
            return None
        return {
            "file": "registered with the live index (POST /admin/canary)",
            "every": self.every(total),
            "k": self.opts.canary_k,
            "guard": self.opts.canary_guard,
            "points_run": self.points_key,
            "reference_run": f"live-{self.reg}",
        }

    def every(self, total: int) -> int:
        return self.opts.every(total)

    def next_stop(self, pos: int, total: int) -> int:
        """The first canary position after ``pos`` (where a batch must stop)."""
        if self.canary is None:
            return total
        every = self.every(total)
        return min(total, (pos // every + 1) * every)

    def due(self, run, pos: int, total: int) -> bool:
        """Whether the canary is to be measured at ``pos`` of backfill ``run`` now."""
        if self.canary is None or (run, pos) == self.last:
            return False
        return pos in (0, total) or pos % self.every(total) == 0

    def wants_old_old(self, has_new_items: bool) -> bool:
        """Whether the reference is to be measured now with the old model's queries."""
        c = self.canary
        return (
            self.reference is None
            and c is not None
            and c.old_vectors is not None
            and stores_old_vectors(self.mode)
            and not has_new_items
        )

    def measure(self, position: int, ids: np.ndarray, old_ids: np.ndarray | None) -> dict:
        """The point at ``position`` from the canary's result ids (``old_ids``: the old model's
        queries' results, when the reference is measured now), kept in the store."""
        k, canary = self.opts.canary_k, self.canary
        if canary is None:
            raise RuntimeError("no canary is registered: nothing to measure")
        if self.reference is None:
            if old_ids is not None:
                ref = CanaryReference("old-old", *canary_terms(old_ids, canary, k))
            else:
                ref = CanaryReference("first point", *canary_terms(ids, canary, k))
            doc = {"kind": ref.kind, "ap": ref.ap.tolist(), "correct": ref.correct.tolist()}
            self.records.put_canary_reference(f"live-{self.reg}", doc)
            self.reference = ref
        point = canary_point(position, ids, canary, self.reference, self.opts)
        self.records.add_canary_point(self.points_key, len(self.history), point)
        self.history.append(point)
        return point

    def status(self, total: int) -> dict | None:
        """What ``/status`` shows of the canary (``None``: none registered)."""
        if self.canary is None:
            return None
        c = self.canary
        return {
            "queries": c.n_queries,
            "groups": int(np.unique(c.groups).size),
            "old_vectors": c.old_vectors is not None,
            "every": self.every(total),
            "k": self.opts.canary_k,
            "positions": len(canary_positions(total, self.every(total))),
            "reference": None if self.reference is None else self.reference.kind,
            "guards": {
                "max_nfr": self.opts.canary_max_nfr,
                "map_margin": self.opts.canary_map_margin,
                "confidence": self.opts.canary_confidence,
                "enabled": self.opts.canary_guard,
            },
            "last": self.history[-1] if self.history else None,
            "history": self.history,
        }
