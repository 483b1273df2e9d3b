"""Your own images end to end: scenario -> train-old -> train bct -> embed-gallery ->
simulate-backfill through the public jobs, labels by class name, and every bad input named."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from PIL import Image

from raycompat.data import GlyphRenderer, default_catalog

CLASSES = 10
TRAIN_FLAGS = [
    "--workers", "0",  # Ray Train's local mode (tests/train tests DDP)
    "--backbone", "lcnet_050", "--resolution", "16", "--embed-dim", "32", "--epochs", "1",
    "--batch-size", "8", "--lr", "0.05",
]  # fmt: skip


def write_folder(root, classes, per_class: int, offset: int = 0) -> str:
    """A user-style image folder: RGB PNGs of rendered glyphs, class names as folder names."""
    renderer = GlyphRenderer(default_catalog(), resolution=20, seed=3)
    for c in classes:
        folder = os.path.join(root, f"species_{c:02d}")
        os.makedirs(folder, exist_ok=True)
        for i in range(per_class + c % 2):
            g = renderer.render(50 + 3 * c, offset + i)
            rgb = np.stack([g, 255 - g, g // 2 + 40], -1).astype(np.uint8)
            Image.fromarray(rgb).save(os.path.join(folder, f"img_{offset + i:03d}.png"))
    return str(root)


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    return write_folder(tmp_path_factory.mktemp("user") / "photos", range(CLASSES), 6)


def run_job(capsys, module: str, *args: str) -> tuple[int, str, str]:
    import importlib

    code = importlib.import_module(module).main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def scenario_file(capsys, photos, out, *extra) -> str:
    code, _, err = run_job(
        capsys,
        "raycompat.scenario_job",
        "--source", "image_folder", "--path", photos, "--eval-fraction", "0.3",
        "--out", str(out), *extra,
    )  # fmt: skip
    assert code == 0, err
    return str(out)


def test_scenario_lists_every_item_with_its_split_and_class(capsys, photos, tmp_path):
    path = scenario_file(capsys, photos, tmp_path / "scenario.json")
    data = json.load(open(path))
    assert data["source"] == {"kind": "image_folder", "path": photos}
    assert data["class_names"] == [f"species_{c:02d}" for c in range(CLASSES)]
    for split in ("old_train", "new_train", "query", "gallery", "distractors"):
        body = data["splits"][split]
        assert len(body["items"]) == len(body["labels"]) == len(body["classes"])
        for item, cls in zip(body["items"], body["classes"], strict=True):
            assert item.split("/")[0] == cls  # the folder is the class
    q, g = data["splits"]["query"], data["splits"]["gallery"]
    assert set(q["classes"]) == set(g["classes"]) and len(set(q["classes"])) == 3
    assert not set(q["items"]) & set(g["items"])
    train = set(data["splits"]["new_train"]["classes"])
    assert not train & set(q["classes"])  # held-out classes never train
    again = scenario_file(capsys, photos, tmp_path / "again.json")
    assert json.load(open(again)) == data  # seeded: the same file twice
    code, _, err = run_job(
        capsys, "raycompat.scenario_job", "--source", "image_folder", "--path", photos,
        "--out", path,
    )  # fmt: skip
    assert code == 2 and f"{path} exists: pass --overwrite" in err


def test_manifest_and_layout_give_explicit_splits(capsys, photos, tmp_path):
    rows = ["item,class,split"]
    for c in range(4):
        for i in range(3):
            split = ("old_train", "new_train", "query" if i == 0 else "gallery")[min(c, 2)]
            rows.append(f"species_{c:02d}/img_{i:03d}.png,species_{c:02d},{split}")
    manifest = tmp_path / "items.csv"
    manifest.write_text("\n".join(rows) + "\n")
    path = scenario_file(capsys, photos, tmp_path / "m.json", "--manifest", str(manifest))
    data = json.load(open(path))
    assert data["name"] == "custom"
    assert data["splits"]["query"]["items"] == [
        "species_02/img_000.png",
        "species_03/img_000.png",
    ]
    layout = tmp_path / "layout"
    for split, classes in (("old_train", [0, 1]), ("new_train", [0, 1, 2]), ("query", [5])):
        write_folder(layout / split, classes, 2)
    write_folder(layout / "gallery", [5], 3, offset=10)
    code, _, err = run_job(
        capsys, "raycompat.scenario_job", "--layout", str(layout), "--out", str(tmp_path / "l.json")
    )
    assert code == 0, err
    data = json.load(open(tmp_path / "l.json"))
    assert data["splits"]["gallery"]["classes"] == ["species_05"] * 4
    assert data["splits"]["query"]["items"][0] == "query/species_05/img_000.png"


def _bad_scenarios(tmp_path, good: str) -> list[tuple[str, str]]:
    data = json.load(open(good))
    no_splits = {k: v for k, v in data.items() if k != "splits"}
    drifted = json.loads(json.dumps(data))
    drifted["splits"]["gallery"]["labels"][0] += 1  # a label that names another class
    cases = {
        "folder": (None, "is a folder; expected a scenario.json"),
        "notjson.json": ("{not json", "is not JSON"),
        "nosplits.json": (json.dumps(no_splits), "lacks field 'splits'"),
        "drift.json": (json.dumps(drifted), "the labels and class names disagree"),
    }
    out = []
    for name, (text, message) in cases.items():
        path = tmp_path / name
        if text is None:
            path.mkdir()
        else:
            path.write_text(text)
        out.append((str(path), message))
    return out


def test_bad_scenario_files_name_the_file_and_field(capsys, photos, tmp_path):
    good = scenario_file(capsys, photos, tmp_path / "scenario.json")
    for path, message in _bad_scenarios(tmp_path, good):
        code, _, err = run_job(capsys, "raycompat.train.old_job", "--scenario", path, *TRAIN_FLAGS)
        assert code == 2, (path, err)
        assert path in err and message in err and "Traceback" not in err


def test_bad_sources_are_named(capsys, tmp_path):
    cases = [
        (["--source", "image_folder"], "--source image_folder needs --path"),
        (["--source", "image_folder", "--path", str(tmp_path / "none")], "no such file"),
        (["--source", "gldv2", "--path", str(tmp_path)], "needs --image-root"),
        (["--path", str(tmp_path)], "needs --source image_folder|parquet|gldv2"),  # not glyphs
        (["--source", "image_folder", "--path", str(tmp_path), "--eval-fraction", "1"], "(0, 1)"),
    ]
    for args, message in cases:
        code, _, err = run_job(capsys, "raycompat.scenario_job", *args, "--out", "x.json")
        assert code == 2 and message in err, err


def _direct_map(models, scenario, resolution: int) -> tuple[float, float]:
    """mAP@100 of new->old and new->new computed without the pipeline or the simulator."""
    from raycompat.evaluation import embed_scenario, evaluate_pair, scenario_eval_items
    from raycompat.models import ModelBundle

    sets = {
        n: embed_scenario(n, ModelBundle.load(p), scenario, resolution) for n, p in models.items()
    }
    (q_labels, _), (g_labels, _) = scenario_eval_items(scenario)
    new_old = evaluate_pair(sets["bct"].query, sets["old"].gallery, q_labels, g_labels)
    new_new = evaluate_pair(sets["bct"].query, sets["bct"].gallery, q_labels, g_labels)
    return new_old["mAP@100"], new_new["mAP@100"]


def test_your_images_end_to_end_through_the_jobs(ray_cluster, capsys, photos, tmp_path):
    from raycompat.data.user_scenarios import read_scenario_file

    scenario = scenario_file(capsys, photos, tmp_path / "scenario.json")
    models = {n: str(tmp_path / "models" / n) for n in ("old", "bct")}
    storage = ["--storage", str(tmp_path / "runs")]
    base = ["--scenario", scenario, *TRAIN_FLAGS, *storage]
    code, _, err = run_job(capsys, "raycompat.train.old_job", *base, "--out", models["old"])
    assert code == 0, err
    bct = [*base, "--method", "bct", "--old-model", models["old"], "--out", models["bct"]]
    code, _, err = run_job(capsys, "raycompat.train.job", *bct)
    assert code == 0, err
    manifest = json.load(open(os.path.join(models["bct"], "manifest.json")))
    assert manifest["class_names"] == [
        json.load(open(scenario))["class_names"][c] for c in manifest["classes"]
    ]
    emb = str(tmp_path / "emb")
    code, _, err = run_job(
        capsys, "raycompat.pipeline.job", "--scenario", scenario, "--old-model", models["old"],
        "--new-model", models["bct"], "--columns", "old,new", "--out", emb,
        "--model-stages", "tasks",
    )  # fmt: skip
    assert code == 0, err
    report = str(tmp_path / "report")
    code, _, err = run_job(
        capsys, "raycompat.simulator.job", "--embeddings", emb, "--policies", "random",
        "--modes", "compatible", "--out", report,
    )  # fmt: skip
    assert code == 0, err
    curve = json.load(open(os.path.join(report, "curves.json")))["curves"][0]
    new_old, new_new = _direct_map(models, read_scenario_file(scenario), 16)
    assert curve["metrics"]["mAP@100"][0] == pytest.approx(new_old, abs=1e-6)
    assert curve["metrics"]["mAP@100"][-1] == pytest.approx(new_new, abs=1e-6)


def test_query_and_gallery_folders_with_different_classes(ray_cluster, capsys, tmp_path):
    """Each folder numbers its own classes; matched by class name the metrics are right."""
    from raycompat.embeddings.gallery import load_parquet
    from raycompat.evaluation import evaluate_pair

    queries = write_folder(tmp_path / "queries", [1, 2, 3], 2)
    gallery = write_folder(tmp_path / "gallery", [0, 2, 3, 4, 5], 3, offset=10)
    emb = tmp_path / "emb"
    emb.mkdir()
    for folder, split in ((queries, "query"), (gallery, "gallery")):
        code, _, err = run_job(
            capsys, "raycompat.pipeline.job", "--source", "image_folder", "--path", folder,
            "--split", split, "--random-init", str(tmp_path / "models"), "--resolution", "16",
            "--columns", "old,new", "--out", str(emb / split), "--model-stages", "tasks",
        )  # fmt: skip
        assert code == 0, err
    data = load_parquet(str(emb))
    assert "label maps differ" in data.extra["label_note"]
    names, positions = {"query": [], "gallery": []}, {"query": [], "gallery": []}
    for split, folder in (("query", queries), ("gallery", gallery)):
        for i, c in enumerate(sorted(os.listdir(folder))):
            n = len(os.listdir(os.path.join(folder, c)))
            names[split] += [c] * n
            positions[split] += [i] * n
    got = evaluate_pair(data.query_new, data.gallery_new, data.query_labels, data.gallery_labels)
    want = evaluate_pair(data.query_new, data.gallery_new, names["query"], names["gallery"])
    assert got == want and got["mAP@100"] > 0
    # each folder's own positions pair species_01 queries with species_02 items, and so on
    drifted = evaluate_pair(
        data.query_new, data.gallery_new, positions["query"], positions["gallery"]
    )
    assert drifted != want


def test_mixed_dimension_shards_name_the_file_and_column(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from raycompat.embeddings.gallery import BackfillInputError, load_parquet

    for name, dim in (("a", 64), ("b", 128)):
        vec = pa.array([[0.1] * dim] * 2, type=pa.list_(pa.float32(), dim))
        table = pa.table(
            {"item_id": [0, 1], "label": [0, 0], "split": ["query", "gallery"], "old": vec,
             "new": vec}
        )  # fmt: skip
        pq.write_table(table, tmp_path / f"{name}.parquet")
    with pytest.raises(BackfillInputError, match=r"column 'old': 64 in shard .*a\.parquet, 128"):
        load_parquet(str(tmp_path))


def test_parquet_and_gldv2_sources_give_the_same_scenario_shape(capsys, photos, tmp_path):
    """The three user sources name items by key and class; a scenario of each decodes."""
    import shutil

    import pyarrow as pa
    import pyarrow.parquet as pq

    from raycompat.data.source import ItemImages, SourceSpec
    from raycompat.data.user_scenarios import read_scenario_file

    classes, ids, images, csv_rows = [], [], [], ["id,url,landmark_id"]
    for c, name in enumerate(sorted(os.listdir(photos))):
        for f in sorted(os.listdir(os.path.join(photos, name))):
            ids.append(len(ids) + 100)
            classes.append(name)
            images.append(open(os.path.join(photos, name, f), "rb").read())
            image_id = f"{ids[-1]:03x}abc"
            csv_rows.append(f"{image_id},,{c}")
            dest = tmp_path / "gld" / image_id[0] / image_id[1] / image_id[2]
            dest.mkdir(parents=True, exist_ok=True)
            shutil.copy(os.path.join(photos, name, f), dest / f"{image_id}.jpg")
    table = pa.table({"item_id": ids, "label": classes, "image": pa.array(images, pa.binary())})
    pq.write_table(table, tmp_path / "images.parquet", row_group_size=7)
    (tmp_path / "train.csv").write_text("\n".join(csv_rows) + "\n")
    sources = {
        "parquet": ["--path", str(tmp_path / "images.parquet")],
        "gldv2": ["--path", str(tmp_path / "train.csv"), "--image-root", str(tmp_path / "gld")],
    }
    for kind, args in sources.items():
        out = scenario_file(capsys, photos, tmp_path / f"{kind}.json", "--source", kind, *args)
        scenario = read_scenario_file(out)
        assert scenario.source["kind"] == kind and len(scenario.class_names) == CLASSES
        query = scenario.splits["query"]
        assert len(query) == 6 and len(set(query.labels.tolist())) == 3
        images = ItemImages(SourceSpec.from_dict(scenario.source), 16)
        assert images.load(query.items[0]).shape == (16, 16, 3)


def test_an_old_model_of_other_classes_is_refused():
    """Head rows are tied to class names: an old model trained on another scenario (or on
    glyphs) cannot pair its rows with this scenario's labels."""
    from raycompat.config import ConfigError
    from raycompat.train.config import check_old_classes

    scenario = {"class_names": ["ant", "bee", "cat"]}
    check_old_classes({"classes": [0, 2], "class_names": ["ant", "cat"]}, scenario, "m")
    check_old_classes({"classes": []}, scenario, "imported")  # no head rows: nothing to pair
    with pytest.raises(ConfigError, match=r"disagree on 1 class\(es\).*label 2: 'dog' vs 'cat'"):
        check_old_classes({"classes": [0, 2], "class_names": ["ant", "dog"]}, scenario, "m")
    with pytest.raises(ConfigError, match="trained on the built-in glyphs"):
        check_old_classes({"classes": [0, 2]}, scenario, "m")
    with pytest.raises(ConfigError, match="trained on your images"):
        check_old_classes({"classes": [0], "class_names": ["ant"]}, {"splits": {}}, "m")


def test_train_out_onto_another_bundle_is_refused_before_ray(capsys, photos, tmp_path):
    """train-old --out onto a bundle trained with another config names the path and exits 2
    before Ray starts (the 16-epoch model is never replaced by a 1-epoch one)."""
    from raycompat.train import TrainConfig

    scenario = scenario_file(capsys, photos, tmp_path / "scenario.json")
    bundle = tmp_path / "models" / "old"
    bundle.mkdir(parents=True)
    cfg = TrainConfig(epochs=16, scenario={"name": "x", "splits": {}})
    manifest = {"train_config": {k: v for k, v in cfg.to_dict().items() if k != "scenario"}}
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    code, _, err = run_job(
        capsys, "raycompat.train.old_job", "--scenario", scenario, *TRAIN_FLAGS,
        "--out", str(bundle),
    )  # fmt: skip
    assert code == 2 and f"{bundle} holds a model bundle trained with a different config" in err
    assert "--overwrite" in err and json.loads((bundle / "manifest.json").read_text()) == manifest


def test_a_corrupt_training_image_is_one_error_line(capsys, tmp_path):
    """train-old on a folder with one corrupt image in a training class: one ``error:`` line
    naming the file, exit 2, no traceback, and nothing started (no run folder)."""
    photos = write_folder(tmp_path / "photos", range(CLASSES), 6)
    scenario = scenario_file(capsys, photos, tmp_path / "scenario.json")
    items = json.load(open(scenario))["splits"]["old_train"]["items"]
    bad = os.path.join(photos, items[len(items) // 2])
    with open(bad, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n this is not a picture")
    runs, out = tmp_path / "runs", tmp_path / "models" / "old"
    code, _, err = run_job(
        capsys, "raycompat.train.old_job", "--scenario", scenario, *TRAIN_FLAGS,
        "--storage", str(runs), "--out", str(out),
    )  # fmt: skip
    assert code == 2, err
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: {bad}: cannot decode the image"), err
    assert "training split 'old_train'" in lines[0]
    assert not runs.exists() and not out.exists()


def test_class_names_that_cannot_be_matched_are_refused(tmp_path):
    """Shards that store class names only in part, an empty name, or a label with two names
    in one file: each refused, naming the file and the classes."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from raycompat.embeddings.gallery import BackfillInputError, load_parquet

    vec = pa.array([[0.1, 0.2]] * 2, type=pa.list_(pa.float32(), 2))

    def shard(folder, name, first_id=0, **names):
        ids = [first_id, first_id + 1]
        base = {"item_id": ids, "label": [0, 0], "split": ["query", "gallery"]}
        (tmp_path / folder).mkdir(exist_ok=True)
        table = pa.table({**base, **{k: v for k, v in names.items()}, "old": vec, "new": vec})
        pq.write_table(table, tmp_path / folder / f"{name}.parquet")

    shard("part", "a", class_name=["ant", "ant"])
    shard("part", "b")
    with pytest.raises(BackfillInputError, match=r"a\.parquet stores class names but .*b\.parq"):
        load_parquet(str(tmp_path / "part"))
    shard("empty", "a", class_name=["ant", ""])
    with pytest.raises(BackfillInputError, match=r"'class_name' of .*a\.parquet has empty"):
        load_parquet(str(tmp_path / "empty"))
    shard("two", "a", class_name=["ant", "bee"])
    with pytest.raises(BackfillInputError, match=r"label 0 is both class '(ant|bee)' and"):
        load_parquet(str(tmp_path / "two"))
    shard("ok", "a", class_name=["bee", "bee"])
    shard("ok", "b", 2, class_name=["ant", "ant"])  # label 0 is another class here: matched by name
    data = load_parquet(str(tmp_path / "ok"))
    assert data.query_labels.tolist() == [1, 0] == data.gallery_labels.tolist()  # bee, ant
    assert "label maps differ" in data.extra["label_note"]
