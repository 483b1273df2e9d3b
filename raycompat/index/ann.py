"""Index kinds of the live index and their options (docs/indexes.md).

One small class per kind, registered by name (:func:`register_kind`), built by one factory
(:func:`create_kind`): ``flat`` (exact, the default), ``ivf_flat``, ``ivf_pq``, ``hnsw`` and
``faiss`` (any faiss factory string).  A kind builds its faiss index for a dimension and the
item count at training time, says whether it needs training and whether it supports
``remove_ids``, and gives the per-call search parameters (nprobe, efSearch, an ID selector).
Every index uses the inner-product metric (the vectors are L2-normalised) and is labelled
by the storage slots of :class:`raycompat.serving.rep_index.RepIndex`.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass

from raycompat.config import ConfigError, option, parse_options

__all__ = [
    "configure_faiss",
    "IndexKind",
    "IndexOptions",
    "bytes_per_item",
    "create_kind",
    "cuda_visible",
    "index_bytes",
    "index_kinds",
    "index_options",
    "pq_m_auto",
    "register_kind",
    "resolve_device",
]

logger = logging.getLogger("raycompat.serving")

_KINDS: dict[str, type[IndexKind]] = {}

#: items below which a representation is searched exactly when ``train_min`` is 0 (auto)
AUTO_TRAIN_MIN = 10_000
#: faiss's minimum of training points per k-means centroid (below it faiss warns)
POINTS_PER_CENTROID = 39


def register_kind(name: str):
    """Class decorator: register an :class:`IndexKind` subclass under ``name``."""

    def deco(cls: type[IndexKind]) -> type[IndexKind]:
        cls.name = name
        _KINDS[name] = cls
        return cls

    return deco


def index_kinds() -> tuple[str, ...]:
    """The registered kind names."""
    return tuple(_KINDS)


def create_kind(options: IndexOptions, dim: int) -> IndexKind:
    """The kind ``options.kind`` for vectors of dimension ``dim`` (``ConfigError`` when the
    options do not fit the dimension)."""
    return _KINDS[options.kind](options, int(dim))


class IndexKind:
    """One index kind (docs/indexes.md, "Index kinds").

    ``exact``: the index returns the true float32 top-n, so the canonical fetch-more search
    applies; ``trains``: it is trained on the live vectors and retrained when the count
    changes by ``retrain_factor``; ``removable``: it has ``remove_ids`` (else removed items
    are tombstones); ``gpu``: it has a GPU version."""

    name = ""
    exact = False
    trains = True
    removable = True
    gpu = True

    def __init__(self, options: IndexOptions, dim: int):
        self.options = options
        self.dim = dim

    def build(self, n: int):
        """An empty faiss index (untrained if it needs training) for ``n`` items, taking
        ``add_with_ids``."""
        raise NotImplementedError

    def train_min(self) -> int:
        """Items before the index is built (below: exact search)."""
        return self.options.train_min or AUTO_TRAIN_MIN

    def settings(self, index) -> dict:
        """The parameters ``index`` searches with: ``nlist`` / ``nprobe`` / ``ef_search``
        (``None`` where they do not apply)."""
        core = _core(index)
        ivf = _is(core, "IndexIVF") or _is(core, "GpuIndexIVF")
        nlist = int(core.nlist) if ivf else None
        return {
            "nlist": nlist,
            "nprobe": min(self.options.nprobe, nlist) if ivf else None,
            "ef_search": self.options.ef_search if _is(core, "IndexHNSW") else None,
        }

    def params(self, index, selector=None):
        """Search parameters for one call on ``index``: nprobe / efSearch, and ``selector``
        (an ``IDSelector`` of the live labels, CPU indexes only); ``None``: nothing to set."""
        import faiss

        core = _core(index)
        if _is(core, "IndexIVF") or _is(core, "GpuIndexIVF"):
            nprobe = min(self.options.nprobe, int(core.nlist))
            return faiss.SearchParametersIVF(nprobe=nprobe, sel=selector)
        if _is(core, "IndexHNSW"):
            return faiss.SearchParametersHNSW(efSearch=self.options.ef_search, sel=selector)
        return None if selector is None else faiss.SearchParameters(sel=selector)


@register_kind("flat")
class FlatKind(IndexKind):
    """Exact: ``IndexFlatIP`` (on a GPU, a torch matrix: :mod:`raycompat.serving.rep_index`)."""

    exact = True
    trains = False

    def build(self, n: int):
        import faiss

        return faiss.IndexIDMap(faiss.IndexFlatIP(self.dim))

    def train_min(self) -> int:
        return 0


@register_kind("ivf_flat")
class IVFFlatKind(IndexKind):
    """``IndexIVFFlat``: k-means lists of full float32 vectors; ``nprobe`` lists searched."""

    def build(self, n: int):
        import faiss

        return faiss.IndexIVFFlat(
            faiss.IndexFlatIP(self.dim), self.dim, self.nlist(n), faiss.METRIC_INNER_PRODUCT
        )

    def nlist(self, n: int) -> int:
        """``options.nlist``, or ``round(4 sqrt(n))`` clipped to ``[1, n / 39]``."""
        if self.options.nlist:
            return self.options.nlist
        return max(1, min(round(4 * math.sqrt(n)), n // POINTS_PER_CENTROID))

    def train_min(self) -> int:
        return self.options.train_min or max(
            AUTO_TRAIN_MIN, POINTS_PER_CENTROID * self.options.nlist
        )


@register_kind("ivf_pq")
class IVFPQKind(IVFFlatKind):
    """``IndexIVFPQ``: residuals product-quantised to ``pq_m`` codes of ``pq_bits`` bits."""

    def __init__(self, options: IndexOptions, dim: int):
        super().__init__(options, dim)
        if options.pq_m and dim % options.pq_m:
            raise ConfigError(
                f"option 'pq_m' = {options.pq_m} must divide the dimension {dim} of {options.kind}"
            )
        self.pq_m = options.pq_m or pq_m_auto(dim)

    def build(self, n: int):
        import faiss

        return faiss.IndexIVFPQ(
            faiss.IndexFlatIP(self.dim),
            self.dim,
            self.nlist(n),
            self.pq_m,
            self.options.pq_bits,
            faiss.METRIC_INNER_PRODUCT,
        )

    def train_min(self) -> int:
        codebook = POINTS_PER_CENTROID * 2**self.options.pq_bits
        return self.options.train_min or max(super().train_min(), codebook)

    def settings(self, index) -> dict:
        return dict(super().settings(index), pq_m=self.pq_m, pq_bits=self.options.pq_bits)


def pq_m_auto(dim: int) -> int:
    """The divisor of ``dim`` nearest ``dim / 4`` (4 dimensions per byte code; the smaller
    one on a tie): 32 for 128, 3 for 12, 2 for 8."""
    divisors = [m for m in range(1, dim + 1) if dim % m == 0]
    return min(divisors, key=lambda m: (abs(m - dim / 4), m))


@register_kind("hnsw")
class HNSWKind(IndexKind):
    """``IndexHNSWFlat``: a navigable small-world graph of full vectors; no ``remove_ids``
    (removed items are tombstones, filtered by an ID selector); no GPU version."""

    trains = False
    removable = False
    gpu = False

    def build(self, n: int):
        import faiss

        inner = faiss.IndexHNSWFlat(self.dim, self.options.hnsw_m, faiss.METRIC_INNER_PRODUCT)
        inner.hnsw.efConstruction = self.options.ef_construction
        return faiss.IndexIDMap(inner)


@register_kind("faiss")
class FaissKind(IndexKind):
    """Any faiss factory string (``options.factory``): trained when the string needs training,
    exact when it is a flat index, removable when it has ``remove_ids``; nprobe / efSearch
    apply to IVF / HNSW strings."""

    def __init__(self, options: IndexOptions, dim: int):
        super().__init__(options, dim)
        probe = self.build(0)  # ConfigError when the string does not fit the dimension
        self.trains = not probe.is_trained
        self.exact = _is(_core(probe), "IndexFlat")
        self.removable = _can_remove(probe)

    def build(self, n: int):
        import faiss

        try:
            index = faiss.index_factory(self.dim, self.options.factory, faiss.METRIC_INNER_PRODUCT)
        except RuntimeError as exc:
            cause = str(exc).strip().splitlines()[-1]
            raise ConfigError(
                f"option 'factory' = {self.options.factory!r} is no faiss index of dimension "
                f"{self.dim}: {cause}"
            ) from None
        if _is(index, "IndexIDMap") or faiss.try_extract_index_ivf(index) is not None:
            return index  # takes add_with_ids as it is
        return faiss.IndexIDMap(index)

    def train_min(self) -> int:
        exact_untrained = self.exact and not self.trains
        return self.options.train_min or (0 if exact_untrained else AUTO_TRAIN_MIN)


def _can_remove(index) -> bool:
    import numpy as np

    try:
        index.remove_ids(np.zeros(0, np.int64))
    except RuntimeError:
        return False
    return True


def _is(index, name: str) -> bool:
    """``index`` is a faiss ``name`` (``False`` when this faiss has no such class)."""
    import faiss

    cls = getattr(faiss, name, None)
    return cls is not None and isinstance(index, cls)


def _core(index):
    """The innermost index, through IDMap and pre-transform wrappers."""
    import faiss

    index = faiss.downcast_index(index)
    inner = getattr(index, "index", None)
    while isinstance(inner, faiss.Index):
        index = faiss.downcast_index(inner)
        inner = getattr(index, "index", None)
    return index


def index_bytes(index) -> int:
    """Bytes a CPU faiss index holds, from its structure: codes, ids, IVF centroids and id
    hashtable (40 bytes an item, measured), HNSW links (docs/indexes.md, "Memory")."""
    import faiss

    index = faiss.downcast_index(index)
    total = 0
    while _is(index, "IndexIDMap") or _is(index, "IndexPreTransform"):
        total += 8 * index.ntotal if _is(index, "IndexIDMap") else 0
        index = faiss.downcast_index(index.index)
    n = int(index.ntotal)
    if _is(index, "IndexIVF"):
        hashtable = 40 * n if index.direct_map.type == faiss.DirectMap.Hashtable else 0
        return total + n * (index.code_size + 8) + hashtable + index.nlist * index.d * 4
    if _is(index, "IndexHNSW"):
        links = 4 * index.hnsw.neighbors.size() + 12 * n
        storage = faiss.downcast_index(index.storage)
        return total + n * storage.code_size + links
    return total + n * getattr(index, "code_size", 4 * index.d)


def bytes_per_item(index) -> int:
    """Bytes one more item costs in a CPU faiss index: its code and its 8-byte id."""
    import faiss

    ivf = faiss.try_extract_index_ivf(index)
    core = ivf if ivf is not None else _core(index)
    return int(getattr(core, "code_size", 4 * index.d)) + 8


# ---------------------------------------------------------------------------------- device
@functools.lru_cache(maxsize=1)
def cuda_visible() -> tuple[bool, str]:
    """``(True, "")`` when torch sees a CUDA device, else ``(False, why)``; imports torch."""
    try:
        import torch
    except ImportError:
        return False, "torch is not installed"
    if not torch.cuda.is_available():
        return False, "no CUDA device is visible (torch.cuda.is_available() is False)"
    return True, ""


def faiss_gpus() -> int:
    import faiss

    return int(faiss.get_num_gpus()) if hasattr(faiss, "get_num_gpus") else 0


def resolve_device(options: IndexOptions, kind: IndexKind, name: str) -> str:
    """``"cpu"`` or ``"cuda"`` for one index (docs/indexes.md, "GPU"): a fallback to CPU
    writes one log line naming the cause; ``device="cuda"`` without a visible CUDA device
    raises ``ConfigError``."""
    if options.device == "cpu":
        return "cpu"
    ok, why = cuda_visible()
    if not ok:
        if options.device == "cuda":
            raise ConfigError(f"{name}: option 'device' (--index-device) is 'cuda' but {why}")
        logger.info("%s: index %s on CPU: %s", name, kind.name, why)
        return "cpu"
    level = logging.WARNING if options.device == "cuda" else logging.INFO
    if not kind.gpu:
        logger.log(level, "%s: index %s on CPU: HNSW has no GPU index in faiss", name, kind.name)
        return "cpu"
    if kind.name != "flat" and faiss_gpus() == 0:
        logger.warning(
            "%s: index %s on CPU: the installed faiss has no GPU support "
            "(faiss.get_num_gpus() is 0; install faiss-gpu)",
            name,
            kind.name,
        )
        return "cpu"
    return "cuda"


# ---------------------------------------------------------------------------------- options
@dataclass(frozen=True)
class IndexOptions:
    """How one representation's items are indexed (docs/indexes.md, "Options")."""

    kind: str = option(
        "flat",
        flag="--index",
        choices=tuple(_KINDS),
        help="index kind: flat is exact; ivf_flat, ivf_pq and hnsw are approximate with an "
        "exact re-rank; faiss takes --factory",
    )
    factory: str = option(
        "Flat", flag="--factory", help="faiss factory string (only with --index faiss)"
    )
    nlist: int = option(
        0, flag="--nlist", min=0, help="IVF lists; 0: round(4 sqrt(n)) at each (re)training"
    )
    nprobe: int = option(32, flag="--nprobe", min=1, help="IVF lists probed per query")
    pq_m: int = option(
        0, flag="--pq-m", min=0, help="IVF-PQ sub-quantizers; 0: the divisor of dim nearest dim/4"
    )
    pq_bits: int = option(8, flag="--pq-bits", min=1, help="bits per IVF-PQ code (1..16)")
    hnsw_m: int = option(16, flag="--hnsw-m", min=2, help="HNSW neighbours per node")
    ef_construction: int = option(100, flag="--ef-construction", min=1, help="HNSW build beam")
    ef_search: int = option(64, flag="--ef-search", min=1, help="HNSW search beam")
    rerank: int = option(
        4,
        flag="--rerank",
        min=1,
        help="an approximate index proposes max(rerank*k, k+16) candidates, re-ranked exactly",
    )
    train_min: int = option(
        0,
        flag="--train-min",
        min=0,
        help="items before a representation's index is built (below: exact search); "
        "0: 10000, more for large nlist or pq_bits",
    )
    retrain_factor: float = option(
        2.0,
        flag="--retrain-factor",
        help="rebuild when a representation grew or shrank by this factor since its last "
        "training (> 1)",
    )
    device: str = option(
        "auto",
        flag="--index-device",
        choices=("auto", "cpu", "cuda"),
        help="auto: the GPU when torch sees CUDA (HNSW stays on CPU)",
    )

    def __post_init__(self):
        if self.kind not in _KINDS:
            raise ConfigError(f"option 'kind' = {self.kind!r}; allowed values: {index_kinds()}")
        if self.kind != "faiss" and self.factory != "Flat":
            raise ConfigError(
                f"option 'factory' = {self.factory!r} needs kind 'faiss' (--index faiss), "
                f"not {self.kind!r}"
            )
        if not 1 <= self.pq_bits <= 16:
            raise ConfigError(f"option 'pq_bits' = {self.pq_bits} must be in 1..16")
        if not self.retrain_factor > 1.0:
            raise ConfigError(f"option 'retrain_factor' = {self.retrain_factor} must be > 1")
        if self.train_min and self.kind in ("ivf_flat", "ivf_pq"):
            self._check_train_min()

    def _check_train_min(self):
        """k-means needs at least as many training points as centroids."""
        need = max(self.nlist, 2**self.pq_bits if self.kind == "ivf_pq" else 1)
        if self.train_min < need:
            raise ConfigError(
                f"option 'train_min' = {self.train_min} must be >= {need} for {self.kind} "
                f"(nlist {self.nlist or 'auto'}, k-means needs a point per centroid)"
            )


def configure_faiss(threads: int, dim: int) -> None:
    """faiss's process-wide settings for a process that searches vectors of up to ``dim``
    dimensions (docs/indexes.md, "Batched exact search"): ``threads`` OpenMP threads, and a
    matrix product (BLAS) for every search of 4 queries or more.  faiss compares its BLAS
    threshold with queries x dimension, and its default (128,000) keeps batches of fewer than
    1,000 queries of 128 dims on the one-query-at-a-time scan: at 250k x 128 on one thread
    that is 240 queries/s at any batch size, against 1,030 with BLAS at 16 queries."""
    import faiss

    faiss.omp_set_num_threads(int(threads))
    faiss.cvar.distance_compute_blas_threshold = 4 * int(dim)


def index_options(values: dict | None = None, **kw) -> IndexOptions:
    """:class:`IndexOptions` from a dict and keywords; a bad value raises ``ConfigError``
    naming the option."""
    return parse_options(IndexOptions, {**(values or {}), **kw}, owner="index")
