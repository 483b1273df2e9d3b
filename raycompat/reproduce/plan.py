"""What the reproduction report trains: scenarios x methods, and the scale presets.

Scenarios (docs/methods.md, "Upgrade scenarios"): ``extended-data`` (old: 30% of the images,
new: all), ``open-class`` (old: 30% of the classes, new: the other 70%), ``architecture``
(the extended-data allocation with a different new backbone; the old model is the
extended-data one) and ``sequential`` (phi_1 -> phi_2 -> phi_3 on 25% -> 50% -> 100% of the
classes, each generation trained against its predecessor).

Methods are *variants*: a registered training method plus options (``bct``, ``bct-kd`` and
``bct-beta`` are the three BCT variants). ``independent`` is always trained: it is new*,
the paragon of its scenario (and of each sequential generation). The field's methods
(docs/methods.md, Field methods) are variants too: ``bt2`` reuses the paragon as its independent
new model, ``fct`` trains its transformation on the frozen paragon, and ``dsimplex`` runs in the
sequential scenario only, in a chain of its own whose first generation has the same simplex head.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from raycompat.config import ConfigError, choices, nonnegative, option, parse_options, positive
from raycompat.data.scenarios import ScenarioSizes
from raycompat.data.source import DataSourceOptions
from raycompat.metrics.bootstrap import BootstrapOptions
from raycompat.outputs import OutputOptions

SCENARIOS = ("extended-data", "open-class", "architecture", "sequential")
#: BCT's lambda_compat by default (its method's default: BCT Eq.3 with lambda = 1)
BCT_LAMBDA = 1.0
#: RM's temperature by default: its Eq.10-13 use ``exp(-dist)``, temperature 1
RM_TEMPERATURE = 1.0
#: ``--setup``: ``released`` trains each method as its released code sets it up (its paper
#: where no code was released; ``Variant.setups``, docs/methods.md "Setups"); ``premise`` as
#: the premise run of 2026-11-29 did (the papers' losses in this project's one setup)
SETUPS = ("released", "premise")


@dataclass(frozen=True)
class Setup:
    """One place where a method's released code (or paper) sets training up otherwise than the
    premise run of 2026-11-29: a method option (``kind="option"``), a training option
    (``kind="training"``) or a choice of the plan (``kind="plan"``: ``init_from_predecessor``,
    start from the predecessor's weights), its released value, and the premise run's (None: not
    given, the scale's or the method's default)."""

    kind: str
    name: str
    released: object
    premise: object = None

    def value(self, setup: str) -> object:
        return self.released if setup == "released" else self.premise


def setup_values(setups: tuple, kind: str, setup: str) -> dict:
    """The ``kind`` values of ``setups`` under ``setup``, those given only."""
    got = {s.name: s.value(setup) for s in setups if s.kind == kind}
    return {k: v for k, v in got.items() if v is not None}


@dataclass(frozen=True)
class Variant:
    """A method as the report names it: registry ``method``, its ``options``, and what the
    training needs (``head`` override; ``init_from_paragon``: start from the frozen new*)."""

    label: str
    method: str
    options: tuple = ()
    head: str | None = None
    init_from_paragon: bool = False
    # False: the variant is the same model as ``bct`` when every new class is known to the
    # old model (beta and kd only differ on classes the old classifier lacks).
    needs_unseen_classes: bool = False
    sequential: bool = True  # meaningful in a sequential chain
    # how new-to-old retrieval is done: "compatible" (phi_n[:D_o] vs phi_o), "adapted"
    # (phi_n vs psi(phi_o), DMU), "fct" (phi_n vs h(phi_o), FCT), "rank_merge"
    # (psi_rev(rho(q)) vs phi_o, RM)
    cross: str = "compatible"
    # the method option that names the paragon's bundle (bt2: its independent new model)
    paragon_option: str | None = None
    # the scenarios it fits (None: every one); dsimplex needs an old model with its own simplex
    # head, which only its sequential chain trains
    scenarios: tuple | None = None
    # training options that replace the scale's for this variant, as ((name, value), ...)
    training: tuple = ()
    # where the released code sets the method up otherwise than the premise run (``Setup``)
    setups: tuple = ()

    def method_options(self, scale: ScaleOptions, setup: str = "released") -> dict:
        opts = dict(self.options) | setup_values(self.setups, "option", setup)
        if self.method in ("mcl", "cl") and scale.rm_temperature != RM_TEMPERATURE:
            opts.setdefault("temperature", scale.rm_temperature)
        if self.method == "bct" and scale.bct_lambda != BCT_LAMBDA:
            # only when it differs from BCT's own default: the configurations (and the run names
            # hashed from them) of runs at the default lambda stay those of earlier runs
            opts.setdefault("lambda_compat", scale.bct_lambda)
        if self.method == "dmu":
            opts.setdefault("psi_hidden", scale.psi_hidden)
        if self.method in ("mcl", "rqt", "cl"):
            opts.setdefault("psi_rev_hidden", scale.psi_hidden)
        if self.method == "fct":
            opts.setdefault("hidden", scale.psi_hidden)
        return opts

    def training_values(self, setup: str = "released") -> dict:
        """Training options that replace the scale's: ``training`` and the setup's."""
        return dict(self.training) | setup_values(self.setups, "training", setup)

    def plan_value(self, name: str, setup: str = "released") -> object:
        """A plan choice of the setup (``Setup`` of kind ``plan``); None when it has none."""
        return setup_values(self.setups, "plan", setup).get(name)


VARIANTS: dict[str, Variant] = {
    v.label: v
    for v in (
        Variant("independent", "independent"),
        Variant("l2", "l2"),
        Variant("bct", "bct", (("variant", "sys"),)),
        Variant("bct-kd", "bct", (("variant", "kd"),), needs_unseen_classes=True),
        Variant("bct-beta", "bct", (("variant", "beta"),), needs_unseen_classes=True),
        # RACT's classifier is one fully-connected layer (Eq.7; Algorithm 2 feeds the old gallery
        # features to it): plain linear logits for training and for the uncertainty orders, for
        # RACT and its vanilla baseline alike
        Variant("contrastive", "contrastive", setups=(Setup("training", "head", "softmax"),)),
        Variant("ract", "ract", setups=(Setup("training", "head", "softmax"),)),
        # DMU's paper trains its BCT and oracle with ArcFace as DMU itself (s = 30, m = 0.3 on
        # landmarks): its claim compares DMU with a BCT of DMU's head, planned beside it
        Variant(
            "dmu",
            "dmu",
            head="arcface",
            cross="adapted",
            setups=(Setup("plan", "reference", "bct-arcface", "bct"),),
        ),
        Variant("bct-arcface", "bct", (("variant", "sys"),), head="arcface"),
        # RM's positives are the anchor's class (Eq.10-13): P x K batches, 16 classes x 4
        Variant(
            "mcl",
            "mcl",
            init_from_paragon=True,
            sequential=False,
            cross="rank_merge",
            setups=(Setup("training", "batch_images_per_class", 4, 0),),
        ),
        Variant("rqt", "rqt", init_from_paragon=True, sequential=False, cross="rank_merge"),
        Variant(
            "cl",
            "cl",
            init_from_paragon=True,
            sequential=False,
            cross="rank_merge",
            setups=(Setup("training", "batch_images_per_class", 4, 0),),
        ),
        Variant("p2s", "p2s"),
        Variant("ndpp", "ndpp"),
        Variant("odpp", "odpp"),
        Variant("lwf", "lwf"),
        # FD on raw features diverges under the scale's SGD at 0.1 (our old model's raw norm
        # is ~190; docs/reproduce.md, "The field methods' claims")
        Variant("fd", "fd", (("features", "normalized"),)),
        Variant("lce", "lce"),
        # the released trainer's ArcFace (s = 30, m = 0.3) on the prototypes, refined on a
        # trained new model (halfway), not at epoch 0 on the untrained one
        Variant(
            "unibct",
            "unibct",
            setups=(
                Setup("option", "margin", 0.3, 0.0),
                Setup("option", "refine_from", 0.5, 0.0),
            ),
        ),
        # the released AdvBCT: boundary metadata from the old model's training split
        # (extract_feat.py gen_class_meta), two raw discriminator passes (models/base_model.py),
        # threshold 0.5 (configs/defaults.py; its new_AdvBct.yml sets 1.0)
        Variant(
            "advbct",
            "advbct",
            setups=(
                Setup("option", "boundary_split", "old", "new"),
                Setup("option", "discriminator", "released", "joint"),
                Setup("option", "threshold", 0.5, 1.0),
            ),
        ),
        Variant("bt2", "bt2", paragon_option="independent_model", sequential=False),
        # the released trainer (iamcl2r main.py, params.py) starts every task from the previous
        # task's checkpoint at lr 1e-3 and balances each batch between seen and new classes
        Variant(
            "dsimplex",
            "dsimplex",
            head="dsimplex",
            scenarios=("sequential",),
            setups=(
                Setup("plan", "init_from_predecessor", True),
                Setup("training", "lr", 1e-3),
                Setup("training", "batch_old_fraction", 0.5, 0.0),
            ),
        ),
        # FCT's released configuration trains h with Adam at 5e-4: h's MSE on raw features
        # diverges under the scale's SGD at 0.1 (the run of 2026-11-26)
        Variant(
            "fct",
            "fct",
            init_from_paragon=True,
            sequential=False,
            cross="fct",
            training=(("optimizer", "adamw"), ("lr", 5e-4)),
            # released train_transformation.py: batch statistics for the first half of the
            # epochs, eval mode after
            setups=(Setup("option", "batchnorm", "switch", "eval"),),
        ),
    )
}

#: The methods trained per scenario at ``--scale default`` when ``--methods`` is not given: every
#: method of the five papers on extended-data, and on the other scenarios what the headline claims
#: need there (a Ray Train run costs ~15 s of start-up on a quiet 2-core machine, far more under
#: load, so the full matrix does not fit the laptop budget). The field methods are not in it
#: (``DEFAULT_LEFT_OUT``): with them the default run took 38.7 minutes on 2026-11-26, without them
#: 28.7 (docs/reproduce.md, "The field methods' claims"); ``--methods field``
#: trains them where their claims are decided (``FIELD_PLAN``). ``--methods all`` (and
#: ``--scale cluster``) trains every method everywhere.
DEFAULT_SCALE_METHODS = {
    "extended-data": (
        "independent",
        "l2",
        "bct",
        "contrastive",
        "ract",
        "dmu",
        "mcl",
        "p2s",
        "ndpp",
        "odpp",
    ),
    "open-class": ("independent", "l2", "bct", "bct-kd", "bct-beta", "dmu"),
    "architecture": ("independent", "bct", "dmu"),
    "sequential": ("independent", "bct", "dmu"),
}
#: The field's methods (docs/methods.md, Field methods; issue 31): each has one claim of its own
#: (or, lwf and fd, the compatibility criterion as baselines)
FIELD_METHODS = ("lwf", "fd", "lce", "unibct", "advbct", "bt2", "dsimplex", "fct")
#: field methods the default-scale plan leaves out so that the default run fits its 30-minute
#: budget on 2 cores: the five papers' plan alone took 28.7 minutes on this machine on
#: 2026-11-26 (docs/reproduce.md, "The field methods' claims"); their claims say ``not run``
#: with that reason, and ``--methods field`` trains them
DEFAULT_LEFT_OUT: tuple = FIELD_METHODS
#: ``--methods field``: the field's methods where their claims are decided, beside the models
#: those claims compare against (the independent model is always trained); no architecture run
FIELD_PLAN = {
    "extended-data": ("bct", "lwf", "fd", "lce", "advbct", "bt2", "fct"),
    "open-class": ("bct", "unibct"),
    "sequential": ("dsimplex",),
}
SEQUENTIAL_DEFAULT = DEFAULT_SCALE_METHODS["sequential"]
#: ``--scale premise`` without ``--methods``: every claim's models, the five papers' default plan
#: and the field methods' plan together (each scenario's union, in report order)
PREMISE_PLAN = {
    s: tuple(dict.fromkeys(DEFAULT_SCALE_METHODS[s] + FIELD_PLAN.get(s, ()))) for s in SCENARIOS
}


@dataclass(frozen=True)
class ScaleOptions:
    """Model and optimisation sizes (the data sizes and the old backbone are
    ``ReproduceOptions.sizes``). Defaults: the 2-core laptop preset."""

    # resnet10t (the sizes' backbone) learns these glyphs in a few epochs (lcnet_050, 2.5x
    # faster per image, stayed near chance at this data size); resnet14t is the larger new
    # backbone of the architecture change, as the papers go to a larger model
    arch_backbone: str = option("resnet14t", help="the new backbone of the architecture scenario")
    embed_dim: int = positive(64, help="embedding dimension")
    # Measured on the default data: the old resnet10t at 10 epochs on its 600 images stayed near
    # chance on held-out classes (mAP@100 0.005, 15 old-old top-1 successes of 1,500 queries);
    # at 30 epochs it reaches 0.11 and 646. The old models are 3 of the 28 runs, so their epochs
    # are cheap; the new models get 10.
    old_epochs: int = positive(30, help="epochs of each old model")
    new_epochs: int = positive(10, help="epochs of each new model")
    batch_size: int = positive(64, help="global batch size")
    lr: float = positive(0.1, help="peak learning rate")
    psi_hidden: int = positive(256, help="DMU psi / RM psi_rev hidden width (papers: 1024)")
    workers: int = nonnegative(
        1,
        help="DDP workers per training run (0: "
        "Ray Train's local mode, the loop in this process, one run at a time)",
    )
    gpus: float = nonnegative(0.0, help="GPUs per worker (0: CPU)")
    bct_lambda: float = positive(
        BCT_LAMBDA,
        help="weight of BCT's influence loss (lambda_compat) for the BCT variants; the "
        "main job uses 2",
    )
    rm_temperature: float = positive(
        RM_TEMPERATURE,
        help="temperature of RM's contrastive losses (mcl, cl): s = exp(-d / T); the paper's "
        "Eq.10-13 use T = 1",
    )


#: the default scale's data: 100 training classes of 20 images, resnet10t; evaluation on 1,500
#: queries (10 of each of 150 held-out classes) against 15,000 gallery items (40 positives per
#: query class and 9,000 distractors of 900 other held-out classes): embedding is cheap next to
#: training, and the intervals and NFR (hundreds of old-old successes) need that many queries
DEFAULT_SIZES = dataclasses.replace(
    ScenarioSizes(),
    train_classes=100,
    images_per_class=20,
    eval_classes=150,
    queries_per_class=10,
    gallery_per_class=40,
    distractor_classes=900,
    distractors_per_class=10,
    resolution=32,
    backbone="resnet10t",
    data_seed=0,
)


@dataclass(frozen=True)
class Scale:
    """A size preset (``--scale``): the data sizes and the model and optimisation sizes."""

    sizes: ScenarioSizes
    training: ScaleOptions


#: the premise scale: the default scale with 1,600 training classes, the smallest count at which
#: BCT's criterion M(bct,o) - M(o,o) > 0 was held with seed 0 and with seed 1 on one machine
#: (+0.0418 and +0.0396; at 800 seed 1 and both seeds together were inconclusive there; counts
#: between 800 and 1,600 not tried: docs/reproduce.md, "The premise scale"); everything else as
#: the default scale, so its queries and gallery are the default run's
PREMISE_CLASSES = 1600

SCALES: dict[str, Scale] = {
    "default": Scale(DEFAULT_SIZES, ScaleOptions()),
    "premise": Scale(
        dataclasses.replace(DEFAULT_SIZES, train_classes=PREMISE_CLASSES), ScaleOptions()
    ),
    # A cluster-size run: the sizes of the main job and beyond, the papers' 1024-wide psi.
    "cluster": Scale(
        dataclasses.replace(
            DEFAULT_SIZES,
            train_classes=400,
            images_per_class=40,
            eval_classes=800,
            queries_per_class=3,
            gallery_per_class=10,
            distractor_classes=1500,
            distractors_per_class=20,
            resolution=64,
            backbone="resnet18",
        ),
        dataclasses.replace(
            ScaleOptions(),
            arch_backbone="resnet50",
            embed_dim=128,
            old_epochs=30,
            new_epochs=30,
            batch_size=256,
            psi_hidden=1024,
            workers=4,
        ),
    ),
}

BACKFILL_POLICIES = (
    "random",
    "uncertainty:least_confidence",
    "uncertainty:margin",
    "uncertainty:entropy",
)


@dataclass(frozen=True)
class ReproduceOptions:
    """Options of the reproduction job. :meth:`at_scale` applies a ``--scale`` preset;
    :meth:`validated` checks the names and backbones and expands ``all``."""

    output: OutputOptions = option(OutputOptions(name="report"), help="where the report goes")
    address: str | None = option(None, help="Ray address; none: an embedded local Ray")
    scale: str = choices(
        *SCALES, default="default", help="size preset (the size flags override it)"
    )
    scenarios: tuple = option(SCENARIOS, help=f"comma-separated subset of {list(SCENARIOS)}")
    methods: tuple | None = option(
        None,
        help=f"comma-separated subset of {list(VARIANTS)}, 'all', or 'field' (the field's "
        "eight methods where their claims are decided, with bct: extended-data, open-class and "
        "sequential); none: the five papers' methods (every one on extended-data, the claims' "
        "elsewhere) at --scale default, those and the field's plan at --scale premise, all at "
        "--scale cluster",
    )
    sequential_methods: tuple | None = option(
        None,
        help=f"methods of the sequential chains, or 'all'; none: {','.join(SEQUENTIAL_DEFAULT)} "
        "at --scale default, those and dsimplex at --scale premise, else all",
    )
    data: DataSourceOptions = option(
        DataSourceOptions(), help="data: the built-in glyphs or your images"
    )
    sizes: ScenarioSizes = option(
        DEFAULT_SIZES,
        help="data (the scenarios are --scenarios; your images: only --queries-per-class, "
        "--resolution, --backbone and --data-seed apply)",
    )
    training: ScaleOptions = option(ScaleOptions(), help="model and optimisation sizes")
    setup: str = choices(
        *SETUPS,
        default="released",
        help="released: each method trained as its released code (or paper) sets it up "
        "(batches, splits, heads, schedules; docs/methods.md, Setups); premise: as the premise "
        "run of 2026-11-29, every method in this project's one setup",
    )
    seed: int = nonnegative(0, help="seed of the models and of the backfill simulation")
    seeds: int = positive(
        1,
        help="train every model this many times, with seeds --seed, --seed+1, ...; tables show "
        "the mean and spread across seeds and the intervals resample seeds and queries",
    )
    seed_spread_from: str | None = option(
        None,
        help="the report.json of an earlier run with --seeds N (N > 1): beside every check of "
        "this report, the seed-to-seed spread of its difference in that run; none: only a "
        "--seeds N run of its own shows one",
    )
    class_scaling: tuple | None = option(
        None,
        help="training class counts, e.g. 100,200,400: extended-data trained with bct and the "
        "independent model at each count (the same held-out queries and gallery), and a report "
        "section with M(bct,o) - M(o,o) and its interval against the count; none: no such run",
    )
    bootstrap: BootstrapOptions = option(
        BootstrapOptions(), help="the bootstrap intervals over queries (and seeds)"
    )
    parallel: int = positive(2, help="Ray Train runs at a time (2: this machine's 2 cores)")
    train_budget_minutes: float | None = option(
        None,
        help="start no training after this many minutes; the report lists what was not trained "
        "and its claims say 'not measured'; none: no limit",
    )
    train_only: bool = option(
        False,
        help="train or resume the plan's models (within --train-budget-minutes) and stop: no "
        "evaluation and no report, only training.json (what exists, what is left); a later run "
        "without it, on the same --out, evaluates every model that exists",
    )
    backfill_policies: tuple = option(BACKFILL_POLICIES, help="policies of the backfill curves")
    verbose: bool = option(False, help="keep Ray's own INFO lines")

    @classmethod
    def at_scale(cls, scale: str = "default", **values) -> ReproduceOptions:
        """The options of preset ``scale`` (its sizes and training sizes), then ``values``."""
        preset = SCALES[parse_options(cls, {"scale": scale}).scale]
        return dataclasses.replace(
            cls(), scale=scale, sizes=preset.sizes, training=preset.training, **values
        )

    def threads_per_worker(self) -> int:
        """Torch threads per training worker: the cores shared by the concurrent runs."""
        import os

        return max(1, (os.cpu_count() or 1) // (self.parallel * max(1, self.training.workers)))

    def method_plan(self, scenario: str) -> list[Variant]:
        """The variants trained in ``scenario`` (``independent`` first), in report order."""
        chosen = ["independent"] + [m for m in self.requested(scenario) if m != "independent"]
        if scenario == "sequential" and self.sequential_methods is not None:
            chosen = ["independent"] + [m for m in chosen if m in self.sequential_methods]
        out = []
        for label in self._with_references(chosen):
            v = VARIANTS[label]
            if v.needs_unseen_classes and scenario in ("extended-data", "architecture"):
                continue
            if scenario == "sequential" and not v.sequential:
                continue
            if v.scenarios is not None and scenario not in v.scenarios:
                continue
            out.append(v)
        return out

    def _with_references(self, chosen: list[str]) -> list[str]:
        """``chosen`` with the reference each variant's claim compares it with (its ``Setup``
        of kind ``plan`` named ``reference``) right after it, when not chosen already."""
        out: list[str] = []
        for label in chosen:
            ref = VARIANTS[label].plan_value("reference", self.setup)
            out += [label] + ([ref] if ref and ref not in chosen and ref not in out else [])
        return list(dict.fromkeys(out))

    def requested(self, scenario: str) -> tuple:
        if self.methods == ("field",):
            return FIELD_PLAN.get(scenario, ())
        if self.methods is not None:
            return self.methods
        if scenario == "sequential" and self.sequential_methods is not None:
            return self.sequential_methods
        if self.scale == "premise":
            return PREMISE_PLAN[scenario]
        return DEFAULT_SCALE_METHODS[scenario] if self.scale == "default" else tuple(VARIANTS)

    def skipped(self, scenario: str) -> list[tuple[str, str]]:
        """``(method, reason)`` for every method not trained in ``scenario``."""
        planned = {v.label for v in self.method_plan(scenario)}
        reasons = []
        for label in VARIANTS:
            if label in planned:
                continue
            v = VARIANTS[label]
            if v.needs_unseen_classes and scenario in ("extended-data", "architecture"):
                why = (
                    "every new class is known to the old classifier here, so this BCT variant "
                    "trains exactly the model of `bct` (sys)"
                )
            elif scenario == "sequential" and not v.sequential:
                why = (
                    "the rank-merge family trains rho/psi_rev on a frozen new* against one "
                    "predecessor; the RM paper has no sequential chain"
                    if v.cross == "rank_merge"
                    else "it needs the paragon (new*) of its generation, which the sequential "
                    "chains do not pair with it"
                )
            elif label == "bct-arcface":
                why = (
                    "DMU's reference (a BCT of DMU's ArcFace head), trained where dmu is under "
                    "`--setup released`"
                )
            elif v.scenarios is not None and scenario not in v.scenarios:
                why = (
                    "its old model must be trained with the same simplex head; only its "
                    "sequential chain trains one (docs/methods.md, Field methods)"
                )
            elif self.methods == ("field",):
                why = "not in the `--methods field` plan (the field methods' claims)"
            elif self.methods is not None and label not in self.methods:
                why = "not requested (`--methods`)"
            elif label in DEFAULT_LEFT_OUT and self.methods is None and self.scale == "default":
                why = (
                    "left out of the default-scale plan: the five papers' plan alone fills the "
                    "default run's 30-minute budget on 2 cores (docs/reproduce.md, \"The field "
                    "methods' claims\"); `--methods field` trains every field method where its "
                    f"claim is decided, `--methods {label},...` this one"
                )
            elif label not in self.requested(scenario):
                plan = "PREMISE_PLAN" if self.scale == "premise" else "DEFAULT_SCALE_METHODS"
                why = (
                    f"not in this scenario's {self.scale}-scale plan ({plan}); "
                    "`--methods all` trains it"
                )
            else:
                why = "not requested (`--sequential-methods`)"
            reasons.append((label, why))
        return reasons

    def validated(self) -> ReproduceOptions:
        """Checks that need more than one option; ``all`` expanded. Raises ``ConfigError``."""
        from raycompat.train.config import check_backbone

        if self.train_budget_minutes is not None and self.train_budget_minutes < 0:
            raise ConfigError(
                f"--train-budget-minutes must be >= 0, got {self.train_budget_minutes}"
            )
        t = self.training
        if t.workers and t.batch_size % t.workers:
            raise ConfigError(
                f"--batch-size {t.batch_size} must be divisible by --workers {t.workers}"
            )
        check_backbone(self.sizes.backbone, "--backbone")
        check_backbone(t.arch_backbone, "--arch-backbone")
        if self.seed_spread_from is not None:
            from raycompat.reproduce.spread import load_seed_spread

            load_seed_spread(self.seed_spread_from)  # refused now, not after the training
        given = (
            ()
            if self.methods is None
            else _names(self.methods, ("field",) + tuple(VARIANTS), "--methods", ("all", "field"))
        )
        if "field" in given and given != ("field",):
            raise ConfigError(
                "--methods: 'field' (the field methods' plan) stands alone; give it by itself, "
                "or name the methods to train"
            )
        field = given == ("field",)
        scenarios = _names(self.scenarios, SCENARIOS, "--scenarios")
        if field:
            scenarios = tuple(s for s in scenarios if s in FIELD_PLAN)
            if not scenarios:
                raise ConfigError(
                    f"--methods field trains in {list(FIELD_PLAN)}; --scenarios names none of them"
                )
        return dataclasses.replace(
            self,
            class_scaling=self._class_counts(),
            scenarios=scenarios,
            methods=None
            if self.methods is None
            else ("field",)
            if field
            else _names(self.methods, tuple(VARIANTS), "--methods"),
            sequential_methods=None
            if self.sequential_methods is None
            else _names(self.sequential_methods, tuple(VARIANTS), "--sequential-methods"),
        )

    def _class_counts(self) -> tuple | None:
        """``--class-scaling`` as distinct increasing ints >= 2 (built-in glyphs only)."""
        if self.class_scaling is None:
            return None
        flag = "--class-scaling"
        raw = self.class_scaling
        items = raw if isinstance(raw, (list, tuple)) else str(raw).split(",")
        try:
            counts = [int(str(v).strip()) for v in items if str(v).strip()]
        except ValueError:
            raise ConfigError(f"{flag}: {raw!r} must be comma-separated integers") from None
        if len(counts) < 2 or min(counts) < 2 or len(set(counts)) != len(counts):
            raise ConfigError(
                f"{flag}: {raw!r} must name at least two distinct class counts, each >= 2"
            )
        if self.data.user:
            raise ConfigError(
                f"{flag} needs the built-in glyphs: your images fix their own training classes"
            )
        return tuple(sorted(counts))


def _names(value, allowed: tuple, flag: str, words: tuple = ("all",)) -> tuple:
    if isinstance(value, (list, tuple)):
        names = list(value)
    else:
        names = [n.strip() for n in str(value).split(",") if n.strip()]
    if names == ["all"]:
        return tuple(a for a in allowed if a not in words)
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        raise ConfigError(
            f"{flag}: {bad[0] if bad else 'empty'!r} is not allowed; allowed values: "
            f"{[a for a in allowed if a not in words]} or {' or '.join(map(repr, words))}"
        )
    return tuple(dict.fromkeys(names))
