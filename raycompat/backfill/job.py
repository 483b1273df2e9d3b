"""Run the backfill simulator on saved embeddings (parquet) and models: the body of
``jobs/simulate_backfill.py``.

Every input problem raises :class:`~raycompat.backfill.gallery.BackfillInputError`
with a one-line message; the job script prints it and exits with status 2.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Dict, Optional, Sequence


from raycompat.backfill.gallery import BackfillInputError, load_parquet
from raycompat.backfill.modes import MODES, apply_bundle_modules, available_modes, parse_modes
from raycompat.backfill.policies import POLICIES, UncertaintyHead, parse_policies

__all__ = ["build_parser", "run", "main"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="simulate_backfill",
        description="Simulate hot-refresh backfilling of a gallery: exact mAP@k / mAP / top-1 / NFR@1 "
                    "curves for each backfill policy and query mode, with AUCs, regression statistics, "
                    "a simulated time axis, and JSON / markdown / PNG reports.")
    p.add_argument("--embeddings", required=True,
                   help="parquet file or folder: item_id, label, split (query/gallery/distractor), "
                        "old, new, optional adapted")
    p.add_argument("--new-model", help="new model bundle: its head drives the uncertainty policies; psi, "
                                       "rho, psi_rev modules give the adapted and rank_merge modes")
    p.add_argument("--old-model", help="old model bundle (checked against the 'old' column's dimension)")
    p.add_argument("--policies", default=None,
                   help=f"comma-separated; allowed: {', '.join(POLICIES)} (default: all that the inputs allow)")
    p.add_argument("--modes", default=None,
                   help=f"comma-separated; allowed: {', '.join(MODES)} (default: all that the inputs allow)")
    p.add_argument("--grid-step", type=float, default=5.0, help="grid step in percent (default 5: 21 points)")
    p.add_argument("--k", type=int, default=100, help="cut-off of mAP@k (default 100)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random and learned policies")
    p.add_argument("--items-per-s-per-gpu", type=float, default=None,
                   help="backfill rate per GPU for the time axis (default: measured with --new-model)")
    p.add_argument("--gpus", type=int, default=1, help="number of GPUs backfilling (default 1)")
    p.add_argument("--newstar-metrics", default=None,
                   help="JSON file {metric: value} of the paragon new*-new* (enables AUC gain)")
    p.add_argument("--learned-sample", type=float, default=0.02,
                   help="held-out sample fraction of the learned policy (default 0.02)")
    p.add_argument("--rank-merge-distance", default="sq_l2", choices=("sq_l2", "sq_l2_raw"))
    p.add_argument("--device", default="auto", help="torch device for scoring (default: cuda if available)")
    from raycompat.outputs import add_output_arguments

    add_output_arguments(p, "backfill", "backfill_out", "simulation")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--quiet", action="store_true", help="no progress messages")
    return p


def _load_bundle(path: str, what: str):
    from raycompat.models import ModelBundle

    if not os.path.isdir(path):
        raise BackfillInputError(f"{what} not found: {path}")
    try:
        return ModelBundle.load(path)
    except FileNotFoundError as exc:
        raise BackfillInputError(f"{what}: {exc}") from exc
    except Exception as exc:
        raise BackfillInputError(f"{what}: cannot load bundle {path}: {exc}".splitlines()[0]) from exc


def run(opts: argparse.Namespace, log=None) -> Dict[str, object]:
    """Load inputs, simulate, write reports; returns the written paths.

    Cheap checks (names, parquet schema and values) run before torch is imported,
    so bad input fails fast."""
    from raycompat.outputs import resolve_job_output
    from raycompat.storage import StorageError

    say = log or (lambda msg: None)
    try:   # an unwritable destination is reported now, not after the simulation
        output = resolve_job_output("backfill", out=opts.out, storage=opts.storage, name=opts.name,
                                    default_out="backfill_out")
    except StorageError as exc:
        raise BackfillInputError(str(exc)) from exc
    if opts.k <= 0:
        raise BackfillInputError(f"--k must be a positive integer, got {opts.k}")
    if opts.gpus <= 0:
        raise BackfillInputError(f"--gpus must be a positive integer, got {opts.gpus}")
    # validate names before the (possibly long) loading
    req_policies = parse_policies(opts.policies) if opts.policies else None
    req_modes = parse_modes(opts.modes) if opts.modes else None

    new_bundle = _load_bundle(opts.new_model, "--new-model") if opts.new_model else None
    old_bundle = _load_bundle(opts.old_model, "--old-model") if opts.old_model else None
    compatible_dim = None
    if new_bundle is not None:
        compatible_dim = new_bundle.manifest.get("compatible_dim")
    say(f"loading {opts.embeddings}")
    data = load_parquet(opts.embeddings, compatible_dim=compatible_dim)
    say(f"{data.n_items:,} gallery items, {data.n_queries:,} queries, old dim {data.old_dim}, "
        f"new dim {data.new_dim}")
    if old_bundle is not None and old_bundle.embed_dim != data.old_dim:
        raise BackfillInputError(
            f"dimension mismatch: --old-model embeds {old_bundle.embed_dim} dims, column 'old' has {data.old_dim}")
    from raycompat.backfill.cost import CostModel, measure_items_per_s
    from raycompat.backfill.report import write_reports
    from raycompat.backfill.simulator import simulate_backfill

    head = None
    if new_bundle is not None:
        if new_bundle.embed_dim != data.new_dim:
            raise BackfillInputError(
                f"dimension mismatch: --new-model embeds {new_bundle.embed_dim} dims, column 'new' has {data.new_dim}")
        data = apply_bundle_modules(data, new_bundle)
        if "head" in new_bundle.modules:
            head = UncertaintyHead.from_classifier_head(new_bundle.head)
    modes = req_modes or available_modes(data)
    if not modes:
        raise BackfillInputError("no query mode is possible with these inputs")
    if req_policies is None:
        pols = ["random", "sequential"]
        if head is not None:
            pols += [p for p in POLICIES if p.startswith("uncertainty:")]
        pols.append("oracle")
        if data.gallery_adapted is not None or data.compat_dim == data.old_dim:
            pols.append("learned")
        req_policies = tuple(pols)
    cost = None
    if opts.items_per_s_per_gpu is not None:
        cost = CostModel(opts.items_per_s_per_gpu, opts.gpus, source="given")
    elif new_bundle is not None:
        rate = measure_items_per_s(new_bundle, device="cpu")
        cost = CostModel(rate, opts.gpus, source="measured: new embedder on cpu, random inputs")
        say(f"measured {rate:.1f} items/s for the new embedder")
    references = None
    if opts.newstar_metrics:
        try:
            with open(opts.newstar_metrics) as f:
                ns = json.load(f)
        except (OSError, ValueError) as exc:
            raise BackfillInputError(f"--newstar-metrics: cannot read {opts.newstar_metrics}: {exc}") from exc
        if not isinstance(ns, dict) or not all(isinstance(v, (int, float)) for v in ns.values()):
            raise BackfillInputError("--newstar-metrics must be a JSON object {metric: number}")
        references = {"new*-new*": ns}
    say(f"policies: {', '.join(req_policies)}; modes: {', '.join(modes)}")
    result = simulate_backfill(
        data, req_policies, modes, grid_step=opts.grid_step, k=opts.k, seed=opts.seed, head=head,
        cost=cost, references=references, learned_sample_fraction=opts.learned_sample,
        rank_merge_distance=opts.rank_merge_distance, device=None if opts.device == "auto" else opts.device,
        progress=say)
    title = f"Backfill simulation: {os.path.basename(opts.embeddings.rstrip('/'))}"
    written = write_reports(result, output.local, plots=not opts.no_plots, title=title)
    where = output.publish()
    if where == output.local:
        return written
    rename = lambda p: where + "/" + os.path.basename(p)  # noqa: E731
    return {"json": rename(written["json"]), "markdown": rename(written["markdown"]),
            "plots": [rename(p) for p in written["plots"]]}


def main(argv: Optional[Sequence[str]] = None) -> int:
    opts = build_parser().parse_args(argv)

    def log(msg: str) -> None:
        if not opts.quiet:
            print(msg, file=sys.stderr, flush=True)

    try:
        paths = run(opts, log)
    except BackfillInputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"report: {paths['markdown']}")
    print(f"json:   {paths['json']}")
    for p in paths["plots"]:
        print(f"plot:   {p}")
    return 0
