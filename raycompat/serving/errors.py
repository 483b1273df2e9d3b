"""HTTP errors of the live index: which exception becomes which status code, and the one JSON
body every error has, ``{"error": "...", "problems": [{"field", "message"}]}``.

* :class:`ApiError` (raised by the router's endpoints) -> its status (400 bad input, 401 auth,
  404 unknown ids, 409 backfill state, 413 too large, 422 invalid values, 503 a shard or the
  controller down), with a problem naming the field when it has one;
* pydantic request validation -> 422 naming the first bad field (``body.k``,
  ``body.vectors[0][0]``) or "malformed JSON";
* Starlette's HTTP exceptions (404 unknown path, 405) -> their status;
* anything else -> 500 ``internal error: <type>`` (never a stack trace).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

__all__ = [
    "ApiError",
    "error_response",
    "problem_field",
    "validation_error",
    "unavailable",
    "image_error",
    "internal_error",
    "install_error_handlers",
]


class ApiError(Exception):
    """An answer with a 4xx/5xx ``status``; ``field`` names where the problem is."""

    def __init__(
        self,
        status: int,
        message: str,
        field: str | None = None,
        headers: dict[str, str] | None = None,
        extra: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.field, self.headers = status, message, field, headers
        self.extra = extra  # more fields of the JSON body (e.g. ``applied_ids``)


def error_response(
    status: int,
    message: str,
    problems: Iterable[dict] = (),
    headers: dict[str, str] | None = None,
    extra: dict | None = None,
) -> JSONResponse:
    """The JSON error body with ``status`` (``extra``: more fields of the body)."""
    content = {"error": message, "problems": list(problems), **(extra or {})}
    return JSONResponse(status_code=status, headers=headers, content=content)


def problem_field(loc: Sequence[Any]) -> str:
    """A pydantic error location as a path: ``("body", "vectors", 0, 1)`` ->
    ``body.vectors[0][1]``."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def validation_error(errors: Sequence[dict]) -> tuple[str, list[dict]]:
    """``(headline, problems)`` of pydantic's request validation errors: the headline names the
    first problem's field, or says the JSON is malformed."""
    problems = []
    for e in errors:
        field = problem_field(e.get("loc", ()))
        msg = str(e.get("msg", "invalid value"))
        if e.get("type") == "json_invalid":
            msg = f"malformed JSON: {e.get('ctx', {}).get('error', msg)}"
        problems.append({"field": field or "body", "message": msg})
    first = problems[0] if problems else {"field": "body", "message": "invalid request"}
    if first["message"].startswith("malformed JSON"):
        return first["message"], problems
    return f"invalid request: {first['field']}: {first['message']}", problems


def unavailable(what: str, exc: BaseException) -> ApiError:
    """503 with ``Retry-After``: a shard or the backfill controller did not answer (in time)."""
    why = "no answer in time" if isinstance(exc, TimeoutError) else type(exc).__name__
    return ApiError(503, f"{what} unavailable: {why}", headers={"Retry-After": "1"})


def image_error(exc: Exception) -> ApiError:
    """A bad query image: 413 when it exceeds a size limit, else 400."""
    status = 413 if "exceeds the limit" in str(exc) else 400
    return ApiError(status, str(exc), "body.images")


def internal_error(exc: BaseException) -> JSONResponse:
    """500 naming only the exception's type."""
    return error_response(500, f"internal error: {type(exc).__name__}")


async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
    probs = [{"field": exc.field, "message": exc.message}] if exc.field else []
    return error_response(exc.status, exc.message, probs, exc.headers, exc.extra)


async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
    head, problems = validation_error(exc.errors())
    return error_response(422, head, problems)


async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    message, field = str(exc.detail), None
    if exc.status_code == 400 and "parsing the body" in message:  # FastAPI's json.loads failed
        cause = exc.__cause__
        why = "nested too deeply" if isinstance(cause, RecursionError) else type(cause).__name__
        message, field = f"malformed JSON: {why}", "body"
    elif exc.status_code == 413:
        field = "body"
    problems = [{"field": field, "message": message}] if field else []
    return error_response(exc.status_code, message, problems, getattr(exc, "headers", None))


def install_error_handlers(app: FastAPI) -> None:
    """Answer :class:`ApiError`, validation errors and HTTP exceptions with the JSON error body."""
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation)
    app.add_exception_handler(StarletteHTTPException, _http)
