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


def main(uri: str, groups: int, batch: int) -> None:
    store = open_store(uri)
    ids = store.read_ids()
    dim = store.describe().new_dim
    for b in range(1_000_000):
        members = ids[b % groups :: groups][:batch]
        vectors = np.full((len(members), dim), float(b), dtype=np.float32)
        store.write_new(members, vectors, f"b{b}", b * batch + np.arange(len(members)))
        sys.stdout.write(f"{b}\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
