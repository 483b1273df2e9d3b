"""Move a stopped live index's items to a new shard count, exactly once (reshard-index).

docs/architecture.md, "Serving state".  Every item goes to the shard its id is placed on under
the new count (:func:`raycompat.serving.placement.shard_of`), keeping its representation and
vector.  The old shards are read (snapshot + log) while holding their locks, so a running index
is refused; the new shards are written as snapshots into ``shards-g<k>/`` and checked (every id
exactly once, on its shard, the same counts per representation); only then does the state
directory's ``layout.json`` switch to them (one atomic rename: a crash before it leaves the old
index as it was).  The old shards' files are kept unless ``--remove-old``; the backfill
checkpoint holds item ids, so a backfill resumes where it stopped.

Needs memory for every vector of the index on the machine that runs it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import time
from dataclasses import dataclass

import numpy as np

from raycompat.config import (
    ConfigError,
    add_options,
    make_parser,
    option,
    options_from_args,
    positive,
)
from raycompat.console import job_main
from raycompat.serving.durability import read_snapshot, state_directory, write_snapshot
from raycompat.serving.layout import StateLayout, read_layout, stored_shards, write_layout
from raycompat.serving.placement import split_by_shard
from raycompat.serving.state import REPRESENTATIONS, ShardLockedError, ShardState

__all__ = ["ReshardOptions", "ReshardResult", "reshard", "main", "build_parser"]


@dataclass(frozen=True)
class ReshardOptions:
    """Flags of ``raycompat reshard-index``."""

    state_dir: str = option("serving_state", help="the stopped index's state directory")
    num_shards: int = positive(2, help="the new number of shards")
    remove_old: bool = option(
        False, help="delete the old shards' files once the new layout is committed"
    )
    fsync: bool = option(True, help="fsync the new snapshots and the layout")


@dataclass(frozen=True)
class ReshardResult:
    """What a reshard moved: items per representation, shard counts, where the files are."""

    items: dict[str, int]
    old_shards: int
    new_shards: int
    per_shard: list[int]
    new_root: str
    old_root: str
    seconds: float


def _current_layout(state_dir: str) -> StateLayout:
    layout = read_layout(state_dir)
    if layout is not None:
        return layout
    stored = stored_shards(state_dir)
    if not stored:
        raise ConfigError(f"reshard: {state_dir} holds no shard snapshots")
    return StateLayout(num_shards=len(stored))


def _open_old(state_dir: str, layout: StateLayout) -> list[ShardState]:
    """Every old shard, recovered and locked (``ConfigError`` if an index still runs)."""
    states = []
    try:
        for i in range(layout.num_shards):
            d = layout.shard_dir(state_dir, i)
            snap = read_snapshot(d)
            if snap is None:
                raise ConfigError(f"reshard: {d} holds no snapshot")
            dims = layout.dims or snap[2]["dims"]
            states.append(ShardState(d, dims, fsync=False, exclusive=True))
    except ShardLockedError as exc:
        for st in states:
            st.close()
        raise ConfigError(f"reshard: {exc}") from None
    return states


def _split(states: list[ShardState], n_new: int) -> list[dict[str, tuple]]:
    """``[{rep: (ids, vectors)}]`` per new shard."""
    parts: list[dict[str, list]] = [{} for _ in range(n_new)]
    for st in states:
        for rep, ix in st.reps.items():
            ids, vecs = ix.export()
            for j, pos in enumerate(split_by_shard(ids, n_new)):
                parts[j].setdefault(rep, []).append((ids[pos], vecs[pos]))
    out = []
    for j in range(n_new):
        merged = {}
        for rep, chunks in parts[j].items():
            ids = np.concatenate([c[0] for c in chunks])
            order = np.argsort(ids, kind="stable")
            merged[rep] = (ids[order], np.concatenate([c[1] for c in chunks])[order])
        out.append(merged)
    return out


def _check_exactly_once(states: list[ShardState], new_parts: list[dict], n_new: int) -> None:
    """Every old item is in exactly one new shard, the one it is placed on, same state."""
    from raycompat.serving.placement import shard_of

    for rep in REPRESENTATIONS:
        old = np.sort(
            np.concatenate([st.reps[rep].export()[0] for st in states if rep in st.reps] or [[]])
        )
        new_chunks = [p[rep][0] for p in new_parts if rep in p]
        new = np.sort(np.concatenate(new_chunks)) if new_chunks else np.zeros(0, np.int64)
        if not np.array_equal(old.astype(np.int64), new):
            raise RuntimeError(f"reshard check failed: {rep} items differ after the move")
        for j, p in enumerate(new_parts):
            if rep in p and (shard_of(p[rep][0], n_new) != j).any():
                raise RuntimeError(
                    f"reshard check failed: an item on new shard {j} belongs elsewhere"
                )


def reshard(
    state_dir: str, num_shards: int, remove_old: bool = False, fsync: bool = True
) -> ReshardResult:
    """Move every item of the stopped index in ``state_dir`` to ``num_shards`` shards."""
    t0 = time.perf_counter()
    state_dir = state_directory(state_dir, "reshard: state_dir")
    layout = _current_layout(state_dir)
    if layout.num_shards == num_shards:
        raise ConfigError(f"reshard: {state_dir} already has {num_shards} shards")
    states = _open_old(state_dir, layout)
    try:
        dims = layout.dims or states[0].dims
        new_parts = _split(states, num_shards)
        _check_exactly_once(states, new_parts, num_shards)
        new = dataclasses.replace(
            layout,
            num_shards=num_shards,
            dims=dims,
            shard_root=f"shards-g{layout.generation + 1}",
            generation=layout.generation + 1,
        )
        _write_new_shards(state_dir, new, new_parts, dims, fsync)
        write_layout(state_dir, new)  # the commit point
    finally:
        for st in states:
            st.close()
    old_root = os.path.normpath(os.path.join(state_dir, layout.shard_root))
    if remove_old:
        _remove_old(state_dir, layout)
    per_shard = [sum(int(v[0].size) for v in p.values()) for p in new_parts]
    items = {r: sum(int(p[r][0].size) for p in new_parts if r in p) for r in REPRESENTATIONS}
    return ReshardResult(
        items,
        layout.num_shards,
        num_shards,
        per_shard,
        os.path.join(state_dir, new.shard_root),
        old_root,
        time.perf_counter() - t0,
    )


def _write_new_shards(state_dir, new: StateLayout, parts, dims, fsync: bool) -> None:
    root = os.path.join(state_dir, new.shard_root)
    if os.path.exists(root):  # left by a reshard that crashed before its commit: not in use
        shutil.rmtree(root)
    for j, p in enumerate(parts):
        full = {
            r: p.get(r, (np.zeros(0, np.int64), np.zeros((0, dims[r]), np.float32))) for r in dims
        }
        write_snapshot(
            new.shard_dir(state_dir, j), 0, full, dims, info={"resharded": True}, fsync=fsync
        )


def _remove_old(state_dir: str, layout: StateLayout) -> None:
    for i in range(layout.num_shards):
        shutil.rmtree(layout.shard_dir(state_dir, i), ignore_errors=True)
    root = os.path.join(state_dir, layout.shard_root)
    if layout.shard_root != "." and os.path.isdir(root) and not os.listdir(root):
        os.rmdir(root)


def build_parser() -> argparse.ArgumentParser:
    parser = make_parser(
        "reshard-index",
        description="Move a stopped live index's items to a new number of shards, exactly once.",
    )
    add_options(parser, ReshardOptions)
    return parser


@job_main
def main(argv: list[str] | None = None) -> int:
    opts = options_from_args(ReshardOptions, build_parser().parse_args(argv))
    res = reshard(opts.state_dir, opts.num_shards, opts.remove_old, opts.fsync)
    print(
        f"[reshard] {sum(res.items.values())} items ({res.items}) moved from {res.old_shards} "
        f"to {res.new_shards} shards {res.per_shard} in {res.seconds:.1f} s; new shards in "
        f"{res.new_root}"
        + ("" if opts.remove_old else f"; the old shards' files stay in {res.old_root}"),
        flush=True,
    )
    return 0
