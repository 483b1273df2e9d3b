"""The per-query samples behind every number of a reproduction, and the bootstrap over them.

docs/methods.md, "Uncertainty". Each number of the report (a retrieval metric of a model pair
on a test set, or a backfill curve) is kept as per-query terms, one row per training seed, under
a key:

* ``("pair", test set, "m_oo" | "m_nstar")`` and ``("pair", test set, method, "m_oo" | "m_nn"
  | "m_no" | "m_nadapted" | "m_cross")``: ``{metric: Sample}`` (mAP@100, mAP, top1, top5, top10);
* ``("curve", scenario, method, policy, mode)``: ``{metric: Sample}`` over the grid points
  (mAP@100, mAP, top1, NFR@1); ``("ref", scenario, method, reference)``: the static references.

The query set of a sample is its scenario (test sets of one scenario share its queries, so
their comparisons are paired). ``save``/``load`` keep everything in ``samples.npz`` beside the
report, so the claims can be decided again from disk.
"""

from __future__ import annotations

import json

import numpy as np

from raycompat.metrics.bootstrap import Bootstrap, BootstrapOptions, Interval, Sample

__all__ = ["Evidence"]


class Evidence:
    """Samples by key (see the module docstring) and the :class:`Bootstrap` over them."""

    def __init__(self, options: BootstrapOptions | None = None, seeds: int = 1):
        self.options = options or BootstrapOptions()
        self.seeds = int(seeds)
        self.bootstrap = Bootstrap(self.options, self.seeds)
        self.query_labels: dict[str, np.ndarray] = {}
        self._per_seed: dict[tuple, list] = {}

    def add_query_set(self, name: str, labels) -> None:
        labels = np.asarray(labels)
        known = self.query_labels.get(name)
        if known is not None and not np.array_equal(known, labels):
            raise ValueError(f"query set {name!r} registered twice with other query labels")
        self.query_labels[name] = labels
        self.bootstrap.add_query_set(name, labels)

    def put(self, key: tuple, samples: dict[str, Sample], seed_index: int) -> None:
        """The samples of ``key`` measured with the ``seed_index``-th training seed."""
        slots = self._per_seed.setdefault(tuple(key), [None] * self.seeds)
        slots[seed_index] = samples

    def latest(self, key: tuple, seed_index: int) -> dict[str, Sample]:
        """The samples ``put`` under ``key`` for seed ``seed_index``."""
        return self._per_seed[tuple(key)][seed_index]

    def get(self, key: tuple) -> dict[str, Sample] | None:
        """``{metric: Sample}`` with every seed stacked, or None if a seed lacks ``key``."""
        slots = self._per_seed.get(tuple(key))
        if not slots or any(s is None for s in slots):
            return None
        out = {}
        for metric in slots[0]:
            if any(metric not in s for s in slots):
                continue
            stacked = slots[0][metric]
            for s in slots[1:]:
                stacked = stacked.stacked(s[metric])
            out[metric] = stacked
        return out

    def sample(self, key: tuple, metric: str) -> Sample | None:
        got = self.get(key)
        return None if got is None else got.get(metric)

    def interval(self, statistic=None, **samples: Sample) -> Interval:
        return self.bootstrap.interval(statistic, **samples)

    def metric_interval(self, key: tuple, metric: str) -> Interval | None:
        s = self.sample(key, metric)
        return None if s is None else self.interval(value=s)

    # -- on disk --------------------------------------------------------------------------
    def save(self, path: str) -> None:
        """Every sample (all seeds stacked) and the query labels, in one ``.npz``."""
        arrays, index = {}, []
        for n, (name, labels) in enumerate(sorted(self.query_labels.items())):
            arrays[f"labels{n}"] = labels
            index.append(["labels", name, f"labels{n}"])
        for key in sorted(self._per_seed, key=repr):
            got = self.get(key)
            for metric, s in (got or {}).items():
                i = len(index)
                arrays[f"num{i}"], arrays[f"den{i}"] = s.num, s.den
                index.append(["sample", list(key), metric, s.query_set, i])
        meta = dict(seeds=self.seeds, options=vars(self.options).copy(), index=index)
        arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
        np.savez_compressed(path, **arrays)

    @classmethod
    def load(cls, path: str) -> Evidence:
        with np.load(path) as z:
            meta = json.loads(bytes(z["meta"]).decode())
            ev = cls(BootstrapOptions(**meta["options"]), meta["seeds"])
            for entry in meta["index"]:
                if entry[0] == "labels":
                    ev.add_query_set(entry[1], z[entry[2]])
            for entry in meta["index"]:
                if entry[0] != "sample":
                    continue
                _, key, metric, qset, i = entry
                num, den = z[f"num{i}"], z[f"den{i}"]
                for s in range(ev.seeds):
                    slots = ev._per_seed.setdefault(tuple(key), [None] * ev.seeds)
                    slots[s] = slots[s] or {}
                    slots[s][metric] = Sample(qset, num[s : s + 1], den[s : s + 1])
        return ev
