"""The reproduction report: tables shaped like the papers' (one row per method and test set),
the claims table (with what each verdict's interval holds and the seed-to-seed spread of every
check), backfill-curve plots for the RACT and RM claims, and the class-scaling section; markdown +
JSON + PNG."""

from __future__ import annotations

import os

from raycompat.report import fmt, markdown_table
from raycompat.reproduce.claims import backfill_curve, shown_verdict

TABLE_HEADERS = [
    "method",
    "M(o,o)",
    "M(n,n)",
    "M(n,o)",
    "M(n,adapted)",
    "cross used",
    "update gain",
    "Delta_up",
    "Delta_down",
    "P_up",
    "P_comp",
    "P_1",
    "compatible",
]


CROSS_USED = {
    "compatible": "n->o",
    "adapted": "n->psi(o)",
    "fct": "n->h(o)",
    "rank_merge": "psi_rev(rho(n))->o",
}


def _v(d, metric, interval=None):
    """``value [low, high]`` (``value`` alone without an interval)."""
    value = None if d is None else d.get(metric)
    if value is None or not interval:
        return value
    return with_interval(value, interval)


def with_interval(value: float, interval) -> str:
    """``value [low, high]``, with ``±sd`` across seeds when ``interval`` has a third entry."""
    bounds = list(interval) if isinstance(interval, (list, tuple)) else []
    low, high = (bounds + [None, None])[:2]
    if low is None or high is None or low != low or high != high:
        return fmt(value)
    sd = f" ±{fmt(bounds[2])} sd" if len(bounds) > 2 else ""
    return f"{fmt(value)} [{fmt(low)}, {fmt(high)}]{sd}"


def _interval(entry: dict, key: str, metric: str | None = None):
    got = (entry.get("intervals") or {}).get(key)
    return got.get(metric) if metric is not None and isinstance(got, dict) else got


# the scores that do not involve M(o,o) (DMU Eq.7)
OO_FREE = ("delta_down",)


def own_old_intervals(test_set: dict, entry: dict, metric: str) -> tuple[list | None, bool]:
    """The interval of ``entry``'s M(o,o), and whether its score intervals (update gain,
    Delta) belong to its own old model. An entry's own M(o,o) interval wins; the test set's
    serves only an entry whose M(o,o) is the test set's (the same old model). A report made
    before the entries had their own (a sequential chain with a phi_1 of its own, d-Simplex's)
    measured the scores against the shared phi_1: those are not the entry's intervals."""
    own = _interval(entry, "m_oo", metric)
    if own:
        return own, True
    shared = test_set.get("m_oo")
    same = shared is not None and (entry.get("m_oo") or {}).get(metric) == shared.get(metric)
    return (_interval(test_set, "m_oo", metric) if same else None), same or shared is None


def method_table(test_set: dict) -> str:
    """One paper-shaped table (mAP@100): M(o,o), M(n,n), M(n,o), M(n,adapted) and the scores.
    The first row is new* (independent); update gain, Delta and P use the method's cross test
    (``cross used``: new-to-old, new-to-adapted-old for DMU, the reverse query for RM). Every
    interval is the row's own (:func:`own_old_intervals`)."""
    metric = test_set["metric"]
    oo_iv = _interval(test_set, "m_oo", metric)
    rows = []
    for label, e in test_set["methods"].items():
        if e.get("diverged"):
            rows.append(
                [label, _v(test_set.get("m_oo"), metric, oo_iv), "diverged (NaN loss)"]
                + [None] * 10
            )
            continue
        e_oo_iv, scores_own = own_old_intervals(test_set, e, metric)
        rows.append(
            [
                label + (" (new*)" if label == "independent" else ""),
                _v(e["m_oo"], metric, e_oo_iv),
                _v(e["m_nn"], metric, _interval(e, "m_nn", metric)),
                _v(e["m_no"], metric, _interval(e, "m_no", metric)),
                _v(e["m_nadapted"], metric, _interval(e, "m_nadapted", metric)),
                CROSS_USED[e["cross_mode"]],
                *(
                    None
                    if e[k] is None
                    else with_interval(
                        e[k], _interval(e, k) if scores_own or k in OO_FREE else None
                    )
                    for k in ("update_gain", "delta_up", "delta_down")
                ),
                e["P_up"],
                e["P_comp"],
                e["P_1"],
                e["compatible"],
            ]
        )
    return markdown_table(TABLE_HEADERS, rows)


def sequential_table(sequential: dict) -> str:
    """Every cross pair of every chain (mAP@100, top-1), adapted galleries included."""
    rows = []
    for label, pairs in sequential["pairs"].items():
        got = {}
        for r in pairs:
            key = (r["query_generation"], r["gallery_generation"], r["gallery_state"])
            got.setdefault(key, {})[r["metric"]] = r["value"]
        for (j, i, state), m in sorted(got.items()):
            rows.append(
                [
                    label,
                    f"phi_{j}",
                    f"phi_{i}" if state == "stored" else f"psi-chain(phi_{i})",
                    m.get("mAP@100"),
                    m.get("top1"),
                ]
            )
    return markdown_table(["method", "query", "gallery", "mAP@100", "top1"], rows)


def interval_text(d: dict | None) -> str:
    """An interval dict (``Interval.to_dict``) as ``value [low, high]`` (``± sd`` over seeds)."""
    if not d:
        return ""
    text = with_interval(d["value"], [d["low"], d["high"]])
    return text + (f" ±{fmt(d['seed_std'])} sd" if d.get("seeds", 1) > 1 else "")


def check_text(check: dict) -> str:
    """``name: d [low, high], n = Q queries -> verdict`` for the claims table."""
    d = check.get("difference")
    if not d:
        return f"{check['check']}: {check['verdict']}"
    return f"{check['check']}: {interval_text(d)}, n = {d['queries']} queries -> {check['verdict']}"


MEASURED_VERDICTS = ("held", "not held", "inconclusive")


def seed_note(seeds: int) -> str:
    """What a verdict's interval holds: the query sampling only (one seed), or the training too."""
    if seeds > 1:
        return f"{seeds} seeds: the interval holds query sampling and training variation"
    return "1 seed: the interval holds query sampling only"


def spread_text(check: dict, spread: dict | None, claim_id: str) -> str:
    """One check's seed-to-seed spread (``spread``: :func:`.spread.seed_spread`): the standard
    deviation of its difference across seeds and the per-seed values, flagged when this run's
    difference lies within ``FRAGILE_SDS`` of them from 0 (the verdict may flip with the seed)."""
    from raycompat.reproduce.spread import FRAGILE_SDS

    if spread is None:
        return "not measured"
    got = spread["checks"].get(claim_id, {}).get(check["check"])
    if got is None:
        return "not in the spread run"
    seeds = ", ".join(fmt(v) for v in got["per_seed"])
    text = f"sd {fmt(got['sd'])} (per seed {seeds})"
    d = check.get("difference") or {}
    if d.get("value") is not None and abs(d["value"]) < FRAGILE_SDS * got["sd"]:
        text += f"; within {FRAGILE_SDS:g} sd of 0: may flip with the seed"
    return text


def claims_table(claims: list[dict], seeds: int = 1, spread: dict | None = None) -> str:
    """The claims with their verdicts (each with what its interval holds: :func:`seed_note`),
    every check, and every check's seed-to-seed spread (:func:`spread_text`)."""
    rows = []
    for c in claims:
        checks = c.get("checks", [])
        note = f"<br>({seed_note(seeds)})" if c["verdict"] in MEASURED_VERDICTS else ""
        rows.append(
            [
                c["paper"],
                c["claim"],
                f"**{shown_verdict(c)}**{note}",
                "<br>".join(check_text(x) for x in checks) or c["explanation"],
                "<br>".join(spread_text(x, spread, c["id"]) for x in checks if x.get("difference"))
                or "",
            ]
        )
    return markdown_table(
        [
            "paper",
            "claim",
            "verdict",
            "difference [95% interval], queries -> verdict, per check",
            "seed-to-seed spread, per check",
        ],
        rows,
    )


def _numbers_table(numbers: list[dict]) -> str:
    if not numbers:
        return "(no data)"
    headers = list(dict.fromkeys(k for row in numbers for k in row))
    return markdown_table(headers, [[_cell(row.get(h)) for h in headers] for row in numbers])


def _cell(value):
    if isinstance(value, dict) and {"value", "low", "high"} <= set(value):
        return interval_text(value)
    if isinstance(value, list):
        return ", ".join(str(_cell(v)) if isinstance(v, dict) else fmt(v) for v in value)
    return value


RACT_ORDERS = (
    "random",
    "uncertainty:margin",
    "uncertainty:least_confidence",
    "uncertainty:entropy",
)
# (model, mode, legend) of the RM plot
RM_LINES = (
    ("mcl", "rank_merge", "rank merge (mcl)"),
    ("rqt", "rank_merge", "rank merge (rqt)"),
    ("cl", "rank_merge", "rank merge (cl)"),
    ("mcl", "naive_merge", "naive merge"),
    ("mcl", "cold", "cold refresh"),
    ("bct", "compatible", "bct, compatible"),
    ("dmu", "adapted", "dmu, adapted"),
)


def _pct_line(ax, curve: dict, metric: str, **style) -> None:
    """The curve in percent, with its bootstrap band when it has one."""
    x = [100 * t for t in curve["fractions"]]
    (line,) = ax.plot(x, [100 * v for v in curve[metric]], **style)
    band = (curve.get("bands") or {}).get(metric)
    if band:
        low, high = ([100 * v for v in band[k]] for k in ("low", "high"))
        ax.fill_between(x, low, high, color=line.get_color(), alpha=0.15, linewidth=0)


def _save(fig, path: str, drawn: bool, paths: list[str]) -> None:
    """Save ``fig`` to ``path`` (and list it) when something was drawn; close it either way."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    if drawn:
        fig.savefig(path)
        paths.append(path)
    plt.close(fig)


def _ract_figure(results: dict, scenario: str):
    """NFR@1 of contrastive / ract / bct under random order, and ract's mAP@100 under each order."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), dpi=100)
    drawn = False
    for label in ("contrastive", "ract", "bct"):
        c = backfill_curve(results, scenario, label, "random", "compatible")
        if c:
            _pct_line(
                axes[0], c, "NFR@1", marker="o", markersize=3, label=f"{label} (random order)"
            )
            drawn = True
    axes[0].set(
        xlabel="gallery backfilled (%)", ylabel="NFR@1 (%)", title=f"{scenario}: negative flips"
    )
    for policy in RACT_ORDERS:
        c = backfill_curve(results, scenario, "ract", policy, "compatible")
        if c:
            _pct_line(axes[1], c, "mAP@100", marker=".", label=f"ract, {policy}")
    axes[1].set(
        xlabel="gallery backfilled (%)",
        ylabel="mAP@100 (%)",
        title=f"{scenario}: RACT by backfill order",
    )
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
        else:
            ax.text(
                0.5,
                0.5,
                "not trained in this scenario",
                ha="center",
                va="center",
                transform=ax.transAxes,
                color="gray",
            )
    return fig, drawn


def _rm_figure(results: dict, scenario: str, models: dict):
    """mAP@100 of rank merge, naive merge, cold and BCT, with the old-old and new*-new* levels."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    drawn = False
    for label, mode, name in RM_LINES:
        c = backfill_curve(results, scenario, label, "random" if mode != "cold" else "any", mode)
        if c:
            _pct_line(ax, c, "mAP@100", marker=".", label=name)
            drawn = True
    refs = models.get("mcl", models.get("bct", {})).get("references", {})
    for ref, color in (("old-old", "gray"), ("new*-new*", "tab:red")):
        v = refs.get(ref, {}).get("mAP@100")
        if v is not None:
            ax.axhline(100 * v, color=color, linestyle=":", label=ref)
    ax.set(
        xlabel="gallery backfilled (%), random order",
        ylabel="mAP@100 (%)",
        title=f"{scenario}: online backfilling",
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    return fig, drawn


def plot_backfill_curves(results: dict, out_dir: str) -> list[str]:
    """PNGs behind the RACT and RM claims, one pair per scenario with a backfill:
    ``ract_<scenario>.png`` (NFR@1 of contrastive / ract / bct under random order, and ract's
    mAP@100 under each order) and ``rm_<scenario>.png`` (mAP@100 of rank merge, naive merge,
    cold and BCT, with the old-old and new*-new* levels)."""
    import matplotlib

    matplotlib.use("Agg", force=False)

    os.makedirs(out_dir, exist_ok=True)
    paths: list[str] = []
    for scenario, models in results.get("backfill", {}).items():
        fig, drawn = _ract_figure(results, scenario)
        _save(fig, os.path.join(out_dir, f"ract_{scenario}.png"), drawn, paths)
        fig, drawn = _rm_figure(results, scenario, models)
        _save(fig, os.path.join(out_dir, f"rm_{scenario}.png"), drawn, paths)
    return paths


def _data_line(opts: dict) -> str:
    """What the models were trained on: the built-in glyphs or your images."""
    source = opts.get("data_source", "glyphs")
    if source == "glyphs":
        return "Built-in glyph data"
    return (
        f"Your images ({source} `{opts.get('data_path')}`; the scenarios allocate its classes, "
        f"so the class and image counts below do not apply)"
    )


def _intro_lines(report: dict) -> list[str]:
    opts = report["options"]
    total = report["timings"]["total_s"]
    return [
        "# raycompat reproduction report",
        "",
        f"{_data_line(opts)}, scale `{opts['scale']}`; wall time **{total:.0f} s** "
        f"({total / 60:.1f} min) on {report['machine']}.",
        "",
        "Scale options: " + ", ".join(f"`{k}={v}`" for k, v in opts["sizes"].items()) + ".",
        "",
        "Every number is mAP@100 (GLDv2 AP@k) on held-out classes (open-set retrieval) unless a "
        "column says otherwise. `M(q, g)`: queries embedded by q, gallery by g. new* = the "
        "independent model of the same scenario and backbone. Update gain (BCT Eq.9), "
        "Delta_up/Delta_down (DMU Eq.6/7) and P_up/P_comp/P_1 (NDPP) use each method's cross test "
        "(`cross used`): new-to-old, new-to-psi(old) for DMU, psi_rev(rho(new))-to-old for the RM "
        "family (whose M(n,n) is rho-to-rho).",
        "",
        _uncertainty_line(report),
        "",
    ]


def _uncertainty_line(report: dict) -> str:
    results, opts = report["results"], report["options"]
    boot = results.get("bootstrap") or opts.get("bootstrap") or {}
    seeds = results.get("seeds") or [opts.get("seed")]
    sizes = sorted({(ts.get("queries"), ts.get("classes")) for ts in results["test_sets"]})
    shown = ", ".join(f"{q} queries of {c} classes" for q, c in sizes if q)
    return (
        f"Uncertainty: every `value [low, high]` is the {100 * boot.get('confidence', 0.95):.0f} % "
        f"percentile bootstrap interval over {boot.get('resamples', 1000)} resamples of the "
        "query classes (every query of a drawn class comes with it)"
        + (f" and of the {len(seeds)} training seeds {seeds}" if len(seeds) > 1 else "")
        + f"; comparisons are paired (the same draws on both sides). Test sets: {shown or 'none'}. "
        "A check is held when its interval excludes the opposite, not held when it excludes the "
        "claim, inconclusive otherwise; a claim needs every check held. "
        + _spread_line(len(seeds), report.get("seed_spread"))
    )


def _spread_line(seeds: int, spread: dict | None) -> str:
    """Where the seed-to-seed spread beside every check comes from (issue 28, point 5)."""
    if seeds > 1:
        return (
            f"Training variation: {seed_note(seeds)}; the spread column gives each check's "
            "per-seed differences and their standard deviation in this run."
        )
    head = f"Training variation: {seed_note(1)}, not the training variation."
    if spread is None:
        return (
            f"{head} No seed-to-seed spread was measured for this report: a run with "
            "`--seeds 2` measures it, and `--seed-spread-from <that run>/report.json` shows it "
            "here beside every check."
        )
    return (
        f"{head} The seed-to-seed spread beside every check comes from `{spread['source']}` "
        f"(seeds {', '.join(map(str, spread['seeds']))}): the standard deviation of the check's "
        "difference across those seeds; a check whose difference here lies within 2 sd of 0 "
        "may change its verdict with the training seed."
    )


def _premise_lines(claims: list[dict]) -> list[str]:
    """A paragraph on the claims whose premise the run did not hold everywhere
    (claims.mark_premise), if any."""
    marked = [c for c in claims if c.get("premise")]
    if not marked:
        return []
    premise = marked[0]["premise"]
    decided = [c for c in marked if c["premise"]["met"]]
    text = (
        f"BCT's criterion M(bct,o) > M(o,o) is **{premise['verdict']}** in this run"
        + (f" (held on {', '.join(premise['met_on'])}; " if premise["met_on"] else " (")
        + f"not held or not decided on {', '.join(premise['not_met_on'])}). {len(marked)} "
        "measured claim(s) build on a compatible new model (RACT's flips and orders, DMU's "
        "adapted gallery, RM's rank merge, NDPP/ODPP's P_1 and the field's methods) and were "
        "measured, on some test sets or all, where that premise fails. "
    )
    if decided:
        text += (
            f"{len(decided)} of them are decided again on the test sets where it held; each "
            "shows that verdict with its verdict on every test set beside it. "
        )
    if len(decided) < len(marked):
        text += (
            f"{len(marked) - len(decided)} have no such test set and say *premise not met at "
            "this scale* beside their measured verdict, which is no evidence for or against "
            "the paper; the premise-scale run (`--scale premise`, docs/reproduce.md) decides "
            "them where BCT is compatible."
        )
    return [text.strip(), ""]


def _claims_lines(report: dict) -> list[str]:
    claims = report["claims"]
    seeds = len(report["results"].get("seeds") or [1])
    lines = ["## Claims", ""] + _premise_lines(claims)
    lines += [claims_table(claims, seeds, report.get("seed_spread")), ""]
    for c in claims:
        lines += [
            f"### {c['paper']}: {c['claim']} -- {shown_verdict(c)}",
            "",
            f"Measurement: {c['measurement']}.",
            "",
            _numbers_table(c["numbers"]),
            "",
        ]
    return lines


def _tables_lines(report: dict) -> list[str]:
    """Per test set tables, what was not trained and why, and the sequential cross pairs."""
    results = report["results"]
    lines = ["## Tables", ""]
    for ts in results["test_sets"]:
        lines += [f"### {ts['name']} ({ts['pair']})", "", method_table(ts), ""]
    skipped = [
        (scenario, m, why) for scenario, items in report["skipped"].items() for m, why in items
    ]
    if skipped:
        lines += [
            "Methods not trained in a scenario, and why:",
            "",
            markdown_table(["scenario", "method", "reason"], skipped),
            "",
        ]
    if results.get("not_trained"):
        lines += [
            "Planned models not trained in this run (their claims say `not measured` where they "
            "were needed):",
            "",
            markdown_table(
                ["model", "reason"], [(m["model"], m["reason"]) for m in results["not_trained"]]
            ),
            "",
        ]
    if results.get("sequential"):
        lines += [
            "## Sequential upgrades: every cross pair",
            "",
            "phi_1 -> phi_2 -> phi_3, each generation trained against its predecessor in its own "
            "chain (phi_1 is shared). `psi-chain(phi_i)`: the stored phi_i gallery brought forward "
            "by DMU's chained psi (psi_j o ... o psi_{i+1}).",
            "",
            sequential_table(results["sequential"]),
            "",
        ]
    return lines


def _models_lines(report: dict) -> list[str]:
    rows = [
        [
            m["scenario"],
            m["label"],
            m["method"],
            m["method_options"] or "",
            m["backbone"],
            m["split"],
            m["epochs"],
            m["final_loss"],
            m["images_per_s"],
            m["wall_s"],
            m["reused"],
        ]
        for m in report["results"]["models"].values()
    ]
    return [
        "## Models",
        "",
        markdown_table(
            [
                "scenario",
                "model",
                "method",
                "options",
                "backbone",
                "split",
                "epochs",
                "final loss",
                "images/s",
                "train s",
                "reused",
            ],
            rows,
            digits=2,
        ),
        "",
        "## Timings",
        "",
        markdown_table(["phase", "seconds"], list(report["timings"].items()), digits=1),
        "",
    ]


def render_markdown(report: dict) -> str:
    lines = _intro_lines(report) + _claims_lines(report) + _tables_lines(report)
    lines += scaling_lines(report["results"].get("class_scaling"), report["plots"])
    curves = [p for p in report["plots"] if os.path.basename(p) != SCALING_PLOT]
    if curves:
        lines += ["## Backfill curves (RACT and RM claims)", ""]
        lines += [f"![{os.path.basename(p)}]({p})\n" for p in curves]
    return "\n".join(lines + _models_lines(report)) + "\n"


# -- the class-scaling run ---------------------------------------------------------------------
SCALING_PLOT = "class_scaling.png"
SCALING_HEADERS = [
    "training classes",
    "old / new training images",
    "M(o,o)",
    "M(bct,o)",
    "M(bct,o) - M(o,o)",
    "verdict",
    "M(bct,bct)",
    "M(n*,n*)",
    "M(n*,o)",
]


def scaling_table(scaling: dict) -> str:
    """One row per class count: every number with its interval, the difference and its
    verdict; a count without numbers says why."""
    rows = []
    for r in scaling["rows"]:
        head = [r["classes"], f"{r['old_train_images']} / {r['new_train_images']}"]
        if not r["measured"]:
            rows.append(head + [f"not measured: {r['reason']}"] + [None] * 6)
            continue
        numbers = [interval_text(r[k]) for k in ("m_oo", "m_bct_o", "difference")]
        rest = [interval_text(r[k]) for k in ("m_bct_bct", "m_nstar", "m_nstar_o")]
        rows.append(head + numbers + [f"**{r['verdict']}**"] + rest)
    return markdown_table(SCALING_HEADERS, rows)


def scaling_lines(scaling: dict | None, plots: list[str]) -> list[str]:
    """The report's class-scaling section (none without ``--class-scaling``)."""
    if not scaling:
        return []
    lines = [
        "## Class scaling: BCT's criterion against the number of training classes",
        "",
        f"{scaling['scenario']}: at each count an old model (30 % of each class's images), "
        "`bct` and the independent model (new*), trained at the scale's epochs and sizes; "
        f"every count is measured on the same queries and gallery (query set "
        f"`{scaling['query_set']}`, {scaling['metric']}), so the differences between counts are "
        'paired too. Training classes are nested (docs/reproduce.md, "The class-scaling run").',
        "",
        scaling_table(scaling),
        "",
        f"What the run shows: {scaling['summary']}",
        "",
    ]
    lines += [f"![{SCALING_PLOT}]({p})\n" for p in plots if os.path.basename(p) == SCALING_PLOT]
    return lines


def _errorbar(ax, rows: list[dict], key: str, **style) -> None:
    x = [r["classes"] for r in rows]
    y = [r[key]["value"] for r in rows]
    err = [[v - r[key]["low"] for v, r in zip(y, rows, strict=True)]]
    err.append([r[key]["high"] - v for v, r in zip(y, rows, strict=True)])
    ax.errorbar(x, y, yerr=err, capsize=3, marker="o", **style)


def plot_class_scaling(scaling: dict | None, out_dir: str) -> list[str]:
    """``class_scaling.png``: M(bct,o) - M(o,o) with its interval against the number of
    training classes (left), and the four retrieval numbers behind it (right)."""
    rows = [r for r in (scaling or {}).get("rows", []) if r["measured"]]
    if not rows:
        return []
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), dpi=100)
    _errorbar(axes[0], rows, "difference", color="tab:blue", label="M(bct,o) - M(o,o)")
    axes[0].axhline(0.0, color="gray", linestyle=":")
    axes[0].set(ylabel="difference (mAP@100)", title="BCT's criterion: held where above 0")
    for key, label in (
        ("m_oo", "M(o,o)"),
        ("m_bct_o", "M(bct,o)"),
        ("m_bct_bct", "M(bct,bct)"),
        ("m_nstar", "M(n*,n*)"),
    ):
        _errorbar(axes[1], rows, key, label=label)
    axes[1].set(ylabel="mAP@100", title="the numbers behind it")
    counts = [r["classes"] for r in rows]
    for ax in axes:
        ax.set_xscale("log")
        ax.set_xticks(counts, [str(c) for c in counts])
        ax.minorticks_off()
        ax.set_xlabel("training classes (extended-data)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    paths: list[str] = []
    _save(fig, os.path.join(out_dir, SCALING_PLOT), True, paths)
    return paths
