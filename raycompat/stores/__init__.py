"""Vector database stores of a gallery mid-upgrade: LanceDB and Milvus behind one interface,
opened from a URI (docs/stores.md)."""

from raycompat.stores.base import (
    Capabilities,
    ColumnMap,
    Filter,
    GalleryBlock,
    ItemWrite,
    ModelCounts,
    RollbackMark,
    StoreInfo,
    VectorStore,
    create_store,
    list_backends,
    open_store,
    register_backend,
)
from raycompat.stores.errors import (
    MissingBackendError,
    StoreError,
    StoreExistsError,
    StoreNotFoundError,
    StoreURIError,
)
from raycompat.stores.mode_search import STORE_MODES, StoreQueries, search, search_field
from raycompat.stores.topk import SearchResult

__all__ = [
    "Capabilities",
    "ColumnMap",
    "Filter",
    "GalleryBlock",
    "ItemWrite",
    "MissingBackendError",
    "ModelCounts",
    "RollbackMark",
    "STORE_MODES",
    "SearchResult",
    "StoreError",
    "StoreExistsError",
    "StoreInfo",
    "StoreNotFoundError",
    "StoreQueries",
    "StoreURIError",
    "VectorStore",
    "create_store",
    "list_backends",
    "open_store",
    "register_backend",
    "search",
    "search_field",
]
