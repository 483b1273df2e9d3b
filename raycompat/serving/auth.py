"""Bearer-token check for the admin endpoints.

The token comes from the environment variable ``RAYCOMPAT_ADMIN_TOKEN`` or from a file
(``token_file`` option; first line, surrounding whitespace stripped).  Comparison is
constant-time (:func:`hmac.compare_digest`).  Without a configured token every admin request
is refused (401), so an unconfigured server cannot be administered by anyone.  The scheme name is
case-insensitive (``Bearer``, ``bearer``), as RFC 7235 section 2.1 says of every auth scheme.
The token is read where the index is started (the job's machine): the router replicas get only
its SHA-256 (:class:`AdminToken`), so no runtime_env or actor argument carries the secret.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass

from raycompat.config import ConfigError

__all__ = ["TOKEN_ENV", "AdminToken", "load_admin_token", "check_bearer"]

TOKEN_ENV = "RAYCOMPAT_ADMIN_TOKEN"
MIN_TOKEN_CHARS = 16


def load_admin_token(token_file: str | None = None, env: dict | None = None) -> str | None:
    """The admin token (file wins over the environment), or ``None`` when none is configured."""
    env = os.environ if env is None else env
    token = None
    if token_file:
        if not os.path.isfile(token_file):
            raise ConfigError(f"admin token file not found: {token_file}")
        with open(token_file, encoding="utf-8") as fh:
            token = (fh.readline() or "").strip()
        if not token:
            raise ConfigError(f"admin token file {token_file} is empty")
    elif env.get(TOKEN_ENV):
        token = env[TOKEN_ENV].strip()
    if token is not None and len(token) < MIN_TOKEN_CHARS:
        raise ConfigError(f"the admin token must have at least {MIN_TOKEN_CHARS} characters")
    return token


def _sha256(value: str) -> str:
    return hashlib.sha256(value.encode("utf-8", "replace")).hexdigest()


@dataclass(frozen=True)
class AdminToken:
    """What a server keeps of the admin token: its SHA-256 only (``None``: no token, admin
    endpoints disabled).  The router's replicas receive this object, never the token, so
    nothing a cluster's dashboard or ``ray list actors --detail`` shows (a runtime_env, an
    actor's arguments) holds the secret."""

    digest: str | None

    @classmethod
    def from_token(cls, token: str | None) -> AdminToken:
        return cls(None if token is None else _sha256(token))

    def check(self, authorization: str | None) -> str | None:
        """``None`` when the ``Authorization`` header carries the token, else why it fails."""
        if self.digest is None:
            return "admin endpoints are disabled: no admin token configured"
        if not authorization:
            return "missing 'Authorization: Bearer <token>' header"
        scheme, _, given = authorization.partition(" ")
        if scheme.lower() != "bearer" or not given:
            return "the Authorization header must be 'Bearer <token>'"
        if not hmac.compare_digest(_sha256(given.strip()), self.digest):
            return "invalid admin token"
        return None


def check_bearer(authorization: str | None, token: str | None) -> str | None:
    """``None`` when the ``Authorization`` header carries ``token``, else the reason it fails."""
    return AdminToken.from_token(token).check(authorization)
