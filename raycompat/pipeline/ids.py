"""Which item ids a run embeds, cut into fixed-size chunks (the unit of resumability).

A plan is either a contiguous range ``[start, stop)`` or an explicit sorted list of unique
ids (``--ids``: what a backfill batch asks for). Chunk ``k`` always holds the ids at plan
positions ``[k * chunk_size, (k + 1) * chunk_size)``, so the same plan cuts into the same
chunks on every run, and each id belongs to exactly one chunk (exactly-once output).

A model stage runs its rows in :class:`ForwardBatches`: each chunk cut again into sub-batches
of the stage's batch size from the chunk's start, so which rows share a forward pass, and in
which places, follows from their plan positions alone (never from Ray Data's batching).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

import numpy as np

from raycompat.config import ConfigError


@dataclass
class IdPlan:
    """Item ids to embed: ``ids`` (sorted, unique) or the range ``[start, stop)``."""

    chunk_size: int
    start: int = 0
    stop: int = 0
    ids: np.ndarray | None = None

    def __post_init__(self):
        if int(self.chunk_size) < 1:
            raise ConfigError(f"chunk size must be >= 1, got {self.chunk_size}")
        self.chunk_size = int(self.chunk_size)
        if self.ids is not None:
            ids = np.asarray(self.ids, dtype=np.int64).ravel()
            if ids.size and (np.diff(ids) <= 0).any():
                raise ConfigError("item ids must be sorted and unique (use IdPlan.from_ids)")
            self.ids = ids

    @classmethod
    def from_ids(cls, ids, chunk_size: int) -> IdPlan:
        ids = np.asarray(ids, dtype=np.int64).ravel()
        if ids.size == 0:
            raise ConfigError("the id list is empty: nothing to embed")
        if ids.min() < 0:
            raise ConfigError(f"item ids must be >= 0, got {int(ids.min())}")
        return cls(chunk_size, ids=np.unique(ids))

    def __len__(self) -> int:
        return int(self.ids.size) if self.ids is not None else max(0, self.stop - self.start)

    @property
    def num_chunks(self) -> int:
        return -(-len(self) // self.chunk_size)

    def chunk_ids(self, chunk: int) -> np.ndarray:
        """The ids of chunk ``chunk`` in ascending order."""
        lo = chunk * self.chunk_size
        hi = min(lo + self.chunk_size, len(self))
        if not 0 <= lo < max(hi, 1) or lo >= len(self):
            raise IndexError(f"chunk {chunk} out of range [0, {self.num_chunks})")
        if self.ids is not None:
            return self.ids[lo:hi]
        return np.arange(self.start + lo, self.start + hi, dtype=np.int64)

    def chunk_of(self, ids) -> np.ndarray:
        """Chunk index of each id (ids must belong to the plan)."""
        ids = np.asarray(ids, dtype=np.int64)
        pos = np.searchsorted(self.ids, ids) if self.ids is not None else ids - self.start
        return pos // self.chunk_size

    def chunk_length(self, chunk: int) -> int:
        return min(self.chunk_size, len(self) - chunk * self.chunk_size)

    def max_id(self) -> int:
        return int(self.ids[-1]) if self.ids is not None else self.stop - 1

    def describe(self) -> dict:
        """What identifies the plan (recorded in the output manifest)."""
        if self.ids is None:
            return {
                "kind": "range",
                "start": self.start,
                "stop": self.stop,
                "chunk_size": self.chunk_size,
            }
        digest = hashlib.sha256(self.ids.tobytes()).hexdigest()[:16]
        return {
            "kind": "ids",
            "count": int(self.ids.size),
            "sha256": digest,
            "chunk_size": self.chunk_size,
        }


@dataclass(frozen=True)
class ForwardBatches:
    """The fixed sub-batches of a model stage: plan positions ``[0, total)`` in chunks of
    ``chunk_size``, each chunk cut into runs of ``batch_size`` positions from its start (a
    chunk's last run shorter). A row's sub-batch, its length and the row's place in it depend
    only on the row's plan position."""

    chunk_size: int
    total: int
    batch_size: int

    @classmethod
    def of(cls, plan: IdPlan, batch_size: int) -> ForwardBatches:
        return cls(plan.chunk_size, len(plan), int(batch_size))

    def split(self, positions) -> list[tuple[np.ndarray, int, np.ndarray]]:
        """``(rows, length, offsets)`` for every sub-batch that ``positions`` (plan positions,
        e.g. of one Ray Data batch) touch: the indices into ``positions`` of its rows, its full
        length and those rows' places in it; in ascending order of sub-batch."""
        pos = np.asarray(positions, np.int64)
        if pos.size and (pos.min() < 0 or pos.max() >= self.total):
            raise IndexError(
                f"plan positions must be in [0, {self.total}), got {int(pos.min())}.."
                f"{int(pos.max())}"
            )
        chunk, within = np.divmod(pos, self.chunk_size)
        start = chunk * self.chunk_size + within - within % self.batch_size
        end = np.minimum(
            np.minimum(start + self.batch_size, (chunk + 1) * self.chunk_size), self.total
        )
        out = []
        for first in np.unique(start).tolist():
            rows = np.flatnonzero(start == first)
            out.append((rows, int(end[rows[0]]) - first, pos[rows] - first))
        return out


def parse_ids_option(value: str) -> np.ndarray:
    """``--ids``: ``A:B`` (the range A..B-1), or a file of ids (one per line, commas or
    whitespace allowed; ``.npy`` files too)."""
    value = value.strip()
    if ":" in value and not os.path.exists(value):
        lo, _, hi = value.partition(":")
        try:
            a, b = int(lo), int(hi)
        except ValueError:
            raise ConfigError(
                f"--ids {value!r}: a range must look like START:STOP (integers)"
            ) from None
        if not 0 <= a < b:
            raise ConfigError(f"--ids {value!r}: need 0 <= START < STOP")
        return np.arange(a, b, dtype=np.int64)
    if not os.path.isfile(value):
        raise ConfigError(f"--ids {value!r}: not a START:STOP range and no such file")
    if value.endswith(".npy"):
        return np.load(value).astype(np.int64).ravel()
    with open(value) as fh:
        text = fh.read().replace(",", " ").split()
    try:
        return np.array([int(t) for t in text], dtype=np.int64)
    except ValueError as exc:
        raise ConfigError(
            f"--ids file {value}: every entry must be an integer item id ({exc})"
        ) from None
