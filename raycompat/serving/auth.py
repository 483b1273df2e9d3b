"""Bearer-token check for the admin endpoints.

The token comes from the environment variable ``RAYCOMPAT_ADMIN_TOKEN`` or from a file
(``token_file`` option; first line, surrounding whitespace stripped).  Comparison is
constant-time (:func:`hmac.compare_digest`).  Without a configured token every admin request
is refused (401), so an unconfigured server cannot be administered by anyone.  The scheme name is
case-insensitive (``Bearer``, ``bearer``), as RFC 7235 section 2.1 says of every auth scheme.
"""

from __future__ import annotations

import hmac
import os

from raycompat.config import ConfigError

__all__ = ["TOKEN_ENV", "load_admin_token", "check_bearer"]

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


def check_bearer(authorization: str | None, token: str | None) -> str | None:
    """``None`` when the ``Authorization`` header carries the token, else the reason it fails."""
    if token is None:
        return "admin endpoints are disabled: no admin token configured"
    if not authorization:
        return "missing 'Authorization: Bearer <token>' header"
    scheme, _, given = authorization.partition(" ")
    if scheme.lower() != "bearer" or not given:
        return "the Authorization header must be 'Bearer <token>'"
    if not hmac.compare_digest(given.strip().encode("utf-8", "replace"), token.encode()):
        return "invalid admin token"
    return None
