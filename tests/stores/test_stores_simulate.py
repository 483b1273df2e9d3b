"""simulate-backfill --store and plan-upgrade --store: a gallery in real LanceDB or real Milvus
Lite gives the curves of the same gallery exported to raycompat's embeddings parquet, number
for number; bad store input is one ``error:`` line naming the column and the store URI, exit
status 2 (docs/simulator.md, "A gallery in a vector store"; docs/planning.md). Small data, the
in-memory simulator, no Ray."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from serving_helpers import labelled_embeddings
from simulator_inputs import run_job, vec_col
from test_stores_behaviour import BACKENDS, uri_of

from raycompat.planning.job import main as plan_main
from raycompat.stores import ColumnMap, GalleryBlock, create_store

N_ITEMS, N_QUERIES, CLASSES = 300, 40, 12
#: the store's own column names, given to the jobs with --store-columns
COLUMNS = ColumnMap(id="pid", label="cls", old="emb_old", new="emb_new")
COLUMNS_FLAG = "id=pid,label=cls,old=emb_old,new=emb_new"
#: every policy and mode the vectors allow without a model bundle
SIMULATION = [
    "--policies", "random,sequential,hinge-benefit,learned",
    "--modes", "compatible,naive_merge,cold",
    "--grid-step", "10", "--k", "50", "--items-per-s-per-gpu", "10", "--resamples", "200",
    "--reference-cache", "none", "--no-plots", "--quiet",
]  # fmt: skip
CLASS_NAMES = np.array([f"class-{c:02d}" for c in range(CLASSES)])


@pytest.fixture(scope="module")
def data():
    """Clustered embeddings with sparse ids and exact ties (copied vectors across classes)."""
    d = labelled_embeddings(n_items=N_ITEMS, n_queries=N_QUERIES, classes=CLASSES, seed=3)
    for a, b in ((1, 2), (1, 3), (10, 11), (40, 41)):
        d.gallery_old[b] = d.gallery_old[a]
        d.gallery_new[b] = d.gallery_new[a]
    return d


def export_parquet(path, d, *, class_names: bool = True, old_dim: int | None = None) -> str:
    """The gallery as raycompat's embeddings parquet, in ascending id order (what an export of
    a store holds), then the queries; ``old_dim``: cut the old vectors (a wrong dimension)."""
    order = np.argsort(d.gallery_ids)
    labels = np.concatenate([d.gallery_labels[order], d.query_labels])
    old = np.concatenate([d.gallery_old[order], d.query_old])[:, :old_dim]
    cols = {
        "item_id": pa.array(np.concatenate([d.gallery_ids[order], d.query_ids])),
        "label": pa.array(labels),
        "split": pa.array(["gallery"] * d.n_items + ["query"] * d.n_queries),
        "old": vec_col(old),
        "new": vec_col(np.concatenate([d.gallery_new[order], d.query_new])),
    }
    if class_names:
        cols["class_name"] = pa.array(CLASS_NAMES[labels])
    pq.write_table(pa.table(cols), path)
    return str(path)


def load_store(uri, d, *, class_names: bool = True, upgraded: int | None = None) -> str:
    """The gallery into a new store, in a shuffled order of three blocks: every item upgraded
    (its new vector loaded with it), or only the first ``upgraded`` of that order."""
    labels = CLASS_NAMES[d.gallery_labels] if class_names else d.gallery_labels
    parts = np.array_split(np.random.default_rng(0).permutation(d.n_items), 3)
    with_new = upgraded is None
    new = d.gallery_new if with_new else None
    blocks = [
        GalleryBlock(d.gallery_ids[p], labels[p], d.gallery_old[p], None if new is None else new[p])
        for p in parts
    ]
    kw = dict(new_model="m-new") if with_new else dict(new_dim=d.gallery_new.shape[1])
    with create_store(uri, blocks, old_model="m-old", columns=COLUMNS, **kw) as store:
        if not with_new:
            rows = np.concatenate(parts)[:upgraded]
            store.write_new(d.gallery_ids[rows], d.gallery_new[rows], "m-new", np.arange(upgraded))
    return uri


def simulate(out, *args):
    r = run_job(*args, *SIMULATION, "--out", out)
    assert r.returncode == 0, r.stderr
    curves = json.loads((out / "curves.json").read_text())
    with np.load(out / "samples.npz") as z:
        samples = {k: z[k] for k in z.files}
    return curves, samples


def assert_same_report(a, b):
    """Every number of two simulations: curves, bands, AUCs, references, their intervals, the
    rows and summaries of curves.json, and every per-query term of samples.npz."""
    (ca, sa), (cb, sb) = a, b
    assert ca.keys() == cb.keys()
    for key in ca:
        if key not in ("config", "stats"):  # where it was read from, how long it took
            assert ca[key] == cb[key], key
    assert sa.keys() == sb.keys() and len(sa) > 10
    for key in sa:
        np.testing.assert_array_equal(sa[key], sb[key], err_msg=key)


@pytest.fixture(scope="module")
def exported(tmp_path_factory, data):
    """The parquet export and its simulation (class names, as embed-gallery writes them)."""
    root = tmp_path_factory.mktemp("exported")
    emb = export_parquet(root / "emb.parquet", data)
    return emb, simulate(root / "parquet", emb)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_store_gives_the_curves_of_its_parquet_export(backend, tmp_path, data, exported):
    emb, from_parquet = exported
    uri = load_store(uri_of(backend, tmp_path), data)
    out = tmp_path / "store"
    from_store = simulate(out, "--store", uri, "--queries", emb, "--store-columns", COLUMNS_FLAG)
    assert_same_report(from_store, from_parquet)
    curves = from_store[0]
    assert curves["n_items"] == N_ITEMS and curves["n_queries"] == N_QUERIES
    assert curves["policies"] == ["random", "sequential", "hinge-benefit", "learned"]
    assert len(curves["curves"]) == 4 * 2 + 1 and curves["config"]["source"] == uri
    m = curves["metrics"][0]  # not vacuous: the curves move along the backfill
    assert curves["curves"][0]["metrics"][m][0] != curves["curves"][0]["metrics"][m][-1]
    assert json.loads((out / "job.json").read_text())["config"]["store_input"]["store"] == uri


def test_integer_labels_are_matched_with_the_queries_label_column(tmp_path, data):
    """A store of integer labels and a parquet without class names: the same numbers."""
    emb = export_parquet(tmp_path / "emb.parquet", data, class_names=False)
    uri = load_store(uri_of("lance", tmp_path), data, class_names=False)
    from_parquet = simulate(tmp_path / "parquet", emb)
    args = ("--store", uri, "--queries", emb, "--store-columns", COLUMNS_FLAG)
    assert_same_report(simulate(tmp_path / "store", *args), from_parquet)


@pytest.mark.parametrize(
    "case, columns, named",
    [
        ("label_absent", "id=pid,label=class,old=emb_old,new=emb_new", "column 'class' (label)"),
        ("old_absent", "id=pid,label=cls,old=emb,new=emb_new", "column 'emb' (old)"),
        ("new_absent", "id=pid,label=cls,old=emb_old,new=vec", "column 'vec' (new)"),
        ("old_dim", COLUMNS_FLAG, "column 'emb_old' of LanceDB table 'gallery'"),
        ("not_upgraded", COLUMNS_FLAG, "column 'emb_new' of LanceDB table 'gallery'"),
        ("label_kind", COLUMNS_FLAG, "column 'cls' of LanceDB table 'gallery'"),
        ("not_unit", COLUMNS_FLAG, "column 'emb_old' of LanceDB table 'gallery'"),
    ],
)
def test_bad_store_input_is_one_error_line(tmp_path, data, exported, case, columns, named):
    emb = exported[0]
    uri = uri_of("lance", tmp_path)
    load_store(uri, data, upgraded=120 if case == "not_upgraded" else None)
    if case == "old_dim":
        emb = export_parquet(tmp_path / "q.parquet", data, old_dim=8)
    elif case == "label_kind":  # class names in the store, integer labels only in the file
        emb = export_parquet(tmp_path / "q.parquet", data, class_names=False)
    elif case == "not_unit":  # a table written by another program: old vectors of norm 3
        _scale_old_vectors(tmp_path / "lancedb", "gallery", 3.0)
    r = run_job("--store", uri, "--queries", emb, "--store-columns", columns, *SIMULATION,
                "--out", tmp_path / "out")  # fmt: skip
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith(f"error: --store {uri}: ") and named in lines[0], lines[0]
    why = {
        "old_dim": "dimension mismatch: the store's old vectors have 16 dims, column 'old' of "
        "the queries",
        "not_upgraded": "180 of 300 items have no new vector",
        "label_kind": "string labels (class names), but column 'label' of the queries",
        "not_unit": "300 of 300 vectors are not unit length (norms 3 to 3)",
    }
    assert why.get(case, "missing from LanceDB table 'gallery'") in lines[0]


def _scale_old_vectors(folder, table: str, factor: float) -> None:
    """Multiply a LanceDB table's old vectors by ``factor`` through lancedb itself, as a
    program other than raycompat could have written them."""
    import lancedb

    t = lancedb.connect(str(folder)).open_table(table)
    rows = t.to_arrow()
    old = np.stack(rows["emb_old"].to_numpy(zero_copy_only=False)) * np.float32(factor)
    i = rows.schema.get_field_index("emb_old")
    rows = rows.set_column(i, rows.schema.field(i), vec_col(old.astype(np.float32)))
    t.merge_insert("pid").when_matched_update_all().execute(rows)


@pytest.mark.parametrize("backend", BACKENDS)
def test_items_without_a_new_vector_are_counted_on_both_backends(backend, tmp_path, data, exported):
    uri = load_store(uri_of(backend, tmp_path), data, upgraded=299)
    r = run_job("--store", uri, "--queries", exported[0], "--store-columns", COLUMNS_FLAG,
                *SIMULATION, "--out", tmp_path / "out")  # fmt: skip
    assert r.returncode == 2
    assert f"error: --store {uri}: column 'emb_new' of " in r.stderr
    assert "1 of 300 items have no new vector" in r.stderr


@pytest.mark.parametrize(
    "args, named",
    [
        (["--store", "lance:///nowhere/db/t"], "--store needs --queries"),
        (["--queries", "q.parquet"], "--queries and --store-columns go with --store"),
        (["--store", "lance:///nowhere/db/t", "--queries", "q", "--embeddings", "e.parquet"],
         "not with --embeddings (DATASET)"),
        (["--store", "lance:///nowhere/db/t", "--queries", "q.parquet", "--engine", "ray"],
         "--engine ray streams the row groups of a parquet dataset only"),
        (["--store", "lance:///nowhere/db/t", "--queries", "q", "--store-columns", "vector=v"],
         "--store-columns: unknown column 'vector'; known: id, old, new, label"),
        (["--store", "lance://nowhere", "--queries", "q"], "bad store URI 'lance://nowhere'"),
    ],
)  # fmt: skip
def test_store_flags_that_do_not_fit(tmp_path, args, named):
    r = run_job(*args, "--quiet", "--out", tmp_path / "out")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and named in lines[0], r.stderr


PLAN = [
    "--items-per-s", "100", "--devices", "2", "--price-per-device-hour", "1.5", "--no-plots",
    "--quiet", "--policies", "random,sequential", "--modes", "compatible,naive_merge,cold",
]  # fmt: skip


def test_plan_upgrade_simulates_the_store_and_plans_as_on_its_export(tmp_path, data, exported):
    """plan-upgrade --store simulates the store into <out>/simulation, names the candidate
    after the table, and plans exactly what --results on the parquet export's simulation
    (same settings) plans; a bad store is one error line before any output folder."""
    emb = exported[0]
    uri = load_store(uri_of("lance", tmp_path), data)
    store = ["--store", uri, "--queries", emb, "--store-columns", COLUMNS_FLAG]
    assert plan_main([*store, *PLAN, "--out", str(tmp_path / "plan")]) == 0
    sim = tmp_path / "parquet"
    r = run_job(emb, "--policies", "random,sequential", "--modes", "compatible,naive_merge,cold",
                "--items-per-s-per-gpu", "100", "--reference-cache", "none", "--no-plots",
                "--quiet", "--out", sim)  # fmt: skip
    assert r.returncode == 0, r.stderr
    args = ["--results", f"gallery={sim}", *PLAN, "--out", str(tmp_path / "plan_parquet")]
    assert plan_main(args) == 0
    got = json.loads((tmp_path / "plan" / "plan.json").read_text())
    want = json.loads((tmp_path / "plan_parquet" / "plan.json").read_text())
    assert got["inputs"][0]["path"] == str(tmp_path / "plan" / "simulation" / "curves.json")
    assert got["items"] == N_ITEMS and got["inputs"][0]["model"] == "gallery"
    for key in want:
        if key not in ("command", "inputs"):
            assert got[key] == want[key], key
    # 2 policies x 2 hot modes, the cold refresh, staying on the old model
    assert len(got["options"]) == 2 * 2 + 2 and got["recommended"] is not None


def test_plan_upgrade_names_a_bad_store_before_making_its_folder(tmp_path, capsys, data, exported):
    uri = load_store(uri_of("lance", tmp_path), data)
    columns = "id=pid,label=class,old=emb_old,new=emb_new"
    store = ["--store", uri, "--queries", exported[0], "--store-columns", columns]
    assert plan_main([*store, *PLAN, "--out", str(tmp_path / "plan")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: --store {uri}: column 'class' (label)")
    assert not (tmp_path / "plan").exists()
    flags = ["--results", str(tmp_path), "--queries", exported[0], *PLAN]
    assert plan_main([*flags, "--out", str(tmp_path / "plan")]) == 2
    err = capsys.readouterr().err
    assert "error: --new-model, --queries and --store-columns go with --store" in err
