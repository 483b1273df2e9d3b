"""What a serving state directory was built for, recorded in ``<state_dir>/layout.json`` and
checked before anything is deployed on it (docs/architecture.md, "Serving state").

Items are placed on shards by their id modulo the shard count
(:mod:`raycompat.serving.placement`), so a state written with one shard count and served with
another would hold items on the wrong shards: some served twice, some never found.  The same
goes for other dimensions, modes or models.  :func:`ensure_layout` therefore records the layout
of a new state directory and refuses a different one with an error naming every difference;
``raycompat reshard-index`` (:mod:`raycompat.serving.reshard`) is the one way to change the
shard count of a stored index.

A layout names the folder its shards live in (``shard_root``, relative to the state
directory): ``.`` for ``shard-<i>`` directly in it, ``shards-g<k>`` after the k-th reshard.
Replacing ``layout.json`` (atomically) is what switches an index to a new set of shards.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass

from raycompat.config import ConfigError
from raycompat.serving.durability import SNAPSHOT_NAME, atomic_write

__all__ = [
    "LAYOUT_NAME",
    "PLACEMENT",
    "StateLayout",
    "ensure_layout",
    "layout_of_plan",
    "read_layout",
    "write_layout",
    "stored_shards",
]

LAYOUT_NAME = "layout.json"
#: the placement rule (:func:`raycompat.serving.placement.shard_of`) a layout was written with
PLACEMENT = "splitmix64-mod-v1"


@dataclass(frozen=True)
class StateLayout:
    """The layout of a state directory: shard count, placement, dims, mode, models, items."""

    num_shards: int
    placement: str = PLACEMENT
    dims: dict[str, int] | None = None
    mode: str | None = None
    old_model: str | None = None
    new_model: str | None = None
    n_items: int | None = None
    shard_root: str = "."
    generation: int = 0

    def shard_dir(self, state_dir: str, shard: int) -> str:
        """Where shard ``shard`` keeps its snapshot and log."""
        return os.path.normpath(os.path.join(state_dir, self.shard_root, f"shard-{int(shard)}"))

    def differences(self, other: StateLayout) -> list[str]:
        """``"name: stored X, requested Y"`` for every field (except where shards live) that
        differs; a field recorded as ``None`` matches anything."""
        out = []
        for f in ("num_shards", "placement", "dims", "mode", "old_model", "new_model", "n_items"):
            mine, theirs = getattr(self, f), getattr(other, f)
            if mine is not None and theirs is not None and mine != theirs:
                out.append(f"{f}: stored {mine}, requested {theirs}")
        return out


def _model_id(version) -> str | None:
    if version is None:
        return None
    return version.manifest_sha256 or version.path


def layout_of_plan(plan) -> StateLayout:
    """The layout a :class:`~raycompat.serving.plan.ServingPlan` asks for."""
    return StateLayout(
        num_shards=plan.config.num_shards,
        dims=plan.dims.as_dict(),
        mode=plan.config.mode,
        old_model=_model_id(plan.old_model),
        new_model=_model_id(plan.new_model),
        n_items=plan.n_items,
    )


def read_layout(state_dir: str) -> StateLayout | None:
    """The recorded layout, or ``None``; ``ConfigError`` naming the file when it is unreadable."""
    path = os.path.join(state_dir, LAYOUT_NAME)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as fh:
            return StateLayout(**json.load(fh))
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"serving state layout {path} is unreadable: {exc}") from None


def write_layout(state_dir: str, layout: StateLayout) -> None:
    """Atomically replace ``layout.json`` (fsynced: this is the commit point of a reshard)."""
    os.makedirs(state_dir, exist_ok=True)
    data = json.dumps(dataclasses.asdict(layout), indent=1).encode()
    atomic_write(
        os.path.join(state_dir, LAYOUT_NAME), lambda fh: fh.write(data), "writing the state layout"
    )


def stored_shards(state_dir: str, shard_root: str = ".") -> list[int]:
    """Indexes of the ``shard-<i>`` folders under ``shard_root`` that hold a snapshot."""
    root = os.path.join(state_dir, shard_root)
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = re.fullmatch(r"shard-(\d+)", name)
        if m and os.path.exists(os.path.join(root, name, SNAPSHOT_NAME)):
            found.append(int(m.group(1)))
    return sorted(found)


def _reshard_hint(state_dir: str, n: int) -> str:
    return f"raycompat reshard-index --state-dir {state_dir} --num-shards {n}"


def ensure_layout(plan) -> StateLayout:
    """Check the plan against the state directory's layout (recording it on a new directory);
    ``ConfigError`` naming every difference, and for a shard count the reshard command."""
    state_dir = plan.config.state_dir
    want = layout_of_plan(plan)
    have = read_layout(state_dir)
    if have is None:
        have = _legacy_layout(state_dir, want)
    stored = stored_shards(state_dir, have.shard_root)
    if stored:
        diffs = have.differences(want)
        if diffs:
            hint = ""
            if have.num_shards != want.num_shards:
                hint = (
                    f"; to change the shard count, stop the index and run "
                    f"`{_reshard_hint(state_dir, want.num_shards)}`"
                )
            raise ConfigError(
                f"serving state {state_dir} was written with a different layout "
                f"({'; '.join(diffs)}): refusing to serve it{hint}, or use a new --state-dir"
            )
    merged = dataclasses.replace(want, shard_root=have.shard_root, generation=have.generation)
    if merged != have or not os.path.exists(os.path.join(state_dir, LAYOUT_NAME)):
        write_layout(state_dir, merged)
    return merged


def _legacy_layout(state_dir: str, want: StateLayout) -> StateLayout:
    """A directory written before layouts were recorded: its shard count is the number of
    ``shard-<i>`` folders holding a snapshot (they must be ``0 .. n-1``)."""
    stored = stored_shards(state_dir)
    if not stored:
        return dataclasses.replace(want)
    if stored != list(range(len(stored))):
        names = ", ".join(f"shard-{i}" for i in stored)
        raise ConfigError(f"serving state {state_dir}: shard folders {names} are not 0..n-1")
    return StateLayout(num_shards=len(stored))
