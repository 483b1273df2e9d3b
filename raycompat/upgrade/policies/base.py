"""The contract between a backfill policy and its two callers (the offline simulator and the
live backfill controller), and the registry behind :func:`policy_order`.

A policy is a small class: it declares what it needs (``needs_embeddings``: the gallery's
embeddings, not only N; ``needs_head``: the new model's classifier head; ``needs_query_log``:
a query log; ``per_mode``: its order depends on the query mode's score sides) and computes the
order from a :class:`PolicyInputs`, reading nothing else.  Register it with
``@register_policy`` (docs/methods.md, Backfill policies).

A policy may build on another one: :meth:`Policy.scores` is a scored policy's priority per item
(what ``cost-aware`` divides by the cost), and a policy with a :meth:`Policy.base_policy`
computes its order from the base's order (:meth:`Policy.order_with_base`: ``demand``'s ties,
``upgrade-on-read``'s queue), so each engine computes the base order its own way first.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from raycompat.config import option, positive
from raycompat.embeddings.gallery import BackfillInputError, GalleryEmbeddings
from raycompat.models.uncertainty_head import UncertaintyHead

if TYPE_CHECKING:
    from raycompat.upgrade.modes import SideBuilder
    from raycompat.upgrade.query_log import LogSearches

__all__ = [
    "BlockScorer",
    "DatasetAccess",
    "Policy",
    "PolicyInputs",
    "PolicyOptions",
    "register_policy",
    "available_policies",
    "policy_class",
    "policy_order",
    "check_policy_inputs",
    "check_order",
    "order_by_score",
]


@dataclass(frozen=True)
class PolicyOptions:
    """Options of the policies that build on another policy or read a query log
    (docs/methods.md, "cost-aware", "demand", "Upgrade on read")."""

    cost_base: str = option(
        "uncertainty:margin",
        help="cost-aware: the scored policy whose score b_i is divided by the item's cost c_i",
    )
    order_base: str = option(
        "random",
        help="demand: the order its ties (equal popularity) follow; upgrade-on-read: the queue "
        "it reorders",
    )
    demand_k: int = positive(
        10, help="demand and upgrade-on-read: results per search of the query log (top-k)"
    )
    queries_per_item: float = positive(
        1.0, help="upgrade-on-read: searches per backfilled item in the simulated stream"
    )
    read_window: int = positive(
        8, help="upgrade-on-read: the last searches whose results move to the front of the queue"
    )


@dataclass(frozen=True)
class PolicyInputs:
    """Everything a policy may be given; each policy reads only what it declares.

    ``data`` is ``None`` for a served gallery without stored embeddings (N only).
    ``sides`` is an optional shared cache of score sides (the simulator's); without it a
    per-mode policy builds the mode's sides from ``data``.  ``block_bytes=None``: the
    simulator engine's default block size.  ``options``: what the policies that build on
    another one or read a query log are told (:class:`PolicyOptions`); ``reads``: the query
    log's searches (:class:`~raycompat.upgrade.query_log.LogSearches`).
    """

    n_items: int
    data: GalleryEmbeddings | None = None
    head: UncertaintyHead | None = None
    mode: str = "compatible"
    seed: int = 0
    learned_sample_fraction: float = 0.02
    rank_merge_distance: str = "sq_l2"
    device: Any = None
    block_bytes: int | None = None
    sides: SideBuilder | None = None
    options: PolicyOptions = field(default_factory=PolicyOptions)
    reads: LogSearches | None = None

    def mode_sides(self) -> tuple[Any, Any]:
        """The (old-state, new-state) score sides of ``mode``."""
        from raycompat.upgrade.modes import SideBuilder

        builder = self.sides if self.sides is not None else SideBuilder(self.data)
        _, old_side, new_side = builder.mode_sides(self.mode, self.rank_merge_distance)
        return old_side, new_side


class Policy:
    """Base class of every backfill policy; subclasses register with ``@register_policy``."""

    name: ClassVar[str] = ""
    #: what the policy sees, one line (docs/methods.md, Backfill policies)
    knows: ClassVar[str] = ""
    needs_embeddings: ClassVar[bool] = False
    needs_head: ClassVar[bool] = False
    needs_query_log: ClassVar[bool] = False
    per_mode: ClassVar[bool] = False

    def check(self, inputs: PolicyInputs) -> None:
        """Raise :class:`BackfillInputError` naming what is missing from ``inputs``."""
        if self.needs_query_log and inputs.reads is None:
            raise BackfillInputError(
                f"policy {self.name!r} needs a query log (--query-log or --zipf-exponent; "
                "the service option query_log)"
            )
        if self.needs_embeddings and inputs.data is None:
            raise BackfillInputError(
                f"policy {self.name!r} needs the gallery's embeddings (a parquet gallery)"
            )
        if self.needs_head and inputs.head is None:
            raise BackfillInputError(
                f"policy {self.name!r} needs the new model's classifier head "
                "(pass --new-model / head=, or the service option new_model)"
            )

    def order(self, inputs: PolicyInputs) -> np.ndarray:
        """A permutation of ``0..n_items-1``: the items in the order they get their new vector."""
        raise NotImplementedError

    def scores(self, inputs: PolicyInputs) -> np.ndarray:
        """A scored policy's priority of every item (float64 ``[N]``, highest first, ties by
        lower index: :meth:`order` is ``order_by_score(scores)``)."""
        raise BackfillInputError(
            f"policy {self.name!r} has no per-item score (scored policies: "
            f"{', '.join(n for n, c in _REGISTRY.items() if c.scored)})"
        )

    #: whether :meth:`scores` is defined
    scored: ClassVar[bool] = False

    def base_policy(self, inputs: PolicyInputs) -> str | None:
        """The policy whose order this one builds on (:meth:`order_with_base`), or None."""
        return None

    def order_with_base(self, inputs: PolicyInputs, base_order: np.ndarray) -> np.ndarray:
        """The order, given the order of :meth:`base_policy` (checked permutation)."""
        raise NotImplementedError

    def block_scorer(self, inputs: PolicyInputs, access: DatasetAccess) -> BlockScorer | None:
        """For a gallery no process holds (``raycompat.simulator.ray_engine``): a picklable
        per-block priority whose global order (highest first, ties by lower index) is
        :meth:`order`; ``None`` when the order needs only N (computed by :meth:`order`).
        ``inputs.data`` then holds the queries and the positives only."""
        if self.needs_embeddings:
            raise NotImplementedError(f"policy {self.name!r} has no block scorer")
        return None


class BlockScorer:
    """One number per gallery item of a block, higher first (ties by lower gallery index):
    ``scores(block, g0)`` for the items ``g0:g0+n`` of a block's :class:`GalleryEmbeddings`."""

    def scores(self, block: GalleryEmbeddings, g0: int) -> np.ndarray:
        raise NotImplementedError


@dataclass(frozen=True)
class DatasetAccess:
    """What a policy may read of a streamed gallery besides its blocks: ``items`` maps the
    rows of ``PolicyInputs.data`` (the positives) to gallery indices, and ``gather(items)``
    reads some gallery items (sorted gallery indices) as a :class:`GalleryEmbeddings` with
    the queries."""

    n_items: int
    items: np.ndarray
    gather: Any


_REGISTRY: dict[str, type[Policy]] = {}


def register_policy(cls: type[Policy]) -> type[Policy]:
    """Class decorator: make a policy available by ``cls.name`` (registration order is kept)."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    if cls.name in _REGISTRY:
        raise ValueError(f"policy {cls.name!r} registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def available_policies() -> dict[str, type[Policy]]:
    """Registered policies by name, in registration order."""
    return dict(_REGISTRY)


#: former names, and why they changed
RENAMED = {
    "oracle": (
        "hinge-benefit",
        "it orders items by a per-item hinge proxy of the AP change, a heuristic, not an upper "
        "bound on the curve",
    )
}


def policy_class(name: str) -> type[Policy]:
    if name in RENAMED:
        new, why = RENAMED[name]
        raise BackfillInputError(f"policy {name!r} was renamed {new!r}: {why}")
    if name not in _REGISTRY:
        raise BackfillInputError(f"unknown policy {name!r}; allowed: {', '.join(_REGISTRY)}")
    return _REGISTRY[name]


def check_policy_inputs(names, inputs: PolicyInputs) -> None:
    """Check every named policy's needs up front (errors name the policy and what is missing)."""
    for name in names:
        policy_class(name)().check(inputs)


def policy_order(name: str, inputs: PolicyInputs) -> np.ndarray:
    """The order of policy ``name`` (validated permutation, int64): the one dispatch used by
    the simulator and the live backfill controller."""
    policy = policy_class(name)()
    policy.check(inputs)
    return check_order(policy.order(inputs), inputs.n_items)


def check_order(order: np.ndarray, n: int) -> np.ndarray:
    """Validate that ``order`` is a permutation of ``0..n-1``; returns it as int64."""
    o = np.asarray(order, dtype=np.int64)
    if (
        o.shape != (n,)
        or (n and (o.min() < 0 or o.max() >= n))
        or (np.bincount(o, minlength=n) != 1).any()
    ):
        raise ValueError(f"a policy order must be a permutation of {n} items")
    return o


def order_by_score(scores) -> np.ndarray:
    """Indices by descending score, ties by ascending index (stable sort of ``-score``)."""
    s = np.asarray(scores, dtype=np.float64)
    if np.isnan(s).any():
        raise ValueError("policy scores contain NaN")
    return np.argsort(-s, kind="stable").astype(np.int64)
