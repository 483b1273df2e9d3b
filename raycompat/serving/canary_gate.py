"""The canary gate of the backfill controller: the registered canary, its reference answers and
the history of its points, kept in ``<state_dir>/canary/`` (docs/live-index.md, "Upgrading a
live gallery safely"; the numbers: :mod:`raycompat.upgrade.canary`).

Files (each written atomically):

* ``canary.parquet`` -- the canary set (:class:`raycompat.upgrade.canary.CanarySet`), what
  ``simulate-backfill --canary`` reads too;
* ``reference.npz`` -- the reference answers (per query AP@k and top-1 correctness, and their
  kind); measured once, at the first point of a backfill on a gallery that holds no new item
  (``old-old`` when the canary has old-model vectors and the mode stores old vectors), else
  the first point's own answers (``first point``);
* ``history.json`` -- every point measured, in the order it was measured (a rollback or a
  resume adds points at positions already seen); a new backfill or canary starts it afresh.
"""

from __future__ import annotations

import io
import json
import os

import numpy as np

from raycompat.serving.checkpoint_files import atomic_write
from raycompat.upgrade.canary import (
    CanaryOptions,
    CanaryReference,
    CanarySet,
    canary_point,
    canary_positions,
    canary_terms,
    stores_old_vectors,
)

__all__ = ["CanaryGate", "CANARY_DIR", "CANARY_FILE"]

CANARY_DIR = "canary"
CANARY_FILE = "canary.parquet"


class CanaryGate:
    """The canary of one index (see the module docstring); not thread-safe: the controller
    calls it under its lock, except :meth:`measure`, which only reads what it is given."""

    def __init__(self, state_dir: str, opts: CanaryOptions, mode: str):
        self.dir = os.path.join(state_dir, CANARY_DIR)
        self.opts = opts
        self.mode = mode
        self.canary: CanarySet | None = None
        self.reference: CanaryReference | None = None
        self.history: list[dict] = []
        self.last: tuple | None = None  # (run, position) of the last point measured
        path = os.path.join(self.dir, CANARY_FILE)
        if os.path.exists(path):
            self.canary = CanarySet.read(path)
            self.reference = self._read_reference()
            self.history = self._read_json("history.json", [])

    # ------------------------------------------------------------------ files
    def _read_json(self, name: str, default):
        path = os.path.join(self.dir, name)
        if not os.path.exists(path):
            return default
        with open(path) as fh:
            return json.load(fh)

    def _write(self, name: str, data: bytes) -> None:
        os.makedirs(self.dir, exist_ok=True)
        atomic_write(os.path.join(self.dir, name), lambda fh: fh.write(data), f"writing {name}")

    def _read_reference(self) -> CanaryReference | None:
        path = os.path.join(self.dir, "reference.npz")
        if not os.path.exists(path):
            return None
        with np.load(path, allow_pickle=False) as z:
            return CanaryReference(str(z["kind"]), z["ap"], z["correct"])

    def _save_reference(self, ref: CanaryReference) -> None:
        buf = io.BytesIO()
        np.savez(buf, kind=np.array(ref.kind), ap=ref.ap, correct=ref.correct)
        self._write("reference.npz", buf.getvalue())

    def _save_history(self) -> None:
        self._write("history.json", json.dumps(self.history).encode())

    @property
    def path(self) -> str:
        return os.path.join(self.dir, CANARY_FILE)

    # ------------------------------------------------------------------ commands
    def register(self, canary: CanarySet) -> None:
        """Store ``canary`` (replacing an earlier one, its reference and its history)."""
        self._write(CANARY_FILE, canary.to_bytes())
        for name in ("reference.npz", "history.json"):
            if os.path.exists(os.path.join(self.dir, name)):
                os.unlink(os.path.join(self.dir, name))
        self.canary, self.reference, self.history, self.last = canary, None, [], None

    def new_run(self) -> None:
        """A new backfill: a new history (the reference stays)."""
        self.history, self.last = [], None
        if self.canary is not None:
            self._save_history()

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
        queries' results, when the reference is measured now), recorded in the history."""
        k = self.opts.canary_k
        if self.reference is None:
            if old_ids is not None:
                ref = CanaryReference("old-old", *canary_terms(old_ids, self.canary, k))
            else:
                ref = CanaryReference("first point", *canary_terms(ids, self.canary, k))
            self._save_reference(ref)
            self.reference = ref
        point = canary_point(position, ids, self.canary, self.reference, self.opts)
        self.history.append(point)
        self._save_history()
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
