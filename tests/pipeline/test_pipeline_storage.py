"""Where the gallery pipeline writes: ``--storage`` / ``--name`` / ``--out`` (local paths and
pyarrow URIs), checked before anything starts, and the resumable shard store on a URI.

The ``file://`` URIs go through pyarrow's filesystem layer exactly as ``s3://`` or ``gs://``
do (listing, footers, manifest and summary); a ``SubTreeFileSystem`` stands in for an object
store (no rename: the final object is written directly) in the shard-store test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import locations
import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from raycompat.data import build_scenario, default_catalog
from raycompat.embeddings.gallery import load_parquet
from raycompat.pipeline import (
    GlyphGallerySource,
    PipelineOptions,
    embed_gallery,
    make_random_bundles,
)
from raycompat.pipeline.job import main
from raycompat.pipeline.location import open_output, resolve_output
from raycompat.pipeline.writer import META_KEY, ShardStore, output_schema, shard_name

REPO = locations.REPO


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    return make_random_bundles(
        str(tmp_path_factory.mktemp("models")),
        backbone="test_resnet",
        old_dim=8,
        new_dim=12,
        num_classes=12,
        psi_hidden=16,
        seed=5,
    )


@pytest.fixture(scope="module")
def source():
    scenario = build_scenario(
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
    return GlyphGallerySource(scenario, extra_distractors=30, resolution=16, data_seed=2)


def small_options(**kw) -> PipelineOptions:
    opts = PipelineOptions(chunk_size=12, progress_every_s=1000.0, model_stages="tasks", **kw)
    for st in opts.stages.values():
        st.batch_size = 8
    return opts


def chunk_meta(path) -> dict:
    return json.loads(pq.read_metadata(str(path)).metadata[META_KEY])


# ----------------------------------------------------------------------------- no Ray needed
def test_output_location_rules(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert resolve_output().uri == str(tmp_path / "gallery_out")
    store = tmp_path / "store"
    store.mkdir()
    local = resolve_output(storage=str(store), name="g1")
    assert (
        local.uri == str(store / "embeddings" / "g1") and local.local and os.path.isdir(local.uri)
    )
    uri = resolve_output(storage=f"file://{tmp_path}/bucket/prefix", name="g2")
    assert uri.uri == f"file://{tmp_path}/bucket/prefix/embeddings/g2"
    assert (
        tmp_path / "bucket" / "prefix" / "embeddings" / "g2"
    ).is_dir()  # created like a bucket prefix
    given = resolve_output(
        out=f"file://{tmp_path}/elsewhere/g3", storage=str(store), name="ignored"
    )
    assert given.uri == f"file://{tmp_path}/elsewhere/g3"
    assert not (store / "embeddings" / "ignored").exists()
    assert not [p for p in os.listdir(tmp_path / "elsewhere" / "g3")]  # the write probe is gone


def test_missing_parents_of_out_are_created(tmp_path, monkeypatch):
    """The README's ``embed-gallery ... --out emb/query`` where ``emb/`` does not exist."""
    monkeypatch.chdir(tmp_path)
    out = resolve_output(out="emb/query")
    assert out.uri == str(tmp_path / "emb" / "query") and os.listdir(out.uri) == []
    deep = resolve_output(out=f"file://{tmp_path}/bucket/a/b/g")
    assert deep.uri == f"file://{tmp_path}/bucket/a/b/g"
    assert (tmp_path / "bucket" / "a" / "b" / "g").is_dir()


@pytest.mark.subprocess
def test_unwritable_storage_is_reported_at_start(tmp_path):
    """The real script: exit status 2, one line naming the location, no traceback, and nothing
    started (no models made, no Ray)."""
    models = tmp_path / "models"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    started = time.perf_counter()
    out = subprocess.run(
        [
            sys.executable,
            os.path.join(REPO, "jobs", "embed_gallery.py"),
            "--storage",
            "/proc/raycompat-gallery",
            "--random-init",
            str(models),
            "--items",
            "100000",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    seconds = time.perf_counter() - started
    assert out.returncode == 2, out.stdout + out.stderr
    assert "error: --storage /proc/raycompat-gallery is not writable" in out.stderr
    assert "Traceback" not in out.stderr and not models.exists()
    assert seconds < 60, seconds


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--out", "file:///proc/raycompat-gallery/g"],
            "--out file:///proc/raycompat-gallery/g is not writable",
        ),
        (
            ["--storage", "nosuchscheme://bucket/x"],
            "--storage nosuchscheme://bucket/x: not a location pyarrow can open",
        ),
        (
            ["--out", "/proc/raycompat-gallery/a/b"],
            "--out /proc/raycompat-gallery/a/b is not writable",
        ),
        (
            ["--storage", "/proc/raycompat-gallery", "--out", "{tmp}/g"],
            "--storage /proc/raycompat-gallery is not writable",
        ),
        (["--storage", "{tmp}", "--name", "a/b"], "--name 'a/b': must be a plain folder name"),
    ],
)
def test_bad_output_locations(tmp_path, capsys, argv, message):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main(argv + ["--random-init", str(tmp_path / "models")]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "models").exists()


@pytest.mark.parametrize(
    "args, named",
    [
        (["--colums", "old"], "unrecognized arguments: --colums"),
        (["--train", "10"], "unrecognized arguments: --train"),  # no abbreviations
        (["--chunk-size", "0"], "option 'chunk_size' = 0 must be >= 1"),
        (["--on-corrupt", "ignore"], "option 'on_corrupt' = 'ignore' is not allowed"),
        (["--model-stages", "threads"], "option 'model_stages' = 'threads' is not allowed"),
        (["--new-resources", "{gpu"], "--new-resources is not JSON"),
    ],
)
@pytest.mark.subprocess
def test_bad_flag_exits_2_before_anything_starts(tmp_path, args, named):
    """The real script: exit status 2, `error:` naming the flag on stderr, nothing on stdout,
    no models made, no Ray."""
    models = tmp_path / "models"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    out = subprocess.run(
        [
            sys.executable,
            os.path.join(REPO, "jobs", "embed_gallery.py"),
            "--random-init",
            str(models),
            "--out",
            str(tmp_path / "g"),
            *args,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stdout == ""
    assert named in out.stderr and "error:" in out.stderr and "Traceback" not in out.stderr
    assert not models.exists()


def test_shard_store_writes_objects_directly_and_rewrites_truncated_ones(tmp_path):
    """On a filesystem without the local rename (an object store), shards are written as their
    final objects; a torn write has no readable footer and the next run rewrites it."""
    (tmp_path / "bucket").mkdir()
    fs = pafs.SubTreeFileSystem(str(tmp_path / "bucket"), pafs.LocalFileSystem())
    from raycompat.storage import Location

    out = open_output(Location(uri="mock://bucket/g", root="g", filesystem=fs, local=False))
    assert not out.on_disk
    schema = output_schema({"old": 3})
    store = ShardStore(out, schema)

    def columns(ids):
        ids = np.asarray(ids, np.int64)
        return {
            "item_id": ids[::-1],
            "label": ids % 2,
            "split": np.array(["gallery"] * len(ids), object),
            "class_name": np.array([f"c{i % 2}" for i in ids], object),
            "old": np.tile(ids[::-1, None], (1, 3)).astype(np.float32),
            "error": np.array([""] * len(ids), object),
        }

    info = store.write(0, columns([0, 1, 2]), 3, nodes={"old": {"n2", "n1"}})
    assert info["nodes"] == {"old": ["n1", "n2"]}
    store.write(1, columns([3, 4, 5]), 3)
    assert sorted(os.listdir(tmp_path / "bucket" / "g")) == [
        shard_name(0),
        shard_name(1),
    ]  # no temp files
    table = pq.read_table(str(tmp_path / "bucket" / "g" / shard_name(0)))
    assert table.column("item_id").to_pylist() == [0, 1, 2] and table.schema.names == schema.names
    assert chunk_meta(tmp_path / "bucket" / "g" / shard_name(0))["nodes"] == {"old": ["n1", "n2"]}
    torn = tmp_path / "bucket" / "g" / shard_name(1)
    torn.write_bytes(torn.read_bytes()[: torn.stat().st_size // 2])
    assert store.completed(2, lambda c: 3) == {0}
    assert not torn.exists()


# ----------------------------------------------------------------------------- on the Ray cluster
def test_uri_output_is_written_and_resumed_exactly_once(ray_cluster, bundles, source, tmp_path):
    """``embed_gallery`` into a ``file://`` URI; after a crash that left one shard missing, one
    torn and a temp file behind, the rerun redoes only those chunks: every id once, the same
    vectors, the untouched shards kept."""
    uri = f"file://{tmp_path}/store/embeddings/g"
    folder = tmp_path / "store" / "embeddings" / "g"
    kwargs = dict(
        old_model=bundles[0], new_model=bundles[1], columns=("old", "new"), options=small_options()
    )
    run = embed_gallery(uri, source, log=lambda m: None, **kwargs)
    n = source.num_ids()
    num_chunks = -(-n // 12)
    assert run.path == uri and run.summary["out"] == uri
    shards = sorted(p for p in os.listdir(folder) if p.startswith("part-"))
    assert len(shards) == num_chunks and {"_manifest.json", "_summary.json"} <= set(
        os.listdir(folder)
    )
    first = run.table()
    assert first.column("item_id").to_pylist() == list(range(n))
    assert first.column_names == ["item_id", "label", "split", "class_name", "old", "new"]
    # where the work ran: this session's one node, for every embedding stage
    node = ray_cluster.get_runtime_context().get_node_id()
    assert chunk_meta(folder / shards[0])["nodes"] == {"new": [node], "old": [node]}
    summary = json.loads((folder / "_summary.json").read_text())
    assert summary["nodes"] == {"new": {node: n}, "old": {node: n}}
    data = load_parquet(uri)
    assert data.n_items + data.n_queries == n and data.source == uri
    assert run.load().gallery_new.shape[1] == 12

    # a crash: chunk 1 never written, chunk 2 torn mid-write, a writer's temp file left behind
    os.remove(folder / shard_name(1))
    torn = folder / shard_name(2)
    torn.write_bytes(torn.read_bytes()[:100])
    (folder / f".{shard_name(3)}.tmp12345").write_bytes(b"partial")
    kept = {
        p: os.stat(folder / p).st_mtime_ns
        for p in shards
        if p not in (shard_name(1), shard_name(2))
    }
    logs = []
    again = embed_gallery(uri, source, log=logs.append, **kwargs)
    assert any(
        f"resuming: {num_chunks - 2} chunks" in m and "1 partial temp file(s) removed" in m
        for m in logs
    )
    assert again.summary["items_planned"] == 24 and again.summary["shards_written"] == 2
    assert again.summary["nodes"]["new"] == {node: 24}
    assert {p: os.stat(folder / p).st_mtime_ns for p in kept} == kept
    assert not [p for p in os.listdir(folder) if ".tmp" in p]
    table = again.table()
    assert table.column("item_id").to_pylist() == list(range(n))  # no loss, no duplicates
    for col in ("old", "new"):
        np.testing.assert_array_equal(
            np.asarray(table.column(col).to_pylist(), np.float32),
            np.asarray(first.column(col).to_pylist(), np.float32),
            err_msg=col,
        )
    assert pa.types.is_fixed_size_list(
        pq.read_schema(str(folder / shard_name(1))).field("new").type
    )
