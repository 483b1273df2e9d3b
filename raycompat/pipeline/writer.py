"""Output shards: one parquet file per id chunk, written atomically, so a killed run leaves
only complete shards (and temp files that the next run deletes).

Shard ``part-<chunk:06d>.parquet`` holds the rows of that chunk's ids sorted by ``item_id``;
its file metadata key ``raycompat.chunk`` records ``{chunk, expected, rows, skipped}`` where
``skipped`` lists ``{item_id, error}`` of corrupt images. A shard is complete when it exists,
its footer reads, and ``rows + len(skipped) == expected``. Schema: see ``output_schema``.
"""
from __future__ import annotations

import json
import os
import re

import numpy as np

SHARD_RE = re.compile(r"^part-(\d{6,})\.parquet$")
META_KEY = b"raycompat.chunk"


def shard_name(chunk: int) -> str:
    return f"part-{chunk:06d}.parquet"


def output_schema(vector_dims: dict[str, int], uncertainty_columns=()):
    """``item_id`` int64, ``label`` int64, ``split`` string, one
    ``fixed_size_list<float32>[D]`` per representation, float64 uncertainty columns."""
    import pyarrow as pa

    fields = [pa.field("item_id", pa.int64(), nullable=False), pa.field("label", pa.int64(), nullable=False),
              pa.field("split", pa.string(), nullable=False)]
    fields += [pa.field(name, pa.list_(pa.float32(), dim), nullable=False) for name, dim in vector_dims.items()]
    fields += [pa.field(name, pa.float64(), nullable=False) for name in uncertainty_columns]
    return pa.schema(fields)


class ShardStore:
    """The shard folder of one run: which chunks are done, and atomic writes of new ones."""

    def __init__(self, directory: str, schema):
        self.directory = directory
        self.schema = schema
        os.makedirs(directory, exist_ok=True)

    def remove_temp_files(self) -> int:
        """Delete leftovers of killed writers (``.part-*.tmp*``); returns how many."""
        n = 0
        for name in os.listdir(self.directory):
            if name.startswith(".part-") and ".tmp" in name:
                os.remove(os.path.join(self.directory, name))
                n += 1
        return n

    def chunk_info(self, chunk: int) -> dict | None:
        """The recorded chunk metadata of a readable shard, else ``None``."""
        import pyarrow.parquet as pq

        path = os.path.join(self.directory, shard_name(chunk))
        if not os.path.isfile(path):
            return None
        try:
            meta = pq.read_metadata(path)
            info = json.loads(meta.metadata[META_KEY])
        except Exception:  # unreadable footer: treat as missing and rewrite
            return None
        if info.get("rows") != meta.num_rows or info["rows"] + len(info.get("skipped", [])) != info.get("expected"):
            return None
        return info

    def completed(self, num_chunks: int, expected_length) -> set[int]:
        """Chunks ``< num_chunks`` whose shard is complete; incomplete or foreign shard files
        are removed so they are rewritten."""
        done = set()
        for name in os.listdir(self.directory):
            m = SHARD_RE.match(name)
            if not m:
                continue
            chunk = int(m.group(1))
            info = self.chunk_info(chunk) if chunk < num_chunks else None
            if info is not None and info.get("expected") == expected_length(chunk):
                done.add(chunk)
            else:
                os.remove(os.path.join(self.directory, name))
        return done

    def write(self, chunk: int, columns: dict[str, np.ndarray], expected: int) -> dict:
        """Write chunk ``chunk`` from numpy columns (rows with a non-empty ``error`` are
        skipped and recorded); temp file + fsync + rename, so the shard appears whole or not
        at all. Returns the chunk metadata."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        order = np.argsort(columns["item_id"], kind="stable")
        errors = np.asarray(columns.get("error", np.full(len(order), "", object)), dtype=object)[order]
        bad = np.array([bool(e) for e in errors], bool)
        ids = np.asarray(columns["item_id"], np.int64)[order]
        keep = order[~bad]
        skipped = [{"item_id": int(i), "error": str(e)} for i, e in zip(ids[bad], errors[bad])]
        arrays = []
        for field in self.schema:
            values = np.asarray(columns[field.name])[keep]
            if pa.types.is_fixed_size_list(field.type):
                flat = pa.array(np.ascontiguousarray(values, dtype=np.float32).ravel(), pa.float32())
                arrays.append(pa.FixedSizeListArray.from_arrays(flat, field.type.list_size))
            elif field.name == "split":
                arrays.append(pa.array(values.astype(str), pa.string()))
            else:
                arrays.append(pa.array(values, field.type))
        info = {"chunk": int(chunk), "expected": int(expected), "rows": int(len(keep)), "skipped": skipped}
        schema = self.schema.with_metadata({META_KEY: json.dumps(info).encode()})
        table = pa.Table.from_arrays(arrays, schema=schema)
        final = os.path.join(self.directory, shard_name(chunk))
        tmp = os.path.join(self.directory, f".{shard_name(chunk)}.tmp{os.getpid()}")
        with open(tmp, "wb") as fh:
            pq.write_table(table, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, final)
        return info


class ChunkAssembler:
    """Collects streamed rows per chunk and writes each chunk once all its ids arrived."""

    def __init__(self, store: ShardStore, plan, columns: list[str]):
        self.store = store
        self.plan = plan
        self.columns = columns
        self.parts: dict[int, list[dict]] = {}
        self.counts: dict[int, int] = {}
        self.received = 0
        self.written_items = 0
        self.written_chunks = 0
        self.skipped: list[dict] = []

    def add(self, batch: dict) -> None:
        ids = np.asarray(batch["item_id"], np.int64)
        self.received += int(ids.size)
        chunks = self.plan.chunk_of(ids)
        for chunk in np.unique(chunks).tolist():
            mask = chunks == chunk
            part = {c: np.asarray(batch[c])[mask] for c in self.columns}
            self.parts.setdefault(chunk, []).append(part)
            self.counts[chunk] = self.counts.get(chunk, 0) + int(mask.sum())
            expected = self.plan.chunk_length(chunk)
            if self.counts[chunk] > expected:
                raise RuntimeError(f"chunk {chunk} received {self.counts[chunk]} rows for {expected} ids")
            if self.counts[chunk] == expected:
                parts = self.parts.pop(chunk)
                merged = {c: np.concatenate([p[c] for p in parts]) for c in self.columns}
                info = self.store.write(chunk, merged, expected)
                del self.counts[chunk]
                self.written_items += info["rows"]
                self.written_chunks += 1
                self.skipped += info["skipped"]

    @property
    def open_chunks(self) -> int:
        return len(self.parts)
