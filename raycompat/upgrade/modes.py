"""Query modes: how old-state and new-state gallery items are scored (docs/methods.md, Query
strategies).

=============== ==================================== ========================== ================
mode            old-state item ``g`` scored with     new-state item ``g``       methods
                                                     scored with
=============== ==================================== ========================== ================
``compatible``  ``s(phi_n(q)[:D_old], phi_o(g))``    ``s(phi_n(q), phi_n(g))``  BCT, RACT, NDPP
``adapted``     ``s(phi_n(q), psi(phi_o(g)))``       ``s(phi_n(q), phi_n(g))``  DMU
``fct``         ``s(phi_n(q), h(phi_o(g)))``         ``s(phi_n(q), phi_n(g))``  FCT
``rank_merge``  ``-d(psi_rev(rho(q)), phi_o(g))``    ``-d(rho(q), rho(g))``     RM
``naive_merge`` ``s(phi_o(q), phi_o(g))``            ``s(phi_n(q), phi_n(g))``  RM naive
``cold``        old-old until t = 1, then new-new
=============== ==================================== ========================== ================

Every mode reduces to two *score sides* (:class:`raycompat.upgrade.score_sides.Side`):
float32 query and gallery arrays whose inner product is the score.  ``s`` is
the cosine, i.e. the inner product of L2-normalised vectors (normalised after
cutting to the compatible subspace, as in ``raycompat.evaluation``).

``rank_merge`` distance (docs/methods.md, Training objectives): ``d`` is the squared L2 distance on
normalised embeddings, so ``-d(a, b) = 2 <a, b> - 2``: a strictly increasing
function of the cosine, the same for both sides, so the merged ranking and its
ties are exactly those of the cosine -- the sides are stored as cosines.  With
``rank_merge_distance="sq_l2_raw"`` (un-normalised squared L2),
``-d(a, b)/2 = <[a, -|a|^2/2, 1], [b, 1, -|b|^2/2]>`` is written as an inner
product of augmented vectors (an order-preserving rescaling of ``-d``).

At every grid point each gallery item holds exactly one vector (old-state or
new-state), see :mod:`raycompat.upgrade.grid`.

Side names (shared between modes, so the engine computes each once):
``old-old``, ``new-old`` (compatible subspace), ``new-new``, ``new-adapted``, ``new-fct``,
``rev-old`` and ``rho-rho`` (``:l2raw`` suffix for the raw distance).

Every mode is one registered :class:`ModeSpec` (:func:`register_mode`): ``MODES``,
``SERVED_MODES`` (the live index's modes, used by ``raycompat.serving``) and
:func:`available_modes` are derived from the registry.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from raycompat.embeddings.gallery import BackfillInputError, GalleryEmbeddings
from raycompat.index.search import l2_normalize

__all__ = [
    "MODES",
    "SERVED_MODES",
    "ModeSpec",
    "mode_spec",
    "register_mode",
    "parse_modes",
    "SideBuilder",
    "apply_bundle_modules",
    "available_modes",
]

RANK_MERGE_DISTANCES = ("sq_l2", "sq_l2_raw")


@dataclass(frozen=True)
class ModeSpec:
    """A mode: the side scoring old-state items, the side scoring new-state items, the schedule.

    ``schedule``: ``hot`` (the policy's order) or ``cold`` (nothing until t = 1).
    ``served``: the live index serves it.  ``arrays``: the :class:`GalleryEmbeddings` arrays
    it needs; ``needs_compatible_subspace``: it compares ``phi_n(q)[:D_old]`` with ``phi_o(g)``;
    ``distance_sides``: its side names take the ``:l2raw`` suffix with ``sq_l2_raw``.
    """

    name: str
    old_side: str
    new_side: str
    schedule: str = "hot"
    served: bool = True
    arrays: tuple[str, ...] = ("query_new", "gallery_new")
    needs_compatible_subspace: bool = False
    distance_sides: bool = False

    def available(self, data: GalleryEmbeddings) -> bool:
        """Every array the mode needs is present (and the compatible subspace, if it needs one)."""
        if any(getattr(data, a) is None for a in self.arrays):
            return False
        return not self.needs_compatible_subspace or data.compat_dim == data.old_dim


_MODES: dict[str, ModeSpec] = {}


def register_mode(spec: ModeSpec) -> ModeSpec:
    """Add a mode to the registry (registration order is the order of :data:`MODES`)."""
    if spec.name in _MODES:
        raise ValueError(f"mode {spec.name!r} registered twice")
    _MODES[spec.name] = spec
    return spec


register_mode(ModeSpec("compatible", "new-old", "new-new", needs_compatible_subspace=True))
register_mode(
    ModeSpec(
        "adapted", "new-adapted", "new-new", arrays=("query_new", "gallery_new", "gallery_adapted")
    )
)
# FCT's transformation h of the stored old vectors (the bundle's ``fct`` module), a gallery
# transform as DMU's psi (the live index stores h(phi_o(g)) as an ``adapted`` item)
register_mode(
    ModeSpec("fct", "new-fct", "new-new", arrays=("query_new", "gallery_new", "gallery_fct"))
)
register_mode(
    ModeSpec(
        "rank_merge",
        "rev-old",
        "rho-rho",
        distance_sides=True,
        arrays=("query_new", "gallery_new", "query_rho", "gallery_rho", "query_rev"),
    )
)
register_mode(
    ModeSpec("naive_merge", "old-old", "new-new", arrays=("query_new", "gallery_new", "query_old"))
)
# cold has no live form: it re-embeds nothing until t = 1
register_mode(
    ModeSpec(
        "cold",
        "old-old",
        "new-new",
        schedule="cold",
        served=False,
        arrays=("query_new", "gallery_new", "query_old"),
    )
)

MODES = tuple(_MODES)
#: the modes the live index serves
SERVED_MODES = tuple(name for name, spec in _MODES.items() if spec.served)


def mode_spec(name: str, rank_merge_distance: str = "sq_l2") -> ModeSpec:
    """The registered mode ``name``, its side names resolved for ``rank_merge_distance``."""
    if name not in _MODES:
        raise BackfillInputError(f"unknown mode {name!r}; allowed: {', '.join(_MODES)}")
    if rank_merge_distance not in RANK_MERGE_DISTANCES:
        raise BackfillInputError(
            f"unknown rank_merge distance {rank_merge_distance!r}; "
            f"allowed: {', '.join(RANK_MERGE_DISTANCES)}"
        )
    spec = _MODES[name]
    if spec.distance_sides and rank_merge_distance == "sq_l2_raw":
        return replace(spec, old_side=spec.old_side + ":l2raw", new_side=spec.new_side + ":l2raw")
    return spec


def parse_modes(names) -> tuple[str, ...]:
    """Comma string or sequence -> validated tuple of mode names (unknown names raise)."""
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    out = []
    for n in names:
        mode_spec(n)
        if n not in out:
            out.append(n)
    if not out:
        raise BackfillInputError(f"no query mode given; allowed: {', '.join(MODES)}")
    return tuple(out)


def _normalized(a: np.ndarray, name: str, already: bool) -> np.ndarray:
    if already:
        return a
    try:
        return l2_normalize(a)
    except ValueError as exc:
        raise BackfillInputError(f"{name}: {exc}") from exc


def _augment(a: np.ndarray, query: bool) -> np.ndarray:
    """Vectors whose inner products give -d/2 for squared L2 (see module docstring)."""
    a64 = a.astype(np.float64)
    sq = np.einsum("ij,ij->i", a64, a64)
    extra = (
        np.stack([-sq / 2.0, np.ones_like(sq)], axis=1)
        if query
        else np.stack([np.ones_like(sq), -sq / 2.0], axis=1)
    )
    return np.concatenate([a, extra.astype(np.float32)], axis=1)


def scores_raw(sides: Sequence[str]) -> bool:
    """Whether any of the score ``sides`` scores raw (un-normalized) vectors (``name:raw``)."""
    return any(s.partition(":")[2] for s in sides)


def normalize_columns(columns: dict[str, np.ndarray], where: str) -> None:
    """Replace every vector of ``columns`` by its :func:`l2_normalize` output, one column at a
    time, so that a raw column is freed before the next is normalized; a zero-norm row names
    the column and ``where``."""
    for c in list(columns):
        columns[c] = _normalized(columns[c], f"column {c!r} of {where}", False)


class SideBuilder:
    """Builds (and caches) the named score sides of a :class:`GalleryEmbeddings`.

    ``normalized``: attributes of ``data`` that already hold the output of
    :func:`raycompat.index.search.l2_normalize` (a block task normalizes a row group's columns
    once, for every candidate's builder, and keeps no raw copy); the others are normalized here
    unless ``data.normalized``."""

    def __init__(self, data: GalleryEmbeddings, normalized: Sequence[str] = ()):
        self.data = data
        self._cache: dict[str, object] = {}
        self._norm: dict[str, np.ndarray] = {a: getattr(data, a) for a in normalized}

    def _n(self, attr: str, why: str) -> np.ndarray:
        if attr not in self._norm:
            a = getattr(self.data, attr)
            if a is None:
                raise BackfillInputError(f"{why} needs {attr}, which is missing")
            self._norm[attr] = _normalized(a, attr, self.data.normalized)
        return self._norm[attr]

    def side(self, name: str):
        """The named :class:`raycompat.upgrade.score_sides.Side` (built once, then cached)."""
        from raycompat.upgrade.score_sides import Side

        if name in self._cache:
            return self._cache[name]
        d = self.data
        base, _, raw = name.partition(":")
        why = f"score side {name!r}"
        if base == "old-old":
            s = Side(self._n("query_old", why), self._n("gallery_old", why))
        elif base == "new-new":
            s = Side(self._n("query_new", why), self._n("gallery_new", why))
        elif base == "new-old":
            if d.query_new is None:
                raise BackfillInputError(f"{why} needs query_new, which is missing")
            dc = d.compat_dim
            if dc is None or dc != d.old_dim:
                raise BackfillInputError(
                    "dimension mismatch: mode 'compatible' compares phi_n(q)[:D_old] "
                    "with phi_o(g), "
                    f"needs a compatible subspace of D_old={d.old_dim} dims, new embeddings have "
                    f"{d.new_dim} dims (compatible_dim={d.compatible_dim})"
                )
            if dc == d.query_new.shape[1]:
                q = self._n("query_new", why)
            else:
                q = _normalized(
                    np.ascontiguousarray(d.query_new[:, :dc]), "query_new[:, :D_old]", False
                )
            s = Side(q, self._n("gallery_old", why))
        elif base == "new-adapted":
            s = Side(self._n("query_new", why), self._n("gallery_adapted", why))
        elif base == "new-fct":
            if d.gallery_fct is None:
                raise BackfillInputError(
                    "mode 'fct' needs gallery_fct (h(phi_o(g))): pass a new model with an 'fct' "
                    "module (method fct)"
                )
            s = Side(self._n("query_new", why), self._n("gallery_fct", why))
        elif base in ("rev-old", "rho-rho"):
            s = self._rank_merge_side(base, raw == "l2raw", why)
        else:
            raise KeyError(f"unknown score side {name!r}")
        self._cache[name] = s
        return s

    def _rank_merge_side(self, base: str, raw: bool, why: str):
        """``rev-old`` (psi_rev(rho(q)) vs phi_o(g)) or ``rho-rho``; ``raw``: un-normalised
        sq. L2."""
        from raycompat.upgrade.score_sides import Side

        d = self.data
        if base == "rev-old":
            q, g, qn, gn = d.query_rev, d.gallery_old, "query_rev", "gallery_old"
        else:
            q, g, qn, gn = d.query_rho, d.gallery_rho, "query_rho", "gallery_rho"
        if q is None or g is None:
            raise BackfillInputError(
                f"mode 'rank_merge' needs {qn} and {gn} (rho / psi_rev outputs): pass a new model "
                "with 'rho' and 'psi_rev' modules"
            )
        if raw:
            return Side(_augment(q, True), _augment(g, False))
        return Side(self._n(qn, why), self._n(gn, why))

    def mode_sides(
        self, mode: str, rank_merge_distance: str = "sq_l2"
    ) -> tuple[ModeSpec, object, object]:
        spec = mode_spec(mode, rank_merge_distance)
        return spec, self.side(spec.old_side), self.side(spec.new_side)


# ----------------------------------------------------------------------------- models
def apply_bundle_modules(
    data: GalleryEmbeddings, new_bundle, *, batch_size: int = 8192
) -> GalleryEmbeddings:
    """Fill ``gallery_adapted`` (psi), ``gallery_fct`` (FCT's h), ``gallery_rho`` / ``query_rho``
    (rho) and ``query_rev`` (psi_rev after rho) from a new
    :class:`raycompat.models.ModelBundle`'s modules, when the bundle has them and the arrays are
    missing.

    The modules are applied with :class:`raycompat.models.FeatureMap` (eval mode, no grad,
    float64 then float32: what the live index applies too) to the stored embeddings as they
    are: psi to ``old`` (docs/methods.md, Training objectives, DMU), h to ``old``
    (docs/methods.md, Field methods, fct), rho to ``new`` and psi_rev to ``rho(new)`` of the
    queries (docs/methods.md, Training objectives, RM).
    """
    from raycompat.models import FeatureMap

    modules = getattr(new_bundle, "modules", {}) or {}

    def run(module, x: np.ndarray) -> np.ndarray:
        return FeatureMap(module, batch_size=batch_size)(x)

    def check_in(module, x: np.ndarray, what: str, name: str):
        in_dim = getattr(module, "in_dim", x.shape[1])
        if in_dim != x.shape[1]:
            raise BackfillInputError(
                f"dimension mismatch: module {name!r} expects {in_dim} dims, "
                f"{what} has {x.shape[1]}"
            )

    updates = {}
    if data.gallery_adapted is None and "psi" in modules:
        check_in(modules["psi"], data.gallery_old, "column 'old'", "psi")
        updates["gallery_adapted"] = run(modules["psi"], data.gallery_old)
    if data.gallery_fct is None and "fct" in modules:
        check_in(modules["fct"], data.gallery_old, "column 'old'", "fct")
        updates["gallery_fct"] = run(modules["fct"], data.gallery_old)
    if "rho" in modules and data.gallery_new is not None and data.query_new is not None:
        rho = modules["rho"]
        check_in(rho, data.gallery_new, "column 'new'", "rho")
        if data.gallery_rho is None:
            updates["gallery_rho"] = run(rho, data.gallery_new)
        q_rho = data.query_rho if data.query_rho is not None else run(rho, data.query_new)
        if data.query_rho is None:
            updates["query_rho"] = q_rho
        if data.query_rev is None and "psi_rev" in modules:
            check_in(modules["psi_rev"], q_rho, "rho(new)", "psi_rev")
            updates["query_rev"] = run(modules["psi_rev"], q_rho)
    return data.with_arrays(**updates) if updates else data


def available_modes(data: GalleryEmbeddings) -> tuple[str, ...]:
    """Modes whose arrays are all present (used for defaults), in registry order."""
    return tuple(name for name, spec in _MODES.items() if spec.available(data))
