"""Move a stopped live index's items to a new shard count, exactly once (reshard-index).

docs/architecture.md, "Serving state".  Every item goes to the shard its id is placed on under
the new count (:func:`raycompat.serving.placement.shard_of`), keeping its representation,
vector and model fingerprint, and the old vector it keeps for a rollback.  The old shards are
read (snapshot + log) while holding their locks, so a running index is refused; the new shards
are written as snapshots into ``shards-g<k>/`` and checked (every id exactly once, on its
shard, the same counts per representation); only then does the state directory's
``layout.json`` switch to them (one atomic rename: a crash before it leaves the old index as it
was).  The old shards' files are kept unless ``--remove-old``; the backfill checkpoint holds
item ids, so a backfill resumes where it stopped.

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
from raycompat.serving.shard_content import ShardContent
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


def _split(contents: list[ShardContent], n_new: int) -> list[ShardContent]:
    """The content of every new shard from the old shards' ``contents``: items with their
    models, and the old vectors kept for a rollback (:mod:`raycompat.serving.shard_content`)."""
    pieces = [c.split(lambda ids: split_by_shard(ids, n_new)) for c in contents]
    return [ShardContent.merge([p[j] for p in pieces]) for j in range(n_new)]


def _check_exactly_once(old_contents: list[ShardContent], new_parts: list[ShardContent], n_new):
    """Every old item (and kept vector) is in exactly one new shard, the one it is placed on,
    in the same representation."""
    from raycompat.serving.placement import shard_of

    for attr in ("items", "kept"):
        old_parts = [getattr(c, attr) for c in old_contents]
        for rep in REPRESENTATIONS:
            old_chunks = [p[rep][0] for p in old_parts if rep in p]
            old = np.sort(np.concatenate(old_chunks)) if old_chunks else np.zeros(0, np.int64)
            new_chunks = [getattr(p, attr)[rep][0] for p in new_parts if rep in getattr(p, attr)]
            new = np.sort(np.concatenate(new_chunks)) if new_chunks else np.zeros(0, np.int64)
            if not np.array_equal(old.astype(np.int64), new):
                raise RuntimeError(f"reshard check failed: {attr} {rep} differ after the move")
            for j, p in enumerate(new_parts):
                part = getattr(p, attr).get(rep)
                if part is not None and (shard_of(part[0], n_new) != j).any():
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
        contents = [st.mem.export() for st in states]
        new_parts = _split(contents, num_shards)
        _check_exactly_once(contents, new_parts, num_shards)
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
    per_shard = [p.count() for p in new_parts]
    items = {
        r: sum(int(p.items[r][0].size) for p in new_parts if r in p.items) for r in REPRESENTATIONS
    }
    return ReshardResult(
        items,
        layout.num_shards,
        num_shards,
        per_shard,
        os.path.join(state_dir, new.shard_root),
        old_root,
        time.perf_counter() - t0,
    )


def _write_new_shards(state_dir, new: StateLayout, parts: list[ShardContent], dims, fsync):
    root = os.path.join(state_dir, new.shard_root)
    if os.path.exists(root):  # left by a reshard that crashed before its commit: not in use
        shutil.rmtree(root)
    for j, content in enumerate(parts):
        content.dims = dict(dims)
        snap_parts, arrays, models = content.snapshot_arrays()
        write_snapshot(
            new.shard_dir(state_dir, j),
            0,
            snap_parts,
            dims,
            info={"resharded": True},
            fsync=fsync,
            arrays=arrays,
            models=models,
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
