"""Errors of the store layer (docs/stores.md#errors).

Every error is a :class:`StoreError`, a ``ValueError``, whose message names the column, the
table or collection, or the URI it is about.
"""

from __future__ import annotations

__all__ = [
    "MissingBackendError",
    "StoreError",
    "StoreExistsError",
    "StoreNotFoundError",
    "StoreURIError",
]


class StoreError(ValueError):
    """A store refused an operation; the message names the column, table or collection."""


class StoreURIError(StoreError):
    """A store URI that does not parse; the message names the URI and the expected form."""


class StoreExistsError(StoreError):
    """``create`` met an existing non-empty table or collection (pass ``overwrite=True``)."""


class StoreNotFoundError(StoreError):
    """``open`` found no such table or collection."""


class MissingBackendError(StoreError, ImportError):
    """The backend's optional dependency is not installed; the message says what to install.
    Also an ``ImportError``, so ``except ImportError`` handlers see it."""

    def __init__(self, scheme: str, package: str, extra: str) -> None:
        # an empty extra: the package is one of raycompat's own dependencies
        how = f"pip install raycompat[{extra}]" if extra else f"pip install {package}"
        super().__init__(
            f"the {scheme}:// store needs the Python package {package!r}, which is not "
            f"installed: {how}" + ("" if extra else " (a dependency of raycompat: reinstall it)")
        )
        self.scheme = scheme
        self.package = package
        self.extra = extra
