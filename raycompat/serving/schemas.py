"""HTTP request and response models (pydantic), built with the server's limits so that the
OpenAPI document states every bound (max k, queries per request, image size, batch sizes).

Values a model cannot check statically (a vector's dimension, unknown ids, base64 and image
decoding) are checked by the router and answered with the same :class:`ErrorResponse`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from raycompat.upgrade.policies import POLICIES

__all__ = ["Limits", "ApiModels", "build_models", "ErrorResponse", "Problem"]

FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]


@dataclass(frozen=True)
class Limits:
    """Request limits (options of the serving config)."""

    max_k: int = 1000
    max_queries: int = 256
    max_image_bytes: int = 1 << 20
    max_image_pixels: int = 4096 * 4096
    max_upsert_items: int = 10000
    max_dim: int = 4096
    max_body_bytes: int = 32 << 20
    max_request_pixels: int = 16 * 4096 * 4096


#: every request model: unknown fields refused, and no coercion (``"k": "10"``, ``"k": true``,
#: ``"id": "200"`` or ``"restart": "yes"`` are errors, not values); ints are accepted as floats
STRICT = ConfigDict(extra="forbid", strict=True)


class Problem(BaseModel):
    field: str = Field(description="where the problem is, e.g. body.k or body.vectors[3]")
    message: str


class ErrorResponse(BaseModel):
    error: str = Field(description="one-line description naming the problem")
    problems: list[Problem] = Field(default_factory=list)


class Hit(BaseModel):
    id: int
    score: float
    representation: Literal["old", "adapted", "new"]


class ShardCounts(BaseModel):
    old: int = 0
    adapted: int = 0
    new: int = 0


class SearchResponse(BaseModel):
    results: list[list[Hit]]
    k: int
    took_ms: float


class UpsertResponse(BaseModel):
    applied: int
    per_shard: list[int]
    seq: int = Field(description="the store's write sequence number of the upsert's commit")


class BackfillResumeRequest(BaseModel):
    model_config = STRICT
    until: int | None = Field(
        default=None,
        ge=0,
        le=2**62,
        description="pause after this many items; null clears an earlier until, absent keeps it",
    )
    rate: float | None = Field(default=None, gt=0, le=1e9, allow_inf_nan=False)
    override: bool = Field(
        default=False,
        description="continue past a canary guard: a backfill the gate paused resumes, and "
        "guards no longer pause this backfill (they are still measured and logged)",
    )


class EmptyRequest(BaseModel):
    """No parameters: send no body, or ``{}``."""

    model_config = STRICT


class BackfillRollbackRequest(BaseModel):
    model_config = STRICT
    to: int | None = Field(
        default=None,
        ge=0,
        le=2**62,
        description="roll back the items upgraded at or after this position of the backfill "
        "order; null: every item that keeps an old vector",
    )
    batch_size: int = Field(default=256, ge=1, le=100_000, description="items per shard call")
    rate: float | None = Field(
        default=None, gt=0, le=1e9, allow_inf_nan=False, description="items per second"
    )


class FinalizeResponse(BaseModel):
    dropped: int = Field(description="upgraded items whose old vector is no longer kept")
    column_dropped: bool = Field(
        description="whether the store dropped its old vector column (every item upgraded)"
    )
    position: int = Field(description="the backfill position when it was finalized")


class StaleResponse(BaseModel):
    model: str
    ids: list[int] = Field(description="ids whose vector the model did not produce, in order")
    next_cursor: int | None = Field(description="pass as cursor for the next page; null: done")
    order: Literal["backfill", "gallery"]


class CanaryResponse(BaseModel):
    queries: int
    groups: int
    relevant: int = Field(description="relevant items over every query")
    old_vectors: bool
    every: int
    k: int


class BackfillState(BaseModel):
    state: str
    policy: str | None = None
    seed: int | None = None
    source: str | None = None
    position: int = 0
    total: int = 0
    until: int | None = None
    rate: float | None = None
    batch_size: int | None = None
    error: str | None = None
    resumed_from_checkpoint: bool = Field(
        default=False, description="started again on a running backfill's record in the store"
    )
    store: str | None = Field(
        default=None, description="the store's URI: the backfill's record and order are there"
    )
    recovered: dict | None = Field(
        default=None,
        description="at a start: a batch written after the record was saved, found in the "
        "store (from, to: the position the record said, and where the order stands)",
    )
    items_per_s: float | None = None
    upsert_retries: int = 0
    upgrade_on_read: bool | None = None
    read_window: int | None = None
    reads_seen: int = 0
    worker_alive: bool | None = None
    worker_restarts: int = 0
    errors: int = 0
    pid: int | None = None
    actor_name: str | None = None
    paused_by: dict | None = Field(
        default=None, description="the canary guard that paused the backfill: guard, reason"
    )
    override: bool = False
    canary: dict | None = None
    rollback: dict | None = None
    rollback_in_flight: bool = False
    finalized: dict | None = None
    in_flight: dict | None = Field(
        default=None,
        description="a batch sent to the shards and not acknowledged yet: kind, from, items",
    )
    counts_consistent: bool | None = Field(
        default=None,
        description="/status: the shard counts were read while the walk was held between "
        "batches, so they agree with position and rollback.done (false: a batch was in flight)",
    )


class StatusResponse(BaseModel):
    items: ShardCounts
    shards: list[dict]
    backfill: BackfillState
    models: dict
    mode: str
    dims: dict
    items_by_model: dict[str, int] = Field(
        default_factory=dict, description="items per fingerprint of the model behind the vector"
    )
    fingerprints: dict = Field(
        default_factory=dict, description="the models this index knows, by fingerprint"
    )
    kept: dict = Field(
        default_factory=dict,
        description="items a rollback can turn back: upgraded since the last finalize (the "
        "store keeps their old vectors)",
    )
    router: dict | None = Field(
        default=None, description="the router replica that answered (with the token only)"
    )


@dataclass(frozen=True)
class ApiModels:
    """The request and response classes of one server (the request classes carry its limits)."""

    SearchRequest: type
    UpsertItem: type
    UpsertRequest: type
    BackfillStartRequest: type
    SearchResponse: type = SearchResponse
    UpsertResponse: type = UpsertResponse
    BackfillResumeRequest: type = BackfillResumeRequest
    BackfillState: type = BackfillState
    StatusResponse: type = StatusResponse
    CanaryRequest: type | None = None
    EmptyRequest: type = EmptyRequest
    BackfillRollbackRequest: type = BackfillRollbackRequest
    FinalizeResponse: type = FinalizeResponse
    StaleResponse: type = StaleResponse
    CanaryResponse: type = CanaryResponse


def build_models(limits: Limits) -> ApiModels:
    """The request/response classes for ``limits``."""
    Vector = Annotated[list[FiniteFloat], Field(min_length=1, max_length=limits.max_dim)]
    upsert_item, upsert_request = _upsert_models(limits, Vector)
    return ApiModels(
        SearchRequest=_search_request(limits, Vector),
        UpsertItem=upsert_item,
        UpsertRequest=upsert_request,
        BackfillStartRequest=_backfill_start_request(limits),
        CanaryRequest=_canary_request(limits, Vector),
    )


def _search_request(limits: Limits, Vector) -> type:
    b64_chars = 4 * ((limits.max_image_bytes + 2) // 3)
    Image = Annotated[
        str, Field(min_length=1, max_length=b64_chars, description="base64 of a PNG or JPEG file")
    ]
    Queries = Annotated[list[Vector], Field(min_length=1, max_length=limits.max_queries)]

    class SearchRequest(BaseModel):
        """Exactly one of ``vectors`` or ``images``."""

        model_config = STRICT
        vectors: Queries | None = Field(
            default=None, description="query embeddings (raw; normalised by the server)"
        )
        images: (
            Annotated[list[Image], Field(min_length=1, max_length=limits.max_queries)] | None
        ) = Field(
            default=None,
            description="query images, base64 PNG/JPEG; embedded with the new model (and the "
            "old model too in the naive_merge mode)",
        )
        old_vectors: Queries | None = Field(
            default=None,
            description="naive_merge mode only: the old model's embeddings of the same "
            "queries, in the same order (old-state items are scored with them)",
        )
        k: int = Field(default=10, ge=1, le=limits.max_k, description="results per query")
        model: Literal["new", "old"] = Field(
            default="new",
            description="which model embedded the query vectors; 'old' searches old-state "
            "items only (clients not upgraded yet)",
        )
        exact: bool = Field(
            default=False,
            description="search every item by brute force, whatever the index kind: the "
            "reference an approximate index's recall is measured against (slow)",
        )

        @model_validator(mode="after")
        def _one_input(self):
            if (self.vectors is None) == (self.images is None):
                raise ValueError("give exactly one of 'vectors' or 'images'")
            if self.images is not None and self.model != "new":
                raise ValueError(
                    "image queries are embedded with the new model: model must be 'new'"
                )
            if self.old_vectors is not None and (self.vectors is None or self.model != "new"):
                raise ValueError("'old_vectors' go with new-model 'vectors' (model 'new')")
            return self

    return SearchRequest


def _upsert_models(limits: Limits, Vector) -> tuple[type, type]:
    class UpsertItem(BaseModel):
        model_config = STRICT
        id: int = Field(ge=0, le=2**63 - 1)
        representation: Literal["old", "adapted", "new"]
        vector: Vector
        model: str | None = Field(
            default=None,
            min_length=1,
            max_length=64,
            description="fingerprint of the model that produced the vector (GET /status, "
            "'fingerprints'); absent: the representation's model. An unknown one, or one "
            "whose dimension or representation differs, is refused with 409",
        )

    class UpsertRequest(BaseModel):
        model_config = STRICT
        items: Annotated[list[UpsertItem], Field(min_length=1, max_length=limits.max_upsert_items)]

    return UpsertItem, UpsertRequest


def _backfill_start_request(limits: Limits) -> type:
    class BackfillStartRequest(BaseModel):
        model_config = STRICT
        policy: Literal[POLICIES] = Field(
            default="random", description="backfill order (simulator policies)"
        )
        seed: int = Field(default=0, ge=0, le=2**32 - 1)
        rate: float | None = Field(
            default=None,
            gt=0,
            le=1e9,
            allow_inf_nan=False,
            description="items per second; null = as fast as possible",
        )
        batch_size: int = Field(default=256, ge=1, le=limits.max_upsert_items)
        until: int | None = Field(
            default=None, ge=0, le=2**62, description="pause after this many items of the order"
        )
        source: Literal["gallery", "pipeline", "embedder"] = Field(
            default="gallery", description="where new embeddings come from"
        )
        restart: bool = Field(
            default=False, description="discard a finished or paused backfill's progress"
        )
        cost_column: str | None = Field(
            default=None,
            min_length=1,
            max_length=256,
            description="cost-aware: the gallery parquet's column of every item's cost (> 0)",
        )
        query_log: str | None = Field(
            default=None,
            min_length=1,
            max_length=4096,
            description="demand, upgrade-on-read: a query log parquet on the server",
        )
        cost_base: Literal[POLICIES] = Field(
            default="uncertainty:margin", description="cost-aware: the scored base policy"
        )
        order_base: Literal[POLICIES] = Field(
            default="random", description="demand: the order of its ties"
        )
        demand_k: int = Field(default=10, ge=1, le=limits.max_k, description="top-k per query")
        upgrade_on_read: bool = Field(
            default=False,
            description="move the items recent searches returned to the front of the queue",
        )
        read_window: int = Field(
            default=8, ge=1, le=1_000_000, description="upgrade_on_read: the searches kept"
        )

    return BackfillStartRequest


def _canary_request(limits: Limits, Vector) -> type:
    b64_chars = 4 * ((limits.max_image_bytes + 2) // 3)
    Image = Annotated[str, Field(min_length=1, max_length=b64_chars)]
    n = limits.max_upsert_items
    Queries = Annotated[list[Vector], Field(min_length=1, max_length=n)]
    Ids = Annotated[list[Annotated[int, Field(ge=0, le=2**63 - 1)]], Field(min_length=1)]

    class CanaryRequest(BaseModel):
        """The canary queries (``vectors`` of the new model, or ``images``; ``old_vectors``:
        the old model's embeddings of the same queries, for the old-old reference) and, per
        query, exactly one of its relevant item ids or its class name."""

        model_config = STRICT
        vectors: Queries | None = None
        images: Annotated[list[Image], Field(min_length=1, max_length=n)] | None = None
        old_vectors: Queries | None = None
        relevant_ids: Annotated[list[Ids], Field(min_length=1, max_length=n)] | None = None
        classes: (
            Annotated[
                list[Annotated[str, Field(min_length=1, max_length=256)] | int],
                Field(min_length=1, max_length=n),
            ]
            | None
        ) = None

        @model_validator(mode="after")
        def _one_each(self):
            if (self.vectors is None) == (self.images is None):
                raise ValueError("give exactly one of 'vectors' or 'images'")
            if (self.relevant_ids is None) == (self.classes is None):
                raise ValueError("give exactly one of 'relevant_ids' or 'classes'")
            n_q = len(self.vectors if self.vectors is not None else self.images)
            for name in ("old_vectors", "relevant_ids", "classes"):
                value = getattr(self, name)
                if value is not None and len(value) != n_q:
                    raise ValueError(f"'{name}' has {len(value)} rows, the queries {n_q}")
            return self

    return CanaryRequest
