"""Class-balanced P x K batches, and batches balanced between old and new classes
(docs/methods.md, "Batches").

A contrastive loss whose positives are the other images of the anchor's class (RM Eq.10-13)
needs several images of a class in one batch: uniformly random batches of 64 over 1,600 classes
hold a same-class pair for only a few anchors. :class:`ClassBalancedBatches` yields global
batches of ``K`` images of each of ``P = batch_size / K`` distinct classes, the batches of
metric learning. Every class appears once per cycle through the classes (a seeded permutation
per cycle), every image once per cycle through its class; a class with fewer than ``K`` images
repeats some. An epoch has ``len(labels) // batch_size`` batches, as many as the random
sampler's. With ``W`` DDP workers, worker ``r`` takes the ``r``-th of ``W`` equal slices of each
global batch, whole classes when ``K`` divides the slice.

:class:`OldNewBatches` draws a fixed share of every global batch from the items of the classes
the old model knows and the rest from the other items, as the released d-Simplex code balances
its rehearsal memory against a task's new classes (each side in seeded permutations; every
worker's slice holds the same shares).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from torch.utils.data import Sampler

from raycompat.config import ConfigError

__all__ = ["ClassBalancedBatches", "OldNewBatches", "check_class_batches"]


def check_class_batches(
    batch_size: int, images_per_class: int, workers: int, classes: int | None
) -> None:
    """``ConfigError`` unless ``K`` divides every worker's slice of the batch and the split has
    ``P = batch_size / K`` classes at least."""
    k, w = images_per_class, max(1, workers)
    if batch_size % (k * w):
        raise ConfigError(
            f"batch_images_per_class {k}: batch_size {batch_size} must be a multiple of "
            f"{k} x {w} worker(s), so that every worker's batch holds whole classes"
        )
    if classes is not None and batch_size // k > classes:
        raise ConfigError(
            f"batch_images_per_class {k}: a batch of {batch_size} needs {batch_size // k} "
            f"classes, the split has {classes}"
        )


class _Cycle:
    """Seeded permutations of ``items``, one per call."""

    def __init__(self, items: np.ndarray, rng: np.random.Generator):
        self.items, self.rng = items, rng

    def __len__(self) -> int:
        return len(self.items)

    def __call__(self) -> list[int]:
        return [int(x) for x in self.rng.permutation(self.items)]


def _take(queue: list, count: int, cycle: _Cycle) -> list[int]:
    """The next ``count`` entries of ``queue`` (consumed). A short queue is topped up with a
    fresh cycle less what it still holds, so that no entry is taken twice at once. A cycle
    shorter than ``count`` (a class of fewer than ``K`` images) gives all its entries, then
    repeats from further cycles."""
    if len(cycle) < count:
        out: list[int] = []
        while len(out) < count:
            out += cycle()
        return out[:count]
    if len(queue) < count:
        queue += [x for x in cycle() if x not in queue]
    taken = queue[:count]
    del queue[:count]
    return taken


class ClassBalancedBatches(Sampler[list[int]]):
    """This worker's slices of P x K global batches of item indices (module docstring); an
    epoch's batches are a function of ``(seed, epoch)`` only."""

    def __init__(
        self,
        labels,
        batch_size: int,
        images_per_class: int,
        rank: int = 0,
        world: int = 1,
        seed: int = 0,
    ):
        self.labels = np.asarray(labels, dtype=np.int64)
        self.classes = np.unique(self.labels)
        check_class_batches(batch_size, images_per_class, world, len(self.classes))
        self.batch_size, self.k = int(batch_size), int(images_per_class)
        self.rank, self.world, self.seed = int(rank), int(world), int(seed)
        self.epoch = 0
        self._members = {int(c): np.flatnonzero(self.labels == c) for c in self.classes}

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return len(self.labels) // self.batch_size

    def global_batches(self) -> list[np.ndarray]:
        """The epoch's global batches, ``[P * K]`` item indices each, class by class."""
        rng = np.random.default_rng([self.seed, self.epoch, 0xBA7C])
        p = self.batch_size // self.k
        class_cycle, class_queue = _Cycle(self.classes, rng), []
        image_cycles = {c: _Cycle(m, rng) for c, m in self._members.items()}
        image_queues: dict[int, list] = {c: [] for c in self._members}
        batches = []
        for _ in range(len(self)):
            chosen = _take(class_queue, p, class_cycle)
            batches.append(
                np.concatenate(
                    [_take(image_queues[c], self.k, image_cycles[c]) for c in chosen]
                ).astype(np.int64)
            )
        return batches

    def __iter__(self) -> Iterator[list[int]]:
        local = self.batch_size // self.world
        for batch in self.global_batches():
            yield batch[self.rank * local : (self.rank + 1) * local].tolist()


class OldNewBatches(Sampler[list[int]]):
    """This worker's slices of global batches of which ``round(old_fraction * batch_size)``
    items are of ``old_classes``, the others of the remaining classes (module docstring); an
    epoch's batches are a function of ``(seed, epoch)`` only; ``len(labels) // batch_size`` of
    them."""

    def __init__(
        self,
        labels,
        batch_size: int,
        old_classes,
        old_fraction: float,
        rank: int = 0,
        world: int = 1,
        seed: int = 0,
    ):
        self.labels = np.asarray(labels, dtype=np.int64)
        known = np.isin(self.labels, np.asarray(list(old_classes), dtype=np.int64))
        self.sides = (np.flatnonzero(known), np.flatnonzero(~known))
        self.batch_size, self.world = int(batch_size), int(world)
        old = round(old_fraction * batch_size)
        self.counts = (old, self.batch_size - old)
        if old % world or (self.batch_size - old) % world:
            raise ConfigError(
                f"batch_old_fraction {old_fraction}: {old} old-class and {self.batch_size - old} "
                f"other items per batch must each split evenly over {world} worker(s)"
            )
        for side, count, what in zip(self.sides, self.counts, ("old", "new"), strict=True):
            if count and not len(side):
                raise ConfigError(
                    f"batch_old_fraction {old_fraction}: the split has no item of an {what} class"
                )
        self.rank, self.seed, self.epoch = int(rank), int(seed), 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return len(self.labels) // self.batch_size

    def global_batches(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """The epoch's global batches as ``(old-class items, other items)``."""
        rng = np.random.default_rng([self.seed, self.epoch, 0x01D])
        cycles = [_Cycle(side, rng) for side in self.sides]
        queues: list[list] = [[], []]
        return [
            tuple(
                np.asarray(_take(queues[i], self.counts[i], cycles[i]), dtype=np.int64)
                for i in (0, 1)
            )
            for _ in range(len(self))
        ]

    def __iter__(self) -> Iterator[list[int]]:
        for halves in self.global_batches():
            parts = []
            for side in halves:
                share = len(side) // self.world
                parts += side[self.rank * share : (self.rank + 1) * share].tolist()
            yield parts
