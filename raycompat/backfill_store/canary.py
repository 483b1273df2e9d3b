"""The canary of a store upgrade: its queries read and checked against the store, measured through
the store's own search and judged by the live index's guards (docs/stores.md, "The canary")."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import numpy as np

from raycompat.backfill_store.options import BackfillStoreOptions
from raycompat.backfill_store.sources import store_labels
from raycompat.config import ConfigError
from raycompat.upgrade.canary import CanaryOptions
from raycompat.upgrade.state_machine import Command, State
from raycompat.upgrade.store_record import StoreUpgrade


# -- the canary -------------------------------------------------------------------------------
class StoreCanary:
    """The canary measured on the store (``raycompat.stores.search`` in the compatible mode)
    at position 0, every ``every`` items and at the end, with the guards of
    :mod:`raycompat.upgrade.canary`; its reference and points are records in the store."""

    def __init__(self, up: StoreUpgrade, canary, opts: CanaryOptions, run: str):
        self.up, self.canary, self.opts, self.run = up, canary, opts, run
        self.every = opts.every(int(up.rec["total"]))

    def due(self, pos: int, total: int, rec: dict) -> bool:
        if rec.get("canary_last") == pos:
            return False
        return pos in (0, total) or pos % self.every == 0

    def next_stop(self, pos: int, total: int) -> int:
        return min(total, (pos // self.every + 1) * self.every)

    def _reference(self):
        from raycompat.stores import search, search_field
        from raycompat.stores.mode_search import StoreQueries
        from raycompat.upgrade.canary import CanaryReference, canary_terms

        found = self.up.records.canary_reference(self.run)
        if found is not None:
            return CanaryReference(
                found["kind"], np.asarray(found["ap"], np.float64), np.asarray(found["correct"])
            )
        k, c = self.opts.canary_k, self.canary
        if c.old_vectors is not None:
            ids = search_field(self.up.store, "old", c.old_vectors, k).ids
            kind = "old-old"
        else:
            queries = StoreQueries(new=c.vectors)
            ids = search(self.up.store, queries, k, "compatible").ids
            kind = "first point"
        ap, correct = canary_terms(ids, c, k)
        doc = {"kind": kind, "ap": ap.tolist(), "correct": correct.astype(bool).tolist()}
        self.up.records.put_canary_reference(self.run, doc)
        return CanaryReference(kind, ap, correct)

    def measure(self, pos: int) -> dict:
        from raycompat.stores import search
        from raycompat.stores.mode_search import StoreQueries
        from raycompat.upgrade.canary import canary_point

        reference = self._reference()
        c = self.canary
        ids = search(self.up.store, StoreQueries(new=c.vectors), self.opts.canary_k).ids
        point = canary_point(pos, ids, c, reference, self.opts)
        points = self.up.records.canary_points(self.run)
        self.up.records.add_canary_point(self.run, len(points), point)
        self.up.rec["canary_last"] = pos
        return point


def judge_point(up: StoreUpgrade, canary: StoreCanary, point: dict) -> None:
    """A tripped guard is the state machine's ``canary_trip``: it pauses the backfill
    (``paused_by`` names it) unless it was resumed with ``override``."""
    rec = up.rec
    if point["guard"] is None or not canary.opts.canary_guard:
        up.save()
        return
    answer = up.decide(Command.CANARY_TRIP)
    up.enter(answer.state)
    if answer.state is State.GUARD_PAUSED:
        rec["paused_by"] = {
            "guard": point["guard"],
            "position": int(point["position"]),
            "reason": point["reason"],
        }
    up.save()


def attach_canary(up: StoreUpgrade, opts: BackfillStoreOptions, canary, path: str):
    """Record the canary (its file, digest and options) in the upgrade's record; a run that
    continues with the default canary options keeps the recorded ones."""
    digest = _file_digest(path)
    saved = up.rec.get("canary") or {}
    if saved and saved.get("sha256") not in (None, digest):
        up.rec["canary_last"] = None  # another canary: measure again where the walk is
    guard = opts.guard
    if guard == CanaryOptions() and saved.get("options"):  # a run that continues: as before
        guard = CanaryOptions(**saved["options"])
    up.rec["canary"] = {
        "file": os.path.abspath(path),
        "sha256": digest,
        "every": guard.every(int(up.rec["total"])),
        "k": guard.canary_k,
        "guard": guard.canary_guard,
        "options": dataclasses.asdict(guard),
    }
    up.save()
    return StoreCanary(up, canary, guard, up.rec["order"]["run"])


def _file_digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]


def read_canary(path: str, store):
    """The canary of ``--canary``: a canary parquet (:meth:`CanarySet.read`) or the live
    index's registration JSON (``vectors``, optional ``old_vectors``, and ``classes`` or
    ``relevant_ids`` per query), checked against the store (dimensions, classes, ids)."""
    from raycompat.upgrade.canary import CanarySet

    if not os.path.isfile(path):
        raise ConfigError(f"--canary {path}: no such file")
    try:
        if path.endswith(".parquet"):
            canary = CanarySet.read(path)
        else:
            canary = _canary_json(path, store)
    except ValueError as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"--canary {path}: {exc}") from None
    info = store.describe()
    cols = store.columns
    if canary.vectors.shape[1] != info.new_dim:
        raise ConfigError(
            f"--canary {path}: 'vectors' have dimension {canary.vectors.shape[1]}, but column "
            f"{cols.new!r} of {store.where} has dimension {info.new_dim}"
        )
    if canary.old_vectors is not None and canary.old_vectors.shape[1] != info.old_dim:
        raise ConfigError(
            f"--canary {path}: 'old_vectors' have dimension {canary.old_vectors.shape[1]}, but "
            f"column {cols.old!r} of {store.where} has dimension {info.old_dim}"
        )
    _check_unit_sample(store, path)
    known = store.read_ids()
    flat = np.unique(np.concatenate(canary.relevant))
    unknown = flat[~np.isin(flat, known)]
    if unknown.size:
        raise ConfigError(
            f"--canary {path}: relevant item id(s) {unknown[:5].tolist()} are not in column "
            f"{cols.id!r} of {store.where}"
        )
    return canary


def _check_unit_sample(store, path: str, rows: int = 4096) -> None:
    """The canary scores through the store's searches, by inner product: the cosine only for
    unit vectors. The first ``rows`` old vectors must be unit length (a table raycompat did not
    create may hold others), or its numbers would not be the simulator's."""
    from raycompat.stores.checks import not_unit_rows

    block = next(iter(store.read_blocks(("id", "old"), block_rows=rows)), None)
    if block is None or not len(block["id"]):
        return
    bad = not_unit_rows(block["old"])
    if bad.any():
        raise ConfigError(
            f"--canary {path}: column {store.columns.old!r} of {store.where} holds vectors that "
            f"are not unit length ({int(bad.sum())} of its first {len(bad)}, e.g. item ids "
            f"{block['id'][bad][:5].tolist()}): the canary's searches score by inner product, "
            "the cosine only for L2-normalised vectors; store those (create_store does)"
        )


def _canary_json(path: str, store):
    from raycompat.upgrade.canary import CanarySet

    with open(path) as fh:
        try:
            doc = json.load(fh)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--canary {path}: not JSON: {exc}") from None
    if not isinstance(doc, dict) or "vectors" not in doc:
        raise ConfigError(f"--canary {path}: expected a JSON object with 'vectors'")
    if ("classes" in doc) == ("relevant_ids" in doc):
        raise ConfigError(f"--canary {path}: give exactly one of 'relevant_ids' or 'classes'")
    vectors = np.asarray(doc["vectors"], np.float32)
    old = doc.get("old_vectors")
    old = None if old is None else np.asarray(old, np.float32)
    if "classes" in doc:
        ids, labels = store_labels(store)
        names = np.asarray([str(v) for v in labels.tolist()], object)
        relevant = [ids[names == str(c)] for c in doc["classes"]]
        missing = [str(c) for c, r in zip(doc["classes"], relevant, strict=True) if not r.size]
        if missing:
            raise ConfigError(
                f"--canary {path}: no item of {store.where} has class {missing[0]!r} (column "
                f"{store.columns.label!r})"
            )
        groups = [str(c) for c in doc["classes"]]
    else:
        relevant = [np.asarray(r, np.int64) for r in doc["relevant_ids"]]
        groups = [
            hashlib.sha256(np.unique(np.asarray(r, np.int64)).tobytes()).hexdigest()[:12]
            for r in doc["relevant_ids"]
        ]
    return CanarySet(vectors, relevant, groups, old)
