"""Store URIs: ``lance://<database>/<table>`` and ``milvus://<file.db or host:port>/<collection>``
(docs/stores.md#uris)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from raycompat.stores.errors import StoreURIError

__all__ = ["StoreURI", "parse_store_uri", "EXPECTED_FORMS"]

#: The accepted form of each built-in scheme, quoted by every URI error.
EXPECTED_FORMS = {
    "lance": "lance://<database path or URI, e.g. /data/db or s3://bucket/db>/<table>",
    "milvus": "milvus://<file.db (Milvus Lite) or host:port (a Milvus server)>/<collection>",
}

_LANCE_TABLE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
#: a scheme followed by a single slash (``s3:/bucket``): a mistyped object-store URI
_HALF_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:/(?!/)")
_MILVUS_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,200}$")
_HOST_PORT = re.compile(r"^[A-Za-z0-9_.-]+:\d{1,5}$")


@dataclass(frozen=True)
class StoreURI:
    """A parsed store URI: its scheme, where the database is, and the table or collection."""

    raw: str
    scheme: str
    target: str
    name: str

    @property
    def is_local_file(self) -> bool:
        """Milvus: whether the target is a Milvus Lite file (``*.db``) rather than a server."""
        return self.scheme == "milvus" and self.target.endswith(".db")

    @property
    def server_uri(self) -> str:
        """Milvus: what ``MilvusClient(uri=...)`` takes: the file path or ``http://host:port``."""
        return self.target if self.is_local_file else f"http://{self.target}"


def _fail(uri: str, scheme: str, why: str) -> StoreURIError:
    expected = EXPECTED_FORMS.get(scheme, " or ".join(EXPECTED_FORMS.values()))
    return StoreURIError(f"bad store URI {uri!r}: {why}; expected {expected}")


def _split(uri: str, scheme: str, rest: str) -> tuple[str, str]:
    target, sep, name = rest.rpartition("/")
    if not sep or not target or not name:
        raise _fail(uri, scheme, "it names no database and table/collection")
    return target, name


def parse_store_uri(uri: str) -> StoreURI:
    """Parse ``uri``; a :class:`StoreURIError` names the URI and the expected form."""
    if not isinstance(uri, str) or "://" not in uri:
        raise _fail(str(uri), "", "it has no scheme")
    scheme, rest = uri.split("://", 1)
    if scheme == "lance":
        target, name = _split(uri, scheme, rest)
        if target.rstrip("/").endswith(":"):  # lance://s3://bucket: the bucket, then no table
            raise _fail(
                uri, scheme, f"the database {target}/{name} is named, but no table after it"
            )
        if _HALF_URI.match(target):  # s3:/bucket/db would be a local folder named 's3:'
            raise _fail(uri, scheme, f"{target!r} looks like a URI with one '/' after its scheme")
        if not _LANCE_TABLE.match(name):
            raise _fail(uri, scheme, f"table name {name!r} is not letters, digits, '_', '-', '.'")
        return StoreURI(uri, scheme, target, name)
    if scheme == "milvus":
        target, name = _split(uri, scheme, rest)
        if not _MILVUS_NAME.match(name):
            raise _fail(uri, scheme, f"collection name {name!r} is not [A-Za-z_][A-Za-z0-9_]*")
        if not (target.endswith(".db") or _HOST_PORT.match(target)):
            raise _fail(uri, scheme, f"{target!r} is neither a file ending .db nor host:port")
        return StoreURI(uri, scheme, target, name)
    return StoreURI(uri, scheme, *_split(uri, scheme, rest))
