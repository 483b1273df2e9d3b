"""HTTP request and response models (pydantic), built with the server's limits so that the
OpenAPI document states every bound (max k, queries per request, image size, batch sizes).

Values a model cannot check statically (a vector's dimension, unknown ids, base64 and image
decoding) are checked by the router and answered with the same :class:`ErrorResponse`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from raycompat.backfill.policies import POLICIES

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


class BackfillResumeRequest(BaseModel):
    model_config = STRICT
    until: int | None = Field(
        default=None,
        ge=0,
        le=2**62,
        description="pause after this many items; null clears an earlier until, absent keeps it",
    )
    rate: float | None = Field(default=None, gt=0, le=1e9, allow_inf_nan=False)


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
    resumed_from_checkpoint: bool = False
    items_per_s: float | None = None
    upsert_retries: int = 0
    worker_alive: bool | None = None
    worker_restarts: int = 0
    errors: int = 0
    pid: int | None = None
    actor_name: str | None = None


class StatusResponse(BaseModel):
    items: ShardCounts
    shards: list[dict]
    backfill: BackfillState
    models: dict
    mode: str
    dims: dict


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


def build_models(limits: Limits) -> ApiModels:
    """The request/response classes for ``limits``."""
    Vector = Annotated[list[FiniteFloat], Field(min_length=1, max_length=limits.max_dim)]
    upsert_item, upsert_request = _upsert_models(limits, Vector)
    return ApiModels(
        SearchRequest=_search_request(limits, Vector),
        UpsertItem=upsert_item,
        UpsertRequest=upsert_request,
        BackfillStartRequest=_backfill_start_request(limits),
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

    return BackfillStartRequest
