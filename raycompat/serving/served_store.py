"""The store a live index serves: its URI from the options, created from the gallery on the
index's first start, and opened by every replica (docs/live-index.md, "Where the gallery
lives").

``store`` is a store URI (``lance://...``; the URIs of ``backfill-store``) or a folder, which
means an embedded LanceDB table ``gallery`` in it; without it the index keeps its store in
``<state_dir>/store``.  When the store does not exist yet it is created from ``gallery`` (an
embeddings parquet or ``synthetic:...``: the ids, labels and L2-normalised old vectors, the new
column empty), once, by the process that deploys the index.  A backend that keeps no write
sequence cannot be followed by the shards and is refused with one line saying what to use.
"""

from __future__ import annotations

import os

import numpy as np

from raycompat.config import ConfigError

__all__ = ["SERVED_TABLE", "store_uri", "ensure_store", "open_served_store"]

#: The table name of a store given as a folder.
SERVED_TABLE = "gallery"


def store_uri(cfg) -> str:
    """The URI of the store ``cfg`` serves (see the module docstring)."""
    spec = cfg.store or os.path.join(cfg.state_dir, "store")
    if "://" in spec:
        return spec
    return f"lance://{os.path.abspath(spec)}/{SERVED_TABLE}"


def store_columns(cfg):
    from raycompat.simulator.store_inputs import parse_store_columns

    return parse_store_columns(cfg.store_columns)


def open_served_store(cfg):
    """Open the served store (every replica); ``ConfigError`` naming it when it cannot be
    followed or opened."""
    from raycompat.stores import StoreError, open_store

    uri = check_followed(cfg)
    try:
        store = open_store(uri, store_columns(cfg))
    except StoreError as exc:
        raise ConfigError(f"serving: store {uri}: {exc}") from None
    if store.columns.write_seq not in _column_names(store):
        store.close()
        raise ConfigError(
            f"serving: store {uri}: column {store.columns.write_seq!r} (write_seq) missing: the "
            "live index follows the store through it; create the store with raycompat"
        )
    return store


def check_followed(cfg) -> str:
    """The served store's URI, checked before anything is opened or created: its backend
    must keep a write sequence (``ConfigError`` with one line saying what to use)."""
    from raycompat.stores import StoreError
    from raycompat.stores.base import backend_class
    from raycompat.stores.uri import parse_store_uri

    uri = store_uri(cfg)
    try:
        cls = backend_class(parse_store_uri(uri).scheme)
    except StoreError as exc:
        raise ConfigError(f"serving: store {uri}: {exc}") from None
    if not cls.keeps_write_sequence:
        raise ConfigError(
            f"serving: store {uri}: the live index follows a store's commits through its "
            f"write sequence, which the {cls.backend} backend does not keep (and Milvus Lite "
            "lets one process hold its file); serve a LanceDB table (lance://PATH/TABLE, at a "
            "path every replica reaches)"
        )
    return uri


def _column_names(store) -> list[str]:
    table = getattr(store, "_table", None)
    return list(table.schema.names) if table is not None else []


def ensure_store(cfg, old_model: str, new_dim: int) -> str:
    """Create the served store from ``cfg.gallery`` unless it exists; returns its URI.
    ``old_model``: the fingerprint of the gallery's old vectors."""
    from raycompat.stores import StoreError, StoreNotFoundError, create_store, open_store

    uri = check_followed(cfg)
    columns = store_columns(cfg)
    try:
        open_store(uri, columns).close()
        return uri
    except StoreNotFoundError:
        pass
    except StoreError as exc:
        raise ConfigError(f"serving: store {uri}: {exc}") from None
    if not cfg.gallery:
        raise ConfigError(
            f"serving: store {uri} does not exist; give the option gallery to create it"
        )
    try:
        create_store(
            uri, _gallery_blocks(cfg), old_model=old_model, columns=columns, new_dim=new_dim
        ).close()
    except StoreError as exc:
        raise ConfigError(f"serving: store {uri} not created from {cfg.gallery}: {exc}") from None
    return uri


def _gallery_blocks(cfg, block: int = 65536):
    """The gallery's items as store blocks: ids, labels (class names of a parquet gallery,
    cluster numbers of a synthetic one, else 0) and L2-normalised old vectors."""
    from raycompat.serving.gallery_source import gallery_labels, open_gallery
    from raycompat.stores import GalleryBlock

    src = open_gallery(cfg.gallery)
    ids = src.gallery_ids()
    labels = gallery_labels(src)
    for start in range(0, ids.size, block):
        part = ids[start : start + block]
        old = src.vectors_of("old", part)
        yield GalleryBlock(part, labels[start : start + block], np.ascontiguousarray(old))
