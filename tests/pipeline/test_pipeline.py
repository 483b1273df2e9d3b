"""Gallery embedding pipeline on the session's real local Ray cluster.

Small random-init bundles (timm ``test_resnet``), a tiny glyph scenario plus generated
distractors; vectors are compared with direct model calls on the same items.
"""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import time

import locations
import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from raycompat.config import ConfigError
from raycompat.data import CorruptImageError, GlyphRenderer, build_scenario, default_catalog
from raycompat.embeddings.gallery import load_parquet
from raycompat.evaluation import embed_glyphs
from raycompat.models import ModelBundle
from raycompat.models.uncertainty_head import UncertaintyHead
from raycompat.pipeline import (
    EXTRA_INSTANCE_BASE,
    ExecutionOptions,
    GlyphGallerySource,
    IdPlan,
    OldFeatureSource,
    ParquetImageSource,
    PipelineOptions,
    RecordSource,
    embed_gallery,
    make_random_bundles,
)
from raycompat.pipeline.ids import ForwardBatches, parse_ids_option
from raycompat.pipeline.options import pipeline_options
from raycompat.pipeline.stages import POSITION_COLUMN, EmbedStage, cached_stage
from raycompat.upgrade.policies import uncertainty_scores

REPO = locations.REPO
OLD_DIM, NEW_DIM = 16, 24


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    return make_random_bundles(
        str(tmp_path_factory.mktemp("models")),
        backbone="test_resnet",
        old_dim=OLD_DIM,
        new_dim=NEW_DIM,
        num_classes=12,
        psi_hidden=32,
        seed=3,
    )


@pytest.fixture(scope="module")
def scenario():
    return build_scenario(
        "extended-class",
        catalog=default_catalog(),
        num_train_classes=10,
        images_per_class=2,
        num_eval_classes=4,
        queries_per_class=1,
        gallery_per_class=3,
        num_distractor_classes=3,
        distractors_per_class=2,
        seed=1,
    )


def small_options(**kw) -> PipelineOptions:
    """Chunks of 16 ids, batches of 8; model stages as Ray tasks unless ``model_stages``
    (workers keep their models between runs: the suite starts no actor per run)."""
    kw.setdefault("model_stages", "tasks")
    opts = PipelineOptions(chunk_size=16, progress_every_s=1000.0, **kw)
    for st in opts.stages.values():
        st.batch_size = 8
    return opts


def quiet(_message):
    pass


def direct(bundles, source, ids):
    """Reference: the models called directly on the same items (no Ray)."""
    old_b, new_b = (ModelBundle.load(p) for p in bundles)
    labels, instances, _ = source.items(ids)
    renderer = GlyphRenderer(default_catalog(), resolution=source.resolution, seed=source.data_seed)
    old = embed_glyphs(old_b, renderer, labels, instances)
    new = embed_glyphs(new_b, renderer, labels, instances)
    with torch.no_grad():
        adapted = new_b.modules["psi"].eval()(torch.from_numpy(old)).numpy()
    head = UncertaintyHead.from_classifier_head(new_b.head)
    unc = {
        f"unc_{k}": uncertainty_scores(old, head, k)
        for k in ("least_confidence", "margin", "entropy")
    }
    return dict(old=old, new=new, adapted=adapted, label=labels, **unc)


def vectors(table, column):
    return np.asarray(table.column(column).to_pylist(), np.float32)


# ----------------------------------------------------------------------------- no Ray needed
def test_id_plan_chunks_cover_every_id_once():
    plan = IdPlan(5, 0, 23)
    assert plan.num_chunks == 5 and plan.chunk_length(4) == 3
    ids = np.concatenate([plan.chunk_ids(c) for c in range(plan.num_chunks)])
    assert ids.tolist() == list(range(23))
    assert plan.chunk_of(ids).tolist() == [i // 5 for i in range(23)]
    listed = IdPlan.from_ids([40, 3, 17, 3], 2)
    assert listed.ids.tolist() == [3, 17, 40] and listed.chunk_ids(1).tolist() == [40]
    assert listed.chunk_of([3, 17, 40]).tolist() == [0, 0, 1]


def test_forward_batches_follow_plan_positions_only():
    """Chunks of 12 of 28 positions cut into sub-batches of 8 from each chunk's start:
    [0, 8), [8, 12), [12, 20), [20, 24), [24, 28)."""
    batches = ForwardBatches.of(IdPlan(12, 100, 128), 8)
    got = [
        (rows.tolist(), length, offsets.tolist())
        for rows, length, offsets in batches.split([9, 3, 25, 11, 12])
    ]
    assert got == [([1], 8, [3]), ([0, 3], 4, [1, 3]), ([4], 8, [0]), ([2], 4, [1])]
    with pytest.raises(IndexError, match=r"\[0, 28\)"):
        batches.split([27, 28])


def test_embed_stage_rows_do_not_depend_on_the_batch_they_arrive_in(bundles):
    """An embedding stage given the rows of a plan whole, one by one or in ragged shuffled
    pieces writes the same bits (each row runs in its fixed sub-batch and place)."""
    threads = torch.get_num_threads()
    try:
        stage = EmbedStage(bundles[0], "old", ForwardBatches(12, 28, 8), threads=1)
        pixels = np.random.default_rng(4).uniform(-1, 1, (28, 1, 16, 16)).astype(np.float32)

        def embed(rows):
            rows = np.asarray(rows)
            batch = {"item_id": rows + 100, "pixels": pixels[rows], POSITION_COLUMN: rows}
            return stage(batch)["old"]

        whole = embed(np.arange(28))
        assert whole.shape == (28, OLD_DIM)
        for pieces in ([[r] for r in range(28)], [[5, 20, 1], [27, 9], list(range(10, 20))]):
            for rows in pieces:
                np.testing.assert_array_equal(embed(rows), whole[rows])
    finally:
        torch.set_num_threads(threads)


class _Built:
    count = 0

    def __init__(self, value):
        _Built.count += 1
        self.value = value


def test_model_stages_option_and_the_worker_cache():
    """``--model-stages`` takes actors or tasks; a task's worker builds a stage once per class,
    bundle fingerprint and arguments and keeps the 4 most recently used."""
    assert pipeline_options(ExecutionOptions(model_stages="tasks")).model_stages == "tasks"
    assert PipelineOptions().model_stages == "actors"
    with pytest.raises(ConfigError, match=r"--model-stages 'threads'.*\['actors', 'tasks'\]"):
        PipelineOptions(model_stages="threads").check()
    first = cached_stage(_Built, "f1", value=1)
    assert cached_stage(_Built, "f1", value=1) is first and _Built.count == 1
    assert cached_stage(_Built, "f2", value=1) is not first  # the bundle was saved again
    for v in range(2, 5):
        cached_stage(_Built, "f1", value=v)
    assert _Built.count == 5
    cached_stage(_Built, "f1", value=1)  # dropped: the 4 most recent are f2 and values 2..4
    assert _Built.count == 6


def test_ids_option(tmp_path):
    assert parse_ids_option("4:7").tolist() == [4, 5, 6]
    f = tmp_path / "ids.txt"
    f.write_text("5\n1, 9\n")
    assert parse_ids_option(str(f)).tolist() == [5, 1, 9]
    with pytest.raises(ConfigError, match="START < STOP"):
        parse_ids_option("7:4")
    f.write_text("1 two\n")
    with pytest.raises(ConfigError, match="integer"):
        parse_ids_option(str(f))


def test_glyph_ids_are_stable_and_distractors_avoid_query_classes(scenario):
    src = GlyphGallerySource(scenario, extra_distractors=50, resolution=16, data_seed=2)
    q, g, d = (len(scenario.splits[k]) for k in ("query", "gallery", "distractors"))
    labels, instances, codes = src.items(np.arange(src.num_ids()))
    assert codes.tolist() == [0] * q + [1] * g + [2] * (d + 50)
    assert np.array_equal(labels[:q], scenario.splits["query"].labels)
    assert np.array_equal(instances[q : q + g], scenario.splits["gallery"].instances)
    eval_classes = set(scenario.splits["query"].labels.tolist())
    assert not eval_classes & set(labels[q + g :].tolist())
    assert (instances[q + g + d :] >= EXTRA_INSTANCE_BASE).all()
    pairs = set(zip(labels.tolist(), instances.tolist(), strict=False))
    assert len(pairs) == src.num_ids()  # every id is a different image
    again = GlyphGallerySource(scenario, extra_distractors=50, resolution=16, data_seed=2)
    ids = np.array([0, q + 1, src.num_ids() - 1])
    assert np.array_equal(src.load(ids)["image"], again.load(ids)["image"])


def test_missing_models_and_bad_columns_are_named(scenario, tmp_path, bundles):
    src = GlyphGallerySource(scenario, resolution=16)
    with pytest.raises(ConfigError, match="old model is required"):
        embed_gallery(str(tmp_path / "a"), src, columns=("old",), log=quiet)
    with pytest.raises(ConfigError, match="unknown column 'newest'"):
        embed_gallery(
            str(tmp_path / "b"), src, old_model=bundles[0], columns=("newest",), log=quiet
        )
    with pytest.raises(ConfigError, match="no 'psi' module"):
        embed_gallery(
            str(tmp_path / "c"),
            src,
            old_model=bundles[0],
            new_model=bundles[0],
            columns=("adapted",),
            log=quiet,
        )
    with pytest.raises(ConfigError, match="not in the glyphs source"):
        embed_gallery(
            str(tmp_path / "d"),
            src,
            old_model=bundles[0],
            columns=("old",),
            ids=[0, 10_000],
            log=quiet,
        )


# ----------------------------------------------------------------------------- on the Ray cluster
def batching_options(render: int, preprocess: int, model_stages="tasks") -> PipelineOptions:
    """Chunks of 12 ids, model stages in sub-batches of 8 (a 4-id tail per chunk), and the
    given batch sizes of the task stages (which shape the blocks the model stages receive)."""
    opts = small_options(model_stages=model_stages)
    opts.chunk_size = 12
    opts.stages["render"].batch_size = render
    opts.stages["preprocess"].batch_size = preprocess
    return opts


@pytest.fixture(scope="module")
def full_run(ray_cluster, bundles, scenario, tmp_path_factory):
    """``(source, run)``: every column and the uncertainty scores, chunks of 12 ids and model
    sub-batches of 8 (:func:`batching_options`), the model stages as actor pools; shared by
    the schema test and the batching and model-stages tests (their reference run)."""
    src = GlyphGallerySource(scenario, extra_distractors=30, resolution=16, data_seed=2)
    run = embed_gallery(
        str(tmp_path_factory.mktemp("full") / "g"),
        src,
        old_model=bundles[0],
        new_model=bundles[1],
        columns=("old", "new", "adapted"),
        uncertainty=True,
        options=batching_options(8, 8, model_stages="actors"),
        log=quiet,
    )
    return src, run


def test_schema_values_and_loader(full_run, bundles, scenario, tmp_path):
    src, run = full_run
    schema = pq.read_schema(os.path.join(run.path, "part-000000.parquet"))
    assert [(f.name, str(f.type)) for f in schema] == [
        ("item_id", "int64"),
        ("label", "int64"),
        ("split", "string"),
        ("class_name", "string"),
        ("old", f"fixed_size_list<element: float>[{OLD_DIM}]"),
        ("new", f"fixed_size_list<element: float>[{NEW_DIM}]"),
        ("adapted", f"fixed_size_list<element: float>[{NEW_DIM}]"),
        ("unc_least_confidence", "double"),
        ("unc_margin", "double"),
        ("unc_entropy", "double"),
    ]
    table = run.table()
    n = src.num_ids()
    assert table.column("item_id").to_pylist() == list(range(n))
    assert sorted(set(table.column("split").to_pylist())) == ["distractor", "gallery", "query"]
    ref = direct(bundles, src, np.arange(n))
    assert np.array_equal(table.column("label").to_numpy(), ref["label"])
    for col in ("old", "new", "adapted"):
        np.testing.assert_allclose(vectors(table, col), ref[col], rtol=1e-4, atol=1e-5, err_msg=col)
    for col in ("unc_least_confidence", "unc_margin", "unc_entropy"):
        np.testing.assert_allclose(
            table.column(col).to_numpy(), ref[col], rtol=1e-4, atol=1e-6, err_msg=col
        )
    summary = run.summary
    assert summary["items_written"] == n and summary["items_skipped"] == 0
    assert any("OldFeatureStage" in s["operator"] for s in summary["stages"])
    assert summary["memory"]["peak_pss_mib"] > 0
    # the backfill simulator's loader reads the output folder as it is
    data = load_parquet(run.path)
    assert data.n_queries == len(scenario.splits["query"]) and data.n_items == n - data.n_queries
    assert data.gallery_adapted.shape == (data.n_items, NEW_DIM)
    # a second run with the same settings finds everything done
    again = embed_gallery(
        run.path,
        src,
        old_model=bundles[0],
        new_model=bundles[1],
        columns=("old", "new", "adapted"),
        uncertainty=True,
        options=batching_options(8, 8),
        log=quiet,
    )
    assert again.summary["items_planned"] == 0 and again.summary["items_resumed"] == n
    # refreshing the stored old features with psi: no image, same adapted vectors and scores
    refreshed = embed_gallery(
        str(tmp_path / "refresh"),
        OldFeatureSource(run.path),
        new_model=bundles[1],
        columns=("adapted",),
        uncertainty=True,
        options=small_options(),
        log=quiet,
    ).table()
    assert refreshed.column_names == [
        "item_id",
        "label",
        "split",
        "class_name",
        "adapted",
        "unc_least_confidence",
        "unc_margin",
        "unc_entropy",
    ]
    assert refreshed.column("split").to_pylist() == table.column("split").to_pylist()
    np.testing.assert_allclose(vectors(refreshed, "adapted"), ref["adapted"], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(
        refreshed.column("unc_margin").to_numpy(), ref["unc_margin"], rtol=1e-4, atol=1e-6
    )
    assert not any(
        re.search(r"EmbedStage|embed_task", s["operator"])
        for s in embed_gallery(
            str(tmp_path / "refresh"),
            OldFeatureSource(run.path),
            new_model=bundles[1],
            columns=("adapted",),
            uncertainty=True,
            options=small_options(overwrite=True),
            log=quiet,
        ).summary["stages"]
    )


def test_new_column_only_for_given_ids(ray_cluster, bundles, scenario, tmp_path):
    src = GlyphGallerySource(scenario, extra_distractors=30, resolution=16, data_seed=2)
    ids = [40, 3, 17, 51]
    run = embed_gallery(
        str(tmp_path / "b"),
        src,
        new_model=bundles[1],
        columns=("new",),
        ids=ids,
        options=small_options(),
        log=quiet,
    )
    table = run.table()
    assert table.column_names == ["item_id", "label", "split", "class_name", "new"]
    assert table.column("item_id").to_pylist() == sorted(ids)
    ref = direct(bundles, src, np.array(sorted(ids)))
    np.testing.assert_allclose(vectors(table, "new"), ref["new"], rtol=1e-4, atol=1e-5)
    with pytest.raises(ConfigError, match="different settings.*columns"):
        embed_gallery(
            run.path,
            src,
            old_model=bundles[0],
            columns=("old",),
            ids=ids,
            options=small_options(),
            log=quiet,
        )


def test_output_is_bit_identical_whatever_ray_data_batching(full_run, bundles, tmp_path):
    """What the pipeline writes does not depend on how Ray Data forms blocks and batches
    (issue 27, point 8). Render and preprocess batches of 9 ids hand the model stages blocks
    of 9 and 12 rows, so Ray Data's batches of 8 leave 1-row and 4-row remainders that cross
    the model's sub-batches; the output must equal, bit for bit, that of blocks aligned to
    them (batches of 1 to 3 rows round differently from 8 in this model). The ragged run's
    model stages are tasks, the aligned run's actors (their equality alone: the next test)."""
    src, aligned_run = full_run  # render and preprocess batches of 8
    aligned = aligned_run.table()
    ragged = embed_gallery(
        str(tmp_path / "ragged"),
        src,
        old_model=bundles[0],
        new_model=bundles[1],
        columns=("old", "new", "adapted"),
        uncertainty=True,
        options=batching_options(9, 9),
        log=quiet,
    ).table()
    assert ragged.column("item_id").to_pylist() == list(range(src.num_ids()))
    assert ragged.column_names == aligned.column_names
    for col in ("old", "new", "adapted", "unc_least_confidence", "unc_margin", "unc_entropy"):
        np.testing.assert_array_equal(
            np.asarray(ragged.column(col).to_pylist()),
            np.asarray(aligned.column(col).to_pylist()),
            err_msg=col,
        )


def test_model_stages_as_tasks_write_the_same_bits_as_actors(full_run, bundles, tmp_path):
    """``--model-stages tasks`` (the stage objects cached in Ray's task workers) writes what
    the actor pools wrote, bit for bit, with the same chunks and model batch sizes."""
    src, actors_run = full_run
    tasks_run = embed_gallery(
        str(tmp_path / "tasks"),
        src,
        old_model=bundles[0],
        new_model=bundles[1],
        columns=("old", "new", "adapted"),
        uncertainty=True,
        options=batching_options(8, 8, model_stages="tasks"),
        log=quiet,
    )
    operators = " ".join(s["operator"] for s in tasks_run.summary["stages"])
    assert "embed_task" in operators and "old_feature_task" in operators
    assert "EmbedStage" not in operators and "OldFeatureStage" not in operators
    tasks, actors = tasks_run.table(), actors_run.table()
    assert tasks.column_names == actors.column_names
    for col in tasks.column_names:
        assert tasks.column(col).equals(actors.column(col)), col


def test_a_model_task_cancelled_while_loading_ends_its_worker(ray_cluster):
    """Ray cancels a running task with a KeyboardInterrupt; during a worker's first import of
    torch that would leave it half-imported for the worker's later tasks, so the worker exits."""

    @ray_cluster.remote(max_retries=0)
    def cancelled_while_loading():
        from raycompat.pipeline.stages import _run_cached

        class Loading:
            def __init__(self, threads):
                raise KeyboardInterrupt

        return _run_cached(Loading, {}, "fingerprint", {"threads": 1})

    with pytest.raises(ray_cluster.exceptions.WorkerCrashedError):
        ray_cluster.get(cancelled_while_loading.remote(), timeout=60)


def png(value: int) -> bytes:
    buf = io.BytesIO()
    Image.new("L", (20, 14), value).save(buf, format="PNG")
    return buf.getvalue()


def test_corrupt_images_skip_and_fail(ray_cluster, bundles, tmp_path):
    root = tmp_path / "imgs"
    for c in ("cat", "dog"):
        (root / c).mkdir(parents=True)
        for k in range(3):
            (root / c / f"{k}.png").write_bytes(png(60 * k + (c == "dog") * 20))
    bad = root / "dog" / "1.png"
    bad.write_bytes(b"this is not a png")
    src = RecordSource.image_folder(str(root), resolution=16)
    bad_id = int(src.ids[src.paths.index(str(bad))])
    with pytest.raises(CorruptImageError, match=re.escape(f"item_id={bad_id} path={bad}")):
        embed_gallery(
            str(tmp_path / "fail"),
            src,
            old_model=bundles[0],
            columns=("old",),
            options=small_options(on_corrupt="fail"),
            log=quiet,
        )
    run = embed_gallery(
        str(tmp_path / "skip"),
        src,
        old_model=bundles[0],
        columns=("old",),
        options=small_options(on_corrupt="skip"),
        log=quiet,
    )
    assert run.table().column("item_id").to_pylist() == [i for i in range(6) if i != bad_id]
    assert [s["item_id"] for s in run.summary["skipped"]] == [bad_id]
    assert str(bad) in run.summary["skipped"][0]["error"]
    # the stored vectors are the old model applied to the decoded, resized images
    old_b = ModelBundle.load(bundles[0])
    from raycompat.data import images_to_tensor, load_image

    imgs = np.stack(
        [
            np.asarray(load_image(src.paths[i], mode="L", resolution=16))
            for i in range(6)
            if i != bad_id
        ]
    )
    with torch.no_grad():
        ref = old_b.embedder(images_to_tensor(imgs, 1)).numpy()
    np.testing.assert_allclose(vectors(run.table(), "old"), ref, rtol=1e-4, atol=1e-5)


def test_parquet_and_gldv2_sources(ray_cluster, bundles, tmp_path):
    import pyarrow as pa

    rows = {
        "item_id": [10, 11, 12, 13],
        "label": ["b", "a", "b", "a"],
        "image": [png(10), png(90), b"broken", png(200)],
    }
    path = tmp_path / "imgs.parquet"
    pq.write_table(pa.table(rows), path, row_group_size=2)
    src = ParquetImageSource(str(path), resolution=16)
    run = embed_gallery(
        str(tmp_path / "pq"),
        src,
        old_model=bundles[0],
        columns=("old",),
        options=small_options(on_corrupt="skip"),
        log=quiet,
    )
    t = run.table()
    assert t.column("item_id").to_pylist() == [10, 11, 13]
    assert t.column("label").to_pylist() == [1, 0, 0]
    assert (
        run.summary["skipped"][0]["item_id"] == 12
        and "rowgroup1/row0" in run.summary["skipped"][0]["error"]
    )

    image_root = tmp_path / "gld"
    ids = ["abc001", "abd002", "xyz003"]
    for k, image_id in enumerate(ids[:2]):  # the third image file is missing
        p = image_root / image_id[0] / image_id[1] / image_id[2] / f"{image_id}.jpg"
        p.parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (24, 20), (50 * k, 80, 120)).save(p, format="JPEG")
    csv = tmp_path / "train.csv"
    csv.write_text(
        "id,url,landmark_id\n" + "".join(f"{i},,{7 + k % 2}\n" for k, i in enumerate(ids))
    )
    gsrc = RecordSource.gldv2(str(csv), str(image_root), resolution=16)
    run = embed_gallery(
        str(tmp_path / "gldout"),
        gsrc,
        old_model=bundles[0],
        columns=("old",),
        options=small_options(on_corrupt="skip"),
        log=quiet,
    )
    assert run.table().column("item_id").to_pylist() == [0, 1]
    assert (
        run.summary["skipped"][0]["item_id"] == 2
        and "xyz003.jpg" in run.summary["skipped"][0]["error"]
    )


def test_parquet_sources_reject_bad_files(tmp_path):
    import pyarrow as pa

    def write(name, **columns):
        path = tmp_path / f"{name}.parquet"
        pq.write_table(pa.table(columns), path)
        return str(path)

    old = pa.FixedSizeListArray.from_arrays(pa.array(np.zeros(4, np.float32)), 2)
    with pytest.raises(ConfigError, match=r"duplicate item ids, e.g. \[1\]"):
        ParquetImageSource(write("dup", item_id=[1, 1], label=[0, 0], image=[b"x", b"y"]))
    with pytest.raises(ConfigError, match="id column 'item_id'.*must hold integers"):
        ParquetImageSource(write("strid", item_id=["a", "b"], label=[0, 0], image=[b"x", b"y"]))
    with pytest.raises(ConfigError, match=r"lacks column\(s\) \['label'\]"):
        ParquetImageSource(write("nolabel", item_id=[1, 2], image=[b"x", b"y"]))
    with pytest.raises(ConfigError, match="column 'label' of .* must hold integers, got string"):
        OldFeatureSource(
            write("strlabel", item_id=[1, 2], label=["a", "b"], split=["gallery"] * 2, old=old)
        )
    with pytest.raises(ConfigError, match="old-feature source .*: duplicate item ids"):
        OldFeatureSource(
            write("olddup", item_id=[3, 3], label=[0, 1], split=["gallery"] * 2, old=old)
        )
    with pytest.raises(ConfigError, match="old-feature source not found"):
        OldFeatureSource(str(tmp_path / "missing"))


def _job(out, bundles, items, extra=()):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    cmd = [
        sys.executable,
        os.path.join(REPO, "jobs", "embed_gallery.py"),
        "--out",
        str(out),
        "--old-model",
        bundles[0],
        "--new-model",
        bundles[1],
        "--columns",
        "old,new",
        "--items",
        str(items),
        "--train-classes",
        "10",
        "--eval-classes",
        "4",
        "--queries-per-class",
        "1",
        "--gallery-per-class",
        "3",
        "--distractor-classes",
        "3",
        "--distractors-per-class",
        "2",
        "--data-seed",
        "1",
        "--resolution",
        "16",
        "--chunk-size",
        "64",
        "--render-batch-size",
        "32",
        "--model-stages",
        "tasks",
        "--num-cpus",
        "2",
        *extra,
    ]
    return cmd, env


@pytest.mark.subprocess
@pytest.mark.timeout(300)  # two runs of the job as programs
def test_kill_and_resume_is_exactly_once(ray_cluster, bundles, scenario, tmp_path):
    """SIGKILL the job's driver (a program joined to the session's cluster with --address, as
    a submitted job's driver is; its tasks and actors die with it) once a shard exists, rerun,
    check every id once."""
    out = tmp_path / "killed"
    items = 1600
    address = ray_cluster.get_runtime_context().gcs_address
    cmd, env = _job(out, bundles, items, extra=("--address", address))
    log = open(tmp_path / "first.log", "w")
    proc = subprocess.Popen(
        cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    deadline = time.time() + 300
    try:
        while time.time() < deadline and proc.poll() is None:
            if out.is_dir() and any(n.startswith("part-") for n in os.listdir(out)):
                break
            time.sleep(0.2)
        assert proc.poll() is None, (
            "the job ended before it could be killed: " + open(tmp_path / "first.log").read()
        )
        os.killpg(proc.pid, signal.SIGKILL)  # the driver and the Ray processes it started
    finally:
        if proc.poll() is None:
            proc.wait(timeout=60)
        log.close()
    done_before = sorted(n for n in os.listdir(out) if n.startswith("part-"))
    num_chunks = -(-items // 64)
    assert 1 <= len(done_before) < num_chunks, "the kill must land mid-run"
    second = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stdout + second.stderr
    assert f"resuming: {len(done_before)} chunks" in second.stdout
    files = sorted(os.listdir(out))
    assert not [f for f in files if ".tmp" in f]
    assert len([f for f in files if f.startswith("part-")]) == num_chunks
    table = pq.read_table(out).sort_by("item_id")
    ids = table.column("item_id").to_numpy()
    assert ids.tolist() == list(range(items))  # no loss, no duplicates
    src = GlyphGallerySource(
        scenario, extra_distractors=items - scenario_items(scenario), resolution=16, data_seed=1
    )
    sample = np.array([0, 5, 63, 64, 700, items - 1])
    ref = direct(bundles, src, sample)
    np.testing.assert_allclose(vectors(table.take(sample), "old"), ref["old"], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(vectors(table.take(sample), "new"), ref["new"], rtol=1e-4, atol=1e-5)


def scenario_items(scenario) -> int:
    return sum(len(scenario.splits[k]) for k in ("query", "gallery", "distractors"))


@pytest.mark.subprocess
def test_job_refuses_other_settings_and_runs_without_models(ray_cluster, capsys, tmp_path, bundles):
    """The embed-gallery job's command line in this process (the session's Ray; the kill test
    above runs it as a program): a run prints its rate and stage times, a second run into the
    same folder with other settings is refused naming them, and no model at all is refused
    before anything is written."""
    from raycompat.pipeline.job import main

    out = tmp_path / "o"
    cmd, _ = _job(out, bundles, 40)
    args = cmd[2:]  # after the interpreter and jobs/embed_gallery.py
    assert main(args) == 0
    first = capsys.readouterr()
    assert "items/s" in first.out and "Per-stage times" in first.out
    other = [c if c != "old,new" else "old" for c in args]
    assert main(other) == 2
    second = capsys.readouterr()
    assert "different settings" in second.err and "columns" in second.err
    # as a program: the folder a failed first run made is removed when the process exits
    no_models = [sys.executable, cmd[1], "--out", str(tmp_path / "n")]
    third = subprocess.run(no_models, capture_output=True, text=True, timeout=120)
    assert third.returncode == 2 and "--random-init" in third.stderr
    assert not (tmp_path / "n").exists()
