"""Query vectors per stored representation: the live counterpart of the simulator's score
sides (:mod:`raycompat.backfill.modes`, METHODS.md "Query strategies").

A query embedded by the new model ``q = phi_n(x)`` scores

* an item stored as ``old`` with ``s(phi_n(q)[:D_c], phi_o(g))`` -- the compatible subspace
  (first ``D_c = compatible_dim`` dims, normalised after the cut; side ``new-old``),
* an item stored as ``adapted`` with ``s(phi_n(q), psi(phi_o(g)))`` (side ``new-adapted``),
* an item stored as ``new`` with ``s(phi_n(q), phi_n(g))`` (side ``new-new``).

So the ``compatible`` mode is "items start as old", the ``adapted`` mode "items start as
adapted"; the backfill moves them to ``new``.  A query embedded by the *old* model
(``model="old"``: clients not upgraded yet, and the old-old reference of NFR) scores old
items only, with ``s(phi_o(q), phi_o(g))``.

Normalisation is :func:`raycompat.index.search.l2_normalize`, exactly as the simulator
normalises its sides, so the served cosines are the simulator's.
"""
from __future__ import annotations

from typing import Dict

import numpy as np

from raycompat.index.search import l2_normalize

__all__ = ["SERVED_MODES", "initial_representation", "query_sides"]

#: query modes the live index serves (rank_merge / naive_merge need a second query model)
SERVED_MODES = ("compatible", "adapted")


def initial_representation(mode: str) -> str:
    if mode not in SERVED_MODES:
        raise ValueError(f"mode {mode!r} is not served; allowed: {', '.join(SERVED_MODES)}")
    return "old" if mode == "compatible" else "adapted"


def query_sides(vectors: np.ndarray, model: str, compatible_dim: int) -> Dict[str, np.ndarray]:
    """``{representation: normalised query array}`` for raw query embeddings ``[Q, D]``.

    Raises ``ValueError`` for a zero vector (no direction)."""
    q = np.ascontiguousarray(vectors, dtype=np.float32)
    if model == "old":
        return {"old": l2_normalize(q)}
    full = l2_normalize(q)
    cut = full if compatible_dim == q.shape[1] else l2_normalize(np.ascontiguousarray(q[:, :compatible_dim]))
    return {"old": cut, "adapted": full, "new": full}
