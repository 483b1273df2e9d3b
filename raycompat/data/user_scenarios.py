"""Upgrade scenarios of your own images, and ``scenario.json`` files.

A scenario of your images is built one of three ways (docs/methods.md, "Upgrade scenarios"):

* :func:`allocate`: the standard allocations (extended-data, open-data, open-class,
  extended-class, sequential) over a labelled source, seeded; ``eval_fraction`` of the classes
  (those with at least two images) are held out for queries and gallery, ``distractor_fraction``
  as gallery distractors, the rest train the models;
* :func:`from_manifest`: an explicit table of (item, class, split);
* :func:`from_layout`: a ``root/<split>/<class>/<image>`` folder.

Every item keeps its key and its class name, so the same ``scenario.json`` gives the same
splits and the same classes to every job. :func:`resolve_scenario` is the one entry point jobs
use: ``--scenario FILE``, else the glyphs, else an allocation of ``--source``.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache

import numpy as np

from raycompat.config import ConfigError
from raycompat.data.scenarios import SCENARIOS, Scenario, ScenarioSizes, Split
from raycompat.data.source import DataSourceOptions, LabelledItems, SourceSpec, list_items

#: Splits every scenario has; ``train_<g>`` (sequential) may be added.
REQUIRED_SPLITS = ("old_train", "new_train", "query", "gallery", "distractors")
#: Split names a manifest may use for the same thing.
SPLIT_SYNONYMS = {"distractor": "distractors"}
OLD_FRACTION = 0.3
SEQUENTIAL_FRACTIONS = (0.25, 0.5, 1.0)
MANIFEST_COLUMNS = ("item", "class", "split")


def _split(name: str, items: LabelledItems, positions, label_of: dict) -> Split:
    positions = list(positions)
    labels = [label_of[items.classes[p]] for p in positions]
    keys = [items.keys[p] for p in positions]
    return Split(name, labels, np.arange(len(keys)), keys)


def _class_members(items: LabelledItems, seed: int) -> dict[str, list[int]]:
    """Class name -> positions of its items, in a seeded random order."""
    members: dict[str, list[int]] = {}
    for p, c in enumerate(items.classes):
        members.setdefault(c, []).append(p)
    rng = np.random.default_rng([int(seed), 0x05E7])
    return {c: [m[i] for i in rng.permutation(len(m))] for c, m in sorted(members.items())}


def _hold_out(members, seed: int, eval_fraction: float, distractor_fraction: float):
    """``(train, eval, distractor)`` class names: eval classes need two images or more."""
    names = sorted(members)
    order = [names[i] for i in np.random.default_rng([int(seed), 0xC1A5]).permutation(len(names))]
    n_eval = max(1, int(round(eval_fraction * len(names))))
    n_dis = int(round(distractor_fraction * len(names)))
    evals = [c for c in order if len(members[c]) >= 2][:n_eval]
    if len(evals) < n_eval:
        raise ConfigError(
            f"only {len(evals)} classes have the two images a query and a gallery item need; "
            f"--eval-fraction {eval_fraction} asks for {n_eval}"
        )
    rest = [c for c in order if c not in set(evals)]
    train, distractors = rest[n_dis:], sorted(rest[:n_dis])
    if len(train) < 2:
        raise ConfigError(
            f"{len(names)} classes leave {len(train)} for training after holding out "
            f"{n_eval} eval and {n_dis} distractor classes: need at least 2"
        )
    return train, sorted(evals), distractors


def _train_splits(name: str, train: list[str], members, items, label_of) -> tuple[dict, dict]:
    """The training splits of allocation ``name`` (docs/methods.md, "Upgrade scenarios")."""

    def classes_split(split: str, classes) -> Split:
        positions = [p for c in sorted(classes) for p in sorted(members[c])]
        return _split(split, items, positions, label_of)

    def prefix(fraction: float) -> list[str]:
        return train[: max(1, int(round(fraction * len(train))))]

    if name in ("extended-data", "open-data"):
        old, new = [], []
        for c in sorted(train):
            m = members[c]
            k = max(1, min(len(m) - 1, int(round(OLD_FRACTION * len(m)))))
            old += sorted(m[:k])
            new += sorted(m if name == "extended-data" or len(m) == 1 else m[k:])
        split = {"old_train": old, "new_train": new}
        return {k: _split(k, items, v, label_of) for k, v in split.items()}, {}
    if name in ("open-class", "extended-class"):
        old = prefix(OLD_FRACTION)[: len(train) - 1]
        new = train if name == "extended-class" else train[len(old) :]
        return {
            "old_train": classes_split("old_train", old),
            "new_train": classes_split("new_train", new),
        }, {}
    gens = {f"train_{g}": prefix(f) for g, f in enumerate(SEQUENTIAL_FRACTIONS, start=1)}
    splits = {k: classes_split(k, v) for k, v in gens.items()}
    return splits, {"old_train": "train_1", "new_train": f"train_{len(gens)}"}


def allocate(
    items: LabelledItems,
    name: str,
    *,
    seed: int = 0,
    eval_fraction: float = 0.25,
    distractor_fraction: float = 0.0,
    queries_per_class: int = 2,
) -> Scenario:
    """Allocation ``name`` (one of ``SCENARIOS``) of ``items``, deterministic in ``seed``.
    Each eval class gives ``min(queries_per_class, n - 1)`` queries and the rest to the
    gallery; distractor classes give all their images to the gallery."""
    if name not in SCENARIOS:
        raise ConfigError(f"unknown allocation {name!r}; expected one of: {', '.join(SCENARIOS)}")
    members = _class_members(items, seed)
    train, evals, distractors = _hold_out(members, seed, eval_fraction, distractor_fraction)
    label_of = {c: i for i, c in enumerate(items.class_names)}
    splits, aliases = _train_splits(name, train, members, items, label_of)
    query, gallery = [], []
    for c in evals:
        k = min(int(queries_per_class), len(members[c]) - 1)
        query += sorted(members[c][:k])
        gallery += sorted(members[c][k:])
    splits["query"] = _split("query", items, query, label_of)
    splits["gallery"] = _split("gallery", items, gallery, label_of)
    dis = [p for c in distractors for p in sorted(members[c])]
    splits["distractors"] = _split("distractors", items, dis, label_of)
    params = dict(
        allocation=name,
        eval_fraction=float(eval_fraction),
        distractor_fraction=float(distractor_fraction),
        queries_per_class=int(queries_per_class),
        old_fraction=OLD_FRACTION,
        source_items=len(items),
        source_classes=len(label_of),
    )
    return Scenario(
        name, int(seed), splits, params, aliases, items.class_names, items.spec.to_dict()
    )


def _read_manifest_rows(path: str) -> list[tuple[str, str, str]]:
    """``(item, class, split)`` rows of a CSV or parquet manifest (errors name the file)."""
    if not os.path.isfile(path):
        raise ConfigError(f"manifest {path}: no such file")
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        columns = {c: [str(v) for v in table.column(c).to_pylist()] for c in table.column_names}
    else:
        import csv

        with open(path, newline="") as fh:
            rows = list(csv.DictReader(fh))
        names = list(rows[0]) if rows else []
        columns = {c: [str(r[c] or "").strip() for r in rows] for c in names}
    missing = [c for c in MANIFEST_COLUMNS if c not in columns]
    if missing:
        raise ConfigError(f"manifest {path} lacks column(s) {missing}; has {sorted(columns)}")
    return list(zip(*(columns[c] for c in MANIFEST_COLUMNS), strict=True))


def from_manifest(items: LabelledItems, path: str) -> Scenario:
    """The scenario an explicit manifest (columns item, class, split) gives; items are keys of
    ``items``' source and must all exist there."""
    rows = _read_manifest_rows(path)
    known = set(items.keys)
    unknown = [r[0] for r in rows if r[0] not in known]
    if unknown:
        raise ConfigError(
            f"manifest {path}: {len(unknown)} item(s) not in {items.spec.describe()}, "
            f"e.g. {unknown[:5]}"
        )
    listed = LabelledItems(items.spec, [r[0] for r in rows], [r[1] for r in rows])
    splits = [SPLIT_SYNONYMS.get(r[2], r[2]) for r in rows]
    return _explicit(listed, splits, f"manifest {path}")


def from_layout(root: str) -> Scenario:
    """The scenario of a ``root/<split>/<class>/<image>`` folder (an image_folder source at
    ``root`` whose keys are ``<split>/<class>/<image>``)."""
    from raycompat.data.readers import read_image_folder

    root = os.path.abspath(os.path.expanduser(root))
    if not os.path.isdir(root):
        raise ConfigError(f"layout {root}: no such folder")
    keys, classes, splits = [], [], []
    for split in sorted(os.listdir(root)):
        if split.startswith(".") or not os.path.isdir(os.path.join(root, split)):
            continue
        try:
            records = read_image_folder(os.path.join(root, split))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"layout {root}: {exc}") from None
        for r in records:
            keys.append(os.path.relpath(r.path, root))
            classes.append(records.class_names[r.label])
            splits.append(SPLIT_SYNONYMS.get(split, split))
    spec = SourceSpec("image_folder", root)
    return _explicit(LabelledItems(spec, keys, classes), splits, f"layout {root}")


def _explicit(items: LabelledItems, split_of: list[str], where: str) -> Scenario:
    allowed = set(REQUIRED_SPLITS)
    bad = sorted({s for s in split_of if s not in allowed and not _is_generation(s)})
    if bad:
        raise ConfigError(
            f"{where}: unknown split(s) {bad}; allowed: {', '.join(REQUIRED_SPLITS)}, train_<g>"
        )
    gens = sorted({s for s in split_of if _is_generation(s)}, key=lambda s: int(s[6:]))
    needed = ["query", "gallery"] + ([] if gens else ["old_train", "new_train"])
    missing = [s for s in needed if s not in split_of]
    if missing:
        raise ConfigError(f"{where}: no item in split(s) {missing}")
    label_of = {c: i for i, c in enumerate(items.class_names)}
    splits = {
        s: _split(s, items, [p for p, x in enumerate(split_of) if x == s], label_of)
        for s in [*REQUIRED_SPLITS, *gens]
        if s not in ("old_train", "new_train") or not gens
    }
    aliases = {"old_train": gens[0], "new_train": gens[-1]} if gens else {}
    params = dict(allocation="explicit", defined_by=where, source_items=len(items))
    name = "sequential" if gens else "custom"
    return Scenario(name, 0, splits, params, aliases, items.class_names, items.spec.to_dict())


def _is_generation(split: str) -> bool:
    return split.startswith("train_") and split[6:].isdigit()


# ----------------------------------------------------------------------------- scenario.json
def read_scenario_file(path: str) -> Scenario:
    """A ``scenario.json``, checked field by field: every error names the file and the field
    (a folder, a file that is not JSON, a missing field, an item whose class disagrees with
    its label)."""
    if os.path.isdir(path):
        raise ConfigError(f"scenario file {path} is a folder; expected a scenario.json")
    if not os.path.isfile(path):
        raise ConfigError(f"scenario file {path}: no such file")
    try:
        with open(path) as fh:
            data = json.load(fh)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(f"scenario file {path} is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"scenario file {path}: expected a JSON object, got {type(data).__name__}"
        )
    _check_fields(data, path)
    try:
        scenario = Scenario.from_dict(data)
    except (ValueError, TypeError, KeyError) as exc:
        raise ConfigError(f"scenario file {path}: {exc}") from None
    if scenario.user_data:
        SourceSpec.from_dict(scenario.source, f"scenario file {path}")
        try:
            _check_user_splits(data, path)
        except (TypeError, IndexError) as exc:  # a field of the wrong type
            raise ConfigError(f"scenario file {path}: {exc}") from None
    return scenario


def _check_fields(data: dict, path: str) -> None:
    for key, kind in (("name", str), ("seed", int), ("splits", dict)):
        if key not in data:
            raise ConfigError(f"scenario file {path} lacks field {key!r}")
        if not isinstance(data[key], kind):
            raise ConfigError(f"scenario file {path}: field {key!r} must be a {kind.__name__}")
    aliased = set(data.get("aliases") or {})
    for split in REQUIRED_SPLITS:
        if split not in data["splits"] and split not in aliased:
            raise ConfigError(f"scenario file {path} lacks field 'splits.{split}'")
    for split, body in data["splits"].items():
        for key in ("name", "labels", "instances"):
            if not isinstance(body, dict) or key not in body:
                raise ConfigError(f"scenario file {path} lacks field 'splits.{split}.{key}'")
    if ("source" in data) != ("class_names" in data):
        raise ConfigError(
            f"scenario file {path}: fields 'source' and 'class_names' go together "
            "(a scenario of your images has both, a glyph scenario neither)"
        )


def _check_user_splits(data: dict, path: str) -> None:
    """Every item's stored class name must be the class its label names: labels cannot drift."""
    names = data["class_names"]
    for split, body in data["splits"].items():
        for key in ("items", "classes"):
            if key not in body:
                raise ConfigError(f"scenario file {path} lacks field 'splits.{split}.{key}'")
        if len(body["classes"]) != len(body["items"]):
            raise ConfigError(
                f"scenario file {path}: 'splits.{split}' has {len(body['items'])} items but "
                f"{len(body['classes'])} classes"
            )
        for item, label, cls in zip(body["items"], body["labels"], body["classes"], strict=True):
            if not 0 <= label < len(names) or names[label] != cls:
                named = names[label] if 0 <= label < len(names) else "out of range"
                raise ConfigError(
                    f"scenario file {path}: split {split!r} item {item!r} has class {cls!r} "
                    f"but label {label} ({named!r}): the labels and class names disagree"
                )


def write_scenario_file(scenario: Scenario, path: str) -> str:
    """Write ``scenario`` as JSON (atomically)."""
    from raycompat.report import write_json

    return write_json(path, scenario.to_dict())


@lru_cache(maxsize=4)
def _cached_items(spec: SourceSpec) -> LabelledItems:
    return list_items(spec)


def resolve_scenario(
    sizes: ScenarioSizes, data: DataSourceOptions | None = None, name: str | None = None
) -> Scenario:
    """The scenario a job runs on: ``--scenario FILE``; else the glyph allocation the sizes
    describe; else allocation ``name`` (default ``--scenario``) of ``--source``'s images."""
    data = data or DataSourceOptions()
    if sizes.scenario_file and name is None:
        scenario = read_scenario_file(sizes.scenario_file)
        if data.user and scenario.source and scenario.source["path"] != data.spec().path:
            raise ConfigError(
                f"--scenario {sizes.scenario} is over {scenario.source['path']}, "
                f"but --path is {data.spec().path}: give one of them"
            )
        return scenario
    if not data.user:
        try:
            return sizes.build(name=name or sizes.scenario)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    return allocate(
        _cached_items(data.spec()),
        name or sizes.scenario,
        seed=sizes.data_seed,
        eval_fraction=data.eval_fraction,
        distractor_fraction=data.distractor_fraction,
        queries_per_class=sizes.queries_per_class,
    )
