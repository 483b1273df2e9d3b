"""Run the reproduction: train every planned model (resumable), embed, evaluate every
(new, old) pair, and simulate the backfill of a hot refresh. Produces plain JSON-able results
that ``claims`` and ``report`` read; nothing here decides a claim.

Results layout::

    {"test_sets": [test set, ...],          # one per (scenario, new generation -> old)
     "sequential": {...} | None,            # every cross pair of every chain
     "backfill": {scenario: {method: [curve, ...]}},
     "models": {key: {label, scenario, method, path, wall_s, reused, epochs, ...}}}

A test set: ``{name, scenario, pair, unseen_classes, metric, m_oo, m_nstar, methods}``
with ``methods[label] = {method, cross_mode, m_oo, m_nn, m_no, m_nadapted, m_cross,
update_gain, delta_up, delta_down, P_up, P_comp, P_1, compatible}``; every ``m_*`` is a
``{metric: value}`` dict and the scores use ``metric`` (mAP@100).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass

import numpy as np

from raycompat.evaluation import (
    PRIMARY_METRIC,
    EmbeddedSet,
    embed_batches,
    embed_scenario,
    pair_samples,
    scenario_eval_items,
    sequential_cross_evaluate,
    transform,
)
from raycompat.metrics.bootstrap import Sample
from raycompat.reproduce.evidence import Evidence
from raycompat.reproduce.intervals import attach_intervals, merge_seeds
from raycompat.reproduce.plan import VARIANTS, ReproduceOptions, Variant
from raycompat.reproduce.scaling import (
    QUERY_SET,
    SCENARIO,
    scaling_results,
    scaling_scenario,
    test_set_name,
)

CURVE_METRICS = ("mAP@100", "top1", "NFR@1")
#: cross tests through a gallery transform of the stored old vectors (``m_nadapted``): DMU's psi,
#: FCT's h
ADAPTED_CROSS = ("adapted", "fct")
#: the key of the ``--class-scaling`` run in a seed's plan, and its training priority (after
#: every model of the scenarios; the largest count first)
CLASS_SCALING = "class-scaling"
SCALING_PRIORITY = 100.0
#: Training order across scenarios (after the old models and the paragons): what the most
#: claims need first, so that a run cut short by ``--train-budget-minutes`` still covers them;
#: the architecture scenario's methods (a larger backbone, the slowest runs) come last.
METHOD_PRIORITY = (
    "bct",
    "dmu",
    "bct-arcface",
    "ract",
    "contrastive",
    "mcl",
    "ndpp",
    "p2s",
    "bct-kd",
    "bct-beta",
    "l2",
    "odpp",
    "rqt",
    "cl",
)


@dataclass
class Trained:
    """A planned training: ``key`` (label + config hash) and the bundle ``path`` are known before
    it runs (so dependants can be configured); ``wall_s``/``history`` once it has run."""

    key: str
    label: str
    path: str
    values: dict
    deps: tuple = ()
    priority: float = 0.0
    skipped: str | None = None  # why it was not trained (the training budget ran out)
    wall_s: float | None = None
    reused: bool = False
    history: list | None = None


class ModelStore:
    """Plans and runs trainings through ``raycompat.train.runs`` under ``<out>/runs``, exporting
    bundles to ``<out>/models/<label>-<tag>`` where ``tag`` hashes the full training config:
    an identical config (the architecture scenario's old model is the extended-data one) trains
    once, and a re-run of the job reuses finished models and resumes unfinished runs.

    ``run_all(parallel)`` trains everything planned, up to ``parallel`` Ray Train runs at a
    time (threads of the driver; Ray Train v2 supports ``fit`` off the main thread), each
    starting once the models it depends on are exported."""

    def __init__(self, out: str, log, runs_dir: str | None = None):
        self.runs_dir = runs_dir or os.path.join(out, "runs")
        self.models_dir = os.path.join(out, "models")
        os.makedirs(self.models_dir, exist_ok=True)
        self.log = log
        self.planned: dict[str, Trained] = {}

    def plan(self, label: str, values: dict, deps: tuple = (), priority: float = 0.0) -> Trained:
        from raycompat.train import TrainConfig
        from raycompat.train.runs import config_tag

        key = f"{label}-{config_tag(values)}"
        if key not in self.planned:
            # every option is checked here, on the driver, before any worker starts
            TrainConfig.from_dict(
                dict(values, storage_path=self.runs_dir, run_name=key), check_paths=not deps
            )
            priority = max([priority] + [d.priority + 0.5 for d in deps])
            self.planned[key] = Trained(
                key,
                label,
                os.path.join(self.models_dir, key),
                values,
                tuple(d.key for d in deps),
                priority,
            )
        return self.planned[key]

    @staticmethod
    def done(t: Trained) -> bool:
        return t.history is not None

    def _run_one(self, t: Trained, futures: dict, deadline: float | None) -> Trained:
        from raycompat.train.runs import train_named

        for dep in t.deps:
            futures[dep].result()  # a failed dependency fails this one too
        missing = [d for d in t.deps if self.planned[d].skipped]
        info_path = t.path + ".json"
        finished = os.path.isfile(os.path.join(t.path, "manifest.json")) and os.path.isfile(
            info_path
        )
        if missing and not finished:
            t.skipped = f"needs {missing[0]}, which was not trained"
            return t
        if not finished and deadline is not None and time.time() > deadline:
            t.skipped = "the training budget (--train-budget-minutes) ran out before it started"
            self.log(f"skipping {t.key}: {t.skipped}")
            return t
        if finished:
            with open(info_path) as f:
                info = json.load(f)
            t.wall_s, t.history, t.reused = info["wall_s"], info["history"], True
            self.log(f"reusing {t.key} (trained earlier in {t.wall_s:.0f} s)")
            return t
        v = t.values
        self.log(
            f"training {t.key}: {v['method']} {dict(v.get('method_options') or {})} on "
            f"{v['split']}, {v['backbone']}, {v['epochs']} epochs"
        )
        label, tag = t.key.rsplit("-", 1)
        run, wall = train_named(v, label, tag, self.runs_dir, self.models_dir, export_name=t.key)
        with open(info_path, "w") as f:
            json.dump({"wall_s": wall, "history": run.history}, f)
        t.wall_s, t.history = wall, run.history
        self.log(
            f"  trained {t.key}: {wall:.0f} s, final loss "
            f"{run.history[-1].get('loss/loss', float('nan')):.3f}"
        )
        return t

    def run_all(self, parallel: int = 1, budget_s: float | None = None) -> None:
        """Train every planned model, most important first (``priority``: paragons and old
        models, then the methods in ``METHOD_PRIORITY`` order across all scenarios, later
        generations after earlier ones). With ``budget_s``, runs not started within the budget
        are skipped (``Trained.skipped`` says why) and the report lists them."""
        from concurrent.futures import ThreadPoolExecutor

        order = {key: i for i, key in enumerate(self.planned)}
        pending = sorted(
            (t for t in self.planned.values() if t.history is None),
            key=lambda t: (t.priority, order[t.key]),
        )
        deadline = None if budget_s is None else time.time() + budget_s
        # Sorted by priority, and a model's priority is above its dependencies', so the order is
        # topological; the pool is FIFO, so a run waiting on a dependency never keeps it from
        # starting.
        futures: dict = {}
        with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
            for t in pending:
                futures[t.key] = pool.submit(self._run_one, t, futures, deadline)
            for t in pending:
                futures[t.key].result()


class Reproduction:
    def __init__(self, opts: ReproduceOptions, out: str, runs_dir: str | None = None, log=print):
        """``out``: the local report folder (models under ``out/models``); ``runs_dir``: the
        Ray Train storage of the checkpoints (default ``out/runs``)."""
        self.opts = opts
        self.out = os.path.abspath(out)
        self.log = log
        self.store = ModelStore(self.out, log, runs_dir)
        self.models: dict[str, dict] = {}
        self._embedded: dict[tuple, EmbeddedSet] = {}
        self._images: dict[str, tuple] = {}
        self.timings: dict[str, float] = {}
        self.seed = opts.seed  # the training seed being planned or evaluated
        self.seed_index = 0
        self.evidence = Evidence(opts.bootstrap, opts.seeds)

    # -- data and training ---------------------------------------------------------------
    def scenario(self, name: str):
        from raycompat.data.user_scenarios import resolve_scenario

        return resolve_scenario(self.opts.sizes, self.opts.data, name=name)

    def values(
        self,
        scenario,
        *,
        backbone: str,
        method: str,
        split: str,
        epochs: int,
        method_options: dict | None = None,
        old_model: str | None = None,
        init_model: str | None = None,
        head: str | None = None,
        embed_dim: int | None = None,
    ) -> dict:
        s, t = self.opts.sizes, self.opts.training
        return dict(
            method=method,
            method_options=method_options or {},
            backbone=backbone,
            embed_dim=embed_dim or t.embed_dim,
            head=head or "cosface",
            epochs=epochs,
            batch_size=t.batch_size,
            lr=t.lr,
            seed=self.seed,
            split=split,
            **s.training_data(scenario),
            num_workers=t.workers,
            use_gpu=t.gpus > 0,
            gpus_per_worker=t.gpus if t.gpus > 0 else 1.0,
            old_model=old_model,
            init_model=init_model,
            threads_per_worker=self.opts.threads_per_worker(),
            log_every=1000,
        )

    def train(
        self, scenario_name: str, label: str, values: dict, deps: tuple = (), priority: float = 0.0
    ) -> Trained:
        t = self.store.plan(label, values, deps, priority)
        suffix = f"@seed{self.seed}" if self.opts.seeds > 1 else ""
        self.models[f"{scenario_name}/{label}{suffix}"] = t
        return t

    def new_model(
        self,
        scenario,
        scenario_name: str,
        variant: Variant,
        split: str,
        backbone: str,
        old: Trained,
        paragon: Trained | None,
        label: str | None = None,
    ) -> Trained:
        s, setup = self.opts.training, self.opts.setup
        needs_old = variant.method != "independent"
        uses_paragon = variant.init_from_paragon or variant.paragon_option is not None
        init = paragon.path if variant.init_from_paragon else None
        if needs_old and variant.plan_value("init_from_predecessor", setup):
            init = old.path  # a chain whose every generation starts from its predecessor
        deps = ((old,) if needs_old else ()) + ((paragon,) if uses_paragon else ())
        options = variant.method_options(s, setup)
        if variant.paragon_option is not None:
            options[variant.paragon_option] = paragon.path
        embed_dim = None
        if variant.head == "dsimplex":  # K = every training class of the scenario, D = K - 1
            options.setdefault("classes", len(scenario.train_classes))
            embed_dim = options["classes"] - 1
        rank = (
            METHOD_PRIORITY.index(variant.label)
            if variant.label in METHOD_PRIORITY
            else len(METHOD_PRIORITY)
        )
        return self.train(
            scenario_name,
            label or variant.label,
            self.values(
                scenario,
                backbone=backbone,
                method=variant.method,
                method_options=options,
                split=split,
                epochs=s.new_epochs,
                old_model=old.path if needs_old else None,
                init_model=init,
                head=variant.head,
                embed_dim=embed_dim,
            )
            | variant.training_values(setup),
            deps,
            priority=0.0
            if variant.label == "independent"
            else 1.0 + rank + (len(METHOD_PRIORITY) if scenario_name == "architecture" else 0),
        )

    def embed(self, trained: Trained, scenario) -> EmbeddedSet:
        from raycompat.models import ModelBundle

        key = (trained.key, scenario.name)
        if key in self._embedded:
            return self._embedded[key]
        started = time.time()
        bundle = ModelBundle.load(trained.path)
        if scenario.user_data:
            embedded = embed_scenario(
                trained.label,
                bundle,
                scenario,
                self.opts.sizes.resolution,
                self.opts.sizes.data_seed,
            )
        else:  # glyphs: rendered once per scenario, embedded by every model
            query, gallery = self._rendered(scenario)
            embedded = EmbeddedSet(
                trained.label,
                embed_batches(bundle, len(query), lambda a, b: query[a:b]),
                embed_batches(bundle, len(gallery), lambda a, b: gallery[a:b]),
                int(bundle.manifest.get("compatible_dim", bundle.embed_dim)),
            )
        self._embedded[key] = embedded
        self.log(
            f"  embedded {len(embedded.query)} queries and {len(embedded.gallery)} gallery items "
            f"with {trained.key} in {time.time() - started:.0f} s"
        )
        return embedded

    def _rendered(self, scenario) -> tuple[np.ndarray, np.ndarray]:
        """The uint8 query and gallery images of a glyph scenario (rendered once)."""
        from raycompat.data import GlyphRenderer, catalog_for

        if scenario.name not in self._images:
            renderer = GlyphRenderer(
                catalog_for(scenario),
                resolution=self.opts.sizes.resolution,
                seed=self.opts.sizes.data_seed,
            )
            (ql, qi), (gl, gi) = scenario_eval_items(scenario)
            self._images[scenario.name] = tuple(
                np.concatenate(
                    [
                        renderer.render_batch(lab[a : a + 2048], ins[a : a + 2048])
                        for a in range(0, len(lab), 2048)
                    ]
                )
                for lab, ins in ((ql, qi), (gl, gi))
            )
        return self._images[scenario.name]

    def not_trained(self) -> list[dict]:
        """The planned models without a finished training, each with why (``skipped``)."""
        return [
            dict(model=name, key=t.key, reason=t.skipped)
            for name, t in self.models.items()
            if not ModelStore.done(t)
        ]

    def model_rows(self) -> dict:
        rows = {}
        for name, t in self.models.items():
            if not ModelStore.done(t):
                continue
            v, h = t.values, (t.history or [{}])[-1]
            rows[name] = dict(
                scenario=name.split("/")[0],
                label=t.label,
                seed=v["seed"],
                key=t.key,
                method=v["method"],
                method_options=v["method_options"],
                backbone=v["backbone"],
                split=v["split"],
                epochs=v["epochs"],
                head=v["head"],
                path=t.path,
                wall_s=t.wall_s,
                reused=t.reused,
                final_loss=h.get("loss/loss"),
                images_per_s=h.get("images_per_s"),
            )
        return rows

    # -- one (new -> old) scenario ---------------------------------------------------------
    def plan_pair_scenario(self, name: str) -> dict:
        """extended-data / open-class / architecture: old, new*, every planned method."""
        s, t = self.opts.sizes, self.opts.training
        scenario = self.scenario("extended-data" if name == "architecture" else name)
        new_backbone = t.arch_backbone if name == "architecture" else s.backbone
        old = self.train(
            name,
            "old",
            self.values(
                scenario,
                backbone=s.backbone,
                method="independent",
                split="old_train",
                epochs=t.old_epochs,
            ),
        )
        paragon = self.new_model(
            scenario, name, VARIANTS["independent"], "new_train", new_backbone, old, None
        )
        trained = {"independent": paragon}
        for v in self.opts.method_plan(name):
            if v.label != "independent":
                trained[v.label] = self.new_model(
                    scenario, name, v, "new_train", new_backbone, old, paragon
                )
        return dict(scenario=scenario, old=old, trained=trained)

    def evaluate_pair_scenario(self, name: str, planned: dict) -> tuple[dict, dict]:
        from raycompat.models import ModelBundle

        scenario, old = planned["scenario"], planned["old"]
        trained = {label: tr for label, tr in planned["trained"].items() if ModelStore.done(tr)}
        if not ModelStore.done(old) or "independent" not in trained:
            return None, None
        t = time.time()
        (q_labels, _), (g_labels, _) = scenario_eval_items(scenario)
        old_emb = self.embed(old, scenario)
        news = {
            label: (VARIANTS[label], ModelBundle.load(tr.path), self.embed(tr, scenario))
            for label, tr in trained.items()
        }
        unseen = bool(
            set(scenario["new_train"].classes.tolist())
            - set(scenario["old_train"].classes.tolist())
        )
        # the architecture change is measured on the extended-data queries: one query set
        query_set = "extended-data" if name == "architecture" else name
        self.evidence.add_query_set(query_set, q_labels)
        test_set = measure_test_set(
            name=name,
            scenario=name,
            pair="new -> old",
            unseen_classes=unseen,
            old=old_emb,
            paragon=news["independent"][2],
            news=news,
            query_labels=q_labels,
            gallery_labels=g_labels,
            evidence=self.evidence,
            seed_index=self.seed_index,
            query_set=query_set,
        )
        self.timings[f"{name}_evaluate_s"] = time.time() - t
        self.log(f"  {name}: backfill curves of {len(news)} models")
        t = time.time()
        backfill = backfill_curves(
            old_emb,
            news,
            q_labels,
            g_labels,
            test_set["m_nstar"],
            self.opts.backfill_policies,
            self.seed,
            evidence=self.evidence,
            scenario=name,
            query_set=query_set,
            seed_index=self.seed_index,
        )
        self.timings[f"{name}_backfill_s"] = time.time() - t
        return test_set, backfill

    # -- sequential ------------------------------------------------------------------------
    def plan_sequential(self) -> dict:
        """phi_1 -> phi_2 -> phi_3 per method, each generation trained against the previous one
        of its own chain; the ``independent`` chain is the paragon of every generation. A chain
        whose head is a fixed simplex (``dsimplex``) starts from a phi_1 of its own, trained
        with that head."""
        s, t = self.opts.sizes, self.opts.training
        scenario = self.scenario("sequential")
        splits = scenario.train_generations()
        first = self.train(
            "sequential",
            "gen1",
            self.values(
                scenario,
                backbone=s.backbone,
                method="independent",
                split=splits[0],
                epochs=t.old_epochs,
            ),
        )
        chains: dict[str, list[Trained]] = {}
        for v in self.opts.method_plan("sequential"):
            chain = [first if v.head != "dsimplex" else self._simplex_first(scenario, v)]
            for g, split in enumerate(splits[1:], start=2):
                chain.append(
                    self.new_model(
                        scenario,
                        "sequential",
                        v,
                        split,
                        s.backbone,
                        chain[-1],
                        None,
                        label=f"{v.label}-gen{g}",
                    )
                )
            chains[v.label] = chain
        return dict(scenario=scenario, splits=splits, chains=chains)

    def _simplex_first(self, scenario, variant: Variant) -> Trained:
        """phi_1 of a ``dsimplex`` chain: independent, with the chain's simplex head (K = every
        training class of the scenario)."""
        s, t = self.opts.sizes, self.opts.training
        k = int(dict(variant.options).get("classes", len(scenario.train_classes)))
        return self.train(
            "sequential",
            f"{variant.label}-gen1",
            self.values(
                scenario,
                backbone=s.backbone,
                method="independent",
                split=scenario.train_generations()[0],
                epochs=t.old_epochs,
                head="dsimplex",
                embed_dim=k - 1,
            ),
        )

    def evaluate_sequential(self, planned: dict) -> tuple[list[dict], dict]:
        from raycompat.models import ModelBundle

        scenario, splits, chains = planned["scenario"], planned["splits"], planned["chains"]
        (q_labels, _), (g_labels, _) = scenario_eval_items(scenario)
        pairs, test_sets = {}, []
        chains = {
            label: chain
            for label, chain in chains.items()
            if all(ModelStore.done(t) for t in chain)
            and not any(diverged(self.embed(t, scenario)) for t in chain)
        }
        if "independent" not in chains:
            return [], None
        self.evidence.add_query_set("sequential", q_labels)
        per_query: dict[str, dict] = {}
        for label, chain in chains.items():
            gens = [self.embed(t, scenario) for t in chain]
            bundles = [ModelBundle.load(t.path) for t in chain]
            psis = [None] + [b.modules.get("psi") for b in bundles[1:]]
            per_query[label] = {}
            pairs[label] = sequential_cross_evaluate(
                gens,
                q_labels,
                g_labels,
                psis=psis if any(p is not None for p in psis) else None,
                samples=per_query[label],
                query_set="sequential",
            )
        paragon_rows = {
            (r["query_generation"], r["metric"]): r["value"]
            for r in pairs["independent"]
            if r["query_generation"] == r["gallery_generation"]
        }
        for j in range(2, len(splits) + 1):
            for i in range(1, j):
                ts = dict(
                    name=f"sequential {j}->{i}",
                    scenario="sequential",
                    pair=f"phi_{j} -> phi_{i}",
                    unseen_classes=True,
                    metric=PRIMARY_METRIC,
                    methods={},
                    m_nstar={m: v for (g, m), v in paragon_rows.items() if g == j},
                )
                for label, rows in pairs.items():
                    get = _pair_getter(rows)
                    ts["methods"][label] = compat_entry(
                        VARIANTS[label],
                        m_oo=get(i, i),
                        m_nn=get(j, j),
                        m_no=get(j, i),
                        m_nadapted=get(j, i, "adapted"),
                        m_nstar=ts["m_nstar"],
                    )
                # the shared phi_1 (the independent chain's) when the gallery is phi_1; a chain
                # with a phi_1 of its own (dsimplex) keeps its M(o,o) in its entry
                ts["m_oo"] = ts["methods"]["independent"]["m_oo"] if i == 1 else None
                self._put_sequential(ts["name"], per_query, i, j)
                test_sets.append(ts)
        return test_sets, {
            "pairs": pairs,
            "generations": splits,
            "chains": {label: [t.key for t in chain] for label, chain in chains.items()},
        }

    def _put_sequential(self, name: str, per_query: dict, i: int, j: int) -> None:
        """The samples of sequential test set ``name`` (phi_j -> phi_i) under the evidence keys
        of a pair test set."""
        put = self.evidence.put
        if i == 1:
            oo = per_query["independent"][(1, 1, "stored")]
            put(("pair", name, "m_oo"), oo, self.seed_index)
        if "independent" in per_query:
            nstar = per_query["independent"][(j, j, "stored")]
            put(("pair", name, "m_nstar"), nstar, self.seed_index)
        for label, got in per_query.items():
            parts = dict(
                m_oo=got.get((i, i, "stored")),
                m_nn=got.get((j, j, "stored")),
                m_no=got.get((j, i, "stored")),
                m_nadapted=got.get((j, i, "adapted")),
            )
            adapted = VARIANTS[label].cross in ADAPTED_CROSS and parts["m_nadapted"]
            parts["m_cross"] = parts["m_nadapted"] if adapted else parts["m_no"]
            for kind, samples in parts.items():
                if samples is not None:
                    put(("pair", name, label, kind), samples, self.seed_index)

    # -- the class-scaling run -----------------------------------------------------------------
    def plan_class_scaling(self) -> list[dict]:
        """extended-data at every ``--class-scaling`` count (:mod:`.scaling`): an old model,
        new* and bct, planned like the extended-data scenario's (the scale's own count reuses
        them), trained after every model of the scenarios, the largest count first."""
        counts = self.opts.class_scaling
        largest_first = sorted(counts, reverse=True)
        return [
            self._plan_scaling_point(classes, SCALING_PRIORITY + largest_first.index(classes))
            for classes in counts
        ]

    def _plan_scaling_point(self, classes: int, priority: float) -> dict:
        s, t = self.opts.sizes, self.opts.training
        scenario = scaling_scenario(s, classes)
        name = test_set_name(classes)
        common = dict(backbone=s.backbone, split="new_train", epochs=t.new_epochs)
        old = self.train(
            name,
            "old",
            self.values(
                scenario,
                backbone=s.backbone,
                method="independent",
                split="old_train",
                epochs=t.old_epochs,
            ),
            priority=priority,
        )
        trained = {}
        for label in ("independent", "bct"):
            v, needs_old = VARIANTS[label], label != "independent"
            values = self.values(
                scenario,
                method=v.method,
                method_options=v.method_options(t, self.opts.setup),
                old_model=old.path if needs_old else None,
                **common,
            )
            deps = (old,) if needs_old else ()
            trained[label] = self.train(name, label, values, deps, priority=priority)
        return dict(classes=classes, scenario=scenario, old=old, trained=trained)

    def evaluate_class_scaling(self, points: list[dict]) -> None:
        """Every count's old, new* and bct on the extended-data queries and gallery: per-query
        samples to the evidence (test set :func:`.scaling.test_set_name`); no backfill curves."""
        from raycompat.models import ModelBundle

        for point in points:
            scenario, old, trained = point["scenario"], point["old"], point["trained"]
            if not all(ModelStore.done(m) for m in (old, *trained.values())):
                continue
            (q_labels, _), (g_labels, _) = scenario_eval_items(scenario)
            self.evidence.add_query_set(QUERY_SET, q_labels)
            news = {
                label: (VARIANTS[label], ModelBundle.load(m.path), self.embed(m, scenario))
                for label, m in trained.items()
            }
            measure_test_set(
                name=test_set_name(point["classes"]),
                scenario=SCENARIO,
                pair="new -> old",
                unseen_classes=False,
                old=self.embed(old, scenario),
                paragon=news["independent"][2],
                news=news,
                query_labels=q_labels,
                gallery_labels=g_labels,
                evidence=self.evidence,
                seed_index=self.seed_index,
                query_set=QUERY_SET,
            )

    def scaling_points(self, planned: list[dict]) -> list[dict]:
        """Per count its training sizes and, when a model of any seed was not trained, why."""
        points = []
        for i, point in enumerate(planned[0][CLASS_SCALING]):
            models = [
                m
                for seed in planned
                for p in (seed[CLASS_SCALING][i],)
                for m in (p["old"], *p["trained"].values())
            ]
            missing = [m for m in models if not ModelStore.done(m)]
            points.append(
                dict(
                    classes=point["classes"],
                    old_train_images=len(point["scenario"]["old_train"]),
                    new_train_images=len(point["scenario"]["new_train"]),
                    missing=f"{missing[0].key}: {missing[0].skipped or 'not trained'}"
                    if missing
                    else None,
                )
            )
        return points

    # -- everything ------------------------------------------------------------------------
    def seeds(self) -> list[int]:
        return [self.opts.seed + i for i in range(self.opts.seeds)]

    def plan_all(self) -> list[dict]:
        """Per training seed, ``{scenario: plan}``: every model planned in the store (a model
        of seed s is the same config with ``seed = s``)."""
        planned = []
        for i, seed in enumerate(self.seeds()):
            self.seed, self.seed_index = seed, i
            plans = {
                name: self.plan_sequential()
                if name == "sequential"
                else self.plan_pair_scenario(name)
                for name in self.opts.scenarios
            }
            if self.opts.class_scaling:
                plans[CLASS_SCALING] = self.plan_class_scaling()
            planned.append(plans)
        return planned

    def run(self) -> dict:
        started = time.time()
        planned = self.plan_all()
        n = sum(1 for t in self.store.planned.values())
        self.log(f"{n} models to train or reuse, {self.opts.parallel} at a time")
        budget = self.opts.train_budget_minutes
        self.store.run_all(self.opts.parallel, None if budget is None else 60.0 * budget)
        self.timings["training_s"] = time.time() - started
        if self.opts.train_only:
            self.log(f"training done in {self.timings['training_s']:.0f} s; not evaluating")
            return dict(
                models=self.model_rows(),
                not_trained=self.not_trained(),
                seeds=self.seeds(),
                timings=self.timings,
            )
        self.log(f"training done in {self.timings['training_s']:.0f} s; evaluating")
        per_seed = []
        for i, seed in enumerate(self.seeds()):
            self.seed, self.seed_index = seed, i
            per_seed.append(self.evaluate_seed(planned[i]))
        test_sets, backfill, sequential = merge_seeds(per_seed)
        attach_intervals(test_sets, backfill, self.evidence)
        self.timings["total_s"] = time.time() - started
        scaling = None
        if self.opts.class_scaling:
            scaling = scaling_results(self.scaling_points(planned), self.evidence)
        return dict(
            scenarios=list(self.opts.scenarios),
            skipped={s: self.opts.skipped(s) for s in self.opts.scenarios},
            test_sets=test_sets,
            sequential=sequential,
            backfill=backfill,
            class_scaling=scaling,
            models=self.model_rows(),
            not_trained=self.not_trained(),
            seeds=self.seeds(),
            bootstrap=dataclasses.asdict(self.opts.bootstrap),
            timings=self.timings,
        )

    def evaluate_seed(self, planned: dict) -> tuple[list, dict, dict | None]:
        """Test sets, backfill curves and sequential pairs of the seed being evaluated."""
        test_sets, backfill, sequential = [], {}, None
        tag = f" (seed {self.seed})" if self.opts.seeds > 1 else ""
        for name, plan in planned.items():
            t = time.time()
            if name == CLASS_SCALING:
                self.evaluate_class_scaling(plan)
            elif name == "sequential":
                seq_sets, sequential = self.evaluate_sequential(plan)
                test_sets += seq_sets
            else:
                ts, bf = self.evaluate_pair_scenario(name, plan)
                if ts is not None:
                    test_sets.append(ts)
                    backfill[name] = bf
            self.log(f"scenario {name} evaluated{tag} in {time.time() - t:.0f} s")
        return test_sets, backfill, sequential


def _pair_getter(rows: list[dict]):
    def get(j, i, state="stored"):
        found = {
            r["metric"]: r["value"]
            for r in rows
            if (r["query_generation"], r["gallery_generation"], r["gallery_state"]) == (j, i, state)
        }
        return found or None

    return get


def compat_entry(
    variant: Variant,
    *,
    m_oo: dict,
    m_nn: dict,
    m_no: dict,
    m_nadapted: dict | None,
    m_nstar: dict,
    metric: str = PRIMARY_METRIC,
) -> dict:
    """Scores of one method on one test set: the cross test is new-to-old, new-to-adapted-old
    (DMU) or the rank-merge reverse query (RM), per ``variant.cross``."""
    from raycompat.metrics import compatibility_report

    cross = m_nadapted if variant.cross in ADAPTED_CROSS and m_nadapted else m_no
    rep = compatibility_report(m_oo[metric], cross[metric], m_nn[metric], m_nstar[metric])
    return dict(
        method=variant.method,
        cross_mode=variant.cross,
        m_oo=m_oo,
        m_nn=m_nn,
        m_no=m_no,
        m_nadapted=m_nadapted,
        m_cross=cross,
        compatible=bool(rep["compatible"]),
        update_gain=rep["update_gain"],
        delta_up=rep["delta_up"],
        delta_down=rep["delta_down"],
        P_up=rep["P_up"],
        P_comp=rep["P_comp"],
        P_1=rep["P_1"],
    )


def _metrics(d: dict) -> dict:
    return {k: float(v) for k, v in d.items() if not k.startswith("num_")}


def diverged(embedded: EmbeddedSet, bundle=None) -> bool:
    """A model whose training diverged (NaN loss) embeds to NaN, or has a module with a
    non-finite weight (FCT's ``h``, DMU's ``psi``): it cannot be searched."""
    if not (np.isfinite(embedded.query).all() and np.isfinite(embedded.gallery).all()):
        return True
    if bundle is None:
        return False
    tensors = (t for m in bundle.modules.values() for t in m.state_dict().values())
    return not all(bool(t.isfinite().all()) for t in tensors if t.is_floating_point())


def diverged_entry(variant: Variant) -> dict:
    """A method whose model embeds to NaN: no retrieval number, and not compatible."""
    return dict(
        method=variant.method,
        cross_mode=variant.cross,
        diverged=True,
        m_oo=None,
        m_nn=None,
        m_no=None,
        m_nadapted=None,
        m_cross=None,
        compatible=False,
        update_gain=None,
        delta_up=None,
        delta_down=None,
        P_up=None,
        P_comp=None,
        P_1=None,
    )


def gallery_transform(bundle, gallery: np.ndarray) -> np.ndarray | None:
    """The new bundle's transform of stored old vectors: DMU's ``psi`` or FCT's ``fct`` (``None``
    without one)."""
    module = bundle.modules.get("psi", bundle.modules.get("fct"))
    return None if module is None else transform(module, gallery)


def measure_test_set(
    *,
    name: str,
    scenario: str,
    pair: str,
    unseen_classes: bool,
    old: EmbeddedSet,
    paragon: EmbeddedSet,
    news: dict,
    query_labels,
    gallery_labels,
    evidence: Evidence | None = None,
    seed_index: int = 0,
    query_set: str | None = None,
) -> dict:
    """Evaluate every new model of a scenario against its old model (see the module docstring).

    ``news[label] = (variant, bundle, embedded)``. Rank-merge methods are measured through
    their exported modules: ``M(n,n) = M(rho(q), rho(g))``,
    ``M(n,o) = M(psi_rev(rho(q)), phi_o(g))``.
    DMU gets ``M(n, adapted) = M(phi_n(q), psi(phi_o(g)))`` besides ``M(n,o)``, FCT
    ``M(phi_n(q), h(phi_o(g)))`` (its ``fct`` module) in the same place.
    With ``evidence``, every pair's per-query samples go to it (query set ``query_set``, default
    ``scenario``; keys
    of :mod:`raycompat.reproduce.evidence`) as the ``seed_index``-th seed.
    """

    def pair_metrics(q, g, *key, dims=None):
        metrics, samples = pair_samples(
            q, g, query_labels, gallery_labels, dims=dims, query_set=query_set or scenario
        )
        if evidence is not None:
            evidence.put(("pair", name, *key), samples, seed_index)
        return _metrics(metrics)

    m_oo = pair_metrics(old.query, old.gallery, "m_oo")
    m_nstar = pair_metrics(paragon.query, paragon.gallery, "m_nstar")
    methods = {}
    for label, (variant, bundle, new) in news.items():
        if diverged(new, bundle):
            methods[label] = diverged_entry(variant)
            continue
        if variant.cross == "rank_merge":
            rho, psi_rev = bundle.modules["rho"], bundle.modules["psi_rev"]
            q_rho = transform(rho, new.query)
            m_nn = pair_metrics(q_rho, transform(rho, new.gallery), label, "m_nn")
            m_no = pair_metrics(transform(psi_rev, q_rho), old.gallery, label, "m_no")
        else:
            m_nn = pair_metrics(new.query, new.gallery, label, "m_nn")
            m_no = pair_metrics(
                new.query,
                old.gallery,
                label,
                "m_no",
                dims=min(new.compatible_dim, old.gallery.shape[1]),
            )
        m_nadapted = None
        if (adapted := gallery_transform(bundle, old.gallery)) is not None:
            m_nadapted = pair_metrics(new.query, adapted, label, "m_nadapted")
        if evidence is not None:  # the test set's old-old, and the cross test used
            cross = "m_nadapted" if variant.cross in ADAPTED_CROSS and m_nadapted else "m_no"
            for kind, source in (("m_oo", ("m_oo",)), ("m_cross", (label, cross))):
                samples = evidence.latest(("pair", name, *source), seed_index)
                evidence.put(("pair", name, label, kind), samples, seed_index)
        methods[label] = compat_entry(
            variant, m_oo=m_oo, m_nn=m_nn, m_no=m_no, m_nadapted=m_nadapted, m_nstar=m_nstar
        )
    return dict(
        name=name,
        scenario=scenario,
        query_set=query_set or scenario,
        pair=pair,
        unseen_classes=unseen_classes,
        metric=PRIMARY_METRIC,
        m_oo=m_oo,
        m_nstar=m_nstar,
        methods=methods,
    )


def backfill_curves(
    old: EmbeddedSet,
    news: dict,
    query_labels,
    gallery_labels,
    paragon_metrics: dict,
    uncertainty_policies: tuple,
    seed: int,
    evidence: Evidence | None = None,
    scenario: str = "",
    query_set: str = "queries",
    seed_index: int = 0,
) -> dict:
    """Backfill curves (a hot refresh, simulated) per method (``simulate_backfill``):
    the query mode each method is built for
    (``compatible``; DMU ``adapted`` and ``compatible``; RM ``rank_merge``, with ``naive_merge``
    and ``cold`` as the RM paper's baselines), random order for all, and the uncertainty orders
    (RACT Eq.9-11) for bct / contrastive / ract. Returns ``{label: [curve, ...]}`` with ``curve
    = {policy, mode, fractions, <metric>: [...], summary: {metric: {auc, auc_gain,
    auc_gain_note, regression}}}``. With ``evidence``, every curve's and reference's per-query
    samples go to it (keys ``("curve", scenario, label, policy, mode)`` and ``("ref", scenario,
    label, reference)``, query set ``query_set``)."""
    from raycompat.embeddings.gallery import GalleryEmbeddings
    from raycompat.models.uncertainty_head import UncertaintyHead
    from raycompat.simulator.memory_engine import simulate_backfill
    from raycompat.upgrade.modes import apply_bundle_modules

    out = {}
    for label, (variant, bundle, new) in news.items():
        if diverged(new, bundle):
            continue
        data = GalleryEmbeddings(
            gallery_labels=np.asarray(gallery_labels),
            gallery_old=old.gallery,
            gallery_new=new.gallery,
            query_labels=np.asarray(query_labels),
            query_old=old.query,
            query_new=new.query,
            compatible_dim=new.compatible_dim,
            source=f"reproduce: old -> {label}",
        )
        data = apply_bundle_modules(data, bundle)
        policies, head = ("random",), None
        if variant.cross == "rank_merge":
            modes = ("rank_merge", "naive_merge", "cold")
        elif variant.cross == "adapted":
            modes = ("adapted", "compatible")
        elif variant.cross == "fct":
            modes = ("fct", "compatible")
        elif label == "independent":
            modes = ("compatible", "cold")
        else:
            modes = ("compatible",)
            if label in ("bct", "contrastive", "ract"):
                policies = tuple(dict.fromkeys(("random",) + tuple(uncertainty_policies)))
                head = UncertaintyHead.from_classifier_head(bundle.head)
        result = simulate_backfill(
            data, policies, modes, seed=seed, head=head, references={"new*-new*": paragon_metrics}
        )
        if evidence is not None:
            _put_curves(evidence, result, (scenario, query_set), label, seed_index)
        curves = []
        for c in result.curves:
            entry = dict(policy=c.policy, mode=c.mode, fractions=[float(x) for x in c.fractions])
            entry.update({m: [float(x) for x in c.metrics[m]] for m in CURVE_METRICS})
            entry["summary"] = {
                m: {
                    k: c.summary[m].get(k)
                    for k in ("auc", "auc_gain", "auc_gain_note", "regression")
                }
                for m in CURVE_METRICS
            }
            curves.append(entry)
        out[label] = dict(curves=curves, references=result.references)
    return out


def _put_curves(evidence: Evidence, result, where: tuple, label: str, seed_index: int) -> None:
    """A simulation's per-query samples, re-tagged with the scenario's query set
    (``where = (scenario, query_set)``)."""
    scenario, query_set = where

    def tagged(samples: dict) -> dict:
        return {m: Sample(query_set, s.num, s.den) for m, s in samples.items()}

    for c in result.curves:
        key = ("curve", scenario, label, c.policy, c.mode)
        evidence.put(key, tagged(c.samples), seed_index)
    for ref, samples in result.reference_samples.items():
        evidence.put(("ref", scenario, label, ref), tagged(samples), seed_index)


def options_dict(opts: ReproduceOptions) -> dict:
    """The report's ``options``: every option; ``sizes`` holds the data and training sizes of
    the scale (``scale``) as one flat dict."""
    values = dataclasses.asdict(opts)
    values.update(values.pop("output"))
    values.update({f"data_{k}": v for k, v in values.pop("data").items()})
    data = values.pop("sizes")
    values["data_seed"] = data.pop("data_seed")
    data.pop("scenario")
    values["sizes"] = dict(data, **values.pop("training"))
    return values
