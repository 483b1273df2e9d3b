"""The Milvus store: ``milvus://<file.db>/<collection>`` (Milvus Lite, in process) or
``milvus://<host:port>/<collection>`` (a Milvus server), through the same ``MilvusClient``
(docs/stores.md#milvus).

One collection holds the gallery with two FLOAT_VECTOR fields; the new vector of an item not
upgraded is stored as zeros (Milvus Lite keeps "null" vectors as zeros anyway), so every search
of the new field and every read filters on the upgraded flag. Writes upsert whole rows (partial
upsert had bugs: milvus-io/milvus#46849); one upsert call is atomic. A second collection
``<collection>__raycompat_state`` holds the key-value records. Milvus has no snapshot or field
drop reachable here: rollback flips the upgraded flag and position back, finalize writes a
marker (docs/stores.md#capabilities).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator

import numpy as np

try:
    from pymilvus import AnnSearchRequest, DataType, MilvusClient, WeightedRanker
    from pymilvus.client.types import Status
    from pymilvus.exceptions import MilvusException
except ModuleNotFoundError as exc:  # pragma: no cover - exercised without the extra
    from raycompat.stores.errors import MissingBackendError

    raise MissingBackendError("milvus", "pymilvus", "milvus") from exc

from raycompat.stores.base import (
    FINALIZED_KEY,
    LOAD_KEY,
    Capabilities,
    CheckedBlock,
    ColumnMap,
    Filter,
    GalleryBlock,
    Layout,
    ModelCounts,
    RollbackMark,
    VectorStore,
    checked_gallery,
)
from raycompat.stores.checks import MAX_NAME_CHARS, MAX_URI_CHARS
from raycompat.stores.errors import (
    MissingBackendError,
    StoreError,
    StoreExistsError,
    StoreNotFoundError,
)
from raycompat.stores.topk import Fetch
from raycompat.stores.uri import StoreURI

__all__ = ["MilvusStore", "STATE_SUFFIX"]

#: The state collection of collection ``c`` is ``c + STATE_SUFFIX``.
STATE_SUFFIX = "__raycompat_state"
#: Where a gallery that replaces an existing collection is loaded before it takes the name.
LOAD_SUFFIX = "__raycompat_load"
#: Largest payload of one upsert, so that one write_new batch is one atomic call.
MAX_UPSERT_BYTES = 32 * 2**20
#: Environment variable holding a Milvus server's token ("user:password" or an API key).
TOKEN_ENV = "RAYCOMPAT_MILVUS_TOKEN"
#: Seconds a Milvus server has to accept the connection (pymilvus waits 10 s by default).
CONNECT_TIMEOUT_S = 3.0
#: How long a store trusts the index types it read (an index another process builds shows
#: after at most this long).
INDEX_CACHE_S = 10.0
_READ_BATCH = 4096
_INDEX_TYPES = {"flat": "FLAT", "ivf": "IVF_FLAT", "hnsw": "HNSW"}
_LITE_USERS: dict[str, int] = {}
_LITE_LOCK = threading.RLock()


class _NoMvccWarning(logging.Filter):
    """Milvus Lite has no MVCC timestamp; pymilvus's iterator warns about it on every read."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "mvccTs" not in record.getMessage()


logging.getLogger("pymilvus.client.iterator.query_iterator").addFilter(_NoMvccWarning())


#: Why Milvus Lite could not start on a file: the exception its server manager logged (it
#: returns None, and pymilvus raises "Open local milvus failed"), by absolute path.
_LITE_FAILURES: dict[str, BaseException] = {}


class _Quiet(logging.Filter):
    """Milvus Lite and pymilvus log a traceback for every error they also hand to the caller
    (the server manager's failure to start, each RPC the Lite server refuses, each RPC error
    pymilvus raises): the StoreError or the exception that follows says it in one line. The
    server manager's exception is kept, so that the StoreError can say why."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        if message.startswith("Failed to start MilvusLite server") and record.exc_info:
            if record.args:
                _LITE_FAILURES[str(record.args[0])] = record.exc_info[1]
            return False
        if record.name == "pymilvus.decorators":
            return record.levelno < logging.ERROR
        return not (record.name.startswith("milvus_lite.adapter") and record.exc_info)


for _name in (
    "milvus_lite.server_manager",
    "milvus_lite.adapter.grpc.servicer",
    "pymilvus.decorators",
):
    logging.getLogger(_name).addFilter(_Quiet())


def _capabilities(lite: bool) -> Capabilities:
    return Capabilities(
        drop_field=False,
        null_vectors=False,
        snapshots=False,
        hybrid_search_raw_scores=True,
        concurrent_writers=not lite,
        partial_update=False,
        exact_with_ann_index=False,
    )


def _require_lite() -> None:
    try:
        import milvus_lite  # noqa: F401  (pymilvus starts it for *.db URIs)
    except ModuleNotFoundError as exc:
        raise MissingBackendError("milvus", "milvus-lite", "milvus") from exc


def _connect(uri: StoreURI) -> MilvusClient:
    """A client; for Milvus Lite, the file's in-process server (one process at a time). A
    StoreError says in one line why there is none: a server that cannot be reached, a Lite
    file that another process holds, that is read-only or on a full disk."""
    if not uri.is_local_file:
        return _server_client(uri)
    _require_lite()
    path = os.path.abspath(uri.target)
    with _LITE_LOCK:  # a file's server starts and stops under the lock (threads of a process)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            client = MilvusClient(uri=path)
        except (MilvusException, OSError) as exc:
            cause = _LITE_FAILURES.pop(path, exc)
            raise StoreError(
                f"Milvus Lite file {uri.target!r} cannot be opened: {_lite_failure(path, cause)}"
            ) from cause
        _LITE_USERS[path] = _LITE_USERS.get(path, 0) + 1
    return client


def _lite_failure(path: str, cause: BaseException) -> str:
    """Why Milvus Lite could not open the file (a folder) ``path``, in plain words. Only a
    lock held elsewhere says "another process holds it" (``backfill-store`` then sends its
    command through the files beside it)."""
    from milvus_lite.exceptions import DataDirLockedError

    if isinstance(cause, DataDirLockedError):
        return "another process holds it (one process at a time)"
    code = getattr(cause, "errno", None)
    if code == errno.EROFS:
        return "it is on a read-only file system (Milvus Lite writes to it even to read it)"
    if code in (errno.EACCES, errno.EPERM) or (code is None and not _writable(path)):
        return (
            "it is read-only to this process: permission denied (Milvus Lite writes to it even "
            "to read it)"
        )
    if code == errno.ENOSPC:
        return "the disk under it is full (No space left on device)"
    if isinstance(cause, OSError):
        return f"{cause.strerror or cause}" + (f": {cause.filename}" if cause.filename else "")
    text = (getattr(cause, "message", None) or str(cause)).strip().splitlines()
    return f"{type(cause).__name__}: {text[0] if text else ''}"


def _writable(path: str) -> bool:
    """Whether this process may write the Lite folder ``path`` and its lock file."""
    lock = os.path.join(path, "LOCK")
    return os.access(path, os.W_OK | os.X_OK) and (
        not os.path.exists(lock) or os.access(lock, os.W_OK)
    )


def _server_client(uri: StoreURI) -> MilvusClient:
    """A client of the Milvus server at ``host:port``, or a StoreError within about
    CONNECT_TIMEOUT_S: a refused connection or an unknown host at once (unless a proxy
    carries gRPC), no answer after CONNECT_TIMEOUT_S."""
    where = f"cannot reach the Milvus server at {uri.target}"
    why = None if _grpc_proxy() else _unreachable(uri.target)
    if why is not None:
        raise StoreError(f"{where}: {why}")
    try:
        return MilvusClient(
            uri=uri.server_uri, token=os.environ.get(TOKEN_ENV, ""), timeout=CONNECT_TIMEOUT_S
        )
    except MilvusException as exc:
        if exc.code == Status.CONNECT_FAILED:
            raise StoreError(
                f"{where}: it did not answer as a Milvus server within {CONNECT_TIMEOUT_S:g} s "
                "(is this its gRPC port, 19530 by default?)"
            ) from exc
        text = str(exc.message).strip().splitlines()
        raise StoreError(
            f"the Milvus server at {uri.target} refused the connection: {text[0] if text else exc}"
        ) from exc


def _grpc_proxy() -> bool:
    """Whether gRPC may connect through a proxy (then only it knows whether the server is
    reachable)."""
    names = ("grpc_proxy", "https_proxy", "http_proxy")
    return any(os.environ.get(n) or os.environ.get(n.upper()) for n in names)


def _unreachable(target: str) -> str | None:
    """Why no TCP connection opens to ``host:port`` (tried for CONNECT_TIMEOUT_S), in plain
    words; None when one does."""
    host, _, port = target.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except socket.gaierror:
        return f"no host is named {host!r}"
    except ConnectionRefusedError:
        return f"connection refused (nothing listens on port {port})"
    except TimeoutError:
        return f"no answer within {CONNECT_TIMEOUT_S:g} s"
    except OSError as exc:
        return (exc.strerror or str(exc)).lower()
    return None


def _disconnect(uri: StoreURI, client: MilvusClient) -> None:
    if not uri.is_local_file:
        client.close()
        return
    path = os.path.abspath(uri.target)
    with _LITE_LOCK:
        client.close()
        _LITE_USERS[path] = _LITE_USERS.get(path, 1) - 1
        if _LITE_USERS[path] <= 0:
            del _LITE_USERS[path]
            from milvus_lite.server_manager import server_manager_instance

            server_manager_instance.release_server(path)


def _quote(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _expr_list(values: Iterable) -> str:
    return "[" + ", ".join(_quote(v) if isinstance(v, str) else str(int(v)) for v in values) + "]"


def _create_index(
    client: MilvusClient,
    name: str,
    column: str,
    kind: str,
    metric: str,
    params: dict,
    timeout_s: float = 600.0,
) -> None:
    """Create an index and wait for it, polling every 20 ms (pymilvus's own wait sleeps
    0.5 s per index, even for FLAT)."""
    index = client.prepare_index_params()
    index.add_index(column, index_type=kind, metric_type=metric, params=params)
    client.create_index(name, index, sync=False)
    deadline = time.monotonic() + timeout_s
    while (client.describe_index(name, index_name=column) or {}).get("state") != "Finished":
        if time.monotonic() > deadline:
            raise StoreError(
                f"Milvus collection {name!r}: index on {column!r} not built in {timeout_s:.0f} s"
            )
        time.sleep(0.02)


def _create_gallery(client: MilvusClient, name: str, cols: ColumnMap, layout: Layout) -> None:
    schema = client.create_schema(auto_id=False, enable_dynamic_field=False)
    schema.add_field(cols.id, DataType.INT64, is_primary=True)
    if layout.label_type == "int64":
        schema.add_field(cols.label, DataType.INT64)
    else:
        schema.add_field(cols.label, DataType.VARCHAR, max_length=4 * MAX_NAME_CHARS)
    schema.add_field(cols.old, DataType.FLOAT_VECTOR, dim=layout.old_dim)
    schema.add_field(cols.new, DataType.FLOAT_VECTOR, dim=layout.new_dim)
    if cols.image_uri:
        schema.add_field(cols.image_uri, DataType.VARCHAR, max_length=4 * MAX_URI_CHARS)
    schema.add_field(cols.old_model, DataType.VARCHAR, max_length=4 * MAX_NAME_CHARS)
    schema.add_field(cols.new_model, DataType.VARCHAR, max_length=4 * MAX_NAME_CHARS)
    if cols.upgraded:
        schema.add_field(cols.upgraded, DataType.BOOL)
    schema.add_field(cols.position, DataType.INT64)
    client.create_collection(name, schema=schema)
    for column in (cols.old, cols.new):
        _create_index(client, name, column, "FLAT", "IP", {})
    client.load_collection(name)


def _create_state(client: MilvusClient, name: str) -> None:
    schema = client.create_schema(auto_id=False, enable_dynamic_field=False)
    schema.add_field("key", DataType.VARCHAR, is_primary=True, max_length=256)
    schema.add_field("value", DataType.VARCHAR, max_length=65_535)
    schema.add_field("_v", DataType.FLOAT_VECTOR, dim=2)  # Milvus needs one vector field
    client.create_collection(name, schema=schema)
    _create_index(client, name, "_v", "FLAT", "L2", {})
    client.load_collection(name)


_FIELD_TYPES = {
    "id": (DataType.INT64,),
    "label": (DataType.INT64, DataType.VARCHAR),
    "old": (DataType.FLOAT_VECTOR,),
    "new": (DataType.FLOAT_VECTOR,),
    "image_uri": (DataType.VARCHAR,),
    "old_model": (DataType.VARCHAR,),
    "new_model": (DataType.VARCHAR,),
    "upgraded": (DataType.BOOL,),
    "position": (DataType.INT64,),
}


def _layout_from_fields(fields: list[dict], cols: ColumnMap, where: str) -> Layout:
    """The layout of an existing collection; a StoreError names the first field that is
    missing or of the wrong type."""
    by_name = {f["name"]: f for f in fields}
    for logical, types in _FIELD_TYPES.items():
        name = getattr(cols, logical)
        if name is None:
            continue
        if name not in by_name:
            raise StoreError(
                f"field {name!r} ({logical}) missing from {where}; its fields: {', '.join(by_name)}"
            )
        if by_name[name]["type"] not in types:
            raise StoreError(
                f"field {name!r} of {where} has type {by_name[name]['type']!r}, "
                f"expected {' or '.join(t.name for t in types)}"
            )
    label = "int64" if by_name[cols.label]["type"] == DataType.INT64 else "string"
    return Layout(
        int(by_name[cols.old]["params"]["dim"]), int(by_name[cols.new]["params"]["dim"]), label
    )


def _block_rows(
    block: CheckedBlock, cols: ColumnMap, layout: Layout, old_model: str, new_model: str | None
) -> list[dict]:
    up = block.new is not None
    new = block.new if up else np.zeros((len(block.ids), layout.new_dim), np.float32)
    rows = []
    for i, item in enumerate(block.ids.tolist()):
        row = {
            cols.id: item,
            cols.label: block.labels[i].item() if layout.label_type == "int64" else block.labels[i],
            cols.old: block.old[i],
            cols.new: new[i],
            cols.old_model: old_model,
            cols.new_model: new_model if up else "",
            cols.position: int(block.positions[i]),
        }
        if cols.image_uri:
            row[cols.image_uri] = block.image_uris[i]
        if cols.upgraded:
            row[cols.upgraded] = up
        rows.append(row)
    return rows


def _row_bytes(layout: Layout) -> int:
    return 4 * (layout.old_dim + layout.new_dim) + 1024


class MilvusStore(VectorStore):
    """A gallery in a Milvus collection (docs/stores.md#milvus)."""

    backend = "milvus"
    max_search_limit = 16_384

    def __init__(
        self, uri: StoreURI, columns: ColumnMap, layout: Layout, client: MilvusClient
    ) -> None:
        super().__init__(uri, columns, layout)
        self._client = client
        self._state_name = uri.name + STATE_SUFFIX
        self._state_ready = False
        self._index_cache: tuple[float, dict[str, str | None]] | None = None

    @staticmethod
    def _where(uri: StoreURI) -> str:
        return f"Milvus collection {uri.name!r} at {uri.target!r}"

    @property
    def where(self) -> str:
        return self._where(self.uri)

    @property
    def capabilities(self) -> Capabilities:
        return _capabilities(self.uri.is_local_file)

    @staticmethod
    def _need_position(columns: ColumnMap, where: str) -> None:
        if columns.position is None:
            raise StoreError(
                f"{where}: a Milvus store needs a position column (rollback "
                "without snapshots turns items back by position)"
            )

    @classmethod
    def create(
        cls,
        uri: StoreURI,
        items: GalleryBlock | Iterable[GalleryBlock],
        *,
        columns: ColumnMap,
        old_model: str,
        new_model: str | None,
        new_dim: int | None,
        overwrite: bool,
    ) -> MilvusStore:
        """Create the collections, then insert the gallery in calls of bounded size; a load
        marker in the state record tells an unfinished load apart (docs/stores.md#create). An
        existing collection is replaced only once the new one is loaded: the gallery goes into
        ``<name>__raycompat_load`` first, which then takes the name."""
        where = cls._where(uri)
        cls._need_position(columns, where)
        layout, blocks = checked_gallery(items, columns, where, new_model, new_dim)
        client = _connect(uri)
        try:
            replacing = cls._existing(client, uri, where, overwrite)
            target = dataclasses.replace(uri, name=uri.name + LOAD_SUFFIX) if replacing else uri
            for name in (target.name, target.name + STATE_SUFFIX):  # leftovers
                if client.has_collection(name):
                    client.drop_collection(name)
            _create_gallery(client, target.name, columns, layout)
            _create_state(client, target.name + STATE_SUFFIX)
            loading = cls(target, columns, layout, client)
            loading._put_record(LOAD_KEY, '{"complete": false}')
            per_call = max(1, MAX_UPSERT_BYTES // _row_bytes(layout))
            try:
                for block in blocks:
                    rows = _block_rows(block, columns, layout, old_model, new_model)
                    for start in range(0, len(rows), per_call):
                        client.insert(target.name, rows[start : start + per_call])
            except BaseException:
                if replacing:  # the old collection stays as it was; the partial one goes
                    for name in (target.name, target.name + STATE_SUFFIX):
                        client.drop_collection(name)
                raise
            loading._put_record(LOAD_KEY, '{"complete": true}')
            if replacing:
                for name in (uri.name, uri.name + STATE_SUFFIX):
                    if client.has_collection(name):
                        client.drop_collection(name)
                client.rename_collection(target.name, uri.name)
                client.rename_collection(target.name + STATE_SUFFIX, uri.name + STATE_SUFFIX)
                for name in (uri.name, uri.name + STATE_SUFFIX):
                    client.load_collection(name)
            store = cls(uri, columns, layout, client)
        except BaseException:
            _disconnect(uri, client)
            raise
        return store

    @staticmethod
    def _existing(client: MilvusClient, uri: StoreURI, where: str, overwrite: bool) -> bool:
        """Whether a collection of that name exists (refused if it holds rows, unless
        ``overwrite``)."""
        if not client.has_collection(uri.name):
            return False
        client.load_collection(uri.name)
        rows = client.query(uri.name, filter="", output_fields=["count(*)"])[0]["count(*)"]
        if rows and not overwrite:
            raise StoreExistsError(
                f"{where} exists and holds {rows} rows; pass overwrite=True to replace it"
            )
        return True

    @classmethod
    def open(cls, uri: StoreURI, columns: ColumnMap) -> MilvusStore:
        """Open an existing collection, checking its fields and that its load finished."""
        where = cls._where(uri)
        cls._need_position(columns, where)
        if uri.is_local_file:
            _require_lite()
            if not os.path.exists(uri.target):  # Milvus Lite would create it: leave nothing
                raise StoreNotFoundError(f"{where} does not exist")
        client = _connect(uri)
        try:
            if not client.has_collection(uri.name):
                raise StoreNotFoundError(f"{where} does not exist")
            fields = client.describe_collection(uri.name)["fields"]
            layout = _layout_from_fields(fields, columns, where)
            client.load_collection(uri.name)
            store = cls(uri, columns, layout, client)
            if not json.loads(store._get_record(LOAD_KEY) or "{}").get("complete"):
                raise StoreError(
                    f"{where} has no finished raycompat load record (its load "
                    "was cut short, or create_store did not write it); create it "
                    "again with overwrite=True"
                )
        except BaseException:
            _disconnect(uri, client)
            raise
        return store

    def close(self) -> None:
        """Close the client and, for Milvus Lite, release the file when no store uses it."""
        if self._client is not None:
            _disconnect(self.uri, self._client)
            self._client = None

    @property
    def finalized(self) -> bool:
        return self._get_record(FINALIZED_KEY) is not None

    # -- reading -------------------------------------------------------------------------
    def _expr(self, flt: Filter) -> str:
        cols, parts = self.columns, []
        if flt.upgraded is not None:
            if cols.upgraded:
                parts.append(f"{cols.upgraded} == {str(flt.upgraded).lower()}")
            else:
                parts.append(f"{cols.position} {'>=' if flt.upgraded else '<'} 0")
        if flt.labels is not None:
            parts.append(f"{cols.label} in {_expr_list(flt.labels)}")
        if flt.ids is not None:
            parts.append(f"{cols.id} in {_expr_list(flt.ids)}")
        if flt.raw:
            parts.append(f"({flt.raw})")
        return " and ".join(parts)

    def _iter_rows(self, fields: list[str], flt: Filter | str | None = None) -> Iterator[dict]:
        """Every matching row: one query on Milvus Lite (no result cap, and its iterator is
        three times slower), pymilvus's query iterator on a server (bounded messages)."""
        expr = self._expr(self._filter(flt))
        if self.uri.is_local_file:
            yield from self._client.query(self.uri.name, filter=expr, output_fields=fields)
            return
        it = self._client.query_iterator(
            self.uri.name, batch_size=_READ_BATCH, filter=expr, output_fields=fields
        )
        try:
            while batch := it.next():
                yield from batch
        finally:
            it.close()

    def count(self, filter: Filter | str | None = None) -> int:
        rows = self._client.query(
            self.uri.name, filter=self._expr(self._filter(filter)), output_fields=["count(*)"]
        )
        return int(rows[0]["count(*)"])

    def read_ids(self, filter: Filter | str | None = None) -> np.ndarray:
        ids = [row[self.columns.id] for row in self._iter_rows([self.columns.id], filter)]
        return np.sort(np.asarray(ids, dtype=np.int64))

    def read_blocks(
        self,
        columns: Iterable[str] = ("id", "label", "old"),
        block_rows: int = 4096,
        filter: Filter | str | None = None,
    ) -> Iterator[dict[str, np.ndarray]]:
        """Blocks in ascending id order; without snapshots, a write between two blocks shows
        in the later block (docs/stores.md#read)."""
        wanted = self._read_columns(columns)
        self._check_block_rows(block_rows)
        physical, flt = self._physical(wanted), self._filter(filter)
        if flt.ids is not None and flt.labels is None and flt.raw is None:
            return self._blocks_of_ids(flt, wanted, physical, block_rows)
        return self._iter_blocks(self.read_ids(flt), wanted, physical, block_rows)

    def _scan_blocks(
        self, wanted: list[str], block_rows: int, flt: Filter
    ) -> Iterator[dict[str, np.ndarray]]:
        """Blocks in the engine's order from one pass over the matching rows (one query on
        Milvus Lite, the query iterator on a server): no read of the ids first and no reads
        by primary key, which :meth:`read_blocks`' id order costs (docs/benchmarks.md,
        "Store backfill")."""
        return self._scan_rows(wanted, self._physical(wanted), block_rows, flt)

    def _physical(self, wanted: list[str]) -> list[str]:
        """The fields a read of the logical columns ``wanted`` asks Milvus for."""
        cols = self.columns
        return sorted(
            {cols.id, cols.upgraded or cols.position} | {cols.physical(name) for name in wanted}
        )

    def _scan_rows(
        self, wanted: list[str], physical: list[str], block_rows: int, flt: Filter
    ) -> Iterator[dict[str, np.ndarray]]:
        rows: list[dict] = []
        for row in self._iter_rows(physical, flt):
            rows.append(row)
            if len(rows) == block_rows:
                yield self._block_dict(rows, wanted)
                rows = []
        if rows:
            yield self._block_dict(rows, wanted)

    def _blocks_of_ids(
        self, flt: Filter, wanted: list[str], physical: list[str], block_rows: int
    ) -> Iterator[dict[str, np.ndarray]]:
        """The blocks of a filter on ids (and the upgraded flag): the rows got by primary key
        and the flag tested here, instead of a query whose filter Milvus Lite evaluates over
        every row of the collection (docs/benchmarks.md, "Store backfill")."""
        ids = np.unique(np.asarray(flt.ids, dtype=np.int64))
        rows = self._get_rows(ids, physical, strict=False)
        if flt.upgraded is not None:
            rows = [
                r for r, up in zip(rows, self._upgraded_of(rows), strict=True) if up == flt.upgraded
            ]
        for start in range(0, len(rows), block_rows):
            yield self._block_dict(rows[start : start + block_rows], wanted)

    def _iter_blocks(
        self, ids: np.ndarray, wanted: list[str], physical: list[str], block_rows: int
    ) -> Iterator[dict[str, np.ndarray]]:
        for start in range(0, len(ids), block_rows):
            rows = self._get_rows(ids[start : start + block_rows], physical, strict=False)
            yield self._block_dict(rows, wanted)

    def _get_rows(self, ids: np.ndarray, fields: list[str], strict: bool = True) -> list[dict]:
        """The rows of ``ids`` in ascending id order; ``strict``: refuse unknown ids."""
        rows = []
        for start in range(0, len(ids), _READ_BATCH):
            chunk = ids[start : start + _READ_BATCH].tolist()
            # a query on our own id column: pymilvus's ``get`` takes the primary key's name
            # from a schema it caches by collection name, which another database's collection
            # of the same name can leave stale (seen: "unknown field 'item_id'")
            expr = f"{self.columns.id} in {chunk}"
            rows += self._client.query(self.uri.name, filter=expr, output_fields=fields)
        if strict and len(rows) != len(ids):
            missing = np.setdiff1d(ids, [row[self.columns.id] for row in rows])
            raise StoreError(
                f"column {self.columns.id!r} of {self.where}: {len(missing)} ids "
                f"are not in the collection, e.g. {missing[:5].tolist()}"
            )
        return sorted(rows, key=lambda row: row[self.columns.id])

    def _upgraded_of(self, rows: list[dict]) -> np.ndarray:
        cols = self.columns
        if cols.upgraded:
            return np.asarray([bool(row[cols.upgraded]) for row in rows], dtype=bool)
        return np.asarray([row[cols.position] >= 0 for row in rows], dtype=bool)

    def _block_dict(self, rows: list[dict], wanted: list[str]) -> dict[str, np.ndarray]:
        cols, out = self.columns, {}
        for name in wanted:
            values = [row[cols.physical(name)] for row in rows]
            if name in ("old", "new"):
                dim = self._layout.old_dim if name == "old" else self._layout.new_dim
                out[name] = np.asarray(values, dtype=np.float32).reshape(len(rows), dim)
            elif name in ("id", "position") or (
                name == "label" and self._layout.label_type == "int64"
            ):
                out[name] = np.asarray(values, dtype=np.int64)
            elif name == "upgraded":
                out[name] = np.asarray(values, dtype=bool)
            else:
                out[name] = np.asarray(values, dtype=object).reshape(len(rows))
        off = ~self._upgraded_of(rows)
        if "new" in out:
            out["new"][off] = np.nan
        if "new_model" in out:
            out["new_model"][off] = ""
        return out

    def counts_by_model(self) -> ModelCounts:
        cols = self.columns
        fields = sorted({cols.old_model, cols.new_model, cols.upgraded or cols.position})
        old, new, rows, upgraded = Counter(), Counter(), 0, 0
        for row in self._iter_rows(fields):
            rows += 1
            old[row[cols.old_model]] += 1
            if row[cols.upgraded] if cols.upgraded else row[cols.position] >= 0:
                upgraded += 1
                new[row[cols.new_model]] += 1
        return ModelCounts(rows, upgraded, dict(old), dict(new))

    # -- writing -------------------------------------------------------------------------
    def _all_fields(self) -> list[str]:
        cols = self.columns
        return [
            name
            for name in (
                cols.id,
                cols.label,
                cols.old,
                cols.new,
                cols.image_uri,
                cols.old_model,
                cols.new_model,
                cols.upgraded,
                cols.position,
            )
            if name
        ]

    def _check_batch(self, n: int, what: str) -> None:
        per_call = max(1, MAX_UPSERT_BYTES // _row_bytes(self._layout))
        if n > per_call:
            raise StoreError(
                f"{self.where}: {what} of {n} rows is more than one atomic upsert "
                f"holds here ({per_call} rows); write smaller batches"
            )

    def _write_new(
        self, ids: np.ndarray, vectors: np.ndarray, fingerprint: str, positions: np.ndarray | None
    ) -> None:
        """Read the batch's whole rows, change the new-model fields, upsert the whole rows
        in one call (atomic)."""
        cols = self.columns
        self._check_batch(len(ids), "write_new batch")
        rows = self._get_rows(ids, self._all_fields())
        order = np.argsort(ids)
        for row, i in zip(rows, order.tolist(), strict=True):
            row[cols.new] = vectors[i]
            row[cols.new_model] = fingerprint
            row[cols.position] = int(positions[i])
            if cols.upgraded:
                row[cols.upgraded] = True
        self._client.upsert(self.uri.name, rows)

    def build_index(self, field: str, kind: str = "ivf") -> None:
        column = self._vector_column(field)
        if kind not in _INDEX_TYPES:
            raise StoreError(
                f"{self.where}: index kind must be one of {sorted(_INDEX_TYPES)}, got {kind!r}"
            )
        params = {
            "ivf": {"nlist": max(1, int(np.sqrt(max(1, self.count()))))},
            "hnsw": {"M": 16, "efConstruction": 200},
        }.get(kind, {})
        self._index_cache = None
        self._client.release_collection(self.uri.name)
        try:
            self._client.drop_index(self.uri.name, index_name=column)
            _create_index(self._client, self.uri.name, column, _INDEX_TYPES[kind], "IP", params)
        finally:
            self._client.load_collection(self.uri.name)

    def _indexes(self) -> dict[str, str | None]:
        """Index types, cached for INDEX_CACHE_S seconds (Milvus Lite's describe_index counts
        the rows: 0.5 s at 20,000 rows)."""
        now = time.monotonic()
        if self._index_cache is None or now - self._index_cache[0] > INDEX_CACHE_S:
            out = {}
            for field, column in (("old", self.columns.old), ("new", self.columns.new)):
                info = self._client.describe_index(self.uri.name, index_name=column) or {}
                out[field] = info.get("index_type")
            self._index_cache = (now, out)
        return dict(self._index_cache[1])

    # -- search --------------------------------------------------------------------------
    def _index_kind(self, field: str, exact: bool) -> str | None:
        kind = self._indexes()[field]
        if exact and kind != "FLAT":
            raise StoreError(
                f"field {self.columns.physical(field)!r} of {self.where} has a "
                f"{kind} index: exact search needs FLAT; search with exact=False "
                f"or build_index({field!r}, 'flat')"
            )
        return kind

    @staticmethod
    def _params(kind: str | None, limit: int) -> dict:
        params = {"ef": max(64, limit)} if kind == "HNSW" else {"nprobe": 16}
        return {"metric_type": "IP", "params": params}

    def _hits(self, result: list) -> list[tuple[np.ndarray, np.ndarray]]:
        id_col = self.columns.id
        return [
            (
                np.asarray([hit[id_col] for hit in hits], dtype=np.int64),
                np.asarray([hit["distance"] for hit in hits], dtype=np.float32),
            )
            for hits in result
        ]

    def _fetch(self, field: str, queries: np.ndarray, flt: Filter, exact: bool) -> Fetch:
        column, expr = self.columns.physical(field), self._expr(flt)
        kind = self._index_kind(field, exact)

        def fetch(rows: np.ndarray, limit: int) -> list[tuple[np.ndarray, np.ndarray]]:
            result = self._client.search(
                self.uri.name,
                data=queries[rows],
                anns_field=column,
                filter=expr,
                limit=limit,
                output_fields=[self.columns.id],
                search_params=self._params(kind, limit),
            )
            return self._hits(result)

        return fetch

    def _compatible_fetch(self, new_q: np.ndarray, old_q: np.ndarray, flt: Filter) -> Fetch:
        """One ``hybrid_search``: a filtered request per field, merged by raw score
        (``WeightedRanker(1, 1, norm_score=False)``)."""
        plan = [
            (new_q, "new", self._expr(flt.and_upgraded(True))),
            (old_q, "old", self._expr(flt.and_upgraded(False))),
        ]
        kinds = [self._index_kind(field, True) for _, field, _ in plan]

        def fetch(rows: np.ndarray, limit: int) -> list[tuple[np.ndarray, np.ndarray]]:
            requests = [
                AnnSearchRequest(
                    data=q[rows],
                    anns_field=self.columns.physical(field),
                    param=self._params(kind, limit),
                    limit=limit,
                    expr=expr,
                )
                for (q, field, expr), kind in zip(plan, kinds, strict=True)
            ]
            result = self._client.hybrid_search(
                self.uri.name,
                requests,
                WeightedRanker(1.0, 1.0, norm_score=False),
                limit=limit,
                output_fields=[self.columns.id],
            )
            return self._hits(result)

        return fetch

    # -- rollback and finalize -----------------------------------------------------------
    def rollback_to_position(self, position: int) -> int:
        """Flip every item at ``position`` or later back to old, in atomic upserts of whole
        rows (idempotent: rerun after a crash to finish). Refused after finalize, as on
        LanceDB: :meth:`rollback` to a mark taken before it undoes the finalize."""
        col = self._check_position_arg(position)
        cols = self.columns
        if self.finalized:
            raise StoreError(
                f"column {cols.old!r} of {self.where}: the store is finalized, the old vectors "
                "are no longer in use; rollback(name) to a mark taken before finalize"
            )
        ids = self.read_ids(f"{col} >= {int(position)}")
        per_call = max(1, MAX_UPSERT_BYTES // _row_bytes(self._layout))
        for start in range(0, len(ids), per_call):
            rows = self._get_rows(ids[start : start + per_call], self._all_fields())
            for row in rows:
                row[cols.position] = -1
                row[cols.new_model] = ""
                if cols.upgraded:
                    row[cols.upgraded] = False
            self._client.upsert(self.uri.name, rows)
        return len(ids)

    def _max_position(self) -> int:
        col = self.columns.position
        values = [row[col] for row in self._iter_rows([col], f"{col} >= 0")]
        return max(values, default=-1)

    def _snapshot(self, name: str) -> int | None:
        return None

    def _rollback_to_mark(self, mark: RollbackMark) -> None:
        """No snapshots: remove the finalize marker (a mark is taken before any finalize that
        follows it), then turn back every item upgraded at or after the mark's position."""
        self._delete_record(FINALIZED_KEY)
        self.rollback_to_position(mark.position)

    def _finalize(self) -> None:
        """Nothing to drop (Milvus cannot drop a field here): the marker is the finalize."""

    # -- state record --------------------------------------------------------------------
    def _state(self) -> str:
        if not self._state_ready:
            if not self._client.has_collection(self._state_name):
                _create_state(self._client, self._state_name)
            self._client.load_collection(self._state_name)
            self._state_ready = True
        return self._state_name

    def _get_record(self, key: str) -> str | None:
        try:
            rows = self._client.get(self._state(), ids=[key], output_fields=["value"])
        except MilvusException as exc:
            if "released" not in str(exc):
                raise
            # another client of the same Milvus Lite file released it (its load in flight):
            # load it again and read once more
            self._client.load_collection(self._state_name)
            rows = self._client.get(self._state_name, ids=[key], output_fields=["value"])
        return rows[0]["value"] if rows else None

    def _put_record(self, key: str, text: str) -> None:
        """One upsert of one row: atomic."""
        row = {"key": key, "value": text, "_v": [0.0, 0.0]}
        self._client.upsert(self._state(), [row])

    def _put_records(self, records: dict[str, str]) -> None:
        """Upserts of up to 64 records each (each upsert atomic)."""
        rows = [{"key": k, "value": v, "_v": [0.0, 0.0]} for k, v in records.items()]
        for start in range(0, len(rows), 64):
            self._client.upsert(self._state(), rows[start : start + 64])

    def _delete_record(self, key: str) -> None:
        self._client.delete(self._state(), ids=[key])

    def _delete_records(self, prefix: str) -> None:
        keys = list(self._records(prefix))
        if keys:
            self._client.delete(self._state(), ids=keys)

    def _records(self, prefix: str) -> dict[str, str]:
        rows = self._client.query(
            self._state(), filter=f"key like {_quote(prefix + '%')}", output_fields=["key", "value"]
        )
        # ("_" may be a one-character wildcard of ``like``: the prefix is checked again)
        return {row["key"]: row["value"] for row in rows if row["key"].startswith(prefix)}
