"""Gallery indexes and exact search."""

from raycompat.index.search import exact_search, full_ranking, iter_full_ranking, l2_normalize

__all__ = ["exact_search", "full_ranking", "iter_full_ranking", "l2_normalize"]
