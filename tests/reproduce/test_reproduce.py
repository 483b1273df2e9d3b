"""The reproduction job end to end at a tiny scale on the shared Ray cluster: report files and
structure, every sequential cross pair with DMU's chained psi, claims recomputed from the
stored numbers, and a re-run that reuses every model."""

from __future__ import annotations

import dataclasses
import json

import pytest

from raycompat.config import ConfigError
from raycompat.outputs import OutputOptions
from raycompat.reproduce import (
    SAMPLES_FILE,
    TRAINING_FILE,
    Evidence,
    ReproduceOptions,
    ScaleOptions,
    evaluate_claims,
    run_reproduce,
)
from raycompat.reproduce.claims import HELD, INCONCLUSIVE, NOT_HELD, NOT_MEASURED, NOT_RUN
from raycompat.reproduce.job import parse_reproduce_options
from raycompat.reproduce.plan import (
    DEFAULT_LEFT_OUT,
    DEFAULT_SIZES,
    FIELD_METHODS,
    FIELD_PLAN,
)
from raycompat.reproduce.report import TABLE_HEADERS

# the first test of this file runs the tiny reproduction (27 s alone) in its setup:
# 300 s leaves room for a busy machine
pytestmark = pytest.mark.timeout(300)

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
    workers=0,  # Ray Train's local mode: no worker processes to start for a tiny run
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
    ).validated()
    return opts, out, run_reproduce(opts)


def test_report_files_tables_and_claims(tiny_run):
    _, out, report = tiny_run
    on_disk = json.loads((out / "report.json").read_text())
    assert on_disk["claims"] == report["claims"]
    names = [ts["name"] for ts in on_disk["results"]["test_sets"]]
    assert names == ["extended-data", "sequential 2->1", "sequential 3->1", "sequential 3->2"]
    ext = on_disk["results"]["test_sets"][0]
    # bct-arcface: DMU's reference, a BCT of DMU's head (the DMU paper's setup)
    assert set(ext["methods"]) == {"independent", "bct", "dmu", "bct-arcface"}
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
    assert len(claims) == 18  # the five papers' 10 and the field methods' 8
    for c in claims.values():
        assert c["verdict"] in (HELD, INCONCLUSIVE, NOT_HELD, NOT_MEASURED, NOT_RUN)
        for check in c["checks"]:
            d = check["difference"]
            if d is not None:  # the verdict follows the interval of the difference
                assert d["low"] <= d["value"] <= d["high"] and d["queries"] == 16
                if d["low"] > 0:
                    assert check["verdict"] == HELD
                elif d["high"] < 0:
                    assert check["verdict"] == NOT_HELD
                else:
                    assert check["verdict"] != NOT_MEASURED
        assert c["measurement"] and c["verdict"] in markdown
    assert claims["bct-variants"]["verdict"] == NOT_MEASURED  # bct-kd / bct-beta not trained
    assert claims["rm-auc-gain"]["verdict"] == NOT_MEASURED  # mcl not trained
    assert claims["dmu-adapted"]["verdict"] != NOT_MEASURED
    assert claims["fct-beats-bct"]["verdict"] == NOT_RUN  # fct not in --methods
    # the verdicts are a pure function of the stored numbers and per-query samples
    evidence = Evidence.load(str(out / SAMPLES_FILE))
    assert evaluate_claims(on_disk["results"], evidence) == on_disk["claims"]


def test_every_number_has_its_interval_and_every_curve_its_band(tiny_run):
    _, out, report = tiny_run
    ext = report["results"]["test_sets"][0]
    assert (ext["queries"], ext["classes"]) == (16, 8)
    low, high = ext["intervals"]["m_oo"]["mAP@100"]
    assert low <= ext["m_oo"]["mAP@100"] <= high and low < high
    for label, entry in ext["methods"].items():
        for key in ("m_nn", "m_no", "m_cross"):
            for metric in ("mAP@100", "top1", "mAP"):
                low, high = entry["intervals"][key][metric]
                assert low <= entry[key][metric] <= high, (label, key, metric)
        low, high = entry["intervals"]["update_gain"]
        assert low <= entry["update_gain"] <= high or entry["update_gain"] != entry["update_gain"]
    for label, model in report["results"]["backfill"]["extended-data"].items():
        for curve in model["curves"]:
            band = curve["bands"]["mAP@100"]
            assert all(
                lo <= v <= hi
                for lo, v, hi in zip(band["low"], curve["mAP@100"], band["high"], strict=True)
            ), label
            assert curve["summary"]["mAP@100"]["auc_interval"] is not None
    nfr = report["results"]["backfill"]["extended-data"]["bct"]["curves"][0]
    assert nfr["old_old_successes"][0] >= 0 and "NFR@1" in nfr["bands"]
    markdown = (out / "report.md").read_text()
    assert "percentile bootstrap interval over 1000 resamples" in markdown
    m_oo = ext["m_oo"]["mAP@100"]
    assert f"{m_oo:.3f} [" in markdown or f"{m_oo:.4f} [" in markdown


def test_sequential_chains_every_cross_pair(tiny_run):
    _, _, report = tiny_run
    seq = report["results"]["sequential"]
    assert set(seq["pairs"]) == {"independent", "dmu", "bct-arcface"}
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
    """A ``--train-only`` piece writes training.json and leaves the report alone; a full
    re-run then reuses every model and gives the same numbers."""
    opts, out, report = tiny_run
    before = (out / "report.md").read_text()
    summary = run_reproduce(dataclasses.replace(opts, train_only=True))
    n = len({m["key"] for m in report["results"]["models"].values()})
    assert (summary["trained"], summary["reused"], summary["left"]) == (0, n, 0)
    written = json.loads((out / TRAINING_FILE).read_text())
    assert written["train_only"] is True and set(written["results"]["models"]) == set(
        report["results"]["models"]
    )
    assert (out / "report.md").read_text() == before
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


def test_seeds_train_every_model_once_per_seed(tmp_path):
    from raycompat.reproduce.runner import Reproduction

    opts = ReproduceOptions(
        output=OutputOptions(out=str(tmp_path)),
        scenarios=("extended-data", "sequential"),
        methods=("bct",),
        sequential_methods=("bct",),
        sizes=TINY_SIZES,
        training=TINY,
        seed=3,
        seeds=2,
    ).validated()
    rep = Reproduction(opts, str(tmp_path), log=lambda m: None)
    planned = rep.plan_all()
    assert len(planned) == 2
    seeds = sorted(t.values["seed"] for t in rep.store.planned.values())
    # per seed: old, independent, bct (extended-data) and gen1 + 2 x 2 generations (sequential)
    assert seeds == [3] * 8 + [4] * 8
    assert {name.rsplit("@", 1)[1] for name in rep.models} == {"seed3", "seed4"}
    assert parse_reproduce_options(["--seeds", "3", "--resamples", "200"]).seeds == 3
    assert parse_reproduce_options(["--train-only"]).train_only is True


def test_methods_all_plans_the_field_methods_where_they_fit(tmp_path):
    from raycompat.reproduce.runner import Reproduction

    opts = parse_reproduce_options(["--methods", "all", "--out", str(tmp_path)])
    field = ("lwf", "fd", "lce", "unibct", "advbct", "bt2", "dsimplex", "fct")
    assert set(field) <= set(opts.methods)
    opts = dataclasses.replace(opts, sizes=TINY_SIZES, training=TINY)
    rep = Reproduction(opts, str(tmp_path), log=lambda m: None)
    rep.plan_all()  # every configuration checked on the driver, nothing trained
    models = rep.models
    for scenario in ("extended-data", "open-class", "architecture"):
        paragon = models[f"{scenario}/independent"]
        bt2, fct = models[f"{scenario}/bt2"], models[f"{scenario}/fct"]
        # bt2 reuses the paragon as its independent new model, fct freezes it as phi_n
        assert bt2.values["method_options"]["independent_model"] == paragon.path
        assert fct.values["init_model"] == paragon.path and fct.values["method"] == "fct"
        assert paragon.key in bt2.deps and paragon.key in fct.deps
        assert {f"{scenario}/{m}" for m in field if m != "dsimplex"} <= set(models)
        assert f"{scenario}/dsimplex" not in models
        why = dict(opts.skipped(scenario))["dsimplex"]
        assert "same simplex head" in why
    # dsimplex: its own chain of three generations, all with the simplex head (K = 16 classes)
    gen1, gen2, gen3 = (models[f"sequential/dsimplex-gen{g}"] for g in (1, 2, 3))
    assert gen1.values["method"] == "independent" and gen1.key != models["sequential/gen1"].key
    for gen, old in ((gen2, gen1), (gen3, gen2)):
        assert gen.values["method"] == "dsimplex" and gen.values["old_model"] == old.path
        assert gen.values["method_options"]["classes"] == 16
    for gen in (gen1, gen2, gen3):
        assert gen.values["head"] == "dsimplex" and gen.values["embed_dim"] == 15
    assert not any(name.startswith(("sequential/bt2", "sequential/fct")) for name in models)
    assert "paragon (new*) of its generation" in dict(opts.skipped("sequential"))["fct"]


def test_default_plan_says_which_field_methods_it_leaves_out_and_why():
    default = parse_reproduce_options([])
    scenarios = default.scenarios
    trained = {v.label for s in scenarios for v in default.method_plan(s)}
    assert DEFAULT_LEFT_OUT and not set(DEFAULT_LEFT_OUT) & trained
    assert set(FIELD_METHODS) - set(DEFAULT_LEFT_OUT) <= trained
    decided = {m: s for s, methods in FIELD_PLAN.items() for m in methods}
    for label in DEFAULT_LEFT_OUT:
        why = dict(default.skipped(decided[label]))[label]
        assert "30-minute budget" in why and f"`--methods {label},...`" in why
        assert "`--methods field`" in why
        asked = parse_reproduce_options(["--methods", f"independent,{label}"])
        assert any(label in [v.label for v in asked.method_plan(s)] for s in scenarios)
    # --methods field: each field method where its claim is decided, beside bct; no architecture
    field = parse_reproduce_options(["--methods", "field"])
    assert field.scenarios == ("extended-data", "open-class", "sequential")
    plans = {s: [v.label for v in field.method_plan(s)] for s in field.scenarios}
    assert plans == {
        "extended-data": ["independent", "bct", "lwf", "fd", "lce", "advbct", "bt2", "fct"],
        "open-class": ["independent", "bct", "unibct"],
        "sequential": ["independent", "dsimplex"],
    }
    assert set(FIELD_METHODS) <= {m for p in plans.values() for m in p}
    assert "`--methods field` plan" in dict(field.skipped("extended-data"))["dmu"]
    with pytest.raises(ConfigError, match="--methods field trains in"):
        parse_reproduce_options(["--methods", "field", "--scenarios", "architecture"])
    with pytest.raises(ConfigError, match="'field' .* stands alone"):
        parse_reproduce_options(["--methods", "field,bct"])
    with pytest.raises(ConfigError, match="'nope' is not allowed; .* or 'all' or 'field'"):
        parse_reproduce_options(["--methods", "nope"])


def test_merged_seeds_average_every_number():
    from raycompat.reproduce.intervals import merge_seeds

    def seed(value):
        ts = {"name": "a", "m_oo": {"mAP@100": value}, "methods": {"bct": {"compatible": True}}}
        curve = {"policy": "random", "mode": "compatible", "mAP@100": [value, 2 * value]}
        return [ts], {"ext": {"bct": {"curves": [curve]}}}, None

    test_sets, backfill, _ = merge_seeds([seed(0.2), seed(0.4)])
    assert test_sets[0]["m_oo"]["mAP@100"] == pytest.approx(0.3)
    assert test_sets[0]["methods"]["bct"]["compatible"] is True
    assert backfill["ext"]["bct"]["curves"][0]["mAP@100"] == pytest.approx([0.3, 0.6])


def test_premise_scale_plans_every_claims_models_at_1600_classes(tmp_path):
    """``--scale premise``: the default scale at 1,600 training classes (same held-out queries and
    gallery), the five papers' plan and the field methods' plan together, so no claim says
    'not run'; a size flag still overrides the preset."""
    from raycompat.reproduce.plan import DEFAULT_SCALE_METHODS, FIELD_PLAN, SCENARIOS

    opts = parse_reproduce_options(["--scale", "premise", "--seeds", "2", "--out", str(tmp_path)])
    default = parse_reproduce_options([])
    assert opts.sizes == dataclasses.replace(default.sizes, train_classes=1600)
    assert opts.training == default.training and opts.seeds == 2
    for scenario in SCENARIOS:
        planned = {v.label for v in opts.method_plan(scenario)}
        wanted = set(DEFAULT_SCALE_METHODS[scenario]) | set(FIELD_PLAN.get(scenario, ()))
        if "dmu" in wanted:  # DMU's reference, a BCT of its ArcFace head
            wanted.add("bct-arcface")
        assert planned == wanted, scenario
    assert (
        parse_reproduce_options(
            ["--scale", "premise", "--train-classes", "400"]
        ).sizes.train_classes
        == 400
    )


def test_bct_lambda_reaches_the_three_bct_variants_only(tmp_path):
    """``--bct-lambda 2``: lambda_compat 2 in the options of bct, bct-kd, bct-beta and
    bct-arcface and of no other method; at the default (1, BCT's own) nothing is added, so
    earlier runs' names stay."""
    from raycompat.reproduce.plan import VARIANTS

    two = parse_reproduce_options(["--bct-lambda", "2", "--out", str(tmp_path)]).training
    one = parse_reproduce_options(["--out", str(tmp_path)]).training
    for label, variant in VARIANTS.items():
        got = variant.method_options(two)
        assert got.get("lambda_compat") == (2.0 if variant.method == "bct" else None), label
        assert "lambda_compat" not in variant.method_options(one), label
