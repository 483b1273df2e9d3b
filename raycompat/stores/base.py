"""The store interface: one vector database table or collection that holds a gallery being
upgraded from an old to a new embedding model (docs/stores.md).

A store is opened from a URI through the registry (:func:`open_store`, :func:`create_store`),
like timm's registry of interchangeable parts behind one factory: ``lance://`` (LanceDB, the
default) and ``milvus://`` (Milvus Lite or a Milvus server) are built in, and
:func:`register_backend` adds others. Backends are imported only when their scheme is used.
"""

from __future__ import annotations

import importlib
import json
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Literal

import numpy as np

from raycompat.stores import checks
from raycompat.stores.errors import MissingBackendError, StoreError, StoreURIError
from raycompat.stores.topk import Fetch, SearchResult, merge_topk, resolve_topk
from raycompat.stores.uri import EXPECTED_FORMS, StoreURI, parse_store_uri

__all__ = [
    "CAPABILITY_NOTES",
    "LOGICAL_COLUMNS",
    "Capabilities",
    "CheckedBlock",
    "ColumnMap",
    "Filter",
    "GalleryBlock",
    "ItemWrite",
    "ModelCounts",
    "RollbackMark",
    "StoreInfo",
    "VectorStore",
    "create_store",
    "list_backends",
    "open_store",
    "register_backend",
]

VectorField = Literal["old", "new"]

#: The logical column names that reads, filters and :class:`ColumnMap` use.
LOGICAL_COLUMNS = (
    "id",
    "label",
    "old",
    "new",
    "image_uri",
    "old_model",
    "new_model",
    "upgraded",
    "position",
    "write_seq",
)
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_MARK_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,100}$")

# Keys of the store's own key-value records (docs/stores.md#state).
STATE_KEY = "state"
FINALIZED_KEY = "finalized"
LOAD_KEY = "load"
MARK_PREFIX = "mark:"
GENERATION_KEY = "generation"
#: The record of the process that drives the upgrade (a lease swapped atomically where the
#: backend can: :meth:`VectorStore._swap_record`).
DRIVER_KEY = "backfill:driver"
#: Largest JSON text of one state record (Milvus VARCHAR bound).
MAX_STATE_CHARS = 65_000


@dataclass(frozen=True)
class ColumnMap:
    """Which physical column holds each logical column (docs/stores.md#columns).

    ``upgraded`` (bool) and ``position`` (int64, the order index of the item's upgrade, -1 if
    not upgraded) may not both be None; ``image_uri`` None means no image URI column.
    ``write_seq`` (int64) is the sequence number of the commit that last wrote the row, which a
    live index follows (backends with the ``write_sequence`` capability; optional in a table).
    """

    id: str = "item_id"
    old: str = "old"
    new: str = "new"
    label: str = "label"
    image_uri: str | None = None
    old_model: str = "old_model"
    new_model: str = "new_model"
    upgraded: str | None = "upgraded"
    position: str | None = "upgrade_position"
    write_seq: str | None = "write_seq"

    def __post_init__(self) -> None:
        names = [(f.name, getattr(self, f.name)) for f in fields(self)]
        for logical, name in names:
            if name is not None and (not isinstance(name, str) or not _IDENT.match(name)):
                raise StoreError(
                    f"ColumnMap.{logical}: column name {name!r} must match [A-Za-z_][A-Za-z0-9_]*"
                )
        used = [name for _, name in names if name is not None]
        if len(set(used)) != len(used):
            raise StoreError(f"ColumnMap: column names must differ, got {used}")
        if self.upgraded is None and self.position is None:
            raise StoreError("ColumnMap: upgraded and position cannot both be None")

    def physical(self, logical: str) -> str:
        """The physical column of ``logical``; a StoreError if unknown or not mapped."""
        if logical not in LOGICAL_COLUMNS:
            raise StoreError(f"unknown column {logical!r}; known: {', '.join(LOGICAL_COLUMNS)}")
        name = getattr(self, logical)
        if name is None:
            raise StoreError(f"column {logical!r} is not mapped (ColumnMap.{logical} is None)")
        return name


#: What each capability means and what raycompat does where a backend lacks it.
CAPABILITY_NOTES = {
    "drop_field": "drops the old vector field at finalize. Without it, finalize records a "
    "'finalized' marker in the store's state record; the old vectors keep their space, and "
    "reads and searches of the old field are refused after finalize.",
    "null_vectors": "leaves the new vector of an item not upgraded null. Without it, that "
    "vector is stored as zeros; every search of the new field filters on the upgraded flag, "
    "and read_blocks returns NaN rows for items not upgraded.",
    "snapshots": "tags a version (mark) and restores it (rollback), and reads blocks from one "
    "pinned version. Without it, mark records the next upgrade position and rollback turns "
    "every item at or after it back to old by flipping its upgraded flag and position (the "
    "new vector stays stored, unused); blocks are read without a common snapshot.",
    "hybrid_search_raw_scores": "merges two filtered searches by raw score inside the "
    "database. Without it, search_compatible runs two filtered exact searches and merges them "
    "by score in numpy.",
    "concurrent_writers": "lets several processes write at once. Without it (Milvus Lite: one "
    "process holds the file), run the writers in one process, or use a Milvus server.",
    "partial_update": "updates some columns of a row in place. Without it, write_new reads "
    "the whole rows of its batch and upserts whole rows (partial upsert had bugs: "
    "milvus-io/milvus#46849).",
    "exact_with_ann_index": "searches exactly while the field has an approximate index. "
    "Without it, exact search needs the FLAT index: search with exact=False, or "
    "build_index(field, 'flat') to search exactly again.",
    "write_sequence": "numbers every commit and stamps the rows it wrote (the write_seq "
    "column), so that a reader can fetch the rows written since it last looked. Without it, "
    "the live index cannot follow the store: serve a LanceDB table.",
}


@dataclass(frozen=True)
class Capabilities:
    """What a backend supports; :data:`CAPABILITY_NOTES` gives each one's workaround."""

    drop_field: bool
    null_vectors: bool
    snapshots: bool
    hybrid_search_raw_scores: bool
    concurrent_writers: bool
    partial_update: bool
    exact_with_ann_index: bool
    write_sequence: bool = False

    def missing(self) -> dict[str, str]:
        """Each capability this backend lacks, with the workaround raycompat uses."""
        return {f.name: CAPABILITY_NOTES[f.name] for f in fields(self) if not getattr(self, f.name)}


@dataclass(frozen=True)
class StoreInfo:
    """What :meth:`VectorStore.describe` reports (docs/stores.md#describe)."""

    uri: str
    backend: str
    rows: int
    upgraded: int
    old_dim: int | None
    new_dim: int
    label_type: str
    metric: str
    finalized: bool
    indexes: dict[str, str | None]
    capabilities: Capabilities


@dataclass(frozen=True)
class ModelCounts:
    """Items per model fingerprint: ``old`` over all items, ``new`` over upgraded items."""

    rows: int
    upgraded: int
    old: dict[str, int]
    new: dict[str, int]


@dataclass(frozen=True)
class RollbackMark:
    """A rollback point: the next upgrade position when it was taken, and the table version
    (backends with snapshots) it restores."""

    name: str
    position: int
    version: int | None = None


@dataclass(frozen=True)
class Filter:
    """A backend-neutral filter; set fields are ANDed. ``raw`` is a backend-native expression
    (LanceDB SQL or a Milvus boolean expression) over physical column names."""

    upgraded: bool | None = None
    labels: tuple[int | str, ...] | None = None
    ids: tuple[int, ...] | None = None
    raw: str | None = None

    def and_upgraded(self, flag: bool) -> Filter:
        """This filter, restricted to upgraded (``True``) or not upgraded items."""
        if self.upgraded is not None and self.upgraded != flag:
            raise StoreError(f"filter upgraded={self.upgraded} contradicts upgraded={flag}")
        return Filter(flag, self.labels, self.ids, self.raw)


@dataclass(frozen=True)
class GalleryBlock:
    """Items to load into a new store. ``new`` vectors, when given, are loaded as upgraded
    (positions in load order); ``image_uris`` when the ColumnMap has an image_uri column."""

    ids: np.ndarray
    labels: np.ndarray
    old: np.ndarray
    new: np.ndarray | None = None
    image_uris: list[str] | None = None


@dataclass(frozen=True)
class ItemWrite:
    """Vectors of existing items for one field, by the model of ``fingerprint``
    (:meth:`VectorStore.write_items`)."""

    ids: np.ndarray
    field: VectorField
    vectors: np.ndarray
    fingerprint: str


@dataclass
class CheckedBlock:
    """A :class:`GalleryBlock` after the checks: typed arrays and upgrade positions."""

    ids: np.ndarray
    labels: np.ndarray
    old: np.ndarray
    new: np.ndarray | None
    image_uris: list[str] | None
    positions: np.ndarray


@dataclass
class Layout:
    """Dimensions and label type of a gallery, fixed by its first block."""

    old_dim: int
    new_dim: int
    label_type: str
    seen_ids: set[int] = field(default_factory=set)
    next_position: int = 0


def _as_blocks(items: GalleryBlock | Iterable[GalleryBlock]) -> Iterator[GalleryBlock]:
    if isinstance(items, GalleryBlock):
        yield items
        return
    for block in items:
        if not isinstance(block, GalleryBlock):
            raise StoreError(f"create: expected GalleryBlock items, got {type(block).__name__}")
        yield block


def _check_block(
    block: GalleryBlock,
    layout: Layout | None,
    columns: ColumnMap,
    where: str,
    new_model: str | None,
    new_dim: int | None,
) -> tuple[CheckedBlock, Layout]:
    ids = checks.check_ids(block.ids, columns.id, where)
    n = len(ids)
    old = checks.check_vectors(block.old, layout and layout.old_dim, n, columns.old, where)
    old = checks.unit_rows(old, columns.old, where)
    labels, kind = checks.check_labels(
        block.labels, n, layout and layout.label_type, columns.label, where
    )
    new = None
    if block.new is not None:
        if new_model is None:
            raise StoreError(
                f"column {columns.new_model!r} of {where}: new vectors were given "
                "without new_model (the new model's fingerprint)"
            )
        want = layout.new_dim if layout else new_dim
        new = checks.unit_rows(
            checks.check_vectors(block.new, want, n, columns.new, where), columns.new, where
        )
    if layout is None:
        dim = new.shape[1] if new is not None else new_dim
        if dim is None or dim < 1:
            raise StoreError(
                f"column {columns.new!r} of {where}: give new_dim (the new model's "
                "dimension) when the first block has no new vectors"
            )
        layout = Layout(old.shape[1], int(dim), kind)
    uris = _check_uris(block, n, columns, where)
    repeated = layout.seen_ids.intersection(ids.tolist())
    if repeated:
        raise checks.column_error(
            columns.id, where, f"ids repeat across blocks: {sorted(repeated)[:5]}"
        )
    layout.seen_ids.update(ids.tolist())
    positions = np.full(n, -1, dtype=np.int64)
    if new is not None:
        positions = np.arange(layout.next_position, layout.next_position + n, dtype=np.int64)
        layout.next_position += n
    return CheckedBlock(ids, labels, old, new, uris, positions), layout


def _check_uris(block: GalleryBlock, n: int, columns: ColumnMap, where: str) -> list[str] | None:
    if columns.image_uri is None:
        if block.image_uris is not None:
            raise StoreError(f"{where}: image_uris were given but ColumnMap.image_uri is None")
        return None
    return checks.check_strings(block.image_uris, n, columns.image_uri, where)


def checked_gallery(
    items: GalleryBlock | Iterable[GalleryBlock],
    columns: ColumnMap,
    where: str,
    new_model: str | None,
    new_dim: int | None,
) -> tuple[Layout, Iterator[CheckedBlock]]:
    """The gallery's layout (from its first block, checked now) and all its checked blocks
    (the others checked as they are consumed): what a backend's ``create`` writes."""
    blocks = _as_blocks(items)
    first = next(blocks, None)
    if first is None:
        raise StoreError(f"create {where}: the gallery has no items")
    checked, layout = _check_block(first, None, columns, where, new_model, new_dim)

    def rest() -> Iterator[CheckedBlock]:
        yield checked
        for block in blocks:
            yield _check_block(block, layout, columns, where, new_model, new_dim)[0]

    return layout, rest()


def state_json(state: object, where: str) -> str:
    """``state`` as JSON text, refused unless it is a JSON object of bounded size."""
    if not isinstance(state, dict):
        raise StoreError(f"state record of {where}: expected a dict, got {type(state).__name__}")
    try:
        text = json.dumps(state, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise StoreError(f"state record of {where}: not JSON serialisable: {exc}") from exc
    if len(text) > MAX_STATE_CHARS:
        raise StoreError(
            f"state record of {where}: {len(text)} characters of JSON, more than {MAX_STATE_CHARS}"
        )
    return text


class VectorStore(ABC):
    """One table or collection holding a gallery mid-upgrade (docs/stores.md#interface).

    Vectors are float32; every score is the inner product (``metric == "ip"``), which is the
    cosine similarity for the L2-normalised vectors raycompat stores. Open one with
    :func:`open_store` or :func:`create_store`; close it (or use ``with``) when done.
    """

    backend: ClassVar[str] = ""
    #: whether the backend keeps a write sequence (:meth:`read_changes`): a live index can
    #: follow it (the ``write_sequence`` capability, known before a store is opened)
    keeps_write_sequence: ClassVar[bool] = False
    #: The largest top-k one engine call may ask for.
    max_search_limit: ClassVar[int] = 16_384

    def __init__(self, uri: StoreURI, columns: ColumnMap, layout: Layout) -> None:
        self.uri = uri
        self.columns = columns
        self._layout = layout
        #: the largest upgrade position written, once read (None: not read, or a rollback
        #: since); write_new keeps it, so that checking that positions grow costs no scan
        self._position_high: int | None = None

    # -- opening -------------------------------------------------------------------------
    @classmethod
    @abstractmethod
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
    ) -> VectorStore:
        """Write a gallery into a new table or collection (docs/stores.md#create)."""

    @classmethod
    @abstractmethod
    def open(cls, uri: StoreURI, columns: ColumnMap) -> VectorStore:
        """Open an existing store, checking its columns (docs/stores.md#open)."""

    @abstractmethod
    def close(self) -> None:
        """Release the connection (and, for Milvus Lite, the file)."""

    def __enter__(self) -> VectorStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri.raw!r})"

    @property
    @abstractmethod
    def where(self) -> str:
        """The table or collection, as error messages name it."""

    @property
    @abstractmethod
    def capabilities(self) -> Capabilities:
        """What this backend supports (docs/stores.md#capabilities)."""

    @property
    @abstractmethod
    def finalized(self) -> bool:
        """Whether :meth:`finalize` ran (and no rollback undid it)."""

    # -- reading -------------------------------------------------------------------------
    @property
    def old_dim(self) -> int | None:
        """The old vectors' dimension; None once a finalize dropped them. Unlike
        :meth:`describe` it counts no rows (a scan on some backends)."""
        dropped = self.finalized and self.capabilities.drop_field
        return None if dropped else self._layout.old_dim

    def describe(self) -> StoreInfo:
        """Rows, dimensions, indexes and capabilities (docs/stores.md#describe)."""
        final = self.finalized
        return StoreInfo(
            uri=self.uri.raw,
            backend=self.backend,
            rows=self.count(),
            upgraded=self.count_upgraded(),
            old_dim=self.old_dim,
            new_dim=self._layout.new_dim,
            label_type=self._layout.label_type,
            metric="ip",
            finalized=final,
            indexes=self._indexes(),
            capabilities=self.capabilities,
        )

    @abstractmethod
    def count(self, filter: Filter | str | None = None) -> int:
        """Rows matching ``filter`` (docs/stores.md#read)."""

    def count_upgraded(self) -> int:
        """Items upgraded to the new model."""
        return self.count(Filter(upgraded=True))

    @abstractmethod
    def read_ids(self, filter: Filter | str | None = None) -> np.ndarray:
        """Ids matching ``filter``, int64, ascending (docs/stores.md#read)."""

    @abstractmethod
    def read_blocks(
        self,
        columns: Iterable[str] = ("id", "label", "old"),
        block_rows: int = 4096,
        filter: Filter | str | None = None,
    ) -> Iterator[dict[str, np.ndarray]]:
        """Blocks of at most ``block_rows`` items in ascending id order, as dicts of numpy
        arrays keyed by logical column; vectors float32 [n, d], a NaN row for the new vector
        of an item not upgraded (docs/stores.md#read)."""

    def scan_blocks(
        self,
        columns: Iterable[str] = ("id", "old"),
        block_rows: int = 65536,
        filter: Filter | str | None = None,
    ) -> Iterator[dict[str, np.ndarray]]:
        """The blocks of :meth:`read_blocks` in no set order: for a reader that scores every
        block and needs no id order (a search side over transformed vectors). Checks its
        arguments when called, as :meth:`read_blocks` does (docs/stores.md#read)."""
        wanted = self._read_columns(columns)
        self._check_block_rows(block_rows)
        return self._scan_blocks(wanted, block_rows, self._filter(filter))

    def _scan_blocks(
        self, wanted: list[str], block_rows: int, flt: Filter
    ) -> Iterator[dict[str, np.ndarray]]:
        """The backend's one-pass read of checked arguments; a backend that can stream its
        rows in storage order overrides it, this default reads them in id order."""
        return self.read_blocks(wanted, block_rows, flt)

    @abstractmethod
    def counts_by_model(self) -> ModelCounts:
        """Items per old and new model fingerprint (docs/stores.md#read)."""

    # -- writing -------------------------------------------------------------------------
    def write_new(
        self,
        ids: np.ndarray,
        vectors: np.ndarray,
        fingerprint: str,
        positions: np.ndarray | None,
    ) -> int:
        """Upgrade one batch atomically: new vectors, their model fingerprint, the upgraded
        flag and upgrade positions, all or nothing (docs/stores.md#write). Returns the rows."""
        cols, where = self.columns, self.where
        ids = checks.check_ids(ids, cols.id, where)
        vectors = checks.check_vectors(vectors, self._layout.new_dim, len(ids), cols.new, where)
        vectors = checks.unit_rows(vectors, cols.new, where)
        fingerprint = checks.check_fingerprint(fingerprint, cols.new_model, where)
        if cols.position is None and positions is not None:
            raise StoreError(f"{where}: positions were given but ColumnMap.position is None")
        if cols.position is not None:
            if positions is None:
                raise StoreError(f"column {cols.position!r} of {where}: positions are required")
            positions = checks.check_positions(positions, len(ids), cols.position, where)
            if len(ids):
                self._check_positions_grow(ids, positions)
        if len(ids):
            self._write_new(ids, vectors, fingerprint, positions)
            if positions is not None:
                self._position_high = max(self._position_high, int(positions.max()))
        return len(ids)

    def _check_positions_grow(self, ids: np.ndarray, positions: np.ndarray) -> None:
        """A batch's positions come after every position written (the order a rollback to a
        position undoes), distinct; a batch written before may be written again at the same
        positions (a retry after a kill)."""
        col, where = self.columns.position, self.where
        if len(np.unique(positions)) != len(positions):
            raise StoreError(f"column {col!r} of {where}: a position appears twice in the batch")
        if self._position_high is None:
            self._position_high = self._max_position()
        if int(positions.min()) > self._position_high:
            return
        written = {}
        for block in self.read_blocks(("id", "position"), filter=Filter(ids=tuple(ids.tolist()))):
            written.update(zip(block["id"].tolist(), block["position"].tolist(), strict=True))
        if any(written.get(i) != p for i, p in zip(ids.tolist(), positions.tolist(), strict=True)):
            raise StoreError(
                f"column {col!r} of {where}: positions must grow: the largest written is "
                f"{self._position_high}, this batch starts at {int(positions.min())} (only a "
                "batch already written may be written again, at the same positions)"
            )

    @abstractmethod
    def _write_new(
        self,
        ids: np.ndarray,
        vectors: np.ndarray,
        fingerprint: str,
        positions: np.ndarray | None,
    ) -> None: ...

    def compact(self) -> None:
        """Merge the small files that many writes leave (LanceDB); nothing where the engine
        compacts by itself (Milvus). A long backfill calls it now and then."""
        return None

    @abstractmethod
    def build_index(self, field: VectorField, kind: str = "ivf") -> None:
        """Build the store's own approximate index on ``field`` (``"ivf"``, ``"hnsw"``), or
        ``"flat"`` to return to exact search (docs/stores.md#search)."""

    # -- search --------------------------------------------------------------------------
    def search(
        self,
        field: VectorField,
        queries: np.ndarray,
        k: int,
        *,
        filter: Filter | str | None = None,
        exact: bool = True,
    ) -> SearchResult:
        """Top-``k`` items by inner product of ``queries`` [nq, d] with ``field``, under
        ``filter``; exact (brute force) by default, else through the store's approximate
        index where the field has one. Ties rank by ascending id; a search of the new field
        sees upgraded items only (docs/stores.md#search)."""
        queries = self._queries(field, queries)
        flt = self._filter(filter)
        if field == "new":
            if flt.upgraded is False:
                raise StoreError(
                    f"column {self.columns.new!r} of {self.where}: the new vectors "
                    "of items not upgraded are not in use; filter upgraded=False "
                    "contradicts a search of the new field"
                )
            flt = flt.and_upgraded(True)
        fetch = self._fetch(field, queries, flt, exact)
        return resolve_topk(fetch, len(queries), self._k(k), self.max_search_limit, self.where)

    def search_compatible(
        self,
        new_queries: np.ndarray,
        old_queries: np.ndarray,
        k: int,
        *,
        filter: Filter | str | None = None,
    ) -> SearchResult:
        """Exact top-``k`` of a half-upgraded gallery: upgraded items scored by
        ``new_queries . new``, the others by ``old_queries . old`` (the old-compatible query),
        merged by score, ties by id (docs/stores.md#compatible-search)."""
        new_q = self._queries("new", new_queries)
        old_q = self._queries("old", old_queries)
        if len(new_q) != len(old_q):
            raise StoreError(f"{self.where}: {len(new_q)} new queries but {len(old_q)} old ones")
        k, flt = self._k(k), self._filter(filter)
        if flt.upgraded is not None:
            raise StoreError(f"{self.where}: search_compatible filters on upgraded itself")
        fetch = self._compatible_fetch(new_q, old_q, flt)
        if fetch is not None:
            return resolve_topk(fetch, len(new_q), k, self.max_search_limit, self.where)
        upgraded = self.search("new", new_q, k, filter=flt.and_upgraded(True))
        rest = self.search("old", old_q, k, filter=flt.and_upgraded(False))
        return merge_topk(upgraded, rest, k)

    @abstractmethod
    def _fetch(self, field: VectorField, queries: np.ndarray, flt: Filter, exact: bool) -> Fetch:
        """The engine's raw top-``limit`` for rows of ``queries``, scores as inner products."""

    def _compatible_fetch(self, new_q: np.ndarray, old_q: np.ndarray, flt: Filter) -> Fetch | None:
        """A one-call merged search where the engine has one (None: two searches)."""
        return None

    def _k(self, k: int) -> int:
        # k < the engine's largest limit, so that a tie at the k-th score can be seen.
        top = self.max_search_limit - 1
        if not isinstance(k, int | np.integer) or k < 1 or k > top:
            raise StoreError(f"{self.where}: k must be an integer in 1..{top}, got {k!r}")
        return int(k)

    def _queries(self, field: str, queries: np.ndarray) -> np.ndarray:
        column = self._vector_column(field)
        arr = np.asarray(queries)
        n = arr.shape[0] if arr.ndim == 2 else -1
        dim = self._layout.old_dim if field == "old" else self._layout.new_dim
        return checks.check_vectors(arr, dim, n, column, self.where + " (queries)")

    def _vector_column(self, field: str) -> str:
        if field not in ("old", "new"):
            raise StoreError(f"{self.where}: vector field must be 'old' or 'new', got {field!r}")
        column = self.columns.physical(field)
        if field == "old" and self.finalized:
            raise StoreError(
                f"column {column!r} of {self.where}: the store is finalized, the "
                "old vectors are no longer in use"
            )
        return column

    def _check_block_rows(self, block_rows: int) -> None:
        if not isinstance(block_rows, int) or block_rows < 1:
            raise StoreError(f"{self.where}: block_rows must be an integer >= 1")

    def _read_columns(self, columns: Iterable[str]) -> list[str]:
        wanted = [columns] if isinstance(columns, str) else list(columns)
        if not wanted:
            raise StoreError(f"{self.where}: read at least one column")
        for name in wanted:
            column = self.columns.physical(name)
            if name == "old" and self.finalized:
                raise StoreError(
                    f"column {column!r} of {self.where}: the store is finalized, "
                    "the old vectors are no longer in use"
                )
        return wanted

    def _filter(self, flt: Filter | str | None) -> Filter:
        if flt is None:
            return Filter()
        if isinstance(flt, str):
            return Filter(raw=flt)
        if not isinstance(flt, Filter):
            raise StoreError(f"{self.where}: filter must be a Filter or a str, got {flt!r}")
        if flt.labels is not None:
            if not len(flt.labels):
                raise StoreError(f"column {self.columns.label!r} of {self.where}: empty labels")
            labels, _ = checks.check_labels(
                np.asarray(flt.labels),
                len(flt.labels),
                self._layout.label_type,
                self.columns.label,
                self.where + " (filter)",
            )
            flt = Filter(flt.upgraded, tuple(labels.tolist()), flt.ids, flt.raw)
        if flt.ids is not None:
            if not len(flt.ids):
                raise StoreError(f"column {self.columns.id!r} of {self.where}: empty ids")
            ids = checks.check_ids(np.unique(np.asarray(flt.ids)), self.columns.id, self.where)
            flt = Filter(flt.upgraded, flt.labels, tuple(ids.tolist()), flt.raw)
        return flt

    # -- following (the live index) -------------------------------------------------------
    def version(self) -> int | None:
        """A number that changes with every commit of the gallery table, cheap to read, so
        that a follower reads :meth:`read_changes` only after a commit (None: the backend has
        none, and a follower reads the changes every time)."""
        return None

    def generation(self) -> int:
        """How many times the table went back to an earlier version (a rollback to a mark):
        a follower that saw another generation reads the whole table again."""
        text = self._get_record(GENERATION_KEY)
        return int(text) if text else 0

    def max_write_seq(self) -> int:
        """The write sequence number of the last commit, 0 before any (docs/stores.md#follow)."""
        raise self._no_sequence()

    def read_changes(
        self, since: int, columns: Iterable[str], block_rows: int = 65536
    ) -> Iterator[dict[str, np.ndarray]]:
        """Blocks of the rows that commits after ``since`` wrote (``write_seq > since``), in no
        set order, each with its ``write_seq`` (docs/stores.md#follow)."""
        raise self._no_sequence()

    def write_items(self, writes: Sequence[ItemWrite]) -> tuple[int, int]:
        """Replace the vectors of existing items in one commit, all or nothing (the live
        index's upserts): an ``old`` write gives an item a new old vector and turns it back to
        not upgraded, a ``new`` write upgrades it outside any backfill order (position -1);
        an id written twice keeps its last write. Returns ``(rows, write_seq)``."""
        raise self._no_sequence()

    def revert_items(self, ids: np.ndarray) -> tuple[int, int]:
        """Turn the upgraded items among ``ids`` back to their old vectors in one commit (the
        live index's rollback, latest upgraded first); returns ``(rows turned back,
        write_seq)``."""
        raise self._no_sequence()

    def _no_sequence(self) -> StoreError:
        return StoreError(
            f"{self.where}: the {self.backend} backend keeps no write sequence, so a live "
            "index cannot follow it; " + CAPABILITY_NOTES["write_sequence"].split(". ", 1)[1]
        )

    def _checked_writes(self, writes: Sequence[ItemWrite]) -> list[ItemWrite]:
        """``writes`` with checked ids, unit vectors of the field's dimension and fingerprints;
        a StoreError names the column. An old write after finalize is refused."""
        cols, where, out = self.columns, self.where, []
        for w in writes:
            if w.field not in ("old", "new"):
                raise StoreError(
                    f"{where}: a write's field must be 'old' or 'new', got {w.field!r}"
                )
            column = self._vector_column(w.field)
            dim = self._layout.old_dim if w.field == "old" else self._layout.new_dim
            ids = checks.check_ids(w.ids, cols.id, where)
            vectors = checks.unit_rows(
                checks.check_vectors(w.vectors, dim, len(ids), column, where), column, where
            )
            model_col = cols.old_model if w.field == "old" else cols.new_model
            fingerprint = checks.check_fingerprint(w.fingerprint, model_col, where)
            out.append(ItemWrite(ids, w.field, vectors, fingerprint))
        return out

    # -- rollback and finalize -----------------------------------------------------------
    def mark(self, name: str) -> RollbackMark:
        """Record a rollback point named ``name`` (docs/stores.md#rollback)."""
        if not isinstance(name, str) or not _MARK_NAME.match(name):
            raise StoreError(
                f"{self.where}: mark name {name!r} must be letters, digits, '_', '.', '-'"
            )
        if self._get_record(MARK_PREFIX + name) is not None:
            raise StoreError(f"{self.where}: rollback mark {name!r} exists already")
        mark = RollbackMark(name, self._max_position() + 1, self._snapshot(name))
        record = {"position": mark.position, "version": mark.version}
        self._put_record(MARK_PREFIX + name, json.dumps(record))
        return mark

    def marks(self) -> dict[str, RollbackMark]:
        """Every rollback mark, by name."""
        out = {}
        for key, text in self._records(MARK_PREFIX).items():
            record = json.loads(text)
            name = key[len(MARK_PREFIX) :]
            out[name] = RollbackMark(name, int(record["position"]), record["version"])
        return out

    def rollback(self, name: str) -> None:
        """Return to the rollback mark ``name`` (docs/stores.md#rollback)."""
        mark = self.marks().get(name)
        if mark is None:
            raise StoreError(
                f"{self.where}: no rollback mark {name!r} (marks: {sorted(self.marks())})"
            )
        self._position_high = None
        self._rollback_to_mark(mark)
        self._put_record(GENERATION_KEY, str(self.generation() + 1))

    @abstractmethod
    def rollback_to_position(self, position: int) -> int:
        """Turn every item upgraded at ``position`` or later back to old; returns how many
        (docs/stores.md#rollback)."""

    def _check_position_arg(self, position: int) -> str:
        """(the start of every rollback to a position) The position column; the cached
        largest position is dropped."""
        self._position_high = None
        if self.columns.position is None:
            raise StoreError(
                f"{self.where}: rollback to a position needs a position column "
                "(ColumnMap.position is None)"
            )
        if not isinstance(position, int | np.integer) or position < 0:
            raise StoreError(
                f"column {self.columns.position!r} of {self.where}: position must "
                f"be an integer >= 0, got {position!r}"
            )
        return self.columns.position

    def finalize(self, *, force: bool = False) -> None:
        """End the upgrade: the old vectors go out of use (docs/stores.md#finalize). Refused
        while some item is not upgraded, unless ``force``."""
        if self.finalized:
            return
        rows, upgraded = self.count(), self.count_upgraded()
        if upgraded != rows and not force:
            raise StoreError(
                f"{self.where}: finalize needs every item upgraded, {upgraded} of "
                f"{rows} are (force=True finalizes anyway)"
            )
        self._put_record(FINALIZED_KEY, json.dumps({"rows": rows, "upgraded": upgraded}))
        self._finalize()

    @abstractmethod
    def _max_position(self) -> int:
        """The largest upgrade position in use, -1 if none."""

    @abstractmethod
    def _snapshot(self, name: str) -> int | None:
        """Tag the current version as ``name`` (backends with snapshots), else None."""

    @abstractmethod
    def _rollback_to_mark(self, mark: RollbackMark) -> None: ...

    @abstractmethod
    def _finalize(self) -> None: ...

    @abstractmethod
    def _indexes(self) -> dict[str, str | None]:
        """The index type of each vector field (None: no index, exact search)."""

    # -- state record --------------------------------------------------------------------
    def read_state(self) -> dict[str, Any]:
        """The job's upgrade progress, stored in the store itself ({} if none yet)
        (docs/stores.md#state)."""
        text = self._get_record(STATE_KEY)
        return json.loads(text) if text else {}

    def write_state(self, state: dict[str, Any]) -> None:
        """Replace the progress record atomically (docs/stores.md#state)."""
        self._put_record(STATE_KEY, state_json(state, self.where))

    @abstractmethod
    def _get_record(self, key: str) -> str | None: ...

    @abstractmethod
    def _put_record(self, key: str, text: str) -> None:
        """Write one key-value record atomically."""

    @abstractmethod
    def _records(self, prefix: str) -> dict[str, str]: ...

    def _put_records(self, records: dict[str, str]) -> None:
        """Write several key-value records (each one atomically)."""
        for key, text in records.items():
            self._put_record(key, text)

    def _swap_record(self, key: str, text: str, expect: str | None) -> bool:
        """Write record ``key`` only if it holds ``expect`` now (``None``: absent); whether it
        was written. Backends with conditional writes do it atomically (LanceDB); this
        default reads, compares and writes, which two processes at one instant may both pass
        (Milvus, which has no conditional write)."""
        if (self._get_record(key) or None) != (expect or None):
            return False
        self._put_record(key, text)
        return True

    def _delete_record(self, key: str) -> None:
        """Remove one key-value record (nothing if it is absent)."""
        raise NotImplementedError(f"{type(self).__name__} cannot delete a record")

    def _delete_records(self, prefix: str) -> None:
        """Remove every key-value record whose key starts with ``prefix``."""
        for key in self._records(prefix):
            self._delete_record(key)


# -- registry ----------------------------------------------------------------------------
@dataclass(frozen=True)
class _Lazy:
    target: str
    package: str
    extra: str  # the pip extra that installs ``package`` ("": raycompat's own dependency)


_REGISTRY: dict[str, type[VectorStore] | _Lazy] = {
    "lance": _Lazy("raycompat.stores.lance:LanceStore", "lancedb", ""),  # a core dependency
    "milvus": _Lazy("raycompat.stores.milvus:MilvusStore", "pymilvus", "milvus"),
}


def register_backend(scheme: str) -> Callable[[type[VectorStore]], type[VectorStore]]:
    """Class decorator: serve ``scheme://`` URIs with a :class:`VectorStore` subclass."""
    if not re.match(r"^[a-z][a-z0-9+.-]*$", scheme):
        raise StoreError(f"backend scheme {scheme!r} must be lower-case letters and digits")

    def decorate(cls: type[VectorStore]) -> type[VectorStore]:
        if not (isinstance(cls, type) and issubclass(cls, VectorStore)):
            raise StoreError(f"backend {scheme!r}: {cls!r} is not a VectorStore subclass")
        _REGISTRY[scheme] = cls
        return cls

    return decorate


def list_backends() -> list[str]:
    """The registered URI schemes."""
    return sorted(_REGISTRY)


def backend_class(scheme: str) -> type[VectorStore]:
    """The store class of ``scheme``, importing it on first use."""
    entry = _REGISTRY.get(scheme)
    if entry is None:
        raise StoreURIError(
            f"no store backend for scheme {scheme!r} (known: "
            f"{', '.join(list_backends())}); expected " + " or ".join(EXPECTED_FORMS.values())
        )
    if isinstance(entry, type):
        return entry
    module_name, _, class_name = entry.target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] == entry.package:
            raise MissingBackendError(scheme, entry.package, entry.extra) from exc
        raise
    return getattr(module, class_name)


def open_store(uri: str, columns: ColumnMap | None = None) -> VectorStore:
    """Open the store at ``uri`` (docs/stores.md#uris)."""
    parsed = parse_store_uri(uri)
    return backend_class(parsed.scheme).open(parsed, columns or ColumnMap())


def create_store(
    uri: str,
    items: GalleryBlock | Iterable[GalleryBlock],
    *,
    old_model: str,
    columns: ColumnMap | None = None,
    new_model: str | None = None,
    new_dim: int | None = None,
    overwrite: bool = False,
) -> VectorStore:
    """Write a gallery into a new store at ``uri`` and open it; an existing non-empty table
    or collection is refused unless ``overwrite`` (docs/stores.md#create)."""
    parsed = parse_store_uri(uri)
    cls = backend_class(parsed.scheme)
    columns = columns or ColumnMap()
    checks.check_fingerprint(old_model, columns.old_model, f"{parsed.scheme} {parsed.name!r}")
    if new_model is not None:
        checks.check_fingerprint(new_model, columns.new_model, f"{parsed.scheme} {parsed.name!r}")
    return cls.create(
        parsed,
        items,
        columns=columns,
        old_model=old_model,
        new_model=new_model,
        new_dim=new_dim,
        overwrite=overwrite,
    )
