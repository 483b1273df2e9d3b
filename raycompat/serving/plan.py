"""The serving plan: the options of a live index plus what its gallery and model bundles
determine, derived once by :func:`build_plan` and handed to every deployment (router, shards,
backfill controller) as one frozen, picklable value (docs/architecture.md "Serving").

Derived fields:

* ``dims`` -- the vector dimension each stored representation holds (``old`` = D_old,
  ``adapted`` = D_new, ``new`` = D_new, or rho's output dimension in the ``rank_merge`` mode,
  where a new item holds ``rho(phi_n(g))``);
* ``query_dims`` -- what clients send per model (``old`` = D_old, ``new`` = D_new);
* ``compatible_dim`` -- D_c, the option or D_old (docs/methods.md "Query strategies");
* ``n_items`` -- gallery items; ``old_model`` / ``new_model`` -- the bundles' versions;
* ``identities`` -- the fingerprint of the model behind each representation's vectors
  (:mod:`raycompat.serving.identity`).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

from raycompat.config import ConfigError
from raycompat.serving.config import ServingConfig
from raycompat.serving.identity import ModelIdentities, model_identities
from raycompat.serving.schemas import Limits

__all__ = ["RepDims", "QueryDims", "ModelVersion", "ServingPlan", "build_plan", "model_version"]


@dataclass(frozen=True)
class RepDims:
    """Vector dimension of each stored representation."""

    old: int
    adapted: int
    new: int

    def as_dict(self) -> dict[str, int]:
        return {"old": self.old, "adapted": self.adapted, "new": self.new}


@dataclass(frozen=True)
class QueryDims:
    """Dimension of the query vectors each model embeds to (what a search request carries)."""

    old: int
    new: int

    def of(self, model: str) -> int:
        """``model`` is ``"old"`` or ``"new"``."""
        return {"old": self.old, "new": self.new}[model]


@dataclass(frozen=True)
class ModelVersion:
    """A model bundle's path and, when it has a manifest, its method, embedding dimension and
    manifest digest (the first 16 hex digits of its SHA-256)."""

    path: str
    method: str | None = None
    embed_dim: int | None = None
    manifest_sha256: str | None = None

    def as_json(self) -> dict:
        """What ``GET /status`` shows (``path`` only for a bundle without a manifest)."""
        if self.manifest_sha256 is None:
            return {"path": self.path}
        return {
            "path": self.path,
            "method": self.method,
            "embed_dim": self.embed_dim,
            "manifest_sha256": self.manifest_sha256,
        }


def model_version(path: str) -> ModelVersion:
    """The :class:`ModelVersion` of the bundle directory ``path``."""
    mpath = os.path.join(path, "manifest.json")
    if not os.path.isfile(mpath):
        return ModelVersion(os.path.abspath(path))
    with open(mpath, "rb") as fh:
        raw = fh.read()
    m = json.loads(raw)
    return ModelVersion(
        os.path.abspath(path),
        m.get("method"),
        m.get("embed_dim"),
        hashlib.sha256(raw).hexdigest()[:16],
    )


@dataclass(frozen=True)
class ServingPlan:
    """A :class:`ServingConfig` and what it determines (see the module docstring)."""

    config: ServingConfig
    dims: RepDims
    query_dims: QueryDims
    compatible_dim: int
    n_items: int
    old_model: ModelVersion | None = None
    new_model: ModelVersion | None = None
    identities: ModelIdentities | None = None

    @property
    def initial_representation(self) -> str:
        """What every item holds before the backfill: ``adapted`` in the adapted and fct modes,
        else ``old``."""
        from raycompat.serving.scoring import initial_representation

        return initial_representation(self.config.mode)

    @property
    def limits(self) -> Limits:
        """The request limits of the HTTP API."""
        c = self.config
        return Limits(
            max_k=c.max_k,
            max_queries=c.max_queries,
            max_image_bytes=c.max_image_bytes,
            max_upsert_items=c.max_upsert_items,
            max_body_bytes=c.max_body_bytes,
            max_request_pixels=c.max_request_pixels,
        )

    def models_json(self) -> dict:
        """``{"old": {...}, "new": {...}}`` for the bundles given (``GET /status``)."""
        out = {}
        for role, version in (("old", self.old_model), ("new", self.new_model)):
            if version is not None:
                out[role] = version.as_json()
        return out


def build_plan(cfg: ServingConfig) -> ServingPlan:
    """Open the gallery (and, in the ``rank_merge`` mode, the new bundle's rho and psi_rev) and
    derive the plan; ``ConfigError`` when the gallery, the bundles and the options disagree."""
    from raycompat.serving.gallery_source import open_gallery
    from raycompat.serving.scoring import adapted_transform

    src = open_gallery(cfg.gallery, cfg.new_model, adapted=adapted_transform(cfg.mode))
    query_dims = QueryDims(old=int(src.old_dim), new=int(src.new_dim))
    new_dim = _rank_merge_dim(cfg, query_dims) if cfg.mode == "rank_merge" else query_dims.new
    dims = RepDims(old=query_dims.old, adapted=query_dims.new, new=new_dim)
    compatible_dim = _compatible_dim(cfg, dims)
    _check_index(cfg, dims)
    return ServingPlan(
        config=cfg,
        dims=dims,
        query_dims=query_dims,
        compatible_dim=compatible_dim,
        n_items=int(src.n_items),
        old_model=model_version(cfg.old_model) if cfg.old_model else None,
        new_model=model_version(cfg.new_model) if cfg.new_model else None,
        identities=model_identities(cfg, dims.as_dict()),
    )


def _rank_merge_dim(cfg: ServingConfig, query_dims: QueryDims) -> int:
    """rho's output dimension (what a new item holds in the rank_merge mode), after checking
    that rho takes D_new dims and psi_rev returns D_old."""
    from raycompat.serving.scoring import rank_merge_maps

    rho, psi_rev = rank_merge_maps(cfg.new_model)
    if rho.in_dim != query_dims.new or psi_rev.out_dim != query_dims.old:
        raise ConfigError(
            f"mode 'rank_merge': rho maps {rho.in_dim} -> {rho.out_dim} dims and psi_rev "
            f"{psi_rev.in_dim} -> {psi_rev.out_dim}, the gallery has new {query_dims.new} "
            f"/ old {query_dims.old} dims"
        )
    return int(rho.out_dim)


def _check_index(cfg: ServingConfig, dims: RepDims) -> None:
    """The index options fit every representation's dimension (``ConfigError`` before any
    deploy: a PQ sub-quantizer count that does not divide a dimension, a bad factory string)."""
    from raycompat.index.ann import create_kind

    for d in sorted(set(dims.as_dict().values())):
        create_kind(cfg.index, d)


def _compatible_dim(cfg: ServingConfig, dims: RepDims) -> int:
    """D_c: the option, or D_old; the compatible mode needs D_c = D_old."""
    compatible_dim = dims.old if cfg.compatible_dim is None else int(cfg.compatible_dim)
    if compatible_dim != dims.old and cfg.mode == "compatible":
        raise ConfigError(
            f"serving: mode 'compatible' compares phi_n(q)[:D_c] with phi_o(g): compatible_dim "
            f"must equal D_old={dims.old}, got {compatible_dim}"
        )
    return compatible_dim
