"""Child process of test_stores_kill.py: upgrades groups of a store's items in a loop, one
``write_new`` per batch, and prints each batch number once the call has returned. The parent
kills it with SIGKILL mid-run.

Batch ``b`` writes group ``b % groups`` (items ``groups`` apart in id order): new vectors all
equal to ``b``, fingerprint ``b<b>``, positions ``b * batch + j``.
"""

from __future__ import annotations

import sys

import numpy as np

from raycompat.stores import open_store


def batch_vector(b: int, dim: int) -> np.ndarray:
    """Batch ``b``'s unit vector (a store keeps vectors L2-normalised)."""
    v = np.zeros(dim, np.float32)
    v[0], v[1] = np.cos(b / 1000.0), np.sin(b / 1000.0)
    return v


def main(uri: str, groups: int, batch: int) -> None:
    store = open_store(uri)
    ids = store.read_ids()
    dim = store.describe().new_dim
    for b in range(1_000_000):
        members = ids[b % groups :: groups][:batch]
        vectors = np.tile(batch_vector(b, dim), (len(members), 1))
        store.write_new(members, vectors, f"b{b}", b * batch + np.arange(len(members)))
        sys.stdout.write(f"{b}\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
