"""The reproduction job end to end at a tiny scale on the shared Ray cluster: report files and
structure, every sequential cross pair with DMU's chained psi, claims recomputed from the
stored numbers, and a re-run that reuses every model."""

from __future__ import annotations

import dataclasses
import json

import pytest

from raycompat.config import ConfigError
from raycompat.outputs import OutputOptions
from raycompat.reproduce import ReproduceOptions, ScaleOptions, evaluate_claims, run_reproduce
from raycompat.reproduce.claims import HELD, NOT_HELD, NOT_MEASURED, PARTLY
from raycompat.reproduce.job import parse_reproduce_options
from raycompat.reproduce.plan import DEFAULT_SIZES
from raycompat.reproduce.report import TABLE_HEADERS

TINY_SIZES = dataclasses.replace(
    DEFAULT_SIZES,
    train_classes=16,
    images_per_class=8,
    eval_classes=8,
    queries_per_class=2,
    gallery_per_class=4,
    distractor_classes=8,
    distractors_per_class=2,
    backbone="test_resnet",
)
TINY = ScaleOptions(
    embed_dim=32,
    old_epochs=2,
    new_epochs=1,
    batch_size=32,
    psi_hidden=64,
    arch_backbone="test_efficientnet",
)


@pytest.fixture(scope="module")
def tiny_run(ray_cluster, tmp_path_factory):
    out = tmp_path_factory.mktemp("reproduce")
    opts = ReproduceOptions(
        output=OutputOptions(out=str(out)),
        scenarios=("extended-data", "sequential"),
        methods=("bct", "dmu"),
        sequential_methods=("dmu",),
        sizes=TINY_SIZES,
        training=TINY,
        parallel=2,
    ).validated()
    return opts, out, run_reproduce(opts)


def test_report_files_tables_and_claims(tiny_run):
    _, out, report = tiny_run
    on_disk = json.loads((out / "report.json").read_text())
    assert on_disk["claims"] == report["claims"]
    names = [ts["name"] for ts in on_disk["results"]["test_sets"]]
    assert names == ["extended-data", "sequential 2->1", "sequential 3->1", "sequential 3->2"]
    ext = on_disk["results"]["test_sets"][0]
    assert set(ext["methods"]) == {"independent", "bct", "dmu"}
    for entry in ext["methods"].values():
        for key in (
            "m_oo",
            "m_nn",
            "m_no",
            "update_gain",
            "delta_up",
            "delta_down",
            "P_up",
            "P_comp",
            "P_1",
        ):
            assert key in entry
        assert 0.0 <= entry["m_nn"]["mAP@100"] <= 1.0 and 0.0 <= entry["P_1"] <= 100.0
    assert (
        ext["methods"]["dmu"]["m_nadapted"] is not None
        and ext["methods"]["dmu"]["cross_mode"] == "adapted"
    )
    assert ext["methods"]["bct"]["m_nadapted"] is None

    markdown = (out / "report.md").read_text()
    assert "## Claims" in markdown and "| " + " | ".join(TABLE_HEADERS) + " |" in markdown
    assert "Scale options:" in markdown and "wall time" in markdown
    for plot in on_disk["plots"]:
        assert (out / plot).is_file() and f"]({plot})" in markdown
    assert any(p.endswith("ract_extended-data.png") for p in on_disk["plots"])

    claims = {c["id"]: c for c in on_disk["claims"]}
    assert len(claims) == 10
    for c in claims.values():
        assert c["verdict"] in (HELD, PARTLY, NOT_HELD, NOT_MEASURED)
        assert c["measurement"] and c["verdict"] in markdown
    assert claims["bct-variants"]["verdict"] == NOT_MEASURED  # bct-kd / bct-beta not trained
    assert claims["rm-auc-gain"]["verdict"] == NOT_MEASURED  # mcl not trained
    assert claims["dmu-adapted"]["verdict"] != NOT_MEASURED
    # the verdicts are a pure function of the stored numbers
    assert evaluate_claims(on_disk["results"]) == on_disk["claims"]


def test_sequential_chains_every_cross_pair(tiny_run):
    _, _, report = tiny_run
    seq = report["results"]["sequential"]
    assert set(seq["pairs"]) == {"independent", "dmu"}
    for label, rows in seq["pairs"].items():
        stored = {
            (r["query_generation"], r["gallery_generation"])
            for r in rows
            if r["gallery_state"] == "stored"
        }
        assert stored == {(1, 1), (2, 1), (2, 2), (3, 1), (3, 2), (3, 3)}, label
    adapted = {
        (r["query_generation"], r["gallery_generation"])
        for r in seq["pairs"]["dmu"]
        if r["gallery_state"] == "adapted"
    }
    assert adapted == {(2, 1), (3, 1), (3, 2)}
    assert not any(r["gallery_state"] == "adapted" for r in seq["pairs"]["independent"])
    # each generation of the DMU chain was trained against its own predecessor
    models = report["results"]["models"]
    assert models["sequential/dmu-gen3"]["split"] == "train_3"
    chain = seq["chains"]["dmu"]
    assert chain[0] == models["sequential/gen1"]["key"] and len(chain) == 3


def test_rerun_reuses_every_model(tiny_run):
    opts, _, report = tiny_run
    again = run_reproduce(dataclasses.replace(opts))
    assert all(m["reused"] for m in again["results"]["models"].values())
    assert again["results"]["test_sets"] == report["results"]["test_sets"]


def test_bad_options_name_the_key():
    with pytest.raises(ConfigError, match="--methods: 'bcx' is not allowed"):
        parse_reproduce_options(["--methods", "bcx"])
    with pytest.raises(ConfigError, match="'scale' = 'huge' is not allowed; allowed values"):
        parse_reproduce_options(["--scale", "huge"])
    with pytest.raises(ConfigError, match="--arch-backbone 'resnet9000' is not a timm model name"):
        parse_reproduce_options(["--arch-backbone", "resnet9000"])
