"""Query vectors per stored representation: the live counterpart of the simulator's score
sides (:mod:`raycompat.upgrade.modes`, docs/methods.md, "Query strategies").

A query embedded by the new model ``q = phi_n(x)`` scores

* an item stored as ``old`` with ``s(phi_n(q)[:D_c], phi_o(g))`` -- the compatible subspace
  (first ``D_c = compatible_dim`` dims, normalised after the cut; side ``new-old``),
* an item stored as ``adapted`` with ``s(phi_n(q), psi(phi_o(g)))`` (side ``new-adapted``);
  in the ``fct`` mode it holds FCT's ``h(phi_o(g))`` instead (side ``new-fct``),
* an item stored as ``new`` with ``s(phi_n(q), phi_n(g))`` (side ``new-new``).

In the ``rank_merge`` mode (RM, docs/methods.md, "Query strategies") a ``new`` item holds
``rho(phi_n(g))`` and the router turns ``phi_n(q)`` into ``r = rho(phi_n(q))`` and
``psi_rev(r)``:

* an ``old`` item scores ``s(psi_rev(r), phi_o(g))`` (side ``rev-old``),
* a ``new`` item scores ``s(r, rho(phi_n(g)))`` (side ``rho-rho``);

RM ranks by ``-d`` with ``d`` the squared L2 (or L2, or cosine) distance between
normalised vectors, a decreasing function of the same cosine on both sides, so ranking by
the cosine is ranking by ``-d``.  rho and psi_rev are the new model bundle's modules,
applied with :class:`raycompat.models.FeatureMap` exactly as the simulator applies them.

In the ``naive_merge`` mode (RM's naive baseline, two query passes) an ``old`` item scores
``s(phi_o(q), phi_o(g))`` with the old model's embedding of the query, which the request
carries (``old_vectors``) or the router computes from the image, and a ``new`` item
``s(phi_n(q), phi_n(g))``.

So the ``compatible``, ``rank_merge`` and ``naive_merge`` modes are "items start as old", the
``adapted`` and ``fct`` modes "items start as adapted" (psi's or h's output:
:func:`adapted_transform`); the backfill moves them to ``new``.  A query embedded
by the *old* model (``model="old"``: clients not upgraded yet, and the old-old reference of NFR)
scores old items only, with ``s(phi_o(q), phi_o(g))``.

Normalisation is :func:`raycompat.index.search.l2_normalize`, exactly as the simulator
normalises its sides, so the served cosines are the simulator's.
"""

from __future__ import annotations

import numpy as np

from raycompat.config import ConfigError
from raycompat.index.search import l2_normalize
from raycompat.upgrade.modes import SERVED_MODES

__all__ = [
    "adapted_transform",
    "initial_representation",
    "query_sides",
    "rank_merge_maps",
    "stored_new",
]

#: the new bundle's module whose output an ``adapted`` item holds, per mode that stores one
ADAPTED_TRANSFORMS = {"adapted": "psi", "fct": "fct"}


def initial_representation(mode: str) -> str:
    """What an item holds before the backfill: ``adapted`` in the adapted and fct modes, else
    ``old`` (``ValueError`` for a mode the live index does not serve)."""
    if mode not in SERVED_MODES:
        raise ValueError(f"mode {mode!r} is not served; allowed: {', '.join(SERVED_MODES)}")
    return "adapted" if mode in ADAPTED_TRANSFORMS else "old"


def adapted_transform(mode: str) -> str | None:
    """The transform of the old vectors an ``adapted`` item holds in ``mode``: ``psi`` (DMU),
    ``fct`` (FCT's h), or ``None`` where items start as ``old``."""
    return ADAPTED_TRANSFORMS.get(mode)


def rank_merge_maps(new_model: str | None) -> tuple[object, object]:
    """``(rho, psi_rev)`` of the new model bundle as :class:`raycompat.models.FeatureMap`
    (``ConfigError`` naming what is missing)."""
    if not new_model:
        raise ConfigError(
            "mode 'rank_merge' needs the option new_model: a bundle with 'rho' and 'psi_rev' "
            "modules (trained with --method mcl, rqt or cl)"
        )
    from raycompat.models import FeatureMap, ModelBundle

    modules = ModelBundle.load(new_model).modules
    missing = [m for m in ("rho", "psi_rev") if m not in modules]
    if missing:
        raise ConfigError(
            f"mode 'rank_merge': the new model {new_model} has no {' / '.join(missing)} module "
            "(train it with --method mcl, rqt or cl)"
        )
    return FeatureMap(modules["rho"]), FeatureMap(modules["psi_rev"])


def stored_new(raw: np.ndarray, new_map=None) -> np.ndarray:
    """What a ``new`` item holds, from its raw new-model embedding: ``l2(rho(v))`` in the
    rank_merge mode (``new_map`` = rho), else ``l2(v)``."""
    v = np.ascontiguousarray(raw, dtype=np.float32)
    return l2_normalize(new_map(v) if new_map is not None else v)


def query_sides(
    vectors: np.ndarray,
    model: str,
    compatible_dim: int,
    rank_merge=None,
    old_queries: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """``{representation: normalised query array}`` for raw query embeddings ``[Q, D]``;
    ``rank_merge``: the ``(rho, psi_rev)`` maps in that mode; ``old_queries``: the old
    model's embeddings of the same queries in the naive_merge mode.

    Raises ``ValueError`` for a zero vector (no direction)."""
    q = np.ascontiguousarray(vectors, dtype=np.float32)
    if model == "old":
        return {"old": l2_normalize(q)}
    if old_queries is not None:  # naive_merge: old-old and new-new scores, merged
        return {
            "old": l2_normalize(np.ascontiguousarray(old_queries, dtype=np.float32)),
            "new": l2_normalize(q),
        }
    if rank_merge is not None:
        rho, psi_rev = rank_merge
        r = rho(q)
        return {"old": l2_normalize(psi_rev(r)), "new": l2_normalize(r)}
    full = l2_normalize(q)
    cut = (
        full
        if compatible_dim == q.shape[1]
        else l2_normalize(np.ascontiguousarray(q[:, :compatible_dim]))
    )
    return {"old": cut, "adapted": full, "new": full}
