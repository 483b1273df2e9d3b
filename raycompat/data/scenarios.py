"""Upgrade scenarios: which classes and images each model generation trains on, and
the held-out query / gallery / distractor sets used for open-set retrieval.

Labels are catalog class indices (one label space for every split); instances are
renderer instance numbers, unique per class across all splits of a scenario.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from raycompat.config import ConfigError, nonnegative, option, positive

#: Known scenario names.
SCENARIOS = ("extended-data", "open-data", "open-class", "extended-class", "sequential")

#: Defaults: 200 train classes x 40 images; 100 eval classes with 2 queries and 10
#: gallery positives each; 100 distractor classes x 5 gallery images.
DEFAULTS = dict(
    num_train_classes=200,
    images_per_class=40,
    num_eval_classes=100,
    queries_per_class=2,
    gallery_per_class=10,
    num_distractor_classes=100,
    distractors_per_class=5,
    old_fraction=0.3,
    sequential_fractions=(0.25, 0.5, 1.0),
)

_EVAL_SPLITS = ("query", "gallery", "distractors")


@dataclass(eq=False)
class Split:
    """One set of images: parallel arrays of class labels and instance numbers. A split of
    your own images also has ``items``: the source key of every image (its instance number is
    its position in ``items``)."""

    name: str
    labels: np.ndarray
    instances: np.ndarray
    items: list[str] | None = None

    def __post_init__(self):
        self.labels = np.asarray(self.labels, dtype=np.int64).ravel()
        self.instances = np.asarray(self.instances, dtype=np.int64).ravel()
        if self.labels.shape != self.instances.shape:
            raise ValueError(
                f"split {self.name!r}: {self.labels.size} labels "
                f"but {self.instances.size} instances"
            )
        if self.items is not None and len(self.items) != self.labels.size:
            raise ValueError(
                f"split {self.name!r}: {self.labels.size} labels but {len(self.items)} items"
            )

    def __len__(self) -> int:
        return int(self.labels.size)

    def __eq__(self, other) -> bool:
        return (
            isinstance(other, Split)
            and self.name == other.name
            and np.array_equal(self.labels, other.labels)
            and np.array_equal(self.instances, other.instances)
            and self.items == other.items
        )

    @property
    def classes(self) -> np.ndarray:
        """Sorted unique labels."""
        return np.unique(self.labels)

    def to_dict(self, class_names: list[str] | None = None) -> dict:
        """JSON-able; with ``class_names`` (your images) also every item's key and class."""
        out = {"name": self.name, "labels": self.labels.tolist()}
        out["instances"] = self.instances.tolist()
        if self.items is not None:
            out["items"] = list(self.items)
            out["classes"] = [class_names[i] for i in self.labels.tolist()]
        return out

    @classmethod
    def from_dict(cls, d: dict) -> Split:
        return cls(d["name"], d["labels"], d["instances"], d.get("items"))


@dataclass
class Scenario:
    """A named allocation of splits. ``splits`` always has ``old_train``,
    ``new_train``, ``query``, ``gallery`` and ``distractors``; ``sequential`` also
    has ``train_1..train_3`` with ``old_train``/``new_train`` aliasing the first and
    last generation (the same objects, listed in ``aliases``)."""

    name: str
    seed: int
    splits: dict[str, Split]
    params: dict = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    #: your images: the sorted class names (label ``i`` is ``class_names[i]``) and the source
    class_names: list[str] | None = None
    source: dict | None = None

    @property
    def user_data(self) -> bool:
        """True for a scenario of your own images (not the built-in glyphs)."""
        return self.source is not None

    @property
    def in_chans(self) -> int:
        """Image channels the models take: 1 for the grey glyphs, 3 for your (colour) images."""
        return 3 if self.user_data else 1

    def __post_init__(self):
        for alias, target in self.aliases.items():
            self.splits[alias] = self.splits[target]

    def __getitem__(self, key: str) -> Split:
        return self.splits[key]

    def train_generations(self) -> list[str]:
        """Training split names, oldest model first."""
        gens = sorted(
            (k for k in self.splits if k.startswith("train_")), key=lambda k: int(k.split("_")[1])
        )
        return gens or ["old_train", "new_train"]

    @property
    def train_classes(self) -> np.ndarray:
        return np.unique(np.concatenate([self.splits[g].labels for g in self.train_generations()]))

    @property
    def eval_classes(self) -> np.ndarray:
        return np.unique(np.concatenate([self.splits[s].labels for s in _EVAL_SPLITS]))

    def allocation_rows(self) -> list[dict]:
        """One dict per split (training generations first): split, alias_of,
        classes, images."""
        order = [
            *self.train_generations(),
            *(a for a in ("old_train", "new_train") if a in self.aliases),
            *_EVAL_SPLITS,
        ]
        return [
            {
                "split": key,
                "alias_of": self.aliases.get(key),
                "classes": int(len(self.splits[key].classes)),
                "images": len(self.splits[key]),
            }
            for key in order
        ]

    def allocation_table(self) -> str:
        """Markdown table: split, #classes, #images (aliases noted)."""
        rows = [
            f"Scenario `{self.name}` (seed {self.seed})",
            "",
            "| split | #classes | #images |",
            "|---|---:|---:|",
        ]
        for row in self.allocation_rows():
            label = f"{row['split']} (= {row['alias_of']})" if row["alias_of"] else row["split"]
            rows.append(f"| {label} | {row['classes']} | {row['images']} |")
        return "\n".join(rows)

    def __str__(self) -> str:
        return self.allocation_table()

    def to_dict(self) -> dict:
        """Plain JSON-able data (aliases are stored once, as names)."""
        out = {
            "name": self.name,
            "seed": self.seed,
            "params": {k: list(v) if isinstance(v, tuple) else v for k, v in self.params.items()},
            "aliases": dict(self.aliases),
        }
        if self.user_data:
            out["source"] = dict(self.source)
            out["class_names"] = list(self.class_names)
        out["splits"] = {
            k: s.to_dict(self.class_names) for k, s in self.splits.items() if k not in self.aliases
        }
        return out

    @classmethod
    def from_dict(cls, d: dict) -> Scenario:
        """The inverse of :meth:`to_dict`; raycompat.data.user_scenarios.read_scenario_file
        checks a file's fields first and names the one that is wrong."""
        splits = {k: Split.from_dict(v) for k, v in d["splits"].items()}
        return cls(
            d["name"],
            int(d["seed"]),
            splits,
            dict(d.get("params", {})),
            dict(d.get("aliases", {})),
            d.get("class_names"),
            d.get("source"),
        )


def format_allocation(scenario: Scenario) -> str:
    """The allocation table that jobs print."""
    return scenario.allocation_table()


def _take(classes: np.ndarray, fraction: float, what: str) -> np.ndarray:
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"{what} must be in (0, 1], got {fraction}")
    k = max(1, int(round(fraction * len(classes))))
    return classes[:k]


def _split(name: str, classes, instances) -> Split:
    """All (class, instance) pairs of ``classes`` x ``instances``, class-major."""
    classes = np.asarray(classes, np.int64)
    instances = np.asarray(instances, np.int64)
    return Split(name, np.repeat(classes, len(instances)), np.tile(instances, len(classes)))


def _check_sizes(name: str, sizes: dict, seed) -> None:
    """``ValueError`` naming the first size (or the seed) :func:`build_scenario` cannot use."""
    for key, value in sizes.items():
        minimum = 0 if key in ("num_distractor_classes", "distractors_per_class") else 1
        if int(value) != value or value < minimum:
            raise ValueError(f"{key} must be an integer >= {minimum}, got {value!r}")
    images_per_class = sizes["images_per_class"]
    if name in ("extended-data", "open-data") and images_per_class < 2:
        raise ValueError(f"images_per_class must be >= 2 for {name!r}, got {images_per_class}")
    if int(seed) != seed or seed < 0:
        raise ValueError(f"seed must be an integer >= 0, got {seed!r}")


def _catalog_size(catalog) -> tuple[int, str | None]:
    """``(number of classes, fingerprint)`` of a ``GlyphCatalog`` (default: the default
    catalog) or of an int number of classes (no fingerprint)."""
    if catalog is None:
        from .glyphs import default_catalog

        catalog = default_catalog()
    if isinstance(catalog, (int, np.integer)):
        return int(catalog), None
    return int(catalog.num_classes), getattr(catalog, "fingerprint", None)


def _training_splits(
    name: str, train: np.ndarray, images_per_class: int, old_fraction, sequential_fractions
) -> tuple[dict[str, Split], dict[str, str]]:
    """The training splits of scenario ``name`` drawn from the (randomly ordered) ``train``
    classes, and its split aliases (``old_train`` / ``new_train`` of ``sequential``)."""
    images = np.arange(images_per_class)
    splits: dict[str, Split] = {}
    aliases: dict[str, str] = {}
    if name in ("extended-data", "open-data"):
        if not 0.0 < old_fraction < 1.0:
            raise ValueError(f"old_fraction must be in (0, 1) for {name!r}, got {old_fraction}")
        k = min(images_per_class - 1, max(1, int(round(old_fraction * images_per_class))))
        classes = np.sort(train)
        splits["old_train"] = _split("old_train", classes, images[:k])
        splits["new_train"] = _split(
            "new_train", classes, images if name == "extended-data" else images[k:]
        )
    elif name in ("open-class", "extended-class"):
        old = _take(train, old_fraction, "old_fraction")
        if name == "open-class" and len(old) == len(train):
            raise ValueError(f"old_fraction={old_fraction} leaves no new classes for 'open-class'")
        new = train if name == "extended-class" else train[len(old) :]
        splits["old_train"] = _split("old_train", np.sort(old), images)
        splits["new_train"] = _split("new_train", np.sort(new), images)
    else:  # sequential
        fractions = [float(f) for f in sequential_fractions]
        if len(fractions) < 2 or any(b < a for a, b in zip(fractions, fractions[1:], strict=False)):
            raise ValueError(
                "sequential_fractions must be >= 2 non-decreasing values, "
                f"got {sequential_fractions}"
            )
        for g, frac in enumerate(fractions, start=1):
            splits[f"train_{g}"] = _split(
                f"train_{g}", np.sort(_take(train, frac, "sequential_fractions")), images
            )
        aliases = {"old_train": "train_1", "new_train": f"train_{len(fractions)}"}
    return splits, aliases


def build_scenario(
    name: str,
    *,
    catalog=None,
    num_train_classes: int = DEFAULTS["num_train_classes"],
    images_per_class: int = DEFAULTS["images_per_class"],
    num_eval_classes: int = DEFAULTS["num_eval_classes"],
    queries_per_class: int = DEFAULTS["queries_per_class"],
    gallery_per_class: int = DEFAULTS["gallery_per_class"],
    num_distractor_classes: int = DEFAULTS["num_distractor_classes"],
    distractors_per_class: int = DEFAULTS["distractors_per_class"],
    seed: int = 0,
    old_fraction: float = DEFAULTS["old_fraction"],
    sequential_fractions=DEFAULTS["sequential_fractions"],
) -> Scenario:
    """Build scenario ``name`` (one of ``SCENARIOS``), deterministic in ``seed``.

    ``catalog`` is a ``GlyphCatalog`` (default: ``default_catalog()``) or an int
    number of classes for any other label space. One seeded permutation of the
    classes gives the train, eval and distractor classes (disjoint, and the same for
    every scenario with the same seed and sizes). Fractions: ``old_fraction`` (0.3)
    of images per class (``extended-data``, ``open-data``; new = all / the rest) or
    of train classes (``open-class``, ``extended-class``); ``sequential_fractions``
    (0.25, 0.5, 1.0) of train classes for the three ``sequential`` generations.
    """
    if name not in SCENARIOS:
        raise ValueError(f"unknown scenario {name!r}; expected one of: {', '.join(SCENARIOS)}")
    sizes = dict(
        num_train_classes=num_train_classes,
        images_per_class=images_per_class,
        num_eval_classes=num_eval_classes,
        queries_per_class=queries_per_class,
        gallery_per_class=gallery_per_class,
        num_distractor_classes=num_distractor_classes,
        distractors_per_class=distractors_per_class,
    )
    _check_sizes(name, sizes, seed)
    num_classes, fingerprint = _catalog_size(catalog)
    needed = num_train_classes + num_eval_classes + num_distractor_classes
    if needed > num_classes:
        raise ValueError(
            f"catalog has too few classes: {num_classes} < {needed} needed "
            f"(num_train_classes={num_train_classes} + num_eval_classes={num_eval_classes} "
            f"+ num_distractor_classes={num_distractor_classes})"
        )

    perm = np.random.default_rng([int(seed), 0x5CE7]).permutation(num_classes).astype(np.int64)
    train = perm[:num_train_classes]  # random order: prefixes are random subsets
    evals = np.sort(perm[num_train_classes : num_train_classes + num_eval_classes])
    distractor = np.sort(perm[num_train_classes + num_eval_classes : needed])

    splits, aliases = _training_splits(
        name, train, images_per_class, old_fraction, sequential_fractions
    )
    splits["query"] = _split("query", evals, np.arange(queries_per_class))
    splits["gallery"] = _split(
        "gallery", evals, np.arange(queries_per_class, queries_per_class + gallery_per_class)
    )
    splits["distractors"] = _split("distractors", distractor, np.arange(distractors_per_class))

    params = dict(
        sizes,
        old_fraction=float(old_fraction),
        sequential_fractions=[float(f) for f in sequential_fractions],
        num_catalog_classes=num_classes,
        catalog_fingerprint=fingerprint,
    )
    return Scenario(name, int(seed), splits, params, aliases)


@dataclass(frozen=True)
class ScenarioSizes:
    """The sizes of a built-in glyph scenario and the data they are rendered at: the one
    declaration every job shares. Each job sets its own defaults with
    ``dataclasses.replace(ScenarioSizes(), ...)`` and gets the flags ``--train-classes``,
    ``--images-per-class`` ... from :func:`raycompat.config.add_options`."""

    scenario: str = option(
        "extended-class",
        help="upgrade scenario: an allocation (" + ", ".join(SCENARIOS) + ") or a scenario.json "
        "written by raycompat scenario",
    )
    train_classes: int = positive(DEFAULTS["num_train_classes"], help="classes the models train on")
    images_per_class: int = positive(DEFAULTS["images_per_class"], help="training images per class")
    eval_classes: int = positive(
        DEFAULTS["num_eval_classes"], help="held-out query/gallery classes"
    )
    queries_per_class: int = positive(DEFAULTS["queries_per_class"], help="queries per eval class")
    gallery_per_class: int = positive(
        DEFAULTS["gallery_per_class"], help="gallery positives per eval class"
    )
    distractor_classes: int = nonnegative(
        DEFAULTS["num_distractor_classes"], help="distractor classes"
    )
    distractors_per_class: int = nonnegative(
        DEFAULTS["distractors_per_class"], help="gallery distractors per class"
    )
    old_fraction: float = option(
        DEFAULTS["old_fraction"],
        help="the old model's share: of the training classes (extended-class, open-class) or of "
        "each class's images (extended-data, open-data)",
    )
    resolution: int = positive(32, help="glyph image side in pixels")
    backbone: str = option("resnet10t", help="any timm model name")
    data_seed: int = nonnegative(0, help="seed of the class split and the renderer")

    def __post_init__(self):
        if not 0.0 < self.old_fraction < 1.0:
            raise ConfigError(f"--old-fraction must be in (0, 1), got {self.old_fraction}")
        if self.scenario not in SCENARIOS and not self.scenario_file:
            raise ConfigError(
                f"--scenario {self.scenario!r} is neither an allocation ({', '.join(SCENARIOS)}) "
                "nor a scenario .json file"
            )

    @property
    def scenario_file(self) -> str | None:
        """The ``scenario.json`` that ``--scenario`` names, if it names a file."""
        s = self.scenario
        if s in SCENARIOS:
            return None
        return s if s.endswith(".json") or os.sep in s or os.path.exists(s) else None

    def training_data(self, scenario: Scenario) -> dict:
        """The ``TrainConfig`` fields that say what a run trains on: ``scenario`` (as a dict),
        ``resolution``, ``in_chans`` (the scenario's) and ``data_seed``."""
        return dict(
            scenario=scenario.to_dict(),
            resolution=self.resolution,
            in_chans=scenario.in_chans,
            data_seed=self.data_seed,
        )

    def build(self, catalog=None, name: str | None = None) -> Scenario:
        """:func:`build_scenario` at these sizes (``name`` overrides :attr:`scenario`)."""
        if name is None and self.scenario_file:
            raise ConfigError(
                f"--scenario {self.scenario} is a file: read it with "
                "raycompat.data.user_scenarios.read_scenario_file"
            )
        return build_scenario(
            name or self.scenario,
            catalog=catalog,
            seed=self.data_seed,
            num_train_classes=self.train_classes,
            images_per_class=self.images_per_class,
            num_eval_classes=self.eval_classes,
            queries_per_class=self.queries_per_class,
            gallery_per_class=self.gallery_per_class,
            num_distractor_classes=self.distractor_classes,
            distractors_per_class=self.distractors_per_class,
            old_fraction=self.old_fraction,
        )


def scenario_from_options(sizes: ScenarioSizes, name: str | None = None, catalog=None) -> Scenario:
    """The scenario a job's :class:`ScenarioSizes` describe (``name`` overrides its
    ``scenario``). Anything else is a ``TypeError``: a misspelt size can not fall back to a
    default silently."""
    if not isinstance(sizes, ScenarioSizes):
        raise TypeError(f"scenario sizes must be a ScenarioSizes, got {type(sizes).__name__}")
    return sizes.build(catalog=catalog, name=name)


def catalog_for(scenario: Scenario):
    """The glyph catalog whose label space ``scenario`` was built on.

    Labels are catalog class indices, so a worker (or a later run) whose fonts or FreeType
    differ would silently train on other characters; the recorded fingerprint rules that out.
    """
    from .glyphs import default_catalog

    catalog = default_catalog()
    expected = scenario.params.get("catalog_fingerprint")
    if expected and catalog.fingerprint != expected:
        raise ValueError(
            f"scenario {scenario.name!r} was built on glyph catalog {expected}, but this machine's "
            f"catalog is {catalog.fingerprint} ({catalog.num_classes} classes): "
            "the fonts, Pillow or "
            "FreeType differ, so class indices would name other characters"
        )
    return catalog
