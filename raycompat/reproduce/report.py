"""The reproduction report: tables shaped like the papers' (one row per method and test set),
the claims table, hot-refresh plots for the RACT and RM claims; markdown + JSON + PNG."""
from __future__ import annotations

import os

from raycompat.report import fmt, markdown_table

TABLE_HEADERS = ["method", "M(o,o)", "M(n,n)", "M(n,o)", "M(n,adapted)", "cross used", "update gain",
                 "Delta_up", "Delta_down", "P_up", "P_comp", "P_1", "compatible"]


def _v(d, metric):
    return None if d is None else d.get(metric)


def method_table(test_set: dict) -> str:
    """One paper-shaped table (mAP@100): M(o,o), M(n,n), M(n,o), M(n,adapted) and the scores.
    The first row is new* (independent); update gain, Delta and P use the method's cross test
    (``cross used``: new-to-old, new-to-adapted-old for DMU, the reverse query for RM)."""
    metric = test_set["metric"]
    rows = []
    for label, e in test_set["methods"].items():
        if e.get("diverged"):
            rows.append([label, _v(test_set.get("m_oo"), metric), "diverged (NaN loss)"] + [None] * 10)
            continue
        rows.append([label + (" (new*)" if label == "independent" else ""), _v(e["m_oo"], metric),
                     _v(e["m_nn"], metric), _v(e["m_no"], metric), _v(e["m_nadapted"], metric),
                     {"compatible": "n->o", "adapted": "n->psi(o)", "rank_merge": "psi_rev(rho(n))->o"}[e["cross_mode"]],
                     e["update_gain"], e["delta_up"], e["delta_down"], e["P_up"], e["P_comp"], e["P_1"],
                     e["compatible"]])
    return markdown_table(TABLE_HEADERS, rows)


def sequential_table(sequential: dict) -> str:
    """Every cross pair of every chain (mAP@100, top-1), adapted galleries included."""
    rows = []
    for label, pairs in sequential["pairs"].items():
        got = {}
        for r in pairs:
            got.setdefault((r["query_generation"], r["gallery_generation"], r["gallery_state"]), {})[r["metric"]] = r["value"]
        for (j, i, state), m in sorted(got.items()):
            rows.append([label, f"phi_{j}", f"phi_{i}" if state == "stored" else f"psi-chain(phi_{i})",
                         m.get("mAP@100"), m.get("top1")])
    return markdown_table(["method", "query", "gallery", "mAP@100", "top1"], rows)


def claims_table(claims: list[dict]) -> str:
    return markdown_table(["paper", "claim", "verdict", "measurement", "why"],
                          [[c["paper"], c["claim"], f"**{c['verdict']}**", c["measurement"], c["explanation"]]
                           for c in claims])


def _numbers_table(numbers: list[dict]) -> str:
    if not numbers:
        return "(no data)"
    headers = list(dict.fromkeys(k for row in numbers for k in row))
    return markdown_table(headers, [[_cell(row.get(h)) for h in headers] for row in numbers])


def _cell(value):
    if isinstance(value, list):
        return ", ".join(fmt(v) for v in value)
    return value


def plot_hot_refresh(results: dict, out_dir: str) -> list[str]:
    """PNGs behind the RACT and RM claims, one pair per scenario with a backfill:
    ``ract_<scenario>.png`` (NFR@1 of contrastive / ract / bct under random order, and ract's
    mAP@100 under each order) and ``rm_<scenario>.png`` (mAP@100 of rank merge, naive merge,
    cold and BCT, with the old-old and new*-new* levels)."""
    import matplotlib
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    from raycompat.reproduce.claims import _curve

    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for scenario, models in results.get("backfill", {}).items():
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), dpi=100)
        drawn = False
        for label in ("contrastive", "ract", "bct"):
            c = _curve(results, scenario, label, "random", "compatible")
            if c:
                axes[0].plot([100 * t for t in c["fractions"]], [100 * v for v in c["NFR@1"]], marker="o",
                             markersize=3, label=f"{label} (random order)")
                drawn = True
        axes[0].set(xlabel="gallery backfilled (%)", ylabel="NFR@1 (%)", title=f"{scenario}: negative flips")
        for policy in ("random", "uncertainty:margin", "uncertainty:least_confidence", "uncertainty:entropy"):
            c = _curve(results, scenario, "ract", policy, "compatible")
            if c:
                axes[1].plot([100 * t for t in c["fractions"]], [100 * v for v in c["mAP@100"]], marker=".",
                             label=f"ract, {policy}")
        axes[1].set(xlabel="gallery backfilled (%)", ylabel="mAP@100 (%)", title=f"{scenario}: RACT by backfill order")
        for ax in axes:
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
            else:
                ax.text(0.5, 0.5, "not trained in this scenario", ha="center", va="center",
                        transform=ax.transAxes, color="gray")
        fig.tight_layout()
        if drawn:
            path = os.path.join(out_dir, f"ract_{scenario}.png")
            fig.savefig(path)
            paths.append(path)
        plt.close(fig)

        fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
        drawn = False
        for label, mode, name in (("mcl", "rank_merge", "rank merge (mcl)"), ("rqt", "rank_merge", "rank merge (rqt)"),
                                  ("cl", "rank_merge", "rank merge (cl)"), ("mcl", "naive_merge", "naive merge"),
                                  ("mcl", "cold", "cold refresh"), ("bct", "compatible", "bct, compatible"),
                                  ("dmu", "adapted", "dmu, adapted")):
            c = _curve(results, scenario, label, "random" if mode != "cold" else "any", mode)
            if c:
                ax.plot([100 * t for t in c["fractions"]], [100 * v for v in c["mAP@100"]], marker=".", label=name)
                drawn = True
        refs = models.get("mcl", models.get("bct", {})).get("references", {})
        for ref, color in (("old-old", "gray"), ("new*-new*", "tab:red")):
            v = refs.get(ref, {}).get("mAP@100")
            if v is not None:
                ax.axhline(100 * v, color=color, linestyle=":", label=ref)
        ax.set(xlabel="gallery backfilled (%), random order", ylabel="mAP@100 (%)",
               title=f"{scenario}: online backfilling")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
        fig.tight_layout()
        if drawn:
            path = os.path.join(out_dir, f"rm_{scenario}.png")
            fig.savefig(path)
            paths.append(path)
        plt.close(fig)
    return paths


def render_markdown(report: dict) -> str:
    opts = report["options"]
    sizes = opts["sizes"]
    lines = ["# raycompat reproduction report", "",
             f"Built-in glyph data, scale `{opts['scale']}`; wall time **{report['timings']['total_s']:.0f} s** "
             f"({report['timings']['total_s'] / 60:.1f} min) on {report['machine']}.", "",
             "Scale options: " + ", ".join(f"`{k}={v}`" for k, v in sizes.items()) + ".", "",
             "Every number is mAP@100 (GLDv2 AP@k) on held-out classes (open-set retrieval) unless a "
             "column says otherwise. `M(q, g)`: queries embedded by q, gallery by g. new* = the "
             "independent model of the same scenario and backbone. Update gain (BCT Eq.9), "
             "Delta_up/Delta_down (DMU Eq.6/7) and P_up/P_comp/P_1 (NDPP) use each method's cross test "
             "(`cross used`): new-to-old, new-to-psi(old) for DMU, psi_rev(rho(new))-to-old for the RM "
             "family (whose M(n,n) is rho-to-rho).", "",
             "## Claims", "", claims_table(report["claims"]), ""]
    for c in report["claims"]:
        lines += [f"### {c['paper']}: {c['claim']} -- {c['verdict']}", "", f"Measurement: {c['measurement']}.", "",
                  _numbers_table(c["numbers"]), ""]
    lines += ["## Tables", ""]
    for ts in report["results"]["test_sets"]:
        lines += [f"### {ts['name']} ({ts['pair']})", "", method_table(ts), ""]
    skipped = [(scenario, m, why) for scenario, items in report["skipped"].items() for m, why in items]
    if skipped:
        lines += ["Methods not trained in a scenario, and why:", "",
                  markdown_table(["scenario", "method", "reason"], skipped), ""]
    if report["results"].get("not_trained"):
        lines += ["Planned models not trained in this run (their claims say `not measured` where they "
                  "were needed):", "",
                  markdown_table(["model", "reason"], [(m["model"], m["reason"])
                                                       for m in report["results"]["not_trained"]]), ""]
    if report["results"].get("sequential"):
        lines += ["## Sequential upgrades: every cross pair", "",
                  "phi_1 -> phi_2 -> phi_3, each generation trained against its predecessor in its own "
                  "chain (phi_1 is shared). `psi-chain(phi_i)`: the stored phi_i gallery brought forward "
                  "by DMU's chained psi (psi_j o ... o psi_{i+1}).", "",
                  sequential_table(report["results"]["sequential"]), ""]
    if report["plots"]:
        lines += ["## Hot refresh (RACT and RM claims)", ""]
        lines += [f"![{os.path.basename(p)}]({p})\n" for p in report["plots"]]
    lines += ["## Models", "",
              markdown_table(["scenario", "model", "method", "options", "backbone", "split", "epochs",
                              "final loss", "images/s", "train s", "reused"],
                             [[m["scenario"], m["label"], m["method"], m["method_options"] or "", m["backbone"],
                               m["split"], m["epochs"], m["final_loss"], m["images_per_s"], m["wall_s"],
                               m["reused"]] for m in report["results"]["models"].values()], digits=2), "",
              "## Timings", "",
              markdown_table(["phase", "seconds"], list(report["timings"].items()), digits=1), ""]
    return "\n".join(lines) + "\n"
