"""The JSON error middleware of Serve's proxy, as plain ASGI (docs/architecture.md, "Router"):
the proxy's own plain-text errors become the index's JSON body (5xx and 408 as 503 with
Retry-After), the router's JSON answers and normal bodies pass through, streamed."""

import asyncio
import json

import pytest

from raycompat.serving.config import serving_config
from raycompat.serving.proxy import JsonProxyErrors, proxy_middlewares, serve_http_options


def _start(status: int, ctype: bytes) -> dict:
    return {"type": "http.response.start", "status": status, "headers": [(b"content-type", ctype)]}


def _body(data: bytes, more: bool = False) -> dict:
    return {"type": "http.response.body", "body": data, "more_body": more}


def _run(app) -> list[dict]:
    """The messages ``JsonProxyErrors(app)`` sends for one HTTP request."""
    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/search", "headers": []}
    asyncio.run(JsonProxyErrors(app)(scope, receive, send))
    return sent


def _answer(sent: list[dict]) -> tuple[int, dict, dict]:
    """``(status, headers, JSON body)`` of a replaced answer (one start, one body)."""
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"], sent
    headers = {k.decode(): v.decode() for k, v in sent[0]["headers"]}
    assert headers["content-type"] == "application/json"
    assert int(headers["content-length"]) == len(sent[1]["body"])
    return sent[0]["status"], headers, json.loads(sent[1]["body"])


def _replying(*messages):
    async def app(scope, receive, send):
        for m in messages:
            await send(m)

    return app


@pytest.mark.parametrize(
    "status, text, words",
    [
        (500, b"Internal Server Error", "unavailable (Internal Server Error)"),
        (502, b"", "unavailable (proxy status 502)"),
        (503, b"Deployment 'router' is unavailable", "unavailable (Deployment"),
        (408, b"Request abc timed out after 5.0s.", "timed out"),
    ],
)
def test_a_plain_text_5xx_or_408_from_the_proxy_becomes_json_503_with_retry_after(
    status, text, words
):
    sent = _run(_replying(_start(status, b"text/plain"), _body(text[:5], True), _body(text[5:])))
    code, headers, body = _answer(sent)
    assert (code, headers["retry-after"], body["problems"]) == (503, "1", [])
    assert words in body["error"]
    if status == 408:
        assert "after 5.0s" in body["error"]


def test_a_plain_text_404_becomes_json_404_without_retry_after():
    code, headers, body = _answer(_run(_replying(_start(404, b"text/plain"), _body(b"Not Found"))))
    assert (code, body) == (404, {"error": "Not Found", "problems": []})
    assert "retry-after" not in headers


def test_the_routers_json_errors_pass_through_untouched():
    msgs = [_start(500, b"application/json"), _body(b'{"error": "internal error: KeyError"}')]
    assert _run(_replying(*msgs)) == msgs


@pytest.mark.parametrize("fail", ["raise", "return", "raise mid-body", "return mid-body"])
def test_a_proxy_that_gives_up_before_answering_gets_a_json_503(fail):
    """A dead replica: the proxy raises, or returns, before (or while holding) its answer."""

    async def app(scope, receive, send):
        if "mid-body" in fail:
            await send(_start(500, b"text/plain"))
            await send(_body(b"partial", True))
        if fail.startswith("raise"):
            raise RuntimeError("replica died")

    code, headers, body = _answer(_run(app))
    assert (code, headers["retry-after"]) == (503, "1")
    assert body["error"].startswith("the live index is unavailable")


def test_normal_bodies_stream_through_chunk_by_chunk():
    """Each chunk of a 200 leaves before the app produces the next (nothing is buffered), and an
    error after the response started is not hidden."""
    sent: list[dict] = []
    chunks = [bytes([i]) * 100_000 for i in range(5)]

    async def app(scope, receive, send):
        await send(_start(200, b"application/octet-stream"))
        for i, c in enumerate(chunks):
            await send(_body(c, more=True))
            assert sent[-1]["body"] is c, f"chunk {i} held back"
        raise RuntimeError("after the start")

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": "/big", "headers": []}
    with pytest.raises(RuntimeError, match="after the start"):
        asyncio.run(JsonProxyErrors(app)(scope, None, send))
    assert sent[0]["status"] == 200 and [m["body"] for m in sent[1:]] == chunks


def test_websocket_and_lifespan_scopes_pass_through():
    seen = []

    async def app(scope, receive, send):
        seen.append(scope["type"])
        await send({"type": "lifespan.startup.complete"})

    out = []

    async def send(message):
        out.append(message)

    asyncio.run(JsonProxyErrors(app)({"type": "lifespan"}, None, send))
    assert seen == ["lifespan"] and out == [{"type": "lifespan.startup.complete"}]


def test_serve_http_options_and_the_proxy_callback():
    cfg = serving_config(gallery="synthetic:1", port=8123, request_timeout_s=5.0)
    assert serve_http_options(cfg) == {"host": "127.0.0.1", "port": 8123, "request_timeout_s": 5.0}
    (mw,) = proxy_middlewares()
    assert mw.cls is JsonProxyErrors
