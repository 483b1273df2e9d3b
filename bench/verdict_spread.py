"""The main job's verdicts across training seeds and torch thread counts, at its full scale.

Whether BCT's criterion M(bct,o) > M(o,o) is held, and the independent model's not held, is a
result of the science that the main job reports; this bench measures how far those numbers move
with the training seed and with the float rounding of another torch thread count (as on another
CPU). It runs the main job (``raycompat.quickstart``, its defaults, one training seed per run)
once per ``seed x threads`` and prints the table the README shows: per run M(o,o), M(bct,o),
and each model's difference M(n,o) - M(o,o) with its 95 % interval and verdict, then the range
of each column over the runs. Every run also prints its wall time, and the ratio of the slowest
to the fastest run.

    python bench/verdict_spread.py [--seeds 0,1,2] [--threads 2,1] [--storage DIR] [--out DIR]

Models are named by a hash of their options under ``--storage`` (default
``~/raycompat_runs/verdict_spread``), so a second run of the bench reuses them and only embeds,
evaluates and simulates again. Writes ``verdict_spread.json`` and ``verdict_spread.md`` to
``--out``. Takes about 20 minutes on a quiet 2-core machine (6 runs of 3-4 minutes).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from raycompat.outputs import OutputOptions  # noqa: E402
from raycompat.quickstart import QuickstartOptions, run_quickstart  # noqa: E402

MODELS = ("bct", "independent")


def parse_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def one_run(seed: int, threads: int, storage: str, out: str) -> dict:
    """The main job with one training seed ``seed`` and ``threads`` torch threads: its
    verdict numbers and wall time."""
    opts = dataclasses.replace(
        QuickstartOptions(),
        seed=seed,
        seeds=1,
        threads=threads,
        output=OutputOptions(
            out=os.path.join(out, f"seed{seed}-threads{threads}"), storage=storage
        ),
    )
    started = time.perf_counter()
    report = run_quickstart(opts)
    wall = time.perf_counter() - started
    verdicts = {v["model"]: v for v in report["verdicts"]}
    row = {"seed": seed, "threads": threads, "wall_s": wall}
    row["m_old_old"] = verdicts["bct"]["m_old_old"]
    for model in MODELS:
        v = verdicts[model]
        d = v["difference"]
        row[f"m_{model}_old"] = v["m_new_old"]
        row[model] = {"value": d["value"], "low": d["low"], "high": d["high"]}
        row[f"{model}_verdict"] = v["verdict"]
    return row


def table(rows: list[dict]) -> str:
    head = (
        "| seed | threads | M(o,o) | M(bct,o) | M(bct,o) - M(o,o) | M(independent,o) - M(o,o) |\n"
        "|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        cells = [str(r["seed"]), str(r["threads"]), f"{r['m_old_old']:.4f}"]
        cells.append(f"{r['m_bct_old']:.4f}")
        for model in MODELS:
            d = r[model]
            cells.append(
                f"{d['value']:.4f} [{d['low']:.4f}, {d['high']:.4f}] {r[f'{model}_verdict']}"
            )
        lines.append("| " + " | ".join(cells) + " |")
    return head + "\n".join(lines) + "\n"


def spread(rows: list[dict]) -> str:
    """The range of every number over the runs, and the verdicts seen."""

    def rng(values):
        return f"{min(values):.4f} to {max(values):.4f}"

    parts = [
        f"M(o,o) {rng([r['m_old_old'] for r in rows])}",
        f"M(bct,o) {rng([r['m_bct_old'] for r in rows])}",
    ]
    for model in MODELS:
        seen = sorted({r[f"{model}_verdict"] for r in rows})
        parts.append(
            f"{model} difference {rng([r[model]['value'] for r in rows])}, "
            f"verdicts {' / '.join(seen)}"
        )
    return "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=parse_ints, default=[0, 1, 2])
    parser.add_argument("--threads", type=parse_ints, default=[2, 1])
    parser.add_argument("--storage", default=os.path.expanduser("~/raycompat_runs/verdict_spread"))
    parser.add_argument("--out", default="verdict_spread_out")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    rows = []
    runs = [(t, s) for t in args.threads for s in args.seeds]
    for i, (threads, seed) in enumerate(runs):
        row = one_run(seed, threads, args.storage, args.out)
        rows.append(row)
        print(
            f"== run {i + 1}/{len(runs)}: seed {seed}, {threads} thread(s): bct "
            f"{row['bct_verdict']}, independent {row['independent_verdict']} "
            f"({row['wall_s']:.0f} s)",
            flush=True,
        )
    walls = [r["wall_s"] for r in rows]
    text = table(rows)
    summary = spread(rows)
    print(text + "\n" + summary)
    print(
        f"wall time per run {min(walls):.0f} to {max(walls):.0f} s (slowest / fastest "
        f"{max(walls) / min(walls):.2f})"
    )
    with open(os.path.join(args.out, "verdict_spread.json"), "w") as fh:
        json.dump({"rows": rows, "spread": summary}, fh, indent=1)
    with open(os.path.join(args.out, "verdict_spread.md"), "w") as fh:
        fh.write("# The main job's verdicts across seeds and thread counts\n\n" + text)
        fh.write("\n" + summary + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
