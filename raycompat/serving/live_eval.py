"""Offline == online: retrieval metrics of a *live* gallery measured through the HTTP endpoint
while the backfill controller upgrades it, at the simulator's grid points.

At each fraction ``t`` the controller is resumed until ``n(t) = floor(t N + 1/2)`` items of
the policy's order are upgraded (:func:`raycompat.upgrade.grid.backfill_counts`, the
simulator's rounding), then the labelled queries are searched through ``POST /search`` and
scored with the same metric functions the simulator uses (docs/methods.md, "Metrics"):
``mAP@k`` (:func:`raycompat.metrics.mean_average_precision_at_k`), ``top1``, ``NFR@1``
(:func:`raycompat.metrics.negative_flip_rate` against old-old top-1 correctness, itself
measured live at t = 0 with the old model's query vectors, ``model="old"``), and the
revisited full ``mAP`` when the search returns the whole gallery (``k >= N``).  At every fraction
the same queries are also searched with ``"exact": true`` (brute force over the live gallery), and
``recall@k`` of the served top-k against that exact top-k is recorded (docs/indexes.md, "Recall"):
1 for the exact index, what an approximate one gives up otherwise.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from raycompat.metrics import correct_at_k, mean_average_precision_at_k, negative_flip_rate
from raycompat.metrics.rank_metrics import METRIC_NAMES, full_ap_from_ranks, positive_pairs
from raycompat.metrics.recall import recall_at_k
from raycompat.upgrade.grid import backfill_counts

__all__ = ["live_metrics", "live_backfill_curve", "old_old_reference", "compare_curves"]


def live_metrics(
    ids: np.ndarray, data, k: int, reference_correct: np.ndarray | None
) -> tuple[dict[str, float], np.ndarray]:
    """Metrics of one result matrix ``ids [Q, k]`` (item ids, -1 padded) on ``data``'s labels."""
    label_of = dict(
        zip(data.gallery_ids.tolist(), np.asarray(data.gallery_labels).tolist(), strict=False)
    )
    index_of = {int(i): j for j, i in enumerate(data.gallery_ids.tolist())}
    ql = np.asarray(data.query_labels)
    rel = np.zeros(ids.shape, dtype=bool)
    for qi in range(ids.shape[0]):
        for r, i in enumerate(ids[qi].tolist()):
            if i >= 0 and label_of[i] == ql[qi]:
                rel[qi, r] = True
    pq, pi, npos = positive_pairs(data.query_labels, data.gallery_labels)
    valid = npos > 0
    names = METRIC_NAMES(k)
    c1 = correct_at_k(rel, 1)
    out = {
        names[0]: mean_average_precision_at_k(rel, npos, k),
        names[2]: float(c1[valid].mean()) if valid.any() else float("nan"),
        names[3]: (
            negative_flip_rate(reference_correct, c1)
            if reference_correct is not None
            else float("nan")
        ),
        names[1]: float("nan"),
    }
    if k >= data.n_items:  # the full ranking: revisited mAP from the positives' ranks
        pos = np.full((ids.shape[0], data.n_items), -1, np.int64)
        for qi in range(ids.shape[0]):
            for r, i in enumerate(ids[qi].tolist()):
                if i >= 0:
                    pos[qi, index_of[i]] = r
        ranks = pos[pq, pi][None, :]
        if (ranks >= 0).all():
            ap = full_ap_from_ranks(ranks, pq, npos)[0]
            out[names[1]] = float(np.nanmean(ap[valid])) if valid.any() else float("nan")
    return out, c1


def _measure_now(client, data, k: int, naive: bool, ref_correct):
    """Every query searched now, served and exact: ``(live metrics, recall@k, recall@k per
    query)``. ``naive``: each query carries its old-model embedding too."""
    old_q = data.query_old if naive else None
    ids, _, _ = client.search(data.query_new, k=k, model="new", old_vectors=old_q)
    exact, _, _ = client.search(data.query_new, k=k, model="new", old_vectors=old_q, exact=True)
    r, per_query = recall_at_k(ids, exact, k)
    m, _ = live_metrics(ids, data, k, ref_correct)
    return m, r, per_query


def live_backfill_curve(
    client,
    data,
    fractions: Sequence[float],
    *,
    policy: str = "random",
    seed: int = 0,
    k: int = 100,
    source: str = "gallery",
    batch_size: int = 64,
    rate: float | None = None,
    log: Callable[[str], None] = print,
) -> dict:
    """Run a live backfill from t = 0 and measure at every fraction (see the module docstring).

    ``client``: a :class:`raycompat.serving.client.ServingClient` (with the admin token);
    ``data``: the gallery's :class:`raycompat.embeddings.gallery.GalleryEmbeddings` (labels,
    ids, query vectors).  Returns ``{"fractions", "counts", "metrics": {name: [..]}, ...}``.
    """
    fractions = np.asarray(fractions, np.float64)
    counts = backfill_counts(fractions, data.n_items)
    k_eff = int(k)
    st = client.status()
    naive = st.get("mode") == "naive_merge"  # each query carries its old-model embedding too
    if st["items"]["new"]:
        raise RuntimeError(f"the live gallery must start with no new-state item, got {st['items']}")
    ref_correct = old_old_reference(client, data, st)
    names = METRIC_NAMES(k_eff)
    metrics = {n: [] for n in names}
    reps, seconds, recall, recall_per_query = [], [], [], []
    t_start = time.perf_counter()
    client.start_backfill(
        policy=policy,
        seed=int(seed),
        batch_size=int(batch_size),
        until=int(counts[0]),
        source=source,
        rate=rate,
        restart=True,
    )
    for j, (t, n) in enumerate(zip(fractions, counts, strict=False)):
        if j:
            client.resume_backfill(until=int(n))
        client.wait_backfill(int(n))
        st = client.status()
        if st["items"]["new"] != int(n):
            raise RuntimeError(
                f"at t={t:.3f} expected {int(n)} new items, the shards hold {st['items']}"
            )
        m, r, per_query = _measure_now(client, data, k_eff, naive, ref_correct)
        recall.append(r)
        recall_per_query.append(per_query)
        for name in names:
            metrics[name].append(m[name])
        reps.append(st["items"])
        seconds.append(time.perf_counter() - t_start)
        log(
            f"  live t={t:5.2f} ({int(n):6d} new): "
            + ", ".join(f"{a}={m[a]:.4f}" for a in names if np.isfinite(m[a]))
            + f", recall@{k_eff}={r:.4f}"
        )
    return {
        "fractions": fractions.tolist(),
        "counts": counts.tolist(),
        "metrics": metrics,
        "recall": recall,
        "recall_per_query": np.stack(recall_per_query, axis=1).tolist(),
        "items": reps,
        "seconds": seconds,
        "policy": policy,
        "seed": int(seed),
        "k": k_eff,
        "source": source,
        "reference_correct_old_old": None if ref_correct is None else int(ref_correct.sum()),
    }


def old_old_reference(client, data, st: dict) -> np.ndarray | None:
    """Top-1 correctness of the old model's queries against the all-old gallery (RACT Eq.12's
    Q+, the NFR reference): measured live while every item is old, else (the adapted mode
    holds no old vectors) by exact search; ``None`` without old query vectors."""
    if data.query_old is None:
        return None
    label_of = dict(
        zip(data.gallery_ids.tolist(), np.asarray(data.gallery_labels).tolist(), strict=False)
    )
    if st["items"]["old"] == data.n_items:
        ids_oo, _, _ = client.search(data.query_old, k=1, model="old")
        top = ids_oo[:, 0]
    else:
        from raycompat.index.search import exact_search

        top = data.gallery_ids[exact_search(data.query_old, data.gallery_old, 1)[1][:, 0]]
    rel = np.array(
        [[t >= 0 and label_of[int(t)] == data.query_labels[qi]] for qi, t in enumerate(top)]
    )
    return correct_at_k(rel, 1)


def compare_curves(live: dict, sim_curve, tol: float = 1e-9) -> dict:
    """Per metric: the largest |live - simulator| over the grid, and whether all are within
    ``tol``."""
    out = {"max_abs_diff": {}, "equal": True}
    for name, vals in live["metrics"].items():
        a = np.asarray(vals, np.float64)
        b = np.asarray(sim_curve.metrics[name], np.float64)
        both_nan = np.isnan(a) & np.isnan(b)
        if np.isnan(a).all():
            continue
        d = float(np.max(np.where(both_nan, 0.0, np.abs(a - b))))
        out["max_abs_diff"][name] = d
        if not d <= tol:
            out["equal"] = False
    return out
