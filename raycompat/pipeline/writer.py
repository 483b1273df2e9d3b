"""Output shards: one parquet file per id chunk, written atomically, so a killed run leaves
only complete shards (and temp files that the next run deletes).

Shard ``part-<chunk:06d>.parquet`` holds the rows of that chunk's ids sorted by ``item_id``;
its file metadata key ``raycompat.chunk`` records ``{chunk, expected, rows, skipped, nodes}``
where ``skipped`` lists ``{item_id, error}`` of corrupt images and ``nodes`` maps each
embedding stage (``new``, ``old``, ``adapt``) to the sorted Ray node ids that computed the
chunk's rows. A shard is complete when it exists, its footer reads, and
``rows + len(skipped) == expected``. Schema: see ``output_schema``.

The folder is a :class:`raycompat.storage.Location`: a local path (temp file + fsync +
rename) or a URI on any pyarrow filesystem (the final object written directly; a truncated
object has no readable footer and is rewritten on resume).
"""

from __future__ import annotations

import json
import os
import re

import numpy as np

from raycompat.embeddings.vector_parquet import write_options

# NODE_PREFIX: internal batch columns ``__node_new``, ``__node_old``, ``__node_adapt``, the Ray
# node id that ran an embedding stage on each row; recorded per shard, never stored as data.
from raycompat.pipeline.stages import NODE_PREFIX

SHARD_RE = re.compile(r"^part-(\d{6,})\.parquet$")
META_KEY = b"raycompat.chunk"


def remove_at_exit_if_unwritten(location) -> bool:
    """A failed first run leaves no folder behind: when output folder ``location`` (a
    :class:`~raycompat.storage.Location` on this machine's disk) is empty now, it is removed
    when the process exits if it then holds no shard (only the manifest and temp files of
    killed writers). Returns whether that was arranged."""
    import atexit

    if not location.on_disk or location.listdir():
        return False
    atexit.register(_remove_if_unwritten, location.root)
    return True


def _remove_if_unwritten(root: str) -> None:
    import shutil

    from raycompat.pipeline.manifest import MANIFEST_NAME

    if not os.path.isdir(root):
        return
    for name in os.listdir(root):
        temp = name.startswith(".") and ".tmp" in name  # an interrupted atomic write
        if not (temp or name == MANIFEST_NAME) or os.path.isdir(os.path.join(root, name)):
            return
    shutil.rmtree(root, ignore_errors=True)


def shard_name(chunk: int) -> str:
    return f"part-{chunk:06d}.parquet"


def output_schema(vector_dims: dict[str, int], uncertainty_columns=()):
    """``item_id`` int64, ``label`` int64, ``split`` string, ``class_name`` string (the
    label's class: queries and gallery are matched by it), one
    ``fixed_size_list<float32>[D]`` per representation, float64 uncertainty columns."""
    import pyarrow as pa

    fields = [
        pa.field("item_id", pa.int64(), nullable=False),
        pa.field("label", pa.int64(), nullable=False),
        pa.field("split", pa.string(), nullable=False),
        pa.field("class_name", pa.string(), nullable=False),
    ]
    fields += [
        pa.field(name, pa.list_(pa.float32(), dim), nullable=False)
        for name, dim in vector_dims.items()
    ]
    fields += [pa.field(name, pa.float64(), nullable=False) for name in uncertainty_columns]
    return pa.schema(fields)


class ShardStore:
    """The shard folder of one run: which chunks are done, and atomic writes of new ones.
    ``directory``: a local path, a URI, or a :class:`~raycompat.storage.Location`."""

    def __init__(self, directory, schema):
        from raycompat.pipeline.location import open_output

        self.out = open_output(directory, check=False)
        self.out.make_dirs()
        self.directory = self.out.uri
        self.schema = schema

    def remove_temp_files(self) -> int:
        """Delete leftovers of killed writers (``.part-*.tmp*``); returns how many."""
        n = 0
        for name in self.out.listdir():
            if name.startswith(".part-") and ".tmp" in name:
                self.out.remove(name)
                n += 1
        return n

    def chunk_info(self, chunk: int) -> dict | None:
        """The recorded chunk metadata of a readable shard, else ``None``."""
        import pyarrow.parquet as pq

        name = shard_name(chunk)
        if not self.out.is_file(name):
            return None
        try:
            with self.out.open_input(name) as fh:
                meta = pq.read_metadata(fh)
            info = json.loads(meta.metadata[META_KEY])
        except Exception:  # unreadable footer (a truncated write): treat as missing and rewrite
            return None
        if info.get("rows") != meta.num_rows or info["rows"] + len(
            info.get("skipped", [])
        ) != info.get("expected"):
            return None
        return info

    def completed(self, num_chunks: int, expected_length) -> set[int]:
        """Chunks ``< num_chunks`` whose shard is complete; incomplete or foreign shard files
        are removed so they are rewritten."""
        done = set()
        for name in self.out.listdir():
            m = SHARD_RE.match(name)
            if not m:
                continue
            chunk = int(m.group(1))
            info = self.chunk_info(chunk) if chunk < num_chunks else None
            if info is not None and info.get("expected") == expected_length(chunk):
                done.add(chunk)
            else:
                self.out.remove(name)
        return done

    def write(
        self, chunk: int, columns: dict[str, np.ndarray], expected: int, nodes: dict | None = None
    ) -> dict:
        """Write chunk ``chunk`` from numpy columns (rows with a non-empty ``error`` are
        skipped and recorded; columns outside the schema, such as the node columns, are not
        stored); temp file + fsync + rename on a local folder, one direct write elsewhere,
        so the shard appears whole or not at all. ``nodes``: ``{stage: [node ids]}``.
        Returns the chunk metadata."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        order = np.argsort(columns["item_id"], kind="stable")
        errors = np.asarray(columns.get("error", np.full(len(order), "", object)), dtype=object)[
            order
        ]
        bad = np.array([bool(e) for e in errors], bool)
        ids = np.asarray(columns["item_id"], np.int64)[order]
        keep = order[~bad]
        skipped = [
            {"item_id": int(i), "error": str(e)}
            for i, e in zip(ids[bad], errors[bad], strict=False)
        ]
        arrays = []
        for field in self.schema:
            values = np.asarray(columns[field.name])[keep]
            if pa.types.is_fixed_size_list(field.type):
                flat = pa.array(
                    np.ascontiguousarray(values, dtype=np.float32).ravel(), pa.float32()
                )
                arrays.append(pa.FixedSizeListArray.from_arrays(flat, field.type.list_size))
            elif field.name == "split":
                arrays.append(pa.array(values.astype(str), pa.string()))
            else:
                arrays.append(pa.array(values, field.type))
        info = {
            "chunk": int(chunk),
            "expected": int(expected),
            "rows": int(len(keep)),
            "skipped": skipped,
            "nodes": {k: sorted(v) for k, v in sorted((nodes or {}).items())},
        }
        schema = self.schema.with_metadata({META_KEY: json.dumps(info).encode()})
        table = pa.Table.from_arrays(arrays, schema=schema)
        options = write_options(table.schema)
        self.out.write(shard_name(chunk), lambda fh: pq.write_table(table, fh, **options))
        return info


def batch_nodes(batch: dict, mask=None) -> dict[str, set[str]]:
    """``{stage: {node ids}}`` from the internal node columns of a batch (rows ``mask``)."""
    found = {}
    for col in batch:
        if col.startswith(NODE_PREFIX):
            values = np.asarray(batch[col])
            if mask is not None:
                values = values[mask]
            found[col[len(NODE_PREFIX) :]] = {str(v) for v in np.unique(values.astype(str)) if v}
    return found


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
        self.chunk_nodes: dict[int, dict[str, set[str]]] = {}
        # {stage: {node id: rows}} over every row received in this run
        self.node_items: dict[str, dict[str, int]] = {}

    def add(self, batch: dict) -> None:
        ids = np.asarray(batch["item_id"], np.int64)
        self.received += int(ids.size)
        for col in batch:
            if col.startswith(NODE_PREFIX):
                per_node = self.node_items.setdefault(col[len(NODE_PREFIX) :], {})
                values, counts = np.unique(np.asarray(batch[col]).astype(str), return_counts=True)
                for v, k in zip(values.tolist(), counts.tolist(), strict=False):
                    per_node[v or "unknown"] = per_node.get(v or "unknown", 0) + int(k)
        chunks = self.plan.chunk_of(ids)
        for chunk in np.unique(chunks).tolist():
            mask = chunks == chunk
            part = {c: np.asarray(batch[c])[mask] for c in self.columns}
            self.parts.setdefault(chunk, []).append(part)
            seen = self.chunk_nodes.setdefault(chunk, {})
            for stage, nodes in batch_nodes(batch, mask).items():
                seen.setdefault(stage, set()).update(nodes)
            self.counts[chunk] = self.counts.get(chunk, 0) + int(mask.sum())
            expected = self.plan.chunk_length(chunk)
            if self.counts[chunk] > expected:
                raise RuntimeError(
                    f"chunk {chunk} received {self.counts[chunk]} rows for {expected} ids"
                )
            if self.counts[chunk] == expected:
                parts = self.parts.pop(chunk)
                merged = {c: np.concatenate([p[c] for p in parts]) for c in self.columns}
                info = self.store.write(
                    chunk, merged, expected, nodes=self.chunk_nodes.pop(chunk, {})
                )
                del self.counts[chunk]
                self.written_items += info["rows"]
                self.written_chunks += 1
                self.skipped += info["skipped"]

    @property
    def open_chunks(self) -> int:
        return len(self.parts)
