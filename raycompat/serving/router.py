"""The router: a FastAPI ingress deployment that validates requests, embeds image queries,
fans searches out to the shards and merges their top-k, and fronts the admin endpoints.

Endpoints (the OpenAPI document at ``/openapi.json`` describes every one):

* ``POST /search`` -- by ``vectors`` or base64 ``images``; returns per query the merged top-k
  ``{id, score, representation}`` (descending score, ties by ascending id).
* ``GET /status`` -- items per representation (total and per shard), backfill progress,
  model versions; ``GET /metrics`` -- Prometheus text; ``GET /healthz``.
* ``POST /admin/upsert``, ``POST /admin/backfill/{start,pause,resume}``,
  ``POST /admin/snapshot`` -- need ``Authorization: Bearer <token>`` (:mod:`.auth`).

Every error is JSON ``{"error": "...", "problems": [{"field", "message"}]}`` with a 4xx code
for bad input (401 auth, 404 unknown ids / paths, 409 backfill state, 413 too large,
422 invalid values) and 503 when a shard is down.  Nothing from the network is unpickled:
bodies are JSON parsed by FastAPI into pydantic models.
"""
import asyncio
import os
import time
from typing import Optional

import numpy as np

__all__ = ["build_router"]


def _problem_field(loc) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def build_router(cfg: dict):
    """The Router deployment class (not bound) for a serving config dict."""
    from fastapi import Depends, FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse
    from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
    from ray import serve
    from starlette.exceptions import HTTPException as StarletteHTTPException

    from raycompat.serving.schemas import ErrorResponse, Limits, build_models

    limits = Limits(max_k=cfg["max_k"], max_queries=cfg["max_queries"], max_image_bytes=cfg["max_image_bytes"],
                    max_upsert_items=cfg["max_upsert_items"])
    M = build_models(limits)
    SearchRequest, SearchResponse = M["SearchRequest"], M["SearchResponse"]
    UpsertRequest, UpsertResponse = M["UpsertRequest"], M["UpsertResponse"]
    BackfillStartRequest, BackfillResumeRequest = M["BackfillStartRequest"], M["BackfillResumeRequest"]
    BackfillState, StatusResponse = M["BackfillState"], M["StatusResponse"]

    errors = {c: {"model": ErrorResponse} for c in (400, 401, 404, 409, 413, 422, 503)}
    app = FastAPI(title="raycompat live index",
                  description="Sharded faiss gallery served during a hot-refresh model upgrade "
                              "(raycompat, ARCHITECTURE.md 'Serving').",
                  version="1", responses={422: {"model": ErrorResponse}})
    shared = {"token": None, "metrics": None}

    class ApiError(Exception):
        def __init__(self, status: int, message: str, field: Optional[str] = None, headers=None):
            self.status, self.message, self.field, self.headers = status, message, field, headers

    def error_response(status, message, problems=(), headers=None):
        return JSONResponse(status_code=status, headers=headers,
                            content={"error": message, "problems": list(problems)})

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        probs = [{"field": exc.field, "message": exc.message}] if exc.field else []
        return error_response(exc.status, exc.message, probs, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        problems = []
        for e in exc.errors():
            field = _problem_field(e.get("loc", ()))
            msg = str(e.get("msg", "invalid value"))
            if e.get("type") == "json_invalid":
                msg = f"malformed JSON: {e.get('ctx', {}).get('error', msg)}"
            problems.append({"field": field or "body", "message": msg})
        first = problems[0] if problems else {"field": "body", "message": "invalid request"}
        head = first["message"] if first["message"].startswith("malformed JSON") else \
            f"invalid request: {first['field']}: {first['message']}"
        return error_response(422, head, problems)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail), (), getattr(exc, "headers", None))

    bearer = HTTPBearer(auto_error=False, description="admin token (env RAYCOMPAT_ADMIN_TOKEN or token file)")

    async def admin_auth(request: Request, creds: Optional[HTTPAuthorizationCredentials] = Depends(bearer)):
        from raycompat.serving.auth import check_bearer

        header = request.headers.get("authorization")
        why = check_bearer(header, shared["token"])
        if why is not None:
            raise ApiError(401, why, headers={"WWW-Authenticate": "Bearer"})

    @app.middleware("http")
    async def _timing(request: Request, call_next):
        t0 = time.perf_counter()
        try:
            response = await call_next(request)
        except Exception as exc:  # never leak a stack trace; still a server error
            response = error_response(500, f"internal error: {type(exc).__name__}")
        m = shared["metrics"]
        if m is not None:
            route = request.scope.get("route")      # the matched route (bounded label set)
            m.observe(getattr(route, "path", "unmatched"), response.status_code, time.perf_counter() - t0,
                      int(request.scope.get("raycompat_queries", 0)))
        return response

    @serve.deployment(name="router")
    @serve.ingress(app)
    class Router:
        def __init__(self, shards: list, controller, cfg: dict):
            from raycompat.serving.auth import load_admin_token
            from raycompat.serving.metrics import RouterMetrics

            self.shards = list(shards)
            self.controller = controller
            self.cfg = cfg
            self.dims = cfg["dims"]                     # per stored representation
            self.query_dims = cfg.get("query_dims") or {"old": self.dims["old"], "new": self.dims["new"]}
            self.compatible_dim = int(cfg.get("compatible_dim") or self.dims["old"])
            self._rank_merge = None
            shared["token"] = load_admin_token(cfg.get("token_file"))
            shared["metrics"] = RouterMetrics()
            self.limits = limits
            self._embedder = None

        # -------------------------------------------------------------- helpers
        def embedder(self, role: str = "new"):
            """The ``new`` (or, for naive_merge image queries, ``old``) model's image embedder."""
            if self._embedder is None:
                self._embedder = {}
            if role not in self._embedder:
                if not self.cfg.get(f"{role}_model"):
                    why = "image queries need the new model" if role == "new" else \
                        "naive_merge image queries are embedded with the old model too"
                    raise ApiError(400, f"{why}: the server was started without {role}_model", "body.images")
                from raycompat.serving.embedder_pool import ModelEmbedder

                self._embedder[role] = ModelEmbedder(self.cfg[f"{role}_model"], self.cfg.get("resolution"),
                                                     self.cfg.get("data_seed", 0))
            return self._embedder[role]

        async def _embed_images(self, images, role: str) -> np.ndarray:
            """Decode (4xx naming a bad image) and embed base64 images with one model."""
            from raycompat.serving.embedder_pool import ImageInputError, decode_images

            emb = self.embedder(role) if self.cfg.get(f"{role}_model") else None
            try:   # images are checked first, so a bad image is named even without a model
                imgs = decode_images(images, emb.resolution if emb else 32, emb.in_chans if emb else 1,
                                     self.limits.max_image_bytes, self.limits.max_image_pixels)
            except ImageInputError as exc:
                status = 413 if "exceeds the limit" in str(exc) else 400
                raise ApiError(status, str(exc), "body.images") from None
            emb = self.embedder(role)
            q = await asyncio.to_thread(emb.embed_images, imgs)
            if q.shape[1] != self.query_dims[role]:
                raise ApiError(400, f"the {role} model embeds to {q.shape[1]} dims, the gallery expects "
                                    f"{self.query_dims[role]}", "body.images")
            return q

        def rank_merge(self):
            """``(rho, psi_rev)`` in the rank_merge mode, else ``None`` (loaded once)."""
            if self.cfg.get("mode") != "rank_merge":
                return None
            if self._rank_merge is None:
                from raycompat.serving.scoring import rank_merge_maps

                self._rank_merge = rank_merge_maps(self.cfg.get("new_model"))
            return self._rank_merge

        async def _fan_out(self, method: str, *args):
            calls = [getattr(h, method).remote(*args) for h in self.shards]
            out = []
            for i, c in enumerate(calls):
                try:
                    out.append(await c)
                except Exception as exc:
                    raise ApiError(503, f"shard {i} unavailable: {type(exc).__name__}") from None
            return out

        def _matrix(self, rows, field: str, dim: int, what: str) -> np.ndarray:
            lengths = {len(r) for r in rows}
            if len(lengths) != 1:
                bad = next(i for i, r in enumerate(rows) if len(r) != len(rows[0]))
                raise ApiError(422, f"dimension mismatch: {field}[{bad}] has {len(rows[bad])} values, "
                                    f"{field}[0] has {len(rows[0])}", f"{field}[{bad}]")
            a = np.asarray(rows, dtype=np.float64)
            if a.shape[1] != dim:
                raise ApiError(422, f"dimension mismatch: {field} have {a.shape[1]} dims, {what} has {dim}", field)
            if not np.isfinite(a).all():
                raise ApiError(422, f"{field} contain NaN or inf", field)
            if (np.abs(a) > 3.0e38).any():
                raise ApiError(422, f"{field} values overflow float32", field)
            zero = np.flatnonzero(~a.astype(np.float32).any(axis=1))
            if zero.size:
                raise ApiError(422, f"{field}[{int(zero[0])}] is a zero vector (no direction to search)",
                               f"{field}[{int(zero[0])}]")
            return a.astype(np.float32)

        # -------------------------------------------------------------- search
        @app.post("/search", response_model=SearchResponse, responses=errors,
                  summary="Top-k search by query vectors or base64 images")
        async def search(self, req: SearchRequest, request: Request):
            from raycompat.serving.scoring import query_sides
            from raycompat.serving.state import REPRESENTATIONS, merge_topk

            t0 = time.perf_counter()
            naive = self.cfg.get("mode") == "naive_merge" and req.model == "new"
            old_q = None
            if req.images is not None:
                q = await self._embed_images(req.images, "new")
                if naive:
                    old_q = await self._embed_images(req.images, "old")
            else:
                dim = self.query_dims[req.model]
                q = self._matrix(req.vectors, "body.vectors", dim, f"the {req.model} model's embedding")
                if req.old_vectors is not None:
                    if not naive:
                        raise ApiError(422, f"'old_vectors' are used in the naive_merge mode only; this index "
                                            f"serves the {self.cfg.get('mode')} mode", "body.old_vectors")
                    old_q = self._matrix(req.old_vectors, "body.old_vectors", self.query_dims["old"],
                                         "the old model's embedding")
                    if old_q.shape[0] != q.shape[0]:
                        raise ApiError(422, f"'old_vectors' has {old_q.shape[0]} rows, 'vectors' has "
                                            f"{q.shape[0]}: one old embedding per query", "body.old_vectors")
                elif naive:
                    raise ApiError(422, "the naive_merge mode scores old-state items with the old model's "
                                        "embedding of each query: send 'old_vectors' with 'vectors'",
                                   "body.old_vectors")
            request.scope["raycompat_queries"] = int(q.shape[0])
            rank_merge = self.rank_merge() if req.model == "new" else None
            sides = await asyncio.to_thread(query_sides, q, req.model, self.compatible_dim, rank_merge, old_q)
            parts = await self._fan_out("search", sides, req.k)
            S, I, R = merge_topk([p[0] for p in parts], [p[1] for p in parts], [p[2] for p in parts], req.k)
            results = []
            for qi in range(S.shape[0]):
                row = []
                for s, i, r in zip(S[qi].tolist(), I[qi].tolist(), R[qi].tolist()):
                    if i < 0:
                        break
                    row.append({"id": i, "score": s, "representation": REPRESENTATIONS[r]})
                results.append(row)
            return {"results": results, "k": req.k, "took_ms": 1000 * (time.perf_counter() - t0)}

        # -------------------------------------------------------------- status / metrics
        async def _status(self):
            shard_status = await self._fan_out("status")
            items = {"old": 0, "adapted": 0, "new": 0}
            for s in shard_status:
                for r, n in s["items"].items():
                    items[r] += int(n)
            try:
                bf = await self.controller.status.remote()
            except Exception as exc:
                bf = {"state": "unavailable", "error": f"backfill controller unavailable: {type(exc).__name__}"}
            return {"items": items, "shards": shard_status, "backfill": bf, "mode": self.cfg["mode"],
                    "dims": self.dims, "models": self.cfg.get("models", {})}

        @app.get("/status", response_model=StatusResponse, responses=errors,
                 summary="Items per representation, backfill progress, model versions")
        async def status(self):
            return await self._status()

        @app.get("/healthz", summary="Liveness of the router")
        async def healthz(self):
            return {"ok": True}

        @app.get("/metrics", response_class=PlainTextResponse, summary="Prometheus metrics (text format)")
        async def metrics(self):
            gauges = []
            try:
                st = await self._status()
            except ApiError:
                st = None
            if st is not None:
                for s in st["shards"]:
                    for r, n in s["items"].items():
                        gauges.append(("items", "Items held per shard and representation.",
                                       {"shard": str(s["shard"]), "representation": r}, n))
                bf = st["backfill"]
                gauges.append(("backfill_position", "Items of the backfill order upgraded.", {},
                               bf.get("position") or 0))
                gauges.append(("backfill_total", "Items in the backfill order.", {}, bf.get("total") or 0))
                gauges.append(("shards_up", "Shards answering.", {}, len(st["shards"])))
            else:
                gauges.append(("shards_up", "Shards answering.", {}, 0))
            return PlainTextResponse(shared["metrics"].render(gauges),
                                     media_type="text/plain; version=0.0.4")

        # -------------------------------------------------------------- admin
        @app.post("/admin/upsert", response_model=UpsertResponse, responses=errors,
                  dependencies=[Depends(admin_auth)],
                  summary="Atomically set items' representation and vector (existing ids only)")
        async def upsert(self, req: UpsertRequest):
            from raycompat.index.search import l2_normalize
            from raycompat.serving.placement import split_by_shard

            ids = np.asarray([it.id for it in req.items], np.int64)
            u, c = np.unique(ids, return_counts=True)
            if (c > 1).any():
                raise ApiError(422, f"duplicate id(s) in one upsert: {u[c > 1][:10].tolist()}", "body.items")
            groups = {}
            for pos, it in enumerate(req.items):
                groups.setdefault(it.representation, []).append(pos)
            prepared = []
            for rep, pos in groups.items():
                want = self.dims[rep]
                vec = self._matrix([req.items[p].vector for p in pos], f"body.items[{pos[0]}].vector", want,
                                   f"representation {rep!r}")
                prepared.append((rep, ids[pos], l2_normalize(vec)))
            # an id is unknown if the shard it is placed on does not hold it
            parts = split_by_shard(ids, len(self.shards))
            unknown = []
            for s, p in enumerate(parts):
                if p.size:
                    try:
                        unknown += await self.shards[s].unknown.remote(ids[p])
                    except Exception as exc:
                        raise ApiError(503, f"shard {s} unavailable: {type(exc).__name__}") from None
            if unknown:
                raise ApiError(404, f"unknown item id(s): {sorted(unknown)[:10]}", "body.items")
            per_shard = [0] * len(self.shards)
            for rep, rid, vec in prepared:
                for s, p in enumerate(split_by_shard(rid, len(self.shards))):
                    if not p.size:
                        continue
                    try:
                        res = await self.shards[s].upsert.remote(rid[p], rep, vec[p])
                    except Exception as exc:
                        raise ApiError(503, f"shard {s} unavailable: {type(exc).__name__}") from None
                    if "error" in res:
                        raise ApiError(404 if res.get("unknown_ids") else 422, res["error"], "body.items")
                    per_shard[s] += int(res["applied"])
            return {"applied": int(sum(per_shard)), "per_shard": per_shard}

        async def _controller(self, method: str, **kw):
            try:
                res = await getattr(self.controller, method).remote(**kw)
            except Exception as exc:
                raise ApiError(503, f"backfill controller unavailable: {type(exc).__name__}") from None
            if "error" in res and res.get("status"):
                raise ApiError(int(res["status"]), res["error"], "body")
            return res

        @app.post("/admin/backfill/start", response_model=BackfillState, responses=errors,
                  dependencies=[Depends(admin_auth)], summary="Start a backfill with a policy and a rate")
        async def backfill_start(self, req: BackfillStartRequest):
            return await self._controller("start", **req.model_dump())

        @app.post("/admin/backfill/pause", response_model=BackfillState, responses=errors,
                  dependencies=[Depends(admin_auth)], summary="Pause the running backfill")
        async def backfill_pause(self):
            return await self._controller("pause")

        @app.post("/admin/backfill/resume", response_model=BackfillState, responses=errors,
                  dependencies=[Depends(admin_auth)], summary="Resume (optionally up to 'until', at 'rate')")
        async def backfill_resume(self, req: BackfillResumeRequest):
            return await self._controller("resume", **req.model_dump())

        @app.post("/admin/snapshot", responses=errors, dependencies=[Depends(admin_auth)],
                  summary="Write every shard's snapshot now (and truncate its log)")
        async def snapshot(self):
            paths = await self._fan_out("snapshot")
            return {"snapshots": len(paths)}

    return Router
