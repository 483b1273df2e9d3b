"""What the reproduction report trains: scenarios x methods, and the scale presets.

Scenarios (METHODS.md, "Upgrade scenarios"): ``extended-data`` (old: 30% of the images,
new: all), ``open-class`` (old: 30% of the classes, new: the other 70%), ``architecture``
(the extended-data allocation with a different new backbone; the old model is the
extended-data one) and ``sequential`` (phi_1 -> phi_2 -> phi_3 on 25% -> 50% -> 100% of the
classes, each generation trained against its predecessor).

Methods are *variants*: a registered training method plus options (``bct``, ``bct-kd`` and
``bct-beta`` are the three BCT variants). ``independent`` is always trained: it is new*,
the paragon of its scenario (and of each sequential generation).
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field

from raycompat.config import ConfigError

SCENARIOS = ("extended-data", "open-class", "architecture", "sequential")


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
    sequential: bool = True            # meaningful in a sequential chain
    # how new-to-old retrieval is done: "compatible" (phi_n[:D_o] vs phi_o), "adapted"
    # (phi_n vs psi(phi_o), DMU), "rank_merge" (psi_rev(rho(q)) vs phi_o, RM)
    cross: str = "compatible"

    def method_options(self, scale: "ScaleOptions") -> dict:
        opts = dict(self.options)
        if self.method == "dmu":
            opts.setdefault("psi_hidden", scale.psi_hidden)
        if self.method in ("mcl", "rqt", "cl"):
            opts.setdefault("psi_rev_hidden", scale.psi_hidden)
        return opts


VARIANTS: dict[str, Variant] = {v.label: v for v in (
    Variant("independent", "independent"),
    Variant("l2", "l2"),
    Variant("bct", "bct", (("variant", "sys"),)),
    Variant("bct-kd", "bct", (("variant", "kd"),), needs_unseen_classes=True),
    Variant("bct-beta", "bct", (("variant", "beta"),), needs_unseen_classes=True),
    Variant("contrastive", "contrastive"),
    Variant("ract", "ract"),
    Variant("dmu", "dmu", head="arcface", cross="adapted"),
    Variant("mcl", "mcl", init_from_paragon=True, sequential=False, cross="rank_merge"),
    Variant("rqt", "rqt", init_from_paragon=True, sequential=False, cross="rank_merge"),
    Variant("cl", "cl", init_from_paragon=True, sequential=False, cross="rank_merge"),
    Variant("p2s", "p2s"),
    Variant("ndpp", "ndpp"),
    Variant("odpp", "odpp"),
)}

#: The methods trained per scenario at ``--scale default`` when ``--methods`` is not given: every
#: method on extended-data, and on the other scenarios what the headline claims need there (a
#: Ray Train run costs ~15 s of start-up on a quiet 2-core machine, far more under load, so the
#: full 49-run matrix does not fit the laptop budget). ``--methods all`` (and ``--scale cluster``)
#: trains every method everywhere.
DEFAULT_SCALE_METHODS = {
    "extended-data": ("independent", "l2", "bct", "contrastive", "ract", "dmu", "mcl", "p2s", "ndpp",
                      "odpp"),
    "open-class": ("independent", "l2", "bct", "bct-kd", "bct-beta", "dmu"),
    "architecture": ("independent", "bct", "dmu"),
    "sequential": ("independent", "bct", "dmu"),
}
SEQUENTIAL_DEFAULT = DEFAULT_SCALE_METHODS["sequential"]


@dataclass
class ScaleOptions:
    """Data, model and optimisation sizes. ``default``: the 2-core laptop preset."""

    train_classes: int = 100
    images_per_class: int = 20
    eval_classes: int = 40
    queries_per_class: int = 3
    gallery_per_class: int = 6
    distractor_classes: int = 40
    distractors_per_class: int = 4
    resolution: int = 32
    # resnet10t learns these glyphs in a few epochs (lcnet_050, 2.5x faster per image, stayed
    # near chance at this data size); resnet14t is the larger new backbone of the architecture
    # change (old resnet10t -> new resnet14t, as the papers go to a larger model)
    backbone: str = "resnet10t"
    arch_backbone: str = "resnet14t"     # the new backbone of the architecture scenario
    embed_dim: int = 64
    old_epochs: int = 10
    new_epochs: int = 5
    batch_size: int = 64
    lr: float = 0.1
    psi_hidden: int = 256               # DMU psi / RM psi_rev hidden width (papers: 1024)
    workers: int = 1
    gpus: float = 0.0


SCALES: dict[str, dict] = {
    "default": {},
    # A cluster-size run: the sizes of the main job and beyond, the papers' 1024-wide psi.
    "cluster": dict(train_classes=400, images_per_class=40, eval_classes=200, queries_per_class=3,
                    gallery_per_class=10, distractor_classes=300, distractors_per_class=5,
                    resolution=64, backbone="resnet18", arch_backbone="resnet50", embed_dim=128,
                    old_epochs=30, new_epochs=30, batch_size=256, psi_hidden=1024, workers=4),
}


@dataclass
class ReproduceOptions:
    out: str | None = None                   # default reproduce_out, or <storage>/reproduce/<name>
    storage: str | None = None               # shared storage (raycompat.outputs)
    name: str = "report"
    address: str | None = None
    scale: str = "default"
    scenarios: tuple = SCENARIOS
    methods: tuple | None = None             # None: DEFAULT_SCALE_METHODS at default scale, else all
    sequential_methods: tuple | None = None  # None: SEQUENTIAL_DEFAULT at default scale, else all
    sizes: ScaleOptions = field(default_factory=ScaleOptions)
    seed: int = 0
    data_seed: int = 0
    parallel: int = 2                    # Ray Train runs at a time (default: this machine's 2 cores)
    train_budget_minutes: float | None = None   # stop starting trainings after this long
    backfill_policies: tuple = ("random", "uncertainty:least_confidence", "uncertainty:margin",
                                "uncertainty:entropy")

    def threads_per_worker(self) -> int:
        """Torch threads per training worker: the cores shared by the concurrent runs."""
        import os

        return max(1, (os.cpu_count() or 1) // (self.parallel * self.sizes.workers))

    def method_plan(self, scenario: str) -> list[Variant]:
        """The variants trained in ``scenario`` (``independent`` first), in report order."""
        chosen = ["independent"] + [m for m in self.requested(scenario) if m != "independent"]
        if scenario == "sequential" and self.sequential_methods is not None:
            chosen = ["independent"] + [m for m in chosen if m in self.sequential_methods]
        out = []
        for label in chosen:
            v = VARIANTS[label]
            if v.needs_unseen_classes and scenario in ("extended-data", "architecture"):
                continue
            if scenario == "sequential" and not v.sequential:
                continue
            out.append(v)
        return out

    def requested(self, scenario: str) -> tuple:
        if self.methods is not None:
            return self.methods
        if scenario == "sequential" and self.sequential_methods is not None:
            return self.sequential_methods
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
                why = ("every new class is known to the old classifier here, so this BCT variant "
                       "trains exactly the model of `bct` (sys)")
            elif scenario == "sequential" and not v.sequential:
                why = ("the rank-merge family trains rho/psi_rev on a frozen new* against one "
                       "predecessor; the RM paper has no sequential chain")
            elif label not in self.requested(scenario):
                why = ("not in this scenario's default-scale plan (DEFAULT_SCALE_METHODS); "
                       "`--methods all` trains it")
            else:
                why = "not requested (`--sequential-methods`)"
            reasons.append((label, why))
        return reasons

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        from raycompat.outputs import add_output_arguments

        add_output_arguments(parser, "reproduce", "reproduce_out", cls.name)
        parser.add_argument("--address", default=None, help="Ray address (default: embedded local Ray)")
        parser.add_argument("--scale", default="default", help=f"size preset: {list(SCALES)}")
        parser.add_argument("--scenarios", default=",".join(SCENARIOS),
                            help=f"comma-separated subset of {list(SCENARIOS)}")
        parser.add_argument("--methods", default=None,
                            help=f"comma-separated subset of {list(VARIANTS)} or 'all' (default: every "
                                 "method on extended-data and the claims' methods elsewhere at --scale "
                                 "default, all at --scale cluster)")
        parser.add_argument("--sequential-methods", default=None,
                            help=f"methods of the sequential chains, or 'all' (default: "
                                 f"{','.join(SEQUENTIAL_DEFAULT)} at --scale default, else all)")
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument("--data-seed", type=int, default=0)
        parser.add_argument("--parallel", type=int, default=cls.parallel,
                            help="Ray Train runs at a time (default %(default)s)")
        parser.add_argument("--train-budget-minutes", type=float, default=None,
                            help="start no training after this many minutes; the report lists what "
                                 "was not trained and its claims say 'not measured' (default: no limit)")
        g = parser.add_argument_group("scale overrides (default: the --scale preset)")
        for f in dataclasses.fields(ScaleOptions):
            kind = {"int": int, "float": float}.get(str(f.type), str)
            g.add_argument("--" + f.name.replace("_", "-"), type=kind, default=None)

    @classmethod
    def from_args(cls, args) -> "ReproduceOptions":
        if args.scale not in SCALES:
            raise ConfigError(f"--scale {args.scale!r} is not allowed; allowed values: {list(SCALES)}")
        sizes = dataclasses.replace(ScaleOptions(), **SCALES[args.scale])
        overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(ScaleOptions)
                     if getattr(args, f.name) is not None}
        sizes = dataclasses.replace(sizes, **overrides)
        return cls(out=args.out, storage=args.storage, name=args.name, address=args.address, scale=args.scale,
                   scenarios=_names(args.scenarios, SCENARIOS, "--scenarios"),
                   methods=None if args.methods is None else _names(args.methods, tuple(VARIANTS), "--methods"),
                   sequential_methods=None if args.sequential_methods is None else
                   _names(args.sequential_methods, tuple(VARIANTS), "--sequential-methods"),
                   sizes=sizes, seed=args.seed, data_seed=args.data_seed,
                   parallel=args.parallel, train_budget_minutes=args.train_budget_minutes).validated()

    def validated(self) -> "ReproduceOptions":
        s = self.sizes
        for name in ("train_classes", "images_per_class", "eval_classes", "queries_per_class",
                     "gallery_per_class", "resolution", "embed_dim", "old_epochs", "new_epochs",
                     "batch_size", "psi_hidden", "workers"):
            if getattr(s, name) <= 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be > 0, got {getattr(s, name)}")
        if self.train_budget_minutes is not None and self.train_budget_minutes < 0:
            raise ConfigError(f"--train-budget-minutes must be >= 0, got {self.train_budget_minutes}")
        if self.parallel <= 0:
            raise ConfigError(f"--parallel must be > 0, got {self.parallel}")
        if s.lr <= 0:
            raise ConfigError(f"--lr must be > 0, got {s.lr}")
        if s.batch_size % s.workers:
            raise ConfigError(f"--batch-size {s.batch_size} must be divisible by --workers {s.workers}")
        from raycompat.train.config import check_backbone

        for name in ("backbone", "arch_backbone"):
            check_backbone(getattr(s, name), "--" + name.replace("_", "-"))
        return self


def _names(value, allowed: tuple, flag: str) -> tuple:
    if isinstance(value, (list, tuple)):
        names = list(value)
    else:
        names = [n.strip() for n in str(value).split(",") if n.strip()]
    if names == ["all"]:
        return tuple(allowed)
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        raise ConfigError(f"{flag}: {bad[0] if bad else 'empty'!r} is not allowed; allowed values: "
                          f"{list(allowed)} or 'all'")
    return tuple(dict.fromkeys(names))
