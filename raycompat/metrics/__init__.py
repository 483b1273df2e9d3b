"""Retrieval, compatibility and backfill-curve metrics (docs/methods.md, "Metrics")."""

from raycompat.metrics.compatibility import (
    compatibility_report,
    delta_down,
    delta_up,
    is_compatible,
    p_scores,
    update_gain,
)
from raycompat.metrics.curves import auc, auc_gain, regression_stats
from raycompat.metrics.recall import recall_at_k as index_recall_at_k
from raycompat.metrics.retrieval import (
    average_precision_at_k,
    average_precision_from_ranks,
    cmc_top_k,
    correct_at_k,
    evaluate_ranking,
    evaluate_retrieval,
    map_full,
    mean_average_precision_at_k,
    negative_flip_rate,
    negative_flips,
    num_relevant_from_labels,
    recall_at_k,
    relevance_from_labels,
    revisited_average_precision,
    revisited_easy_medium_hard,
    revisited_map,
)

__all__ = [
    "auc",
    "auc_gain",
    "average_precision_at_k",
    "average_precision_from_ranks",
    "cmc_top_k",
    "compatibility_report",
    "correct_at_k",
    "delta_down",
    "delta_up",
    "evaluate_ranking",
    "evaluate_retrieval",
    "index_recall_at_k",
    "is_compatible",
    "map_full",
    "mean_average_precision_at_k",
    "negative_flip_rate",
    "negative_flips",
    "num_relevant_from_labels",
    "p_scores",
    "recall_at_k",
    "regression_stats",
    "relevance_from_labels",
    "revisited_average_precision",
    "revisited_easy_medium_hard",
    "revisited_map",
    "update_gain",
]
