"""Argument checks of the store layer: each failure is one :class:`StoreError` that names the
column and the table or collection (docs/stores.md#errors)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from raycompat.stores.errors import StoreError

__all__ = [
    "check_fingerprint",
    "check_ids",
    "check_labels",
    "check_positions",
    "check_strings",
    "check_vectors",
    "column_error",
]

#: Longest model fingerprint and label string a store keeps (Milvus VARCHAR bounds).
MAX_NAME_CHARS = 512
#: Longest image URI a store keeps.
MAX_URI_CHARS = 4096


def column_error(column: str, where: str, why: str) -> StoreError:
    """The StoreError for ``column`` of ``where`` (a table or collection)."""
    return StoreError(f"column {column!r} of {where}: {why}")


_err = column_error


def check_ids(ids: object, column: str, where: str) -> np.ndarray:
    """Unique int64 ids, one dimension."""
    arr = np.asarray(ids)
    if arr.ndim != 1:
        raise _err(column, where, f"ids must be one-dimensional, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise _err(column, where, f"ids must be integers, got dtype {arr.dtype}")
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
        raise _err(column, where, "ids must fit in int64")
    arr = arr.astype(np.int64)
    uniq, counts = np.unique(arr, return_counts=True)
    if len(uniq) != len(arr):
        dup = uniq[counts > 1][:5].tolist()
        raise _err(column, where, f"ids must be unique, repeated: {dup}")
    return arr


def check_vectors(vectors: object, dim: int | None, n: int, column: str, where: str) -> np.ndarray:
    """Finite float32 vectors [n, dim] (any dim when ``dim`` is None)."""
    arr = np.asarray(vectors)
    if arr.ndim != 2 or arr.shape[0] != n:
        raise _err(column, where, f"expected vectors of shape ({n}, d), got shape {arr.shape}")
    if dim is not None and arr.shape[1] != dim:
        raise _err(
            column, where, f"expected dimension {dim}, got vectors of dimension {arr.shape[1]}"
        )
    if arr.shape[1] < 1 or arr.dtype.kind not in "fiu":
        raise _err(column, where, f"expected numeric vectors, got dtype {arr.dtype}")
    arr = np.ascontiguousarray(arr, dtype=np.float32)
    if not np.isfinite(arr).all():
        raise _err(column, where, "vectors must be finite (found NaN or inf)")
    return arr


#: a stored vector whose norm differs from 1 by more than this is not unit length
UNIT_TOLERANCE = 1e-3


def unit_rows(vectors: np.ndarray, column: str, where: str) -> np.ndarray:
    """``vectors`` with every row of unit length: the rows whose norm differs from 1 by more
    than 1e-6 are divided by it, the others kept bit for bit (a store scores by inner product,
    the cosine only for unit vectors). A zero row cannot be scaled: ``StoreError`` naming it."""
    norms = np.linalg.norm(vectors.astype(np.float64), axis=1)
    zero = np.flatnonzero(norms == 0)
    if zero.size:
        raise _err(column, where, f"zero vectors (no direction) at rows {zero[:5].tolist()}")
    scale = np.abs(norms - 1.0) > 1e-6
    if not scale.any():
        return vectors
    out = vectors.copy()
    out[scale] = (vectors[scale] / norms[scale, None]).astype(np.float32)
    return out


def not_unit_rows(vectors: np.ndarray) -> np.ndarray:
    """The rows of ``vectors`` that are not unit length (:data:`UNIT_TOLERANCE`)."""
    norms = np.linalg.norm(np.asarray(vectors, np.float64), axis=1)
    return np.abs(norms - 1.0) > UNIT_TOLERANCE


def check_labels(labels: object, n: int, kind: str | None, column: str, where: str):
    """Labels as int64 or str, with their kind (``"int64"`` or ``"string"``); when ``kind``
    is given they must be of that kind. Returns ``(array, kind)``."""
    arr = np.asarray(labels)
    if arr.ndim != 1 or len(arr) != n:
        raise _err(column, where, f"expected {n} labels, got shape {arr.shape}")
    if arr.dtype.kind in "iu":
        found = "int64"
    elif arr.dtype.kind in "US" or (
        arr.dtype.kind == "O" and all(isinstance(v, str) for v in arr.tolist())
    ):
        found = "string"
    else:
        raise _err(column, where, f"labels must be integers or strings, got dtype {arr.dtype}")
    if kind is not None and found != kind:
        raise _err(column, where, f"labels must be {kind} (as stored), got {found} labels")
    if found == "int64":
        return arr.astype(np.int64), found
    values = np.asarray([str(v) for v in arr.tolist()], dtype=object)
    _check_lengths(values.tolist(), MAX_NAME_CHARS, column, where)
    return values, found


def check_strings(values: Sequence[str] | None, n: int, column: str, where: str) -> list[str]:
    """``n`` strings (image URIs) of at most MAX_URI_CHARS characters each."""
    if values is None or isinstance(values, str) or len(values) != n:
        got = "none" if values is None else f"{len(values)}"
        raise _err(column, where, f"expected {n} strings, got {got}")
    out = [v for v in values]
    if not all(isinstance(v, str) for v in out):
        raise _err(column, where, "every value must be a string")
    _check_lengths(out, MAX_URI_CHARS, column, where)
    return out


def _check_lengths(values: list[str], limit: int, column: str, where: str) -> None:
    if values and max(len(v) for v in values) > limit:
        raise _err(column, where, f"strings must be at most {limit} characters")


def check_positions(positions: object, n: int, column: str, where: str) -> np.ndarray:
    """Upgrade positions: ``n`` int64 values >= 0."""
    arr = np.asarray(positions)
    if arr.ndim != 1 or len(arr) != n:
        raise _err(column, where, f"expected {n} positions, got shape {arr.shape}")
    if n and (arr.dtype.kind not in "iu" or int(arr.min()) < 0):
        raise _err(column, where, "positions must be integers >= 0")
    return arr.astype(np.int64)


def check_fingerprint(fingerprint: object, column: str, where: str) -> str:
    """A model fingerprint: a non-empty string of at most MAX_NAME_CHARS characters."""
    if not isinstance(fingerprint, str) or not fingerprint or len(fingerprint) > MAX_NAME_CHARS:
        raise _err(
            column,
            where,
            f"model fingerprint must be a non-empty string of at most "
            f"{MAX_NAME_CHARS} characters, got {fingerprint!r}",
        )
    return fingerprint
