"""The one reader of the embeddings parquet schema (raycompat/embeddings/format.py):
the in-memory engine (``load_parquet``), the Ray engine's ``ParquetGallery`` and the live
index's gallery read the same rows, bit for bit, and refuse the same bad input with the same
message naming the file and the column.  No Ray: the Ray engine's reads are the driver's
``open`` and each block task's ``read_block``, called here in-process."""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from simulator_inputs import vec_col

from raycompat.config import ConfigError
from raycompat.embeddings.dataset import ParquetGallery, vector_bytes
from raycompat.embeddings.format import BackfillInputError, EmbeddingsParquet
from raycompat.embeddings.gallery import GalleryEmbeddings, load_parquet
from raycompat.index.search import l2_normalize
from raycompat.serving.gallery_source import PipelineOutput, open_gallery, write_gallery_parquet

N, NQ, D_OLD, D_NEW, ROW_GROUP = 40, 8, 4, 6, 7


def _columns(seed: int = 0) -> dict[str, np.ndarray]:
    """Two shards' worth of rows: queries spread over both, coarse float64 values."""
    rng = np.random.default_rng(seed)
    total = N + NQ
    split = np.array(["gallery"] * (N - 6) + ["distractor"] * 6 + ["query"] * NQ)
    rng.shuffle(split)
    return {
        "item_id": np.arange(total, dtype=np.int64) * 3 + 100,
        "label": rng.integers(0, 5, total),
        "split": split,
        "old": np.round(rng.standard_normal((total, D_OLD)), 2),
        "new": np.round(rng.standard_normal((total, D_NEW)), 2),
        "adapted": np.round(rng.standard_normal((total, D_NEW)), 2),
        "unc_margin": np.round(rng.random(total), 2),
    }


def write_shards(root, cols=None, plain_lists=False) -> str:
    """``part-0.parquet`` and ``part-1.parquet`` under ``root``, row groups of 7 rows."""
    cols = _columns() if cols is None else cols
    os.makedirs(root, exist_ok=True)
    half = len(cols["item_id"]) // 2
    for s, part in enumerate((slice(0, half), slice(half, None))):
        table = {}
        for k, v in cols.items():
            if np.ndim(v) == 1:
                table[k] = pa.array(v[part])
            elif plain_lists:
                table[k] = pa.array(list(v[part]), type=pa.list_(pa.float64()))
            else:
                table[k] = vec_col(v[part])
        pq.write_table(pa.table(table), f"{root}/part-{s}.parquet", row_group_size=ROW_GROUP)
    return str(root)


# ----------------------------------------------------------------------------- the same rows
def test_both_engines_read_the_written_values_bit_for_bit(tmp_path):
    cols = _columns(1)
    for plain in (False, True):
        root = write_shards(tmp_path / f"plain{plain}", cols, plain_lists=plain)
        mem = load_parquet(root)
        is_g = cols["split"] != "query"
        for c in ("old", "new", "adapted"):
            want = cols[c].astype(np.float32)
            assert getattr(mem, f"gallery_{c}").tobytes() == want[is_g].tobytes()
        assert mem.query_old.tobytes() == cols["old"].astype(np.float32)[~is_g].tobytes()
        assert mem.gallery_ids.tolist() == cols["item_id"][is_g].tolist()
        assert mem.query_labels.tolist() == cols["label"][~is_g].tolist()
        assert mem.extra["uncertainty"]["margin"].tolist() == cols["unc_margin"][is_g].tolist()
        ds = ParquetGallery.open(root)
        assert ds.query_arrays()["query_new"].tobytes() == mem.query_new.tobytes()
        assert ds.dims == {"old": D_OLD, "new": D_NEW, "adapted": D_NEW}
        blocks = [ds.read_block(g, ["new", "unc_margin"]) for g in ds.groups if g.gallery_rows]
        assert np.concatenate([b[0] for b in blocks]).tolist() == mem.gallery_ids.tolist()
        streamed = np.concatenate([b[1]["new"] for b in blocks])
        assert streamed.tobytes() == mem.gallery_new.tobytes()
        half = (N + NQ) // 2
        assert [g.gallery_rows for g in ds.groups] == [
            int(is_g[s : min(s + ROW_GROUP, h + half)].sum())
            for h in (0, half)
            for s in range(h, h + half, ROW_GROUP)
        ]


def test_only_the_asked_for_columns_are_read(tmp_path):
    """A null ``old`` vector fails a read of ``old``, naming it; a read of ``new`` in the same
    row group never converts ``old``."""
    root = write_shards(tmp_path / "null")
    path = f"{root}/part-0.parquet"
    table = pq.read_table(path)
    old = table.column("old").to_pylist()
    row = next(i for i, s in enumerate(table.column("split").to_pylist()) if s != "query")
    old[row] = None
    table = table.set_column(3, "old", pa.array(old, type=table.schema.field("old").type))
    pq.write_table(table, path, row_group_size=ROW_GROUP)
    reader = EmbeddingsParquet.open(root)
    group = reader.row_groups(reader.read_keys())[row // ROW_GROUP]
    rows = reader.read_group(group, ["new"])
    assert list(rows.values) == ["new"] and rows.values["new"].shape[1] == D_NEW
    item = table.column("item_id")[row].as_py()
    with pytest.raises(BackfillInputError) as err:
        reader.read_group(group, ["old"])
    assert str(err.value) == f"column 'old' of {group.name} is null for item ids [{item}]"


def test_a_query_may_share_its_id_with_a_gallery_item(tmp_path):
    """GalleryEmbeddings numbers each side from 0; what write_gallery_parquet writes from it
    reads back in every engine (the Ray engine used to refuse it as duplicate ids)."""
    rng = np.random.default_rng(2)
    data = GalleryEmbeddings(
        gallery_labels=rng.integers(0, 3, 12),
        gallery_old=rng.standard_normal((12, 4)),
        gallery_new=rng.standard_normal((12, 5)),
        query_labels=rng.integers(0, 3, 4),
        query_old=rng.standard_normal((4, 4)),
        query_new=rng.standard_normal((4, 5)),
    )
    assert set(data.query_ids) <= set(data.gallery_ids)
    path = write_gallery_parquet(str(tmp_path / "g.parquet"), data)
    back = load_parquet(path)
    for name in ("gallery_old", "gallery_new", "query_old", "query_new", "gallery_ids"):
        assert getattr(back, name).tobytes() == getattr(data, name).tobytes(), name
    assert ParquetGallery.open(path).query_ids.tolist() == [0, 1, 2, 3]
    assert open_gallery(path).gallery_ids().tolist() == list(range(12))


# ----------------------------------------------------------------------------- bad input
def _in_memory(path):
    load_parquet(path)


def _ray_engine(path):
    """The driver's pass, then every block task's read."""
    ds = ParquetGallery.open(path)
    for g in ds.groups:
        if g.gallery_rows:
            ds.read_block(g, ds.vector_columns + ds.uncertainty_columns)


def _live_index(path):
    open_gallery(path)


ENTRY_POINTS = {
    "in-memory": (_in_memory, BackfillInputError),
    "ray": (_ray_engine, BackfillInputError),
    "live index": (_live_index, ConfigError),
}


def _nan_gallery(cols):
    row = int(np.flatnonzero(cols["split"] != "query")[-3])  # part-1, a late row group
    cols["new"][row, 2] = np.nan
    group = (row - (N + NQ) // 2) // ROW_GROUP
    return (
        f"NaN or inf embeddings in gallery_new for 1 item(s), item ids [{cols['item_id'][row]}]"
        f": column 'new' of {{root}}/part-1.parquet (row group {group})"
    )


def _nan_query(cols):
    row = int(np.flatnonzero(cols["split"] == "query")[0])
    cols["old"][row] = np.inf
    return (
        f"NaN or inf embeddings in query_old for 1 item(s), item ids [{cols['item_id'][row]}]"
        f": column 'old' of {{root}}/part-{int(row >= (N + NQ) // 2)}.parquet "
        f"(row group {row % ((N + NQ) // 2) // ROW_GROUP})"
    )


def _duplicate(cols):
    g = np.flatnonzero(cols["split"] != "query")
    first, last = int(g[0]), int(g[-1])  # part-0 and part-1
    cols["item_id"][last] = cols["item_id"][first]
    dup = cols["item_id"][first]
    return (
        f"duplicate item ids [{dup}] among the gallery rows: id {dup} is in shards "
        "{root}/part-0.parquet and {root}/part-1.parquet"
    )


def _unknown_split(cols):
    cols["split"] = np.where(cols["split"] == "distractor", "distracter", cols["split"])
    return (
        "unknown split value(s) ['distracter'] in column 'split' of {root}/part-0.parquet; "
        "allowed: query, gallery, distractor"
    )


def _adapted_dim(cols):
    cols["adapted"] = cols["adapted"][:, :5]
    return (
        f"dimension mismatch: column 'adapted' has dim 5, column 'new' has dim {D_NEW} in {{root}}"
    )


def _float_ids(cols):
    cols["item_id"] = cols["item_id"].astype(np.float64)
    return "column 'item_id' of {root}/part-0.parquet must be int64, got double"


CASES = {
    "nan in a gallery vector": _nan_gallery,
    "inf in a query vector": _nan_query,
    "duplicate gallery ids across shards": _duplicate,
    "unknown split": _unknown_split,
    "adapted and new of other dims": _adapted_dim,
    "float item ids": _float_ids,
}


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@pytest.mark.parametrize("case", list(CASES))
def test_every_engine_refuses_bad_input_with_the_same_message(tmp_path, case, entry):
    cols = _columns(3)
    expected = CASES[case](cols)
    root = write_shards(tmp_path / "bad", cols)
    read, error = ENTRY_POINTS[entry]
    with pytest.raises(error) as err:
        read(root)
    assert str(err.value) == expected.format(root=root)


def test_dimensions_that_differ_between_shards_are_named(tmp_path):
    """Fixed sizes from the footers; plain lists once a row group is read."""
    for plain in (False, True):
        root = write_shards(tmp_path / f"plain{plain}", plain_lists=plain)
        table = pq.read_table(f"{root}/part-1.parquet")
        wide = np.ones((table.num_rows, D_OLD + 1))
        wide_col = pa.array(list(wide), pa.list_(pa.float64())) if plain else vec_col(wide)
        table = table.set_column(table.schema.get_field_index("old"), "old", wide_col)
        pq.write_table(table, f"{root}/part-1.parquet", row_group_size=ROW_GROUP)
        if plain:
            want = (
                f"dimension mismatch in column 'old': {D_OLD + 1} in {root}/part-1.parquet "
                f"(row group 0), {D_OLD} in the other shards"
            )
        else:
            want = (
                f"dimension mismatch in column 'old': {D_OLD} in shard {root}/part-0.parquet, "
                f"{D_OLD + 1} in shard {root}/part-1.parquet"
            )
        for read, error in ENTRY_POINTS.values():
            with pytest.raises(error) as err:
                read(root)
            assert str(err.value) == want


# ----------------------------------------------------------------------------- locations
def test_metadata_files_and_folders_are_skipped_by_every_engine(tmp_path):
    root = write_shards(tmp_path / "emb")
    for junk in ("_tmp/part-9.parquet", ".partial/part-9.parquet", "_x.parquet"):
        os.makedirs(os.path.dirname(f"{root}/{junk}"), exist_ok=True)
        with open(f"{root}/{junk}", "wb") as f:
            f.write(b"not parquet")
    reader = EmbeddingsParquet.open(root)
    assert reader.files == [f"{root}/part-0.parquet", f"{root}/part-1.parquet"]
    assert load_parquet(root).n_items == N
    assert ParquetGallery.open(root).n_items == N
    assert open_gallery(root).n_items == N
    sizes = [
        pq.read_metadata(f).row_group(i).column(j)
        for f in reader.files
        for i in range(pq.read_metadata(f).num_row_groups)
        for j in range(pq.read_metadata(f).num_columns)
    ]
    want = sum(c.total_compressed_size for c in sizes if c.path_in_schema.split(".")[0] in (
        "old", "new", "adapted"))  # fmt: skip
    assert vector_bytes(root) == want == reader.nbytes


def test_uri_locations_in_every_reader(tmp_path):
    """A ``file://`` URI reads what the path reads, in the simulator, the live index's gallery
    (which used to accept local paths only) and its pipeline-output source."""
    root = write_shards(tmp_path / "emb")
    uri = "file://" + root
    assert load_parquet(uri).gallery_new.tobytes() == load_parquet(root).gallery_new.tobytes()
    assert load_parquet(uri).source == uri
    served = open_gallery(uri)
    assert served.gallery_ids().tolist() == open_gallery(root).gallery_ids().tolist()
    ids = served.gallery_ids()[:5]
    by_path, by_uri = PipelineOutput(root), PipelineOutput(uri)
    assert by_uri.new_vectors(ids).tobytes() == by_path.new_vectors(ids).tobytes()
    assert by_uri.new_vectors(ids).tobytes() == served.new_vectors(ids).tobytes()
    with pytest.raises(ConfigError) as err:
        PipelineOutput(str(tmp_path / "missing"))
    assert str(err.value) == f"pipeline output: embeddings not found: {tmp_path}/missing"
    with pytest.raises(BackfillInputError, match="^embeddings not found: ''$"):
        load_parquet("")  # not the default storage folder


def test_pipeline_output_of_ids_and_new_vectors_only(tmp_path):
    """The live index's pipeline-output source needs only ``item_id`` and ``new``: every row
    is an item to upsert."""
    rng = np.random.default_rng(5)
    new = rng.standard_normal((9, D_NEW)).astype(np.float32)
    ids = np.arange(9, dtype=np.int64)[::-1] + 50
    path = str(tmp_path / "pipeline.parquet")
    pq.write_table(pa.table({"item_id": ids, "new": vec_col(new)}), path, row_group_size=4)
    source = PipelineOutput(path)
    assert source.new_dim == D_NEW
    assert source.vectors.tobytes() == new.tobytes()
    assert source.new_vectors([50, 58]).tobytes() == l2_normalize(new[[8, 0]]).tobytes()
    with pytest.raises(ConfigError) as err:
        PipelineOutput(str(tmp_path / "pipeline.parquet"), column="old")
    assert str(err.value) == (
        f"pipeline output: missing column(s) ['old'] in {path}; found ['item_id', 'new']"
    )


def test_pipeline_output_names_a_nan_vector(tmp_path):
    cols = _columns(4)
    row = int(np.flatnonzero(cols["split"] != "query")[0])
    cols["new"][row, 0] = np.nan
    root = write_shards(tmp_path / "emb", cols)
    with pytest.raises(ConfigError) as err:
        PipelineOutput(root)
    assert str(err.value) == (
        f"pipeline output: NaN or inf embeddings in gallery_new for 1 item(s), item ids "
        f"[{cols['item_id'][row]}]: column 'new' of {root}/part-0.parquet "
        f"(row group {row // ROW_GROUP})"
    )


def test_a_nan_in_a_candidate_column_is_named_by_the_block_read(tmp_path):
    """A block's vectors are checked once, by the reader: a NaN in another candidate's column
    names that column, the file and the row group (nothing downstream scans them again)."""
    cols = _columns(6)
    row = int(np.flatnonzero(cols["split"] != "query")[-2])  # part-1
    cols["new_b"] = cols["new"] + 0.5
    cols["new_b"][row, 1] = np.nan
    root = write_shards(tmp_path / "emb", cols)
    ds = ParquetGallery.open(root).candidate_view("new_b")
    where = f"part-1.parquet (row group {_group_of(row)})"
    group = next(g for g in ds.groups if g.name.endswith(where))
    with pytest.raises(BackfillInputError) as err:
        ds.block_embeddings(group, ds.query_arrays(), ["old", "new"])
    assert str(err.value) == (
        f"NaN or inf embeddings in gallery_new_b for 1 item(s), item ids "
        f"[{cols['item_id'][row]}]: column 'new_b' of {root}/part-1.parquet "
        f"(row group {_group_of(row)})"
    )
    other = next(g for g in ds.groups if g.gallery_rows and g is not group)
    block = ds.block_embeddings(other, ds.query_arrays(), ["old", "new"])
    assert np.isfinite(block.gallery_new).all()


def _group_of(row: int) -> int:
    return (row - (N + NQ) // 2) // ROW_GROUP


def test_vector_columns_are_written_plain_and_read_back_bit_for_bit(tmp_path):
    """Every writer of embeddings parquet (the pipeline, the simulator's gallery files) stores
    vector columns uncompressed, without a dictionary; the other columns keep snappy."""
    rng = np.random.default_rng(8)
    data = GalleryEmbeddings(
        gallery_labels=rng.integers(0, 3, 30),
        query_labels=rng.integers(0, 3, 4),
        gallery_old=rng.standard_normal((30, D_OLD)).astype(np.float32),
        gallery_new=rng.standard_normal((30, D_NEW)).astype(np.float32),
        query_old=rng.standard_normal((4, D_OLD)).astype(np.float32),
        query_new=rng.standard_normal((4, D_NEW)).astype(np.float32),
    )
    path = write_gallery_parquet(str(tmp_path / "g.parquet"), data)
    meta = pq.ParquetFile(path).metadata.row_group(0)
    chunks = {meta.column(i).path_in_schema.split(".")[0]: meta.column(i) for i in range(5)}
    for name in ("old", "new"):
        assert chunks[name].compression == "UNCOMPRESSED", name
        assert "RLE_DICTIONARY" not in chunks[name].encodings, name
        assert not chunks[name].is_stats_set, name
    assert chunks["label"].compression == "SNAPPY"
    back = load_parquet(path)
    assert back.gallery_new.tobytes() == data.gallery_new.tobytes()
    assert back.query_old.tobytes() == data.query_old.tobytes()
