"""The router: a FastAPI ingress deployment that validates requests, embeds image queries,
fans searches out to the shards and merges their top-k, and fronts the admin endpoints.

Endpoints (the OpenAPI document at ``/openapi.json`` describes every one):

* ``POST /search`` -- by ``vectors`` or base64 ``images``; returns per query the merged top-k
  ``{id, score, representation}`` (descending score, ties by ascending id).
* ``GET /status`` -- items per representation (total and per shard), backfill progress,
  model versions; ``GET /metrics`` -- Prometheus text; ``GET /healthz``.
* ``POST /admin/upsert``, ``POST /admin/backfill/{start,pause,resume,rollback,finalize}``,
  ``POST /admin/canary``, ``GET /admin/stale`` -- need
  ``Authorization: Bearer <token>`` (:mod:`.auth`); the guarded upgrade behind them:
  :mod:`.upgrade`.

Every error is JSON ``{"error": "...", "problems": [{"field", "message"}]}`` with a 4xx code
for bad input (401 auth, 404 unknown ids / paths, 409 backfill state, 413 too large,
422 invalid values) and 503 when a shard is down (:mod:`.errors`).  Nothing from the network
is unpickled: bodies are JSON parsed by FastAPI into pydantic models.

:class:`Router` is the deployment: one method per endpoint, its state in attributes.  Its
FastAPI app is built on the replica (:func:`build_api`, Serve's ``__serve_build_asgi_app__``),
because the request models carry the server's limits
(:func:`raycompat.serving.schemas.build_models`).
"""

import asyncio
import inspect
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from fastapi import Depends, FastAPI, Query, Request
from fastapi.responses import PlainTextResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel
from ray import serve

from raycompat.serving.errors import (
    ApiError,
    image_error,
    install_error_handlers,
    internal_error,
    unavailable,
)
from raycompat.serving.guard import RequestGuard
from raycompat.serving.plan import ServingPlan
from raycompat.serving.schemas import ApiModels, ErrorResponse, build_models

__all__ = ["Router", "build_api"]

#: the error codes the OpenAPI document lists for every endpoint
ERROR_CODES = (400, 401, 404, 409, 413, 422, 503)
#: seconds between two asks whether the backfill controller wants the searches' results
READS_RECHECK_S = 1.0
BEARER = HTTPBearer(
    auto_error=False, description="admin token (env RAYCOMPAT_ADMIN_TOKEN or token file)"
)


@serve.deployment(name="router")
@serve.ingress()
class Router:
    """The ingress deployment over the shard handles and the backfill controller handle."""

    def __init__(self, shards: list, controller, plan: ServingPlan, admin):
        from raycompat.serving.batching import Batcher
        from raycompat.serving.metrics import ServingMetrics

        self.shards = list(shards)
        self.controller = controller
        self.plan = plan
        self.cfg = plan.config
        self.limits = plan.limits
        self.admin = admin  # raycompat.serving.auth.AdminToken: the token's hash only
        self.recorder = ServingMetrics()
        self.batcher = Batcher(
            self.search_batch,
            self.cfg.search_batch_size,
            self.cfg.search_batch_wait_ms / 1000,
        )
        self.embedders: dict = {}  # role -> ModelEmbedder
        self.rank_merge_maps = None  # (rho, psi_rev) in the rank_merge mode
        self._reads_wanted = False  # upgrade on read: the controller wants the results
        self._reads_checked = -float("inf")
        self._read_tasks: set = set()
        self._load_models()

    def _load_models(self) -> None:
        """Every model a query can need, loaded now: not on the event loop of a first query."""
        if self.cfg.new_model:
            self.embedder("new")
        if self.cfg.old_model and self.cfg.mode == "naive_merge":
            self.embedder("old")
        self.rank_merge()

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_api(self)

    # ------------------------------------------------------------------ middleware, auth
    async def timed(self, request: Request, call_next):
        """Count and time every request (a 500 JSON body if a handler raises)."""
        t0 = time.perf_counter()
        try:
            response = await call_next(request)
        except Exception as exc:  # never leak a stack trace; still a server error
            response = internal_error(exc)
        route = request.scope.get("route")  # the matched route (bounded label set)
        self.recorder.observe(
            getattr(route, "path", "unmatched"),
            response.status_code,
            time.perf_counter() - t0,
            int(request.scope.get("raycompat_queries", 0)),
        )
        return response

    async def admin_auth(
        self, request: Request, creds: HTTPAuthorizationCredentials | None = Depends(BEARER)
    ) -> None:
        """401 unless the request carries the admin token."""
        why = self.admin.check(request.headers.get("authorization"))
        if why is not None:
            raise ApiError(401, why, headers={"WWW-Authenticate": "Bearer"})

    # ------------------------------------------------------------------ query vectors
    def embedder(self, role: str = "new"):
        """The ``new`` (or, for naive_merge image queries, ``old``) model's image embedder."""
        path = self.cfg.new_model if role == "new" else self.cfg.old_model
        if not path:
            why = (
                "image queries need the new model"
                if role == "new"
                else "naive_merge image queries are embedded with the old model too"
            )
            raise ApiError(
                400, f"{why}: the server was started without {role}_model", "body.images"
            )
        if role not in self.embedders:
            from raycompat.serving.embedder_pool import ModelEmbedder

            self.embedders[role] = ModelEmbedder(path, self.cfg.resolution, self.cfg.data_seed)
        return self.embedders[role]

    async def embed_images(self, images: list[str], role: str) -> np.ndarray:
        """Decode (4xx naming a bad image) and embed base64 images with one model."""
        from raycompat.serving.embedder_pool import ImageInputError, decode_images

        has_model = bool(self.cfg.new_model if role == "new" else self.cfg.old_model)
        emb = self.embedder(role) if has_model else None
        try:  # images are checked first, so a bad image is named even without a model
            # off the event loop: decoding a request's images must not stall other requests
            imgs = await asyncio.to_thread(
                decode_images,
                images,
                emb.resolution if emb else 32,
                emb.in_chans if emb else 1,
                self.limits.max_image_bytes,
                self.limits.max_image_pixels,
                self.limits.max_request_pixels,
            )
        except ImageInputError as exc:
            raise image_error(exc) from None
        emb = self.embedder(role)
        q = await asyncio.to_thread(emb.embed_images, imgs)
        want = self.plan.query_dims.of(role)
        if q.shape[1] != want:
            raise ApiError(
                400,
                f"the {role} model embeds to {q.shape[1]} dims, the gallery expects {want}",
                "body.images",
            )
        return q

    def rank_merge(self):
        """``(rho, psi_rev)`` in the rank_merge mode, else ``None`` (loaded once)."""
        if self.cfg.mode != "rank_merge":
            return None
        if self.rank_merge_maps is None:
            from raycompat.serving.scoring import rank_merge_maps

            self.rank_merge_maps = rank_merge_maps(self.cfg.new_model)
        return self.rank_merge_maps

    def matrix(self, rows: list, field: str, dim: int, what: str) -> np.ndarray:
        """float32 ``[n, dim]`` of request rows; 422 naming the row for a wrong dimension,
        NaN/inf, a float32 overflow or a zero vector."""
        lengths = {len(r) for r in rows}
        if len(lengths) != 1:
            bad = next(i for i, r in enumerate(rows) if len(r) != len(rows[0]))
            raise ApiError(
                422,
                f"dimension mismatch: {field}[{bad}] has {len(rows[bad])} values, "
                f"{field}[0] has {len(rows[0])}",
                f"{field}[{bad}]",
            )
        a = np.asarray(rows, dtype=np.float64)
        if a.shape[1] != dim:
            raise ApiError(
                422, f"dimension mismatch: {field} have {a.shape[1]} dims, {what} has {dim}", field
            )
        if not np.isfinite(a).all():
            raise ApiError(422, f"{field} contain NaN or inf", field)
        if (np.abs(a) > 3.0e38).any():
            raise ApiError(422, f"{field} values overflow float32", field)
        zero = np.flatnonzero(~a.astype(np.float32).any(axis=1))
        if zero.size:
            raise ApiError(
                422,
                f"{field}[{int(zero[0])}] is a zero vector (no direction to search)",
                f"{field}[{int(zero[0])}]",
            )
        return a.astype(np.float32)

    async def query_vectors(self, req) -> tuple[np.ndarray, np.ndarray | None]:
        """``(q, old_q)``: the request's query embeddings, and in the naive_merge mode the old
        model's embeddings of the same queries (else ``None``)."""
        naive = self.cfg.mode == "naive_merge" and req.model == "new"
        if req.images is not None:
            q = await self.embed_images(req.images, "new")
            return q, (await self.embed_images(req.images, "old") if naive else None)
        q = self.matrix(
            req.vectors,
            "body.vectors",
            self.plan.query_dims.of(req.model),
            f"the {req.model} model's embedding",
        )
        if req.old_vectors is None:
            if naive:
                raise ApiError(
                    422,
                    "the naive_merge mode scores old-state items with the old model's "
                    "embedding of each query: send 'old_vectors' with 'vectors'",
                    "body.old_vectors",
                )
            return q, None
        if not naive:
            raise ApiError(
                422,
                f"'old_vectors' are used in the naive_merge mode only; this index "
                f"serves the {self.cfg.mode} mode",
                "body.old_vectors",
            )
        old_q = self.matrix(
            req.old_vectors,
            "body.old_vectors",
            self.plan.query_dims.old,
            "the old model's embedding",
        )
        if old_q.shape[0] != q.shape[0]:
            raise ApiError(
                422,
                f"'old_vectors' has {old_q.shape[0]} rows, 'vectors' has "
                f"{q.shape[0]}: one old embedding per query",
                "body.old_vectors",
            )
        return q, old_q

    # ------------------------------------------------------------------ shards, controller
    async def call(self, handle, method: str, *args, **kw):
        """``handle.method(*args, **kw)``, waited for at most ``shard_timeout_s``; a call
        whose replica died is sent again (Serve then routes it to a live replica of the same
        deployment): every shard method is idempotent (docs/architecture.md, "Replicas")."""
        return (await self.call_counting_sends(handle, method, *args, **kw))[0]

    async def call_counting_sends(self, handle, method: str, *args, **kw) -> tuple[Any, int]:
        """:meth:`call`, and how many times the call was sent: more than once means a replica
        died with an earlier send, which may have taken effect before it died."""
        from ray.exceptions import RayActorError

        deadline = time.monotonic() + self.cfg.shard_timeout_s
        sends = 0
        while True:
            response = getattr(handle, method).remote(*args, **kw)
            sends += 1
            try:
                timeout = deadline - time.monotonic()
                return await asyncio.wait_for(response, timeout=timeout), sends
            except RayActorError:
                if time.monotonic() + 0.05 >= deadline:
                    raise
                self.recorder.count_retry()
                await asyncio.sleep(0.05)

    async def fan_out(self, method: str, *args) -> list:
        """``method(*args)`` on every shard; 503 naming the first shard that fails."""
        calls = [asyncio.ensure_future(self.call(h, method, *args)) for h in self.shards]
        out = []
        for i, c in enumerate(calls):
            try:
                out.append(await c)
            except Exception as exc:
                for rest in calls[i + 1 :]:
                    rest.cancel()
                raise unavailable(f"shard {i}", exc) from None
        return out

    async def on_shard(self, shard: int, method: str, *args):
        """``method(*args)`` on one shard; 503 when it fails or does not answer in time."""
        try:
            return await self.call(self.shards[shard], method, *args)
        except Exception as exc:
            raise unavailable(f"shard {shard}", exc) from None

    async def on_controller(self, method: str, **kw) -> dict:
        """A backfill controller command; its ``{"error", "status"}`` answers become that status."""
        try:
            res = await self.call(self.controller, method, **kw)
        except Exception as exc:
            raise unavailable("backfill controller", exc) from None
        if "error" in res and res.get("status"):
            headers = {"Retry-After": "5"} if int(res["status"]) == 503 else None
            raise ApiError(int(res["status"]), res["error"], "body", headers)
        return res

    async def shard_status(self, shard: int) -> dict:
        """One shard's status (from one of its replicas) with ``replicas``: every live
        replica's own status; 503 when no replica answers."""
        try:
            answers = (
                await self.shards[shard]
                .broadcast("status")
                .results_async(timeout_s=self.cfg.shard_timeout_s, return_exceptions=True)
            )
        except Exception as exc:
            raise unavailable(f"shard {shard}", exc) from None
        live = [a for a in answers if isinstance(a, dict)]
        if not live:
            why = next((a for a in answers if isinstance(a, BaseException)), None)
            raise unavailable(f"shard {shard}", why or RuntimeError("no replica is running"))
        live.sort(key=lambda a: a.get("started", 0))
        return {
            **live[0],
            "store": merged_store(live),
            "replicas": [replica_summary(a) for a in live],
        }

    async def gather_status(self) -> dict:
        """Items per representation (total and per shard), backfill state, mode, dims, models.

        One moment: the controller holds its walk (no batch is sent, the one in flight is
        waited for) while the shards are read, then answers its status and ends the hold
        (``backfill.counts_consistent``; docs/live-index.md, "The upgrade state machine")."""
        token = await self._hold_walk()
        try:
            shard_status = list(
                await asyncio.gather(*(self.shard_status(i) for i in range(len(self.shards))))
            )
        except BaseException:
            if token is not None:  # do not keep the walk waiting for the lease
                asyncio.ensure_future(self._release_walk(token))
            raise
        items = {"old": 0, "adapted": 0, "new": 0}
        for s in shard_status:
            for r, n in s["items"].items():
                items[r] += int(n)
        try:
            bf = await self.call(self.controller, "status", release=token)
        except Exception as exc:
            bf = {
                "state": "unavailable",
                "error": f"backfill controller unavailable: {type(exc).__name__}",
            }
        return {
            "items": items,
            "shards": shard_status,
            "backfill": bf,
            "mode": self.cfg.mode,
            "dims": self.plan.dims.as_dict(),
            "models": self.plan.models_json(),
            **upgrade_totals(shard_status, self.plan),
            "kept": bf.get("kept") or {"items": None},
            "router": {"replica": _router_replica(), "pid": os.getpid()},
        }

    async def _hold_walk(self) -> int | None:
        """A hold on the controller's walk for one status read (``None``: it is away); the
        lease covers the shards' reads (``shard_timeout_s``) and a margin."""
        try:
            res = await self.call(self.controller, "hold", lease_s=self.cfg.shard_timeout_s + 5)
            return int(res["token"])
        except Exception:
            return None

    async def _release_walk(self, token: int) -> None:
        try:
            await self.call(self.controller, "release_hold", token)
        except Exception:  # the lease ends it
            pass

    # ------------------------------------------------------------------ endpoints
    async def search(self, req: BaseModel, request: Request):
        from raycompat.serving.scoring import query_sides

        t0 = time.perf_counter()
        q, old_q = await self.query_vectors(req)
        request.scope["raycompat_queries"] = int(q.shape[0])
        rank_merge = self.rank_merge() if req.model == "new" else None
        sides = await asyncio.to_thread(
            query_sides, q, req.model, self.plan.compatible_dim, rank_merge, old_q
        )
        S, I, R = await self.batcher.submit((sides, req.k, req.exact))
        self.report_reads(I)
        return {"results": hits(S, I, R), "k": req.k, "took_ms": 1000 * (time.perf_counter() - t0)}

    def report_reads(self, ids) -> None:
        """Upgrade on read: the ids each search returned go to the backfill controller in the
        background, while it wants them (asked again every ``READS_RECHECK_S`` otherwise)."""
        now = time.monotonic()
        if not self._reads_wanted and now - self._reads_checked < READS_RECHECK_S:
            return
        self._reads_checked = now
        task = asyncio.ensure_future(self._send_reads(np.asarray(ids).tolist()))
        self._read_tasks.add(task)
        task.add_done_callback(self._read_tasks.discard)

    async def _send_reads(self, rows: list) -> None:
        try:
            res = await self.call(self.controller, "note_reads", rows)
            self._reads_wanted = bool(res.get("wanted"))
        except Exception:  # the controller is away: these searches go unreported
            self._reads_wanted = False

    async def canary_search(self, vectors, k: int, model: str = "new", old_vectors=None):
        """Result ids ``[Q, k]`` of the canary's queries (called by the backfill controller):
        the query sides and the batcher of ``POST /search``, without the HTTP layer."""
        from raycompat.serving.scoring import query_sides

        q = np.asarray(vectors, np.float32)
        naive = self.cfg.mode == "naive_merge" and model == "new"
        rank_merge = self.rank_merge() if model == "new" else None
        old_q = np.asarray(old_vectors, np.float32) if naive else None
        sides = await asyncio.to_thread(
            query_sides, q, model, self.plan.compatible_dim, rank_merge, old_q
        )
        _, ids, _ = await self.batcher.submit((sides, int(k), False))
        return ids

    async def search_batch(self, requests: list) -> list:
        """The searches of concurrent requests, ``[(sides, k, exact)]``, in one call per shard
        and group (docs/architecture.md, "Batching"): requests with the same representations,
        k and exactness are stacked; each gets back exactly its own rows."""
        from raycompat.serving.batching import query_rows, split_rows, stacked_groups

        sides, k, exact = (list(column) for column in zip(*requests, strict=True))
        self.recorder.observe_batch("router", "", len(sides), sum(query_rows(s) for s in sides))
        out: list = [None] * len(sides)
        for members, stacked, kk, ex in stacked_groups(sides, k, exact):
            parts = await self.fan_out("search", stacked, kk, ex)
            merged = await asyncio.to_thread(_merge_parts, parts, kk)
            sizes = [query_rows(sides[j]) for j in members]
            for j, rows in zip(members, split_rows(merged, sizes), strict=True):
                out[j] = rows
        return out

    async def status(self, request: Request):
        """The status; process ids, actor names and model paths only with the admin token."""
        st = await self.gather_status()
        if self.admin.check(request.headers.get("authorization")) is None:
            return st
        return public_status(st)

    async def healthz(self):
        return {"ok": True}

    async def metrics(self):
        """Prometheus text: the counters and histograms of every replica, summed (each node's
        Ray metrics agent, read now), and the gauges of the status."""
        from raycompat.serving.metrics import (
            render_cluster_metrics,
            scrape_nodes,
            sum_over_replicas,
        )

        try:
            st = await self.gather_status()
        except ApiError:
            st = None
        texts, unreachable = await asyncio.to_thread(scrape_nodes)
        gauges = status_gauges(st) + [
            ("metrics_nodes_unreachable", "Nodes whose Ray metrics agent did not answer.", {},
             len(unreachable)),
        ]  # fmt: skip
        families = sum_over_replicas(texts, self.cfg.app_name)
        text = render_cluster_metrics(families, gauges)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    async def upsert(self, req: BaseModel):
        from raycompat.serving.placement import split_by_shard

        ids = np.asarray([it.id for it in req.items], np.int64)
        prepared = self.prepare_upsert(req.items, ids)
        groups = [(rep, model, rid, vec) for (rep, model), rid, vec in prepared]
        res = await self.commit_upsert(groups, ids.size)
        per_shard = [int(p.size) for p in split_by_shard(ids, len(self.shards))]
        return {"applied": int(ids.size), "per_shard": per_shard, "seq": int(res["seq"])}

    async def commit_upsert(self, groups: list, n: int) -> dict:
        """The upsert's one commit, through the backfill controller (the store's one writer).
        A refusal of the store is a 503 naming it (nothing of the upsert applied); a controller
        that died mid-call leaves the outcome unknown (upserts are idempotent: retry)."""
        try:
            res = await self.call(self.controller, "upsert_items", groups)
        except Exception as exc:
            raise ApiError(
                503,
                f"the store's writer (the backfill controller) unavailable "
                f"({type(exc).__name__}): the outcome of the {n} item(s) is unknown; retry "
                "the upsert (it is idempotent)",
                "body.items",
                headers={"Retry-After": "1"},
            ) from None
        if res.get("unknown_ids"):
            raise ApiError(404, f"unknown item id(s): {res['unknown_ids'][:10]}", "body.items")
        if "error" in res:
            raise ApiError(
                503,
                f"{res['error']}: nothing of the upsert was applied",
                "body.items",
                headers={"Retry-After": "5"},
            )
        return res

    def stored_representation(self, rep: str) -> str | None:
        """Why an upsert may not write ``rep`` (None: it may): the store holds old and new
        vectors; an ``adapted`` vector is derived from the item's old one by the mode."""
        if rep == "adapted":
            return (
                "representation 'adapted' is not stored: the index derives it from the item's "
                "old vector (psi, or FCT's h); upsert the item's 'old' or 'new' vector"
            )
        if rep == "old" and self.plan.initial_representation == "adapted":
            return (
                f"the {self.cfg.mode} mode serves every item not upgraded by its adapted "
                "vector, derived from the gallery: upsert the item's 'new' vector"
            )
        return None

    def prepare_upsert(
        self, items: list, ids: np.ndarray
    ) -> list[tuple[tuple[str, str], np.ndarray, np.ndarray]]:
        """``[((representation, model fingerprint), ids, normalised vectors)]``; 422 for a
        repeated id or a bad vector, 409 for a model the index does not know, or whose
        dimension or representation is not the item's."""
        from raycompat.index.search import l2_normalize

        u, c = np.unique(ids, return_counts=True)
        if (c > 1).any():
            raise ApiError(
                422, f"duplicate id(s) in one upsert: {u[c > 1][:10].tolist()}", "body.items"
            )
        groups: dict[tuple[str, str], list[int]] = {}
        known = self.plan.identities
        for pos, it in enumerate(items):  # a named model is checked; none: the default
            refused = self.stored_representation(it.representation)
            if refused:
                raise ApiError(422, refused, f"body.items[{pos}].representation")
            refused = it.model and known.refusal(it.model, it.representation, len(it.vector))
            if refused:
                raise ApiError(409, refused, f"body.items[{pos}].model")
            model = it.model or known.default(it.representation)
            groups.setdefault((it.representation, model), []).append(pos)
        prepared = []
        for (rep, model), pos in groups.items():
            vec = self.matrix(
                [items[p].vector for p in pos],
                f"body.items[{pos[0]}].vector",
                getattr(self.plan.dims, rep),
                f"representation {rep!r}",
            )
            prepared.append(((rep, model), ids[pos], l2_normalize(vec)))
        return prepared

    async def backfill_start(self, req: BaseModel):
        res = await self.on_controller("start", **req.model_dump())
        self._reads_wanted = bool(req.upgrade_on_read)
        return res

    async def backfill_pause(self, req: BaseModel | None = None):
        """No parameters: a body other than none or ``{}`` is a 422."""
        return await self.on_controller("pause")

    async def backfill_resume(self, req: BaseModel):
        """``"until": null`` clears an earlier ``until``; an absent field keeps the old value."""
        clear = "until" in req.model_fields_set and req.until is None
        return await self.on_controller(
            "resume", until=req.until, rate=req.rate, clear_until=clear, override=req.override
        )

    async def backfill_rollback(self, req: BaseModel):
        return await self.on_controller(
            "rollback", to=req.to, batch_size=req.batch_size, rate=req.rate
        )

    async def backfill_finalize(self, req: BaseModel | None = None):
        return await self.on_controller("finalize")

    async def canary_register(self, req: BaseModel):
        """Store the canary set (image queries embedded here, by both models when the old one
        is configured)."""
        if req.images is not None:
            q = await self.embed_images(req.images, "new")
            old = await self.embed_images(req.images, "old") if self.cfg.old_model else None
        else:
            dims = self.plan.query_dims
            q = self.matrix(req.vectors, "body.vectors", dims.new, "the new model's embedding")
            old = None
            if req.old_vectors is not None:
                what = "the old model's embedding"
                old = self.matrix(req.old_vectors, "body.old_vectors", dims.old, what)
        return await self.on_controller(
            "register_canary",
            vectors=q,
            relevant_ids=req.relevant_ids,
            classes=req.classes,
            old_vectors=old,
        )

    async def stale(
        self,
        model: str = Query(description="a model fingerprint (GET /status, 'fingerprints')"),
        cursor: int = Query(0, ge=0, le=2**62, description="next_cursor of the last page"),
        limit: int = Query(1000, ge=1, le=10_000, description="ids per page"),
    ):
        """The ids whose vector ``model`` did not produce, paged in the backfill's order."""
        if self.plan.identities.get(model) is None:
            raise ApiError(
                404,
                f"unknown model fingerprint {model!r}; known: {self.plan.identities.known()}",
                "query.model",
            )
        return await self.on_controller("stale", model=model, cursor=cursor, limit=limit)


def merged_store(replicas: list[dict]) -> dict:
    """How a shard's replicas follow the store: the first replica's, with the error any replica
    saw reading it (the one that failed may not be the first)."""
    out = dict(replicas[0].get("store") or {})
    out["error"] = next(
        (r["store"]["error"] for r in replicas if r.get("store", {}).get("error")), None
    )
    return out


def upgrade_totals(shards: list[dict], plan) -> dict:
    """``items_by_model`` (summed over the shards) and ``fingerprints`` of a status."""
    by_model: dict[str, int] = {}
    for s in shards:
        for fp, n in (s.get("models") or {}).items():
            by_model[fp] = by_model.get(fp, 0) + int(n)
    known = plan.identities.as_json() if plan.identities else {}
    return {"items_by_model": by_model, "fingerprints": known}


def _router_replica() -> str | None:
    from raycompat.serving.shard import _replica_id

    return _replica_id()


def replica_summary(status: dict) -> dict:
    """What ``/status`` lists per replica of a shard."""
    keys = ("replica", "pid", "actor_name", "node_id", "seq", "searches", "startup_s", "store")
    return {key: status.get(key) for key in keys}


#: what /status shows only to the admin: where processes and files are, Serve's replica tags
PRIVATE_STATUS_KEYS = ("pid", "actor_id", "actor_name", "node_id", "path", "replica")


def public_status(st: dict) -> dict:
    """``st`` without :data:`PRIVATE_STATUS_KEYS`, at any depth."""
    if isinstance(st, dict):
        return {k: public_status(v) for k, v in st.items() if k not in PRIVATE_STATUS_KEYS}
    if isinstance(st, list):
        return [public_status(v) for v in st]
    return st


def _merge_parts(parts: list, k: int):
    """The shards' top-k lists merged into one ``(S, I, R)``."""
    from raycompat.serving.rep_index import merge_topk

    return merge_topk([p[0] for p in parts], [p[1] for p in parts], [p[2] for p in parts], k)


def hits(S: np.ndarray, I: np.ndarray, R: np.ndarray) -> list[list[dict]]:
    """Merged top-k arrays -> per query ``[{id, score, representation}]`` (padding dropped)."""
    from raycompat.serving.shard_cache import REPRESENTATIONS

    results = []
    for qi in range(S.shape[0]):
        row = []
        for s, i, r in zip(S[qi].tolist(), I[qi].tolist(), R[qi].tolist(), strict=False):
            if i < 0:
                break
            row.append({"id": i, "score": s, "representation": REPRESENTATIONS[r]})
        results.append(row)
    return results


#: the backfill states ``GET /metrics`` exports as ``raycompat_backfill_state{state}``
BACKFILL_STATES = (
    "idle",
    "running",
    "paused",
    "rolling_back",
    "done",
    "error",
    "finalizing",
    "unavailable",
)


def status_gauges(st: dict | None) -> list[tuple[str, str, dict, float]]:
    """The gauges ``GET /metrics`` adds from a status (``None``: no shard answered)."""
    if st is None:
        return [("shards_up", "Shards answering.", {}, 0)]
    gauges = []
    for s in st["shards"]:
        shard = {"shard": str(s["shard"])}
        for r, n in s["items"].items():
            labels = {**shard, "representation": r}
            gauges.append(("items", "Items held per shard and representation.", labels, n))
        store = s.get("store", {})
        failing = int(bool(store.get("error")))
        gauges.append(("store_error", "1 while a shard cannot read the store.", shard, failing))
        gauges.append(("store_seq", "The store's write sequence a shard has applied.", shard,
                       store.get("seq") or 0))  # fmt: skip
        gauges += index_gauges(shard, s.get("index", {}))
        gauges.append(("replicas", "Replicas of the shard answering.", shard, len(s["replicas"])))
    for fp, n in (st.get("items_by_model") or {}).items():
        help_ = "Items whose vector the model with this fingerprint produced."
        gauges.append(("items_by_model", help_, {"model": fp}, n))
    kept = (st.get("kept") or {}).get("items")
    if kept is not None:
        help_ = "Upgraded items whose old vectors a rollback can return to (until finalize)."
        gauges.append(("kept_items", help_, {}, kept))
    gauges += backfill_gauges(st["backfill"])
    gauges += canary_gauges(st["backfill"])
    gauges.append(("shards_up", "Shards answering.", {}, len(st["shards"])))
    return gauges


def index_gauges(shard: dict, index: dict) -> list[tuple[str, str, dict, float]]:
    """Per representation: the index's memory, whether it is built, whether it is being
    rebuilt (docs/indexes.md, "Status")."""
    gauges = []
    for rep, ix in index.items():
        labels = {**shard, "representation": rep, "kind": ix.get("kind", "")}
        gauges += [
            (
                "index_memory_bytes",
                "Bytes of an index and its vectors.",
                labels,
                ix["memory_bytes"],
            ),
            (
                "index_built",
                "1 when the index is built (else exact search).",
                labels,
                ix["trained"],
            ),
            (
                "index_rebuilding",
                "1 while an index is built in the background.",
                labels,
                ix["rebuilding"],
            ),
        ]
    return gauges


#: the canary guards ``GET /metrics`` exports as ``raycompat_backfill_paused_by{guard}``
GUARDS = ("map", "nfr")


def canary_gauges(bf: dict) -> list[tuple[str, str, dict, float]]:
    """The canary's last point (mAP@k and NFR@1 with their bounds, the mAP difference), and a
    0/1 gauge per guard: 1 while the backfill is paused by it."""
    paused_by = (bf.get("paused_by") or {}).get("guard")
    gauges = [
        (
            "backfill_paused_by",
            "1 while a canary guard keeps the backfill paused.",
            {"guard": g},
            int(paused_by == g),
        )
        for g in GUARDS
    ]
    last = (bf.get("canary") or {}).get("last")
    if not last:
        return gauges
    gauges.append(("canary_position", "Position of the canary's last point.", {}, last["position"]))
    fields = {
        "canary_map": ("map", "map_low", "map_high"),
        "canary_delta_map": ("delta_map", "delta_low", "delta_high"),
        "canary_nfr": ("nfr", "nfr_low", "nfr_high"),
    }
    for name, keys in fields.items():
        help_ = f"The canary's {keys[0]} at its last point, with its interval's bounds."
        for bound, key in zip(("value", "low", "high"), keys, strict=True):
            if last.get(key) is not None:
                gauges.append((name, help_, {"bound": bound}, last[key]))
    return gauges


def backfill_gauges(bf: dict) -> list[tuple[str, str, dict, float]]:
    """Position, total, and a 0/1 gauge per state (``error`` is 1 when the controller failed)."""
    gauges = [
        ("backfill_position", "Items of the backfill order upgraded.", {}, bf.get("position") or 0),
        ("backfill_total", "Items in the backfill order.", {}, bf.get("total") or 0),
    ]
    for state in BACKFILL_STATES:
        gauges.append(
            (
                "backfill_state",
                "1 for the backfill controller's current state.",
                {"state": state},
                int(bf.get("state") == state),
            )
        )
    return gauges


def typed_endpoint(method: Callable, **models: type) -> Callable:
    """``method`` as a FastAPI endpoint whose parameters named in ``models`` are annotated with
    this server's request classes (FastAPI reads a body's class, and so its limits, from the
    endpoint's signature)."""
    sig = inspect.signature(method)
    params = [
        p.replace(annotation=models.get(p.name, p.annotation)) for p in sig.parameters.values()
    ]

    async def endpoint(**kwargs: Any):
        return await method(**kwargs)

    endpoint.__signature__ = sig.replace(parameters=params)
    endpoint.__name__ = endpoint.__qualname__ = method.__name__
    return endpoint


def build_api(router: Router) -> FastAPI:
    """The FastAPI app of one router replica: routes to its methods, error handlers, timing."""
    app = FastAPI(
        title="raycompat live index",
        description="Sharded faiss gallery served during a hot-refresh model upgrade "
        "(raycompat, docs/architecture.md, 'Serving').",
        version="1",
        responses={422: {"model": ErrorResponse}},
        docs_url="/docs" if router.cfg.api_docs else None,
        redoc_url="/redoc" if router.cfg.api_docs else None,
    )
    install_error_handlers(app)
    # inside the timing middleware: auth and body size are checked before the body is read
    app.add_middleware(
        RequestGuard, max_body_bytes=router.limits.max_body_bytes, admin=router.admin
    )
    app.middleware("http")(router.timed)
    models = build_models(router.limits)
    _public_routes(app, router, models)
    _admin_routes(app, router, models)
    return app


def _public_routes(app: FastAPI, router: Router, models: ApiModels) -> None:
    errors = {c: {"model": ErrorResponse} for c in ERROR_CODES}
    app.add_api_route(
        "/search",
        typed_endpoint(router.search, req=models.SearchRequest),
        methods=["POST"],
        response_model=models.SearchResponse,
        responses=errors,
        summary="Top-k search by query vectors or base64 images",
    )
    app.add_api_route(
        "/status",
        router.status,
        methods=["GET"],
        response_model=models.StatusResponse,
        responses=errors,
        summary="Items per representation, backfill progress, model versions",
    )
    app.add_api_route("/healthz", router.healthz, methods=["GET"], summary="Liveness of the router")
    app.add_api_route(
        "/metrics",
        router.metrics,
        methods=["GET"],
        response_class=PlainTextResponse,
        summary="Prometheus metrics (text format)",
    )


#: the OpenAPI description of ``POST /admin/upsert``: what a failure leaves applied
UPSERT_DESCRIPTION = (
    "The whole request is one commit of the store (concurrent upserts are grouped into one "
    "commit), acknowledged once the store has committed it: every shard then serves it. A "
    "refusal of the store (a full disk, a lost connection) is a 503 naming the store and its "
    "reason, and nothing of the request is applied; a writer that died mid-call is a 503 "
    "'outcome unknown'. An upsert is idempotent: retry it whole. 'old' writes an item's old "
    "vector and turns it back to not upgraded, 'new' upgrades it; 'adapted' is derived, not "
    "stored (422). `model` names the fingerprint of the model that produced a vector (409 for "
    "an unknown one, or a dimension or representation that is not the model's)."
)


def _add_admin(app, router, path, endpoint, summary, response_model=None, method="POST", **kw):
    app.add_api_route(
        path,
        endpoint,
        methods=[method],
        response_model=response_model,
        responses={c: {"model": ErrorResponse} for c in ERROR_CODES},
        dependencies=[Depends(router.admin_auth)],
        summary=summary,
        **kw,
    )


def _admin_routes(app: FastAPI, router: Router, models: ApiModels) -> None:
    def admin(path, endpoint, summary, response_model=None, **kw) -> None:
        _add_admin(app, router, path, endpoint, summary, response_model, **kw)

    admin(
        "/admin/upsert",
        typed_endpoint(router.upsert, req=models.UpsertRequest),
        "Atomically set items' representation and vector (existing ids only)",
        models.UpsertResponse,
        description=UPSERT_DESCRIPTION,
    )
    admin(
        "/admin/backfill/start",
        typed_endpoint(router.backfill_start, req=models.BackfillStartRequest),
        "Start a backfill with a policy and a rate",
        models.BackfillState,
    )
    admin(
        "/admin/backfill/pause",
        typed_endpoint(router.backfill_pause, req=models.EmptyRequest),
        "Pause the running backfill (or rollback); no body, or {}",
        models.BackfillState,
    )
    admin(
        "/admin/backfill/resume",
        typed_endpoint(router.backfill_resume, req=models.BackfillResumeRequest),
        "Resume (optionally up to 'until', at 'rate'; 'override' past a canary guard)",
        models.BackfillState,
    )
    _upgrade_routes(app, router, models)


def _upgrade_routes(app: FastAPI, router: Router, models: ApiModels) -> None:
    """The guarded upgrade's endpoints (docs/live-index.md, "Upgrading a live gallery
    safely")."""

    def admin(path, endpoint, summary, response_model=None, **kw) -> None:
        _add_admin(app, router, path, endpoint, summary, response_model, **kw)

    admin(
        "/admin/canary",
        typed_endpoint(router.canary_register, req=models.CanaryRequest),
        "Register the canary queries a backfill is measured with",
        models.CanaryResponse,
    )
    admin(
        "/admin/backfill/rollback",
        typed_endpoint(router.backfill_rollback, req=models.BackfillRollbackRequest),
        "Return the items upgraded at or after 'to' (all: null) to their old vectors",
        models.BackfillState,
    )
    admin(
        "/admin/backfill/finalize",
        typed_endpoint(router.backfill_finalize, req=models.EmptyRequest),
        "End the rollback window: the old vectors are no longer kept (the store drops its old "
        "column once every item is upgraded); no body, or {}",
        models.FinalizeResponse,
    )
    admin(
        "/admin/stale",
        router.stale,
        "The ids not yet produced by a model, paged in the backfill's order",
        models.StaleResponse,
        method="GET",
    )
