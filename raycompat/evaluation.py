"""Cross-model retrieval evaluation: old-old, new-new and new-old (docs/methods.md, Notation).

``M(query embedder, gallery embedder)``: queries are embedded by one model and searched
(exact cosine, faiss) against a gallery embedded by another. Across models, only the
first ``D_old`` dims of the new embedding are used (BCT dimension change), and both sides
are L2-normalised after that cut.

Every ranking is by the canonical score (:mod:`raycompat.index.canonical_ranking`: float64
over the float32 vectors, ties by ascending gallery index), the ranking of the backfill
simulator and the live index: a static number and the same number on a backfill curve agree.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from raycompat.data import GlyphRenderer, Scenario, catalog_for, images_to_tensor
from raycompat.index.canonical_ranking import iter_canonical_ranking
from raycompat.index.search import l2_normalize
from raycompat.metrics import (
    evaluate_ranking,
    map_full,
    num_relevant_from_labels,
)
from raycompat.metrics.bootstrap import BootstrapOptions, Sample
from raycompat.metrics.compatibility import delta_down, delta_up, update_gain
from raycompat.models import ModelBundle

PRIMARY_METRIC = "mAP@100"


@torch.no_grad()
def embed_batches(bundle: ModelBundle, n: int, images_of, batch_size: int = 512) -> np.ndarray:
    """Raw (un-normalised) float32 embeddings of ``n`` items; ``images_of(start, stop)`` gives
    the uint8 images of items ``[start, stop)``."""
    bundle.eval()
    in_chans = int(bundle.manifest.get("in_chans", 1))
    out = np.empty((n, bundle.embed_dim), np.float32)
    for start in range(0, n, batch_size):
        stop = min(start + batch_size, n)
        out[start:stop] = bundle.embedder(
            images_to_tensor(images_of(start, stop), in_chans)
        ).numpy()
    return out


def embed_glyphs(
    bundle: ModelBundle,
    renderer: GlyphRenderer,
    labels: np.ndarray,
    instances: np.ndarray,
    batch_size: int = 512,
) -> np.ndarray:
    """Raw (un-normalised) float32 embeddings of rendered glyph items, in item order."""
    return embed_batches(
        bundle,
        len(labels),
        lambda a, b: renderer.render_batch(labels[a:b], instances[a:b]),
        batch_size,
    )


def embed_keys(bundle: ModelBundle, images, keys: list[str], batch_size: int = 512) -> np.ndarray:
    """Raw float32 embeddings of your images by key (``images``: a
    ``raycompat.data.source.ItemImages``), in key order."""
    return embed_batches(
        bundle, len(keys), lambda a, b: np.stack([images.load(k) for k in keys[a:b]]), batch_size
    )


@dataclass
class EmbeddedSet:
    """Query and gallery embeddings of one model."""

    name: str
    query: np.ndarray
    gallery: np.ndarray
    compatible_dim: int


def embed_scenario(
    name: str, bundle: ModelBundle, scenario: Scenario, resolution: int, data_seed: int = 0
) -> EmbeddedSet:
    """Queries and gallery (distractors included) of ``scenario`` embedded by ``bundle``:
    rendered glyphs, or your images decoded by key."""
    compatible_dim = int(bundle.manifest.get("compatible_dim", bundle.embed_dim))
    if scenario.user_data:
        from raycompat.data.source import ItemImages, SourceSpec

        in_chans = int(bundle.manifest.get("in_chans", 3))
        images = ItemImages(SourceSpec.from_dict(scenario.source), resolution, in_chans)
        q_keys, g_keys = scenario_eval_keys(scenario)
        query, gallery = embed_keys(bundle, images, q_keys), embed_keys(bundle, images, g_keys)
        return EmbeddedSet(name, query, gallery, compatible_dim)
    renderer = GlyphRenderer(catalog_for(scenario), resolution=resolution, seed=data_seed)
    query, gallery = scenario_eval_items(scenario)
    return EmbeddedSet(
        name=name,
        query=embed_glyphs(bundle, renderer, *query),
        gallery=embed_glyphs(bundle, renderer, *gallery),
        compatible_dim=compatible_dim,
    )


def scenario_eval_keys(scenario: Scenario) -> tuple[list[str], list[str]]:
    """(query keys, gallery keys) of a scenario of your images; the gallery includes
    distractors, in the order of :func:`scenario_eval_items`."""
    parts = [scenario.splits["gallery"], scenario.splits.get("distractors")]
    gallery = [k for p in parts if p is not None for k in p.items]
    return list(scenario.splits["query"].items), gallery


def scenario_eval_items(scenario: Scenario):
    """((query labels, instances), (gallery labels, instances)); the gallery includes
    distractors."""
    q = scenario.splits["query"]
    parts = [scenario.splits["gallery"]]
    if "distractors" in scenario.splits:
        parts.append(scenario.splits["distractors"])
    g_labels = np.concatenate([p.labels for p in parts])
    g_instances = np.concatenate([p.instances for p in parts])
    return (q.labels, q.instances), (g_labels, g_instances)


def canonical_retrieval(
    query: np.ndarray,
    gallery: np.ndarray,
    query_labels,
    gallery_labels,
    k: int = 100,
    ks=(1, 5, 10),
) -> tuple[dict[str, float], dict[str, np.ndarray]]:
    """The metrics of :func:`raycompat.metrics.evaluate_retrieval` (the same keys, in the same
    order) and their per-query arrays, from the canonical ranking of the L2-normalised
    ``query`` against the L2-normalised ``gallery`` (one pass: the top of each chunk of the
    full ranking is the top-k ranking)."""
    q, g = l2_normalize(query), l2_normalize(gallery)
    for name, emb, labels in (("query", q, query_labels), ("gallery", g, gallery_labels)):
        if emb.shape[0] != len(labels):
            raise ValueError(f"{name} embeddings {emb.shape} do not match {len(labels)} labels")
    top = np.empty((q.shape[0], min(max((k, *ks)), g.shape[0])), dtype=np.int64)

    def chunks():
        for start, ranks in iter_canonical_ranking(q, g):
            top[start : start + ranks.shape[0]] = ranks[:, : top.shape[1]]
            yield start, ranks

    full_map, ap = map_full(chunks(), query_labels, gallery_labels, return_per_query=True)
    metrics, per = evaluate_ranking(
        top, query_labels, gallery_labels, k=k, ks=ks, return_per_query=True
    )
    ordered = {m: v for m, v in metrics.items() if not m.startswith("num_")}
    ordered["mAP"] = full_map
    ordered.update((m, v) for m, v in metrics.items() if m.startswith("num_"))
    return ordered, dict(per, ap=ap)


def evaluate_pair(
    query: np.ndarray,
    gallery: np.ndarray,
    query_labels,
    gallery_labels,
    dims: int | None = None,
    k: int = 100,
) -> dict[str, float]:
    """Metrics of one (query embedder, gallery embedder) pair, optionally on the first ``dims``
    (:func:`canonical_retrieval`)."""
    if dims is not None:
        query, gallery = query[:, :dims], gallery[:, :dims]
    return canonical_retrieval(query, gallery, query_labels, gallery_labels, k=k)[0]


def pair_samples(
    query: np.ndarray,
    gallery: np.ndarray,
    query_labels,
    gallery_labels,
    dims: int | None = None,
    k: int = 100,
    query_set: str = "queries",
) -> tuple[dict[str, float], dict[str, Sample]]:
    """:func:`evaluate_pair` and the per-query terms of each of its metrics (``mAP@k``,
    ``mAP``, ``top1``/``top5``/``top10``) as bootstrap samples of ``query_set``
    (docs/methods.md, "Uncertainty")."""
    if dims is not None:
        query, gallery = query[:, :dims], gallery[:, :dims]
    metrics, per = canonical_retrieval(query, gallery, query_labels, gallery_labels, k=k)
    valid = num_relevant_from_labels(query_labels, gallery_labels) > 0
    samples = {f"mAP@{k}": Sample.mean(query_set, per[f"ap@{k}"])}
    if "ap" in per:
        samples["mAP"] = Sample.mean(query_set, per["ap"])
    for kk in (1, 5, 10):
        c = np.where(valid, per[f"correct@{kk}"].astype(np.float64), np.nan)
        samples[f"top{kk}"] = Sample.mean(query_set, c)
    return metrics, samples


def cross_evaluate(
    old: EmbeddedSet,
    new_sets: Iterable[EmbeddedSet],
    query_labels,
    gallery_labels,
    paragon: str | None = None,
    k: int = 100,
    bootstrap: BootstrapOptions | None = None,
):
    """Evaluate old-old, and for each new model new-new and new-old (one training seed: see
    :func:`cross_evaluate_seeds`, which this calls with one seed).

    Returns ``(evaluations, verdicts)``: evaluations are flat rows ``{model, query, gallery,
    metric, value, low, high, dropped}`` (``low``/``high``: the bootstrap interval over the
    query classes, docs/methods.md "Uncertainty", NaN when refused; ``dropped``: resamples
    with an undefined value); verdicts give, per new model, the BCT empirical
    criterion ``M(n,o) > M(o,o)`` on ``PRIMARY_METRIC``: the paired interval of ``M(n,o) -
    M(o,o)`` (same queries, same draws) as ``difference`` and its three-outcome ``verdict``
    (``compatible``: the verdict is "held"), plus update gain (BCT Eq.9) and DMU's
    Delta_up/Delta_down, using the ``paragon`` model as new*; ``intervals`` holds the paired
    interval of every one of those numbers.
    """
    return cross_evaluate_seeds(
        [(old, list(new_sets))], query_labels, gallery_labels, paragon, k, bootstrap
    )


def cross_evaluate_seeds(
    runs: list[tuple[EmbeddedSet, list[EmbeddedSet]]],
    query_labels,
    gallery_labels,
    paragon: str | None = None,
    k: int = 100,
    bootstrap: BootstrapOptions | None = None,
):
    """:func:`cross_evaluate` over several training seeds: ``runs`` holds, per seed, the old
    model's embeddings and the new models' (the same names in every seed). Every value is the
    mean over the seeds; every interval resamples the seeds as well as the query classes
    (hierarchical bootstrap, docs/methods.md "Uncertainty"), so a verdict counts the training
    variation; rows and verdicts list the per-seed values (``per_seed``) when there are
    several."""
    from raycompat.metrics.bootstrap import Bootstrap

    boot = Bootstrap(bootstrap or BootstrapOptions(), seeds=len(runs))
    boot.add_query_set("queries", query_labels)
    per_seed = [_seed_pairs(old, news, query_labels, gallery_labels, k) for old, news in runs]
    metrics = {pair: _mean_metrics([m[pair] for m, _ in per_seed]) for pair in per_seed[0][0]}
    per_query = {pair: _stacked([q[pair] for _, q in per_seed]) for pair in per_seed[0][1]}
    old, new_sets = runs[0]
    rows: list[dict] = []
    for pair in metrics:
        model = pair[0]
        rows.extend(_evaluation_rows(boot, model, pair, metrics[pair], per_query[pair]))
    names = {new.name for new in new_sets}
    verdicts = [
        _compatibility_verdict(
            boot,
            dict(oo=old.name, no=new.name, nstar=paragon if paragon in names else new.name),
            paragon,
            metrics,
            per_query,
        )
        for new in new_sets
    ]
    return rows, verdicts


def _seed_pairs(old: EmbeddedSet, new_sets, query_labels, gallery_labels, k: int):
    """One seed's ``({(query, gallery): metrics}, {(query, gallery): samples})``: old-old,
    then new-new and new-old for every new model."""
    metrics: dict[tuple, dict] = {}
    samples: dict[tuple, dict] = {}

    def add(q_name, g_name, q, g, dims=None):
        pair = (q_name, g_name)
        metrics[pair], samples[pair] = pair_samples(
            q, g, query_labels, gallery_labels, dims=dims, k=k
        )

    add(old.name, old.name, old.query, old.gallery)
    for new in new_sets:
        if new.compatible_dim > new.query.shape[1]:
            raise ValueError(
                f"{new.name}: compatible_dim {new.compatible_dim} exceeds its "
                f"embedding size {new.query.shape[1]}"
            )
        add(new.name, new.name, new.query, new.gallery)
        dims = min(new.compatible_dim, old.gallery.shape[1])
        add(new.name, old.name, new.query, old.gallery, dims=dims)
    return metrics, samples


def _mean_metrics(per_seed: list[dict]) -> dict:
    """Every metric's mean over the seeds (one seed: its values, unchanged)."""
    if len(per_seed) == 1:
        return per_seed[0]
    return {m: float(np.mean([d[m] for d in per_seed])) for m in per_seed[0]}


def _stacked(per_seed: list[dict]) -> dict:
    """Every metric's per-query sample with the seeds stacked (:meth:`Sample.stacked`)."""
    out = {}
    for metric, sample in per_seed[0].items():
        for other in per_seed[1:]:
            sample = sample.stacked(other[metric])
        out[metric] = sample
    return out


def _evaluation_rows(boot, model: str, pair: tuple, metrics: dict, samples: dict) -> list[dict]:
    """One row per metric of a (query, gallery) pair, with its bootstrap interval (and the
    per-seed values when there are several seeds)."""
    rows = []
    for metric, value in metrics.items():
        if metric.startswith("num_"):
            continue
        iv = boot.interval(value=samples[metric]) if metric in samples else None
        row = dict(
            model=model,
            query=pair[0],
            gallery=pair[1],
            metric=metric,
            value=float(value),
            low=None if iv is None else iv.low,
            high=None if iv is None else iv.high,
            dropped=None if iv is None else iv.dropped,
        )
        if iv is not None and iv.seeds > 1:
            row["per_seed"] = list(iv.per_seed)
        rows.append(row)
    return rows


#: every number of a compatibility verdict, as a function of the paired samples
VERDICT_STATISTICS = dict(
    m_old_old=lambda oo, no, nn, ns: oo,
    m_new_old=lambda oo, no, nn, ns: no,
    m_new_new=lambda oo, no, nn, ns: nn,
    m_paragon=lambda oo, no, nn, ns: ns,
    update_gain=lambda oo, no, nn, ns: update_gain(no, oo, ns),
    delta_up=lambda oo, no, nn, ns: delta_up(no, oo),
    delta_down=lambda oo, no, nn, ns: delta_down(nn, ns),
)


def _compatibility_verdict(boot, names: dict, paragon, metrics: dict, per_query: dict) -> dict:
    """The BCT criterion of one new model (``names``: the old, new and new* model names) on
    ``PRIMARY_METRIC``, with the paired interval of every number (see :func:`cross_evaluate`)."""
    from raycompat.metrics.verdicts import HELD, verdict

    old, new, nstar = names["oo"], names["no"], names["nstar"]
    pairs = dict(oo=(old, old), no=(new, old), nn=(new, new), ns=(nstar, nstar))
    value = {key: metrics[pair][PRIMARY_METRIC] for key, pair in pairs.items()}
    paired = {key: per_query[pair][PRIMARY_METRIC] for key, pair in pairs.items()}
    diff = boot.interval(lambda a, b: a - b, a=paired["no"], b=paired["oo"])
    held = verdict(diff)
    intervals = {name: boot.interval(stat, **paired) for name, stat in VERDICT_STATISTICS.items()}
    # Each number is its interval's estimate: the mean over the training seeds of the seed's
    # value. For a ratio (the update gain) that is not the ratio of the means.
    report = {name: iv.estimate for name, iv in intervals.items()}
    return dict(
        model=new,
        metric=PRIMARY_METRIC,
        criterion="M(new, old) > M(old, old)",
        compatible=held == HELD,
        verdict=held,
        difference=diff.to_dict(),
        intervals={name: iv.to_dict() for name, iv in intervals.items()},
        m_old_old=value["oo"],
        m_new_old=value["no"],
        m_new_new=value["nn"],
        m_paragon=value["ns"],
        paragon=paragon,
        update_gain=report["update_gain"],
        delta_up=report["delta_up"],
        delta_down=report["delta_down"],
    )


@torch.no_grad()
def transform(module: torch.nn.Module, x: np.ndarray, batch_size: int = 4096) -> np.ndarray:
    """Apply a bundle module (psi, rho, psi_rev) to stored embeddings, eval mode, float32."""
    module = module.eval()
    out = [
        module(torch.from_numpy(np.ascontiguousarray(x[s : s + batch_size]))).float().numpy()
        for s in range(0, len(x), batch_size)
    ]
    return np.concatenate(out) if out else np.zeros((0, getattr(module, "out_dim", 0)), np.float32)


def chain_adapt(gallery: np.ndarray, psis: list) -> np.ndarray:
    """Forward adaptation across generations (docs/methods.md, "Sequential upgrades", "DMU
    chains psi"): the gallery of generation i brought to generation j by
    ``psi_j(...psi_{i+1}(phi_i(g)))``; ``psis`` in order ``[psi_{i+1}, ..., psi_j]``."""
    for psi in psis:
        gallery = transform(psi, gallery)
    return gallery


def sequential_cross_evaluate(
    generations: list[EmbeddedSet],
    query_labels,
    gallery_labels,
    psis: list | None = None,
    k: int = 100,
    samples: dict | None = None,
    query_set: str = "queries",
) -> list[dict]:
    """Every pair of a sequential upgrade ``phi_1 -> phi_2 -> ...`` (docs/methods.md,
    "Sequential upgrades"): queries of generation j against the gallery of generation i, for
    every i <= j (phi_3 vs phi_1 too).

    Across generations only the shared compatible subspace is used (the first
    ``min(D_i, compatible_dim_j, ...)`` dims). With ``psis`` (``psis[j]`` maps generation
    j-1's space to j's, ``None`` for the first generation), every older gallery is also
    evaluated after chained forward adaptation (``gallery_state="adapted"``).

    Rows: ``{query_generation, gallery_generation, gallery_state, metric, value}`` with
    1-based generations; ``gallery_state`` is ``stored`` or ``adapted``. With ``samples`` (a
    dict), ``samples[(j, i, state)]`` receives each pair's per-query samples
    (:func:`pair_samples`, query set ``query_set``).
    """
    rows: list[dict] = []

    def add(j, i, state, q, g, dims=None):
        metrics, per_query = pair_samples(
            q, g, query_labels, gallery_labels, dims=dims, k=k, query_set=query_set
        )
        if samples is not None:
            samples[(j + 1, i + 1, state)] = per_query
        for metric, value in metrics.items():
            if not metric.startswith("num_"):
                rows.append(
                    dict(
                        query_generation=j + 1,
                        gallery_generation=i + 1,
                        gallery_state=state,
                        metric=metric,
                        value=float(value),
                    )
                )

    for j, query in enumerate(generations):
        for i in range(j + 1):
            gallery = generations[i]
            if i == j:
                add(j, i, "stored", query.query, gallery.gallery)
                continue
            dims = min(
                [gallery.gallery.shape[1]] + [g.compatible_dim for g in generations[i + 1 : j + 1]]
            )
            add(j, i, "stored", query.query, gallery.gallery, dims=dims)
            chain = None if psis is None else psis[i + 1 : j + 1]
            if chain and all(p is not None for p in chain):
                add(j, i, "adapted", query.query, chain_adapt(gallery.gallery, chain))
    return rows
