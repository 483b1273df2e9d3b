"""What a shard holds, as one value: every item's vector by representation with the model that
produced it, and the old vectors kept for a rollback -- the snapshot's arrays
(:mod:`raycompat.serving.durability`, format 2) and what ``reshard-index`` moves.

Models are fingerprints (:mod:`raycompat.serving.identity`), stored per item as a code into the
shard's :class:`ModelTable`; ``""`` is a vector whose model was not recorded (written before
model identity), which a served shard reads as its representation's default model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["ModelTable", "ShardContent", "Part"]

#: ``(ids ascending, float32 vectors [n, dim], model codes [n])``
Part = tuple[np.ndarray, np.ndarray, np.ndarray]


class ModelTable:
    """Fingerprint <-> small integer code, in the order fingerprints were first seen."""

    def __init__(self, names=()):
        self.names: list[str] = []
        self._code: dict[str, int] = {}
        for name in names:
            self.code(name)

    def code(self, name: str) -> int:
        if name not in self._code:
            if len(self.names) >= 65535:
                raise ValueError("a shard records at most 65535 model fingerprints")
            self._code[name] = len(self.names)
            self.names.append(name)
        return self._code[name]

    def name(self, code: int) -> str:
        return self.names[int(code)]


def _empty(dim: int) -> Part:
    return np.zeros(0, np.int64), np.zeros((0, dim), np.float32), np.zeros(0, np.int32)


@dataclass
class ShardContent:
    """``items[rep]`` and ``kept[rep]`` (by the representation a rollback returns to), each a
    :data:`Part` whose model codes index ``models``."""

    dims: dict[str, int]
    items: dict[str, Part] = field(default_factory=dict)
    kept: dict[str, Part] = field(default_factory=dict)
    models: list[str] = field(default_factory=list)

    def snapshot_arrays(self) -> tuple[dict, dict, list[str]]:
        """``(parts, arrays, models)`` for :func:`raycompat.serving.durability.write_snapshot`."""
        parts, arrays = {}, {}
        for rep, dim in self.dims.items():
            ids, vecs, codes = self.items.get(rep, _empty(dim))
            parts[rep] = (ids, vecs)
            arrays[f"model_{rep}"] = codes.astype(np.uint16)
            if rep in self.kept and self.kept[rep][0].size:
                kids, kvecs, kcodes = self.kept[rep]
                arrays[f"kept_ids_{rep}"] = kids
                arrays[f"kept_vec_{rep}"] = kvecs
                arrays[f"kept_model_{rep}"] = kcodes.astype(np.uint16)
        return parts, arrays, list(self.models)

    @classmethod
    def from_snapshot(cls, arrays: dict, meta: dict, dims: dict[str, int]) -> ShardContent:
        """The content of a snapshot's arrays (:func:`~raycompat.serving.durability.
        read_snapshot_arrays`); a format-1 snapshot has every model unrecorded (``""``)."""
        models = list(meta.get("models", []))
        unrecorded = len(models)
        out = cls(dict(dims), models=models + [""])
        for rep in dims:
            if f"ids_{rep}" not in arrays:
                continue
            ids, vecs = arrays[f"ids_{rep}"], arrays[f"vec_{rep}"]
            codes = arrays.get(f"model_{rep}", np.full(ids.size, unrecorded))
            out.items[rep] = (ids, vecs, _checked_codes(codes, ids.size, len(models), rep))
            if f"kept_ids_{rep}" in arrays:
                kids = arrays[f"kept_ids_{rep}"].astype(np.int64)
                kvecs = arrays[f"kept_vec_{rep}"].astype(np.float32)
                kcodes = _checked_codes(arrays[f"kept_model_{rep}"], kids.size, len(models), rep)
                if kvecs.shape != (kids.size, dims[rep]):
                    raise ValueError(f"kept {rep}: {kids.size} ids but vectors {kvecs.shape}")
                out.kept[rep] = (kids, kvecs, kcodes)
        return out

    def split(self, part_of) -> list[ShardContent]:
        """This content split by ``part_of(ids) -> [array of positions per part]`` (reshard:
        :func:`raycompat.serving.placement.split_by_shard`)."""
        pieces: list[ShardContent] | None = None
        for attr in ("items", "kept"):
            for rep, (ids, vecs, codes) in getattr(self, attr).items():
                positions = part_of(ids)
                if pieces is None:
                    pieces = [
                        ShardContent(dict(self.dims), models=list(self.models)) for _ in positions
                    ]
                for piece, pos in zip(pieces, positions, strict=True):
                    getattr(piece, attr)[rep] = (ids[pos], vecs[pos], codes[pos])
        return pieces or []

    def _like(self) -> ShardContent:
        return ShardContent(dict(self.dims), models=list(self.models))

    @staticmethod
    def merge(contents: list[ShardContent]) -> ShardContent:
        """One content holding every item of ``contents`` (model codes remapped to one table;
        each part sorted by id)."""
        table = ModelTable()
        out = ShardContent(dict(contents[0].dims) if contents else {})
        for attr in ("items", "kept"):
            chunks: dict[str, list] = {}
            for c in contents:
                for rep, (ids, vecs, codes) in getattr(c, attr).items():
                    remap = np.array([table.code(m) for m in c.models] or [0], np.int32)
                    chunks.setdefault(rep, []).append((ids, vecs, remap[codes]))
            for rep, parts in chunks.items():
                ids = np.concatenate([p[0] for p in parts])
                o = np.argsort(ids, kind="stable")
                vecs = np.concatenate([p[1] for p in parts])[o]
                getattr(out, attr)[rep] = (ids[o], vecs, np.concatenate([p[2] for p in parts])[o])
        out.models = table.names
        return out

    def count(self, attr: str = "items") -> int:
        return sum(int(p[0].size) for p in getattr(self, attr).values())


def _checked_codes(codes, n: int, n_models: int, rep: str) -> np.ndarray:
    codes = np.asarray(codes).astype(np.int32)
    if codes.shape != (n,) or (codes.size and (codes.min() < 0 or codes.max() > n_models)):
        raise ValueError(f"model codes of {rep} do not match its {n} items")
    return codes
