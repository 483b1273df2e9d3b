"""The canary of an upgrade: a labelled query set whose search quality is measured as the
backfill goes, the guards that judge it, and its curve computed offline.

docs/live-index.md, "Upgrading a live gallery safely" (the metrics: docs/methods.md,
"Metrics" and "Uncertainty").
A :class:`CanarySet` holds query vectors of the new model (and, optionally, of the old model)
with the item ids relevant to each query and a group per query (its class: the bootstrap draws
groups).  At a backfill position the canary's result ids give (:func:`canary_point`):

* ``mAP@k`` with its bootstrap interval (:class:`raycompat.metrics.bootstrap.Bootstrap` over the
  groups, seeded: the same draws at every position);
* ``mAP@k - mAP@k(t=0)``, the paired difference with the reference answers, with its interval;
* ``NFR@1`` against the reference answers (RACT Eq.12) with its interval.

The *reference* is the answer of the system before the upgrade: the old model's queries
against the all-old gallery (``old-old``) when the canary has old-model vectors and the mode
stores old vectors (:func:`stores_old_vectors`), else the canary's own first point (position 0,
the new model's queries against the untouched gallery).

A guard trips (:func:`guard_trip`) when the whole interval says so: the upper bound of the
mAP@k difference is below ``-canary_map_margin``, or the lower bound of NFR@1 is above
``canary_max_nfr``; an interval that cannot be computed (too few old-old successes for NFR)
trips nothing.  :func:`offline_canary_curve` ranks the canary over the gallery exactly as the
live index does (canonical scores, ties by item id) along a policy's order, so the simulator
gives the live curve's numbers before the live run.
"""

from __future__ import annotations

import dataclasses
import io
from dataclasses import dataclass

import numpy as np

from raycompat.config import nonnegative, option, positive
from raycompat.embeddings.gallery import BackfillInputError, GalleryEmbeddings
from raycompat.index.canonical import float32_score_error, pair_scores_at
from raycompat.metrics.bootstrap import Bootstrap, BootstrapOptions, Sample
from raycompat.metrics.retrieval import average_precision_at_k

__all__ = [
    "CanaryOptions",
    "CanarySet",
    "CanaryReference",
    "canary_point",
    "canary_positions",
    "guard_trip",
    "stores_old_vectors",
    "canary_terms",
    "mixed_canonical_top_k",
    "offline_canary_curve",
    "write_canary_curves",
]

QUERY_SET = "canary"


@dataclass(frozen=True)
class CanaryOptions:
    """How the canary is measured and judged (the live index's and the simulator's flags)."""

    canary_every: int = nonnegative(
        0,
        help="measure the canary every this many upgraded items (0: every 2 percent of them)",
    )
    canary_k: int = positive(10, help="cut-off of the canary's mAP@k")
    canary_max_nfr: float = option(
        0.2, min=0.0, help="pause when the lower bound of the canary's NFR@1 is above this"
    )
    canary_map_margin: float = option(
        0.05,
        min=0.0,
        help="pause when the upper bound of mAP@k - mAP@k(t=0) is below minus this margin",
    )
    canary_resamples: int = positive(1000, help="bootstrap resamples of the canary's intervals")
    canary_confidence: float = option(0.95, min=0.5, help="confidence of the canary's intervals")
    canary_seed: int = nonnegative(0, help="seed of the canary's bootstrap draws")
    canary_guard: bool = option(True, help="pause the backfill when a guard trips")

    def every(self, n_items: int) -> int:
        """Items between two canary points (at least 1)."""
        return int(self.canary_every) or max(1, round(0.02 * int(n_items)))

    def bootstrap(self, groups) -> Bootstrap:
        bs = Bootstrap(
            BootstrapOptions(self.canary_resamples, self.canary_confidence, self.canary_seed)
        )
        bs.add_query_set(QUERY_SET, np.asarray(groups))
        return bs


@dataclass
class CanarySet:
    """Canary queries: new-model ``vectors`` ``[Q, D]``, optional ``old_vectors`` ``[Q, D_old]``,
    the ``relevant`` item ids of each query, and each query's ``group`` (its class name, or
    the key of its relevant set): the unit the bootstrap draws."""

    vectors: np.ndarray
    relevant: list[np.ndarray]
    groups: np.ndarray
    old_vectors: np.ndarray | None = None

    def __post_init__(self):
        self.vectors = np.ascontiguousarray(self.vectors, np.float32)
        self.relevant = [np.unique(np.asarray(r, np.int64)) for r in self.relevant]
        self.groups = np.asarray([str(g) for g in self.groups])
        if self.old_vectors is not None:
            self.old_vectors = np.ascontiguousarray(self.old_vectors, np.float32)
        n = self.vectors.shape[0]
        lengths = {
            "relevant": len(self.relevant),
            "groups": len(self.groups),
            "old_vectors": n if self.old_vectors is None else self.old_vectors.shape[0],
        }
        bad = {k: v for k, v in lengths.items() if v != n}
        if self.vectors.ndim != 2 or bad:
            raise BackfillInputError(f"canary: {n} query vectors but {bad}")
        empty = [q for q, r in enumerate(self.relevant) if r.size == 0]
        if empty:
            raise BackfillInputError(f"canary query {empty[0]} has no relevant item")

    @property
    def n_queries(self) -> int:
        return int(self.vectors.shape[0])

    def to_bytes(self) -> bytes:
        """The canary as a parquet file: ``vector``, ``old_vector`` (when present),
        ``relevant`` (item ids), ``group``."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        def fixed(a: np.ndarray):
            return pa.FixedSizeListArray.from_arrays(pa.array(a.reshape(-1)), a.shape[1])

        cols = {"vector": fixed(self.vectors)}
        if self.old_vectors is not None:
            cols["old_vector"] = fixed(self.old_vectors)
        cols["relevant"] = pa.array([r.tolist() for r in self.relevant], pa.list_(pa.int64()))
        cols["group"] = pa.array(self.groups.tolist(), pa.string())
        buf = io.BytesIO()
        pq.write_table(pa.table(cols), buf)
        return buf.getvalue()

    @classmethod
    def read(cls, path: str) -> CanarySet:
        """Read a canary parquet (:meth:`to_bytes`), or the canary registered with a live
        index whose store ``path`` names (``lance://...``, ``milvus://...``: it is kept in the
        store's records); ``BackfillInputError`` naming the file and the column that is
        missing or wrong."""
        if path.startswith(("lance://", "milvus://")):
            return cls.from_bytes(_registered_canary(path), f"the canary of store {path}")
        return cls._from_parquet(path, path)

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> CanarySet:
        """:meth:`read` of the bytes of :meth:`to_bytes` (``where``: named in errors)."""
        import pyarrow as pa

        return cls._from_parquet(pa.BufferReader(data), where)

    @classmethod
    def _from_parquet(cls, source, path: str) -> CanarySet:
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(source)
        except Exception as exc:  # pyarrow raises several types for unreadable files
            raise BackfillInputError(f"canary {path}: cannot read it ({exc})") from None
        for column in ("vector", "relevant", "group"):
            if column not in table.column_names:
                raise BackfillInputError(f"canary {path}: column {column!r} is missing")

        def matrix(column: str) -> np.ndarray:
            try:
                return np.asarray(table.column(column).to_pylist(), np.float32)
            except (TypeError, ValueError) as exc:
                raise BackfillInputError(f"canary {path}: column {column!r}: {exc}") from None

        old = matrix("old_vector") if "old_vector" in table.column_names else None
        try:
            return cls(
                matrix("vector"),
                [np.asarray(r, np.int64) for r in table.column("relevant").to_pylist()],
                np.asarray(table.column("group").to_pylist()),
                old,
            )
        except BackfillInputError as exc:
            raise BackfillInputError(f"{exc} (file {path})") from None


def _registered_canary(uri: str) -> bytes:
    """The canary registered with the live index that serves the store ``uri``."""
    from raycompat.stores import open_store
    from raycompat.stores.backfill import BackfillRecords

    with open_store(uri) as store:
        data = BackfillRecords(store).live_canary()
    if data is None:
        raise BackfillInputError(f"canary of store {uri}: no canary was registered with it")
    return data


@dataclass
class CanaryReference:
    """The answers the canary is compared with: per query AP@k and top-1 correctness;
    ``kind``: ``old-old`` or ``first point``."""

    kind: str
    ap: np.ndarray
    correct: np.ndarray

    def as_arrays(self) -> dict:
        return {"ap": self.ap, "correct": self.correct}


def canary_terms(ids: np.ndarray, canary: CanarySet, k: int) -> tuple[np.ndarray, np.ndarray]:
    """``(AP@k [Q], top-1 correct [Q])`` of result ids ``[Q, >=k]`` (-1 padded)."""
    ids = np.asarray(ids, np.int64)[:, :k]
    rel = np.zeros(ids.shape, dtype=bool)
    for q, row in enumerate(ids):
        rel[q] = np.isin(row, canary.relevant[q]) & (row >= 0)
    npos = np.array([r.size for r in canary.relevant], np.int64)
    return average_precision_at_k(rel, npos, k), rel[:, 0].copy()


def _value(x) -> float | None:
    x = float(x)
    return x if np.isfinite(x) else None


def canary_point(
    position: int,
    ids: np.ndarray,
    canary: CanarySet,
    reference: CanaryReference,
    opts: CanaryOptions,
) -> dict:
    """The canary's numbers at ``position`` from its result ids (see the module docstring),
    with the guard verdict (``guard``: ``None``, ``"map"`` or ``"nfr"``; ``reason``)."""
    ap, correct = canary_terms(ids, canary, opts.canary_k)
    bs = opts.bootstrap(canary.groups)
    now = Sample.mean(QUERY_SET, ap)
    ref = Sample.mean(QUERY_SET, reference.ap)
    m = bs.interval(now=now)
    delta = bs.interval(lambda now, ref: now - ref, now=now, ref=ref)
    flips = reference.correct & ~correct
    nfr = bs.interval(nfr=Sample.rate(QUERY_SET, flips, reference.correct))
    point = {
        "position": int(position),
        "map": _value(m.estimate),
        "map_low": _value(m.low),
        "map_high": _value(m.high),
        "reference_map": _value(np.nanmean(reference.ap)),
        "delta_map": _value(delta.estimate),
        "delta_low": _value(delta.low),
        "delta_high": _value(delta.high),
        "nfr": _value(nfr.estimate),
        "nfr_low": _value(nfr.low),
        "nfr_high": _value(nfr.high),
        "top1": _value(np.mean(correct)),
        "reference": reference.kind,
    }
    trip = guard_trip(point, opts)
    point["guard"], point["reason"] = trip if trip else (None, None)
    return point


def guard_trip(point: dict, opts: CanaryOptions) -> tuple[str, str] | None:
    """``(guard, reason)`` when a guard trips at ``point`` (judged by the intervals), else
    ``None``."""
    k, margin = opts.canary_k, opts.canary_map_margin
    high = point["delta_high"]
    if high is not None and high < -margin:
        return "map", (
            f"mAP@{k} {point['map']:.4f} fell below its t=0 value {point['reference_map']:.4f} "
            f"by more than the margin {margin:g}: the difference {point['delta_map']:.4f} has "
            f"the interval [{point['delta_low']:.4f}, {high:.4f}]"
        )
    low = point["nfr_low"]
    if low is not None and low > opts.canary_max_nfr:
        return "nfr", (
            f"NFR@1 {point['nfr']:.4f} [{low:.4f}, {point['nfr_high']:.4f}] is above "
            f"{opts.canary_max_nfr:g} (the whole interval)"
        )
    return None


def stores_old_vectors(mode: str) -> bool:
    """Whether ``mode`` keeps the old model's vectors before the backfill (so the old model's
    queries can be answered: the old-old reference); the adapted mode stores psi's output."""
    from raycompat.upgrade.modes import mode_spec

    return mode_spec(mode).old_side.partition(":")[0].endswith("-old")


def canary_positions(total: int, every: int) -> list[int]:
    """The positions the canary is measured at: 0, every, 2 every, ..., and ``total``."""
    return sorted(set(range(0, int(total), max(1, int(every)))) | {int(total)})


# ----------------------------------------------------------------------------- offline
def mixed_canonical_top_k(parts: list[tuple], item_ids: np.ndarray, k: int) -> np.ndarray:
    """Item ids ``[Q, k]`` (-1 padded) of the exact top-k over a gallery whose rows are scored
    on several sides, by descending canonical score, ties by ascending item id: the live
    index's ranking (:mod:`raycompat.index.canonical`).

    ``parts``: ``(queries [Q, D], gallery [N, D], rows)``: the float32 normalised arrays of
    one side and the gallery rows it scores.  Float32 scores pick the candidates that can
    reach the k-th canonical score (their error bound included); only those are scored
    canonically."""
    n_q = parts[0][0].shape[0]
    out = np.full((n_q, k), -1, np.int64)
    total = sum(int(np.asarray(rows).size) for _, _, rows in parts)
    kk = min(k, total)
    if kk == 0 or n_q == 0:
        return out
    step = max(1, (1 << 22) // max(total, 1))
    for q0 in range(0, n_q, step):
        q1 = min(n_q, q0 + step)
        scores, errors, side_of, row_of = [], [], [], []
        for s, (q, g, rows) in enumerate(parts):
            rows = np.asarray(rows, np.int64)
            sub = g[rows]
            scores.append(q[q0:q1] @ sub.T)
            norm = float(np.sqrt(np.einsum("ij,ij->i", sub, sub).max(initial=0.0)))
            qn = np.sqrt(np.einsum("ij,ij->i", q[q0:q1].astype(np.float64), q[q0:q1]))
            err = float32_score_error(q.shape[1], qn, norm * (1 + 1e-6))
            errors.append(np.repeat(err[:, None], rows.size, axis=1))
            side_of.append(np.full(rows.size, s))
            row_of.append(rows)
        S = np.concatenate(scores, axis=1).astype(np.float64)
        E = np.concatenate(errors, axis=1)
        side_of, row_of = np.concatenate(side_of), np.concatenate(row_of)
        lower = S - E
        bound = -np.partition(-lower, kk - 1, axis=1)[:, kk - 1]
        rq, col = np.nonzero(S + E >= bound[:, None])
        canon = np.empty(rq.size)
        for s, (q, g, _) in enumerate(parts):
            at = side_of[col] == s
            canon[at] = pair_scores_at(q, q0 + rq[at], g, row_of[col[at]])
        ids = item_ids[row_of[col]]
        order = np.lexsort((ids, -canon, rq))
        rq, ids = rq[order], ids[order]
        first = np.searchsorted(rq, np.arange(q1 - q0))
        rank = np.arange(rq.size) - first[rq]
        keep = rank < kk
        out[q0 + rq[keep], rank[keep]] = ids[keep]
    return out


def _canary_data(data: GalleryEmbeddings, canary: CanarySet, new_bundle=None):
    """``data`` with the canary as its queries (the new bundle's modules applied to them)."""
    from raycompat.upgrade.modes import apply_bundle_modules

    n = canary.n_queries
    out = data.with_arrays(
        query_new=canary.vectors,
        query_old=canary.old_vectors,
        query_labels=np.arange(n),
        query_ids=np.arange(n, dtype=np.int64),
        query_rho=None,
        query_rev=None,
    )
    return apply_bundle_modules(out, new_bundle) if new_bundle is not None else out


def offline_canary_curve(
    data: GalleryEmbeddings,
    canary: CanarySet,
    order: np.ndarray,
    mode: str,
    opts: CanaryOptions,
    new_bundle=None,
    positions=None,
) -> dict:
    """The canary curve of a backfill in ``mode`` walking gallery rows ``order``, at
    ``positions`` (default :func:`canary_positions` with ``opts.every``): what the live index
    reports for the same order, the same points, the same numbers."""
    from raycompat.upgrade.modes import SideBuilder

    known = set(np.asarray(data.gallery_ids).tolist())
    for q, rel in enumerate(canary.relevant):
        unknown = [int(i) for i in rel.tolist() if int(i) not in known]
        if unknown:
            raise BackfillInputError(
                f"canary query {q}: relevant item id(s) {unknown[:5]} are not in the gallery"
            )
    cdata = _canary_data(data, canary, new_bundle)
    builder = SideBuilder(cdata)
    spec, old_side, new_side = builder.mode_sides(mode)
    ids, n = np.asarray(data.gallery_ids, np.int64), data.n_items
    k = opts.canary_k
    positions = canary_positions(n, opts.every(n)) if positions is None else positions
    order = np.asarray(order, np.int64)

    def search(p: int) -> np.ndarray:
        is_new = np.zeros(n, dtype=bool)
        is_new[order[:p]] = True
        parts = [
            (old_side.queries, old_side.gallery, np.flatnonzero(~is_new)),
            (new_side.queries, new_side.gallery, np.flatnonzero(is_new)),
        ]
        return mixed_canonical_top_k([pt for pt in parts if pt[2].size], ids, k)

    if canary.old_vectors is not None and stores_old_vectors(mode):
        oo = builder.side("old-old")
        top = mixed_canonical_top_k([(oo.queries, oo.gallery, np.arange(n))], ids, k)
        reference = CanaryReference("old-old", *canary_terms(top, canary, k))
    else:
        reference = CanaryReference("first point", *canary_terms(search(0), canary, k))
    points = [canary_point(p, search(p), canary, reference, opts) for p in positions]
    return {"mode": mode, "reference": reference.kind, "k": k, "points": points}


def write_canary_curves(
    result, data: GalleryEmbeddings, path: str, opts: CanaryOptions, out_dir: str, new_bundle=None
) -> str:
    """``canary.json`` in ``out_dir``: the canary of file ``path`` along every simulated
    (policy, served mode) order of ``result`` (:class:`raycompat.simulator.memory_engine.
    SimulationResult`), as the live index would report it; returns its path."""
    import json
    import os

    from raycompat.upgrade.modes import SERVED_MODES

    canary = CanarySet.read(path)
    curves = []
    for (policy, mode), order in sorted(result.orders.items()):
        if mode in SERVED_MODES:
            curve = offline_canary_curve(data, canary, order, mode, opts, new_bundle)
            curves.append({"policy": policy, **curve})
    out = os.path.join(out_dir, "canary.json")
    doc = {"canary": path, "options": dataclasses.asdict(opts), "curves": curves}
    with open(out, "w") as fh:
        json.dump(doc, fh, indent=1)
    return out
