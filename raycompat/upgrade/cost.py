"""Wall-clock cost model of a backfill: simulated time to reach each grid point.

Backfilling item by item at a constant rate of ``items_per_s_per_gpu`` new
embeddings per second on each of ``num_gpus`` GPUs (or any accelerator/worker),
reaching ``n(t)`` backfilled items (the grid's rounding rule, see
:mod:`raycompat.upgrade.grid`) takes

    seconds(t) = n(t) / (items_per_s_per_gpu * num_gpus).

The per-GPU rate is either given or measured (:func:`measure_items_per_s`,
forward passes of the new embedder on random inputs of the model's size).
``device`` says what the rate was measured on: ``"gpu"`` (a given rate, or one
measured on CUDA) labels it "items/s per GPU"; any other device (``"cpu"``)
labels it "items/s on cpu", and ``num_gpus`` counts such workers.

Items of unequal cost (docs/methods.md, "cost-aware"): with a cost column (``unit``: its
name; bytes of the image, pixels, a storage tier's price) the rate counts cost units per second
and the time axis is the summed cost of what was backfilled,

    seconds(t) = sum of c_i over the first n(t) items of the order / (rate * num_gpus),

so :meth:`CostModel.seconds` takes that sum (``work``) instead of the count.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import numpy as np

from raycompat.embeddings.gallery import BackfillInputError

__all__ = ["CostModel", "measure_items_per_s"]


@dataclass
class CostModel:
    """``items_per_s_per_gpu`` x ``num_gpus`` -> seconds to backfill ``n`` items.

    ``items_per_s_per_gpu`` is the rate of one device of kind ``device`` (``"gpu"``, or
    the device it was measured on, e.g. ``"cpu"``); the labels say which.
    """

    items_per_s_per_gpu: float
    num_gpus: int = 1
    source: str = "given"  # "given" or "measured: ..."
    device: str = "gpu"
    #: what the rate counts: ``items``, or the cost column whose units it counts
    unit: str = "items"

    def __post_init__(self):
        r = self.items_per_s_per_gpu
        if r is None or not np.isfinite(r) or r <= 0:
            raise BackfillInputError(f"items per second per GPU must be > 0, got {r!r}")
        if int(self.num_gpus) != self.num_gpus or self.num_gpus < 1:
            raise BackfillInputError(
                f"number of GPUs must be a positive integer, got {self.num_gpus!r}"
            )
        self.items_per_s_per_gpu = float(r)
        self.num_gpus = int(self.num_gpus)
        self.device = str(self.device).strip().lower() or "gpu"
        self.unit = str(self.unit).strip() or "items"

    @property
    def items_per_s(self) -> float:
        return self.items_per_s_per_gpu * self.num_gpus

    @property
    def on_gpu(self) -> bool:
        return self.device == "gpu" or self.device.startswith("cuda")

    @property
    def by_cost(self) -> bool:
        """Whether the rate counts a cost column's units (the time axis sums the costs)."""
        return self.unit != "items"

    @property
    def rate_label(self) -> str:
        """The rate's unit: ``"items/s per GPU"``, ``"items/s on cpu"``, or ``"<unit>/s per GPU"``
        with a cost column."""
        return f"{self.unit}/s per GPU" if self.on_gpu else f"{self.unit}/s on {self.device}"

    @property
    def workers_label(self) -> str:
        """What ``num_gpus`` counts: ``"GPU(s)"`` or ``"cpu worker(s)"``."""
        return "GPU(s)" if self.on_gpu else f"{self.device} worker(s)"

    def describe(self) -> str:
        """``"<rate> items/s per GPU x <n> GPU(s)"`` (or ``on cpu`` / ``cpu worker(s)``)."""
        return (
            f"{self.items_per_s_per_gpu:g} {self.rate_label} x {self.num_gpus} {self.workers_label}"
        )

    def seconds(self, work) -> np.ndarray:
        """Simulated seconds to backfill ``work``: a count of items, or with a cost column
        (:attr:`by_cost`) the summed cost of the items backfilled (float64 array)."""
        return np.asarray(work, dtype=np.float64) / self.items_per_s

    def to_dict(self) -> dict:
        d = asdict(self)
        d["items_per_s"] = self.items_per_s
        d["rate_label"] = self.rate_label
        return d


def measure_items_per_s(
    bundle, *, batch_size: int = 32, repeats: int = 2, device: str = "cpu", warmup: int = 1
) -> float:
    """Items/s of ``bundle.embedder`` on random inputs shaped like its training images.

    Uses ``manifest['in_chans']`` and ``manifest['resolution']`` (defaults 1 and 32).
    Returns the best rate over ``repeats`` timed batches after ``warmup`` batches.
    """
    import torch

    manifest = getattr(bundle, "manifest", {}) or {}
    c = int(manifest.get("in_chans", 1))
    r = int(manifest.get("resolution", 32))
    emb = bundle.embedder.to(device).eval()
    x = torch.randn(batch_size, c, r, r, device=device)
    best = 0.0
    with torch.no_grad():
        for i in range(warmup + repeats):
            if device != "cpu" and torch.cuda.is_available():
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            emb(x)
            if device != "cpu" and torch.cuda.is_available():
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            if i >= warmup and dt > 0:
                best = max(best, batch_size / dt)
    return best
