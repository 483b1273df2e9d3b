"""Model identity: which model produced each stored vector (docs/live-index.md, "Upgrading a
live gallery safely").

Every vector a shard stores records a *fingerprint*: 16 hex digits naming the model that
produced it.  For a model bundle it is the bundle's fingerprint
(:func:`raycompat.models.fingerprint.bundle_fingerprint`: SHA-256 of its manifest and weights,
the value a new bundle's manifest records as its ``predecessor``).  Vectors that come from the
gallery without a bundle get a fingerprint of where they come from (the gallery and its column),
and the ``adapted`` vectors computed by the new bundle's psi (FCT's h in the ``fct`` mode) one
derived from that bundle's.
The index knows one model per representation (:class:`ModelIdentities`, derived once into the
serving plan); an upsert may name one of them, and is refused when it names another or a
vector of another dimension.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

__all__ = ["KnownModel", "ModelIdentities", "model_identities", "derived_fingerprint"]


def derived_fingerprint(*parts: str) -> str:
    """16 hex digits of SHA-256 over ``parts`` (a model that is not a bundle)."""
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class KnownModel:
    """A model whose vectors the index stores: its fingerprint, the representation its vectors
    are stored in, their dimension, and what it is (``source``; ``path``: its bundle)."""

    fingerprint: str
    representation: str
    dim: int
    source: str
    path: str | None = None

    def as_json(self) -> dict:
        out = {"representation": self.representation, "dim": self.dim, "source": self.source}
        return out if self.path is None else {**out, "path": self.path}


@dataclass(frozen=True)
class ModelIdentities:
    """The models of a served index, one per representation (see the module docstring)."""

    models: tuple[KnownModel, ...]

    def get(self, fingerprint: str) -> KnownModel | None:
        return next((m for m in self.models if m.fingerprint == fingerprint), None)

    def default(self, representation: str) -> str:
        """The fingerprint of vectors stored in ``representation`` by default."""
        return next(m.fingerprint for m in self.models if m.representation == representation)

    def defaults(self) -> dict[str, str]:
        return {m.representation: m.fingerprint for m in self.models}

    def known(self) -> str:
        """``"<fp> (old, 16 dims), ..."``: for error messages."""
        return ", ".join(f"{m.fingerprint} ({m.representation}, {m.dim} dims)" for m in self.models)

    def refusal(self, fingerprint: str, representation: str, dim: int) -> str | None:
        """Why an upsert of a ``dim``-dims vector into ``representation`` that names model
        ``fingerprint`` is refused (an HTTP 409), or ``None``."""
        model = self.get(fingerprint)
        if model is None:
            return (
                f"unknown model fingerprint {fingerprint!r} (a vector of {dim} dims): this index "
                f"stores vectors of {self.known()}"
            )
        if model.dim != dim:
            return (
                f"model {fingerprint} embeds to {model.dim} dims, the vector has {dim}: "
                "a dimension that does not match its model"
            )
        if model.representation != representation:
            return (
                f"model {fingerprint} produces {model.representation!r} vectors, the item is "
                f"upserted as {representation!r}"
            )
        return None

    def as_json(self) -> dict:
        """``{fingerprint: {representation, dim, source[, path]}}`` (``GET /status``)."""
        return {m.fingerprint: m.as_json() for m in self.models}


def model_identities(cfg, dims: dict[str, int]) -> ModelIdentities:
    """The models of an index with options ``cfg`` (:class:`~raycompat.serving.config.
    ServingConfig`) and representation dimensions ``dims``: the bundles' fingerprints where
    ``old_model`` / ``new_model`` are given, else the gallery's columns."""
    gallery = cfg.gallery
    if not gallery.startswith("synthetic:"):
        gallery = os.path.abspath(gallery)

    def from_gallery(column: str) -> tuple[str, str]:
        return derived_fingerprint("gallery", gallery, column), f"gallery column {column!r}"

    models = []
    for rep, bundle in (("old", cfg.old_model), ("new", cfg.new_model)):
        if bundle:
            fp, source, path = _bundle_fingerprint(bundle), f"{rep}_model", bundle
        else:
            (fp, source), path = from_gallery(rep), None
        models.append(KnownModel(fp, rep, int(dims[rep]), source, path))
    if cfg.new_model and (cfg.mode != "adapted" or not _has_column(cfg.gallery, "adapted")):
        new_fp = models[1].fingerprint
        transform = "fct" if cfg.mode == "fct" else "psi"  # fct: h, never the psi column
        adapted = KnownModel(
            derived_fingerprint(transform, new_fp),
            "adapted",
            int(dims["adapted"]),
            f"new_model's {transform}",
        )
    else:
        fp, source = from_gallery("adapted")
        adapted = KnownModel(fp, "adapted", int(dims["adapted"]), source)
    return ModelIdentities((models[0], adapted, models[1]))


def _bundle_fingerprint(path: str) -> str:
    """The bundle's fingerprint; a folder without a manifest (not a saved bundle) gets one of
    its path."""
    from raycompat.config import ConfigError
    from raycompat.models.fingerprint import bundle_fingerprint

    try:
        return bundle_fingerprint(path)
    except ConfigError:
        return derived_fingerprint("bundle", os.path.abspath(path))


def _has_column(gallery: str, column: str) -> bool:
    """Whether an embeddings parquet has ``column`` (a synthetic gallery has every column)."""
    if gallery.startswith("synthetic:"):
        return True
    from raycompat.embeddings.format import EmbeddingsParquet

    return column in EmbeddingsParquet.open(gallery).columns
