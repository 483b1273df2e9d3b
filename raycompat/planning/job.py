"""Plan an upgrade: which new model, query mode and backfill order, how long, how much, and how
good at every hour.

``raycompat plan-upgrade`` / ``jobs/plan_upgrade.py`` reads simulated backfill curves (one or
more ``simulate-backfill`` report folders, or the main job's report folder; with ``--store``
it first simulates the gallery of a LanceDB table or Milvus collection into
``<out>/simulation``, the store's candidate named after its table or collection), puts every
candidate (model x policy x query mode), a cold refresh per model and staying on the old model
on one wall clock for the gallery size, devices, rates and price given, checks the
constraints, and writes ``plan.md``, ``plan.json`` and two PNGs (docs/planning.md). :func:`run`
is the library call. A bad input is one ``error:`` line naming it (exit 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import sys
from dataclasses import dataclass

from raycompat.config import (
    ConfigError,
    add_options,
    choices,
    fraction,
    make_parser,
    nonnegative,
    option,
    options_from_args,
    positive,
)
from raycompat.console import job_main
from raycompat.outputs import OutputOptions
from raycompat.simulator.store_inputs import StoreInputOptions

__all__ = ["PlanUpgradeOptions", "build_parser", "main", "run"]


@dataclass(frozen=True)
class PlanUpgradeOptions:
    """Every flag of the plan-upgrade job."""

    results: tuple[str, ...] = option(
        (),
        help="comma-separated: simulate-backfill report folders (or their curves.json) or main "
        "job report folders, one per candidate new model of one old model; NAME=PATH names one",
    )
    store_input: StoreInputOptions = option(
        StoreInputOptions(),
        help="instead of (or beside) --results: simulate the gallery of a vector store first "
        "(simulate-backfill --store, into <out>/simulation) and plan on it; the candidate is "
        "named after the table or collection",
    )
    new_model: str | None = option(
        None,
        help="with --store: the new model bundle the simulation uses (its head for the "
        "uncertainty policies, psi / fct / rho for their modes, its rate measured on the CPU "
        "when no rate is given)",
    )
    items: int | None = option(
        None, min=1, help="gallery size to plan for (none: the simulated gallery's)"
    )
    devices: int = positive(1, help="devices re-embedding the gallery")
    device_kind: str = choices("gpu", "cpu", default="gpu", help="what a device is")
    price_per_device_hour: float = nonnegative(0.0, help="price of one device for one hour")
    items_per_s: float | None = option(
        None,
        min=1e-12,
        help="embedding rate per device, given (none: --rate-summary, --rate-model, or each "
        "simulation's recorded rate)",
    )
    rate_summary: str | None = option(
        None, help="an embed-gallery output folder (or its _summary.json): the rate it measured"
    )
    rate_model: str | None = option(
        None,
        help="a new-model bundle: measure its rate on the spot, embedding --rate-items glyph "
        "items with embed-gallery on this machine",
    )
    rate_items: int = positive(2000, help="items embedded by --rate-model")
    quality: str = choices(
        "auto",
        "weighted",
        "unweighted",
        default="auto",
        help="the curves to rank on: auto (frequency-weighted when the simulations have a "
        "query log), weighted, or unweighted (every query once)",
    )
    rate_device_check: bool = option(
        True,
        help="refuse a simulation's recorded rate measured on another kind of device than "
        "--device-kind (--no-rate-device-check plans with it anyway)",
    )
    psi_per_s: float | None = option(
        None,
        min=1e-12,
        help="gallery transform rate per device, vectors/s, given: psi (adapted mode) or FCT's "
        "h (fct mode)",
    )
    psi_model: str | None = option(
        None, help="a new-model bundle with psi: measure its refresh rate on the spot"
    )
    queries_per_s: float | None = option(
        None, min=0, help="query load during the upgrade (prices second searches per query)"
    )
    searches_per_s: float | None = option(
        None, min=1e-12, help="searches per second of one device (with --queries-per-s)"
    )
    store_items_per_s: float | None = option(
        None, min=1e-12, help="the store's write rate, items/s: it bounds the backfill's rate"
    )
    training_hours: float | None = option(
        None,
        min=0,
        help="fixed cost: device-hours of training the new model, at the device price "
        "(default: each candidate's own, read from its bundle's training.json when it trained on "
        "--device-kind; else 0)",
    )
    index_build_hours: float = nonnegative(
        0.0, help="fixed cost: device-hours of building the new index, at the device price"
    )
    new_dim: int | None = option(
        None, min=1, help="dimension of the new vectors (float32): sizes the second vector set"
    )
    storage_price_per_gib_hour: float = nonnegative(
        0.0, help="fixed cost: the second vector set held until the end, per GiB-hour (--new-dim)"
    )
    new_items_per_hour: float = nonnegative(
        0.0, help="fixed cost: items arriving during the backfill, each embedded once more"
    )
    size_check: bool = option(
        False,
        help="re-simulate each candidate on nested subsamples of its gallery (--size-fractions) "
        "and report how the options' quality-hours and ranking move with the size",
    )
    size_fractions: str = option("0.25,0.5,1", help="comma-separated: the --size-check sizes")
    never_below_old: bool = option(
        False, help="constraint: the lower bound of mAP@k never below old-old's value"
    )
    max_nfr: float | None = fraction(
        None, help="constraint: NFR@1 at most this (a fraction: 0.05 for 5 percent)"
    )
    deadline_hours: float | None = option(
        None, min=1e-12, help="constraint: every item re-embedded within this many hours"
    )
    budget: float | None = option(None, min=0, help="constraint: total cost at most this")
    policies: str | None = option(None, help="comma-separated: only these policies (none: all)")
    modes: str | None = option(None, help="comma-separated: only these query modes (none: all)")
    output: OutputOptions = option(OutputOptions(name="plan"), help="where the plan goes")
    plots: bool = option(True, help="write the PNG plots (--no-plots skips them)")
    quiet: bool = option(False, help="no progress messages")


def build_parser() -> argparse.ArgumentParser:
    parser = make_parser(
        "plan-upgrade",
        description="Plan an upgrade from simulated backfill curves: hours, cost, mAP@k and NFR@1 "
        "at 25/50/90/100 %, quality-hours, the hour quality passes old-old, and the option "
        "that meets the constraints with the most quality-hours (plan.md, plan.json, PNGs).",
    )
    add_options(parser, PlanUpgradeOptions)
    return parser


def _check(opts: PlanUpgradeOptions) -> None:
    """Flag combinations (``ConfigError`` naming them)."""
    rates = {"items_per_s": "--items-per-s", "rate_summary": "--rate-summary"}
    rates["rate_model"] = "--rate-model"
    given = [flag for field, flag in rates.items() if getattr(opts, field) is not None]
    if len(given) > 1:
        raise ConfigError(f"give one embedding rate, not {' and '.join(given)}")
    if opts.psi_per_s is not None and opts.psi_model:
        raise ConfigError("give --psi-per-s or --psi-model, not both")
    if (opts.queries_per_s is None) != (opts.searches_per_s is None):
        raise ConfigError("--queries-per-s and --searches-per-s go together")
    if opts.budget is not None and opts.price_per_device_hour == 0:
        raise ConfigError("--budget needs --price-per-device-hour")
    store = opts.store_input
    if not opts.results and not store.store:
        raise ConfigError("--results: give at least one simulation (or --store)")
    if (opts.new_model or store.queries or store.store_columns) and not store.store:
        raise ConfigError("--new-model, --queries and --store-columns go with --store")
    if store.store and opts.size_check:
        raise ConfigError(
            "--size-check re-simulates subsamples of a parquet gallery: not with --store "
            "(simulate-backfill --store, then --size-check on a parquet export of the gallery)"
        )
    if opts.storage_price_per_gib_hour and opts.new_dim is None:
        raise ConfigError("--storage-price-per-gib-hour needs --new-dim (the new vectors' size)")


def _size_fractions(text: str) -> tuple[float, ...]:
    """``--size-fractions``: fractions in (0, 1], the whole gallery included."""
    try:
        values = tuple(sorted({float(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise ConfigError(f"--size-fractions {text!r}: comma-separated numbers") from None
    if not values or values[0] <= 0 or values[-1] != 1.0:
        raise ConfigError(f"--size-fractions {text!r}: fractions in (0, 1], 1 among them")
    return values


def _resolved(opts: PlanUpgradeOptions) -> PlanUpgradeOptions:
    """Input paths made absolute (``NAME=`` kept), as job.json records them."""
    from raycompat.planning.inputs import split_name

    def absolute(entry: str) -> str:
        name, path = split_name(entry)
        return f"{name}={os.path.abspath(path)}" if name else os.path.abspath(path)

    paths = {f: getattr(opts, f) for f in ("rate_summary", "rate_model", "psi_model", "new_model")}
    store = opts.store_input
    if store.queries:
        from raycompat.outputs import resolved_option

        store = dataclasses.replace(store, queries=resolved_option(store.queries))
    return dataclasses.replace(
        opts,
        results=tuple(absolute(r) for r in opts.results),
        store_input=store,
        **{f: os.path.abspath(p) for f, p in paths.items() if p},
    )


def _names(parse, text: str | None, flag: str) -> tuple[str, ...]:
    from raycompat.embeddings.gallery import BackfillInputError

    if not text:
        return ()
    try:
        return tuple(parse(text))
    except BackfillInputError as exc:
        raise ConfigError(f"{flag}: {exc}") from None


def _given_rate(opts: PlanUpgradeOptions):
    """The embedding rate of ``--items-per-s`` or ``--rate-summary`` (None otherwise)."""
    from raycompat.planning import rates

    if opts.items_per_s is not None:
        return rates.EmbeddingRate(opts.items_per_s, 0.0, "given (--items-per-s)")
    if opts.rate_summary:
        return rates.rate_from_summary(opts.rate_summary)
    return None


def _psi_rate(opts: PlanUpgradeOptions):
    from raycompat.planning import rates

    if opts.psi_per_s is not None:
        return rates.PsiRate(opts.psi_per_s, "given (--psi-per-s)")
    if opts.psi_model:
        return rates.measure_psi_rate(opts.psi_model, opts.device_kind)
    return None


def _store_candidate(opts: PlanUpgradeOptions) -> str | None:
    """``--store``'s candidate name (its table or collection), its inputs checked without
    reading a vector (``ConfigError`` naming the column and the URI); None without it."""
    from raycompat.embeddings.gallery import BackfillInputError
    from raycompat.simulator.store_inputs import check_store_inputs

    if not opts.store_input.store:
        return None
    try:
        found = check_store_inputs(opts.store_input)
    except BackfillInputError as exc:
        raise ConfigError(str(exc)) from None
    return found.uri.rstrip("/").rpartition("/")[2]


def _simulate_store(opts: PlanUpgradeOptions, name: str, folder: str, say) -> str:
    """``simulate-backfill --store ...`` into ``folder`` (the simulator's defaults, the plan's
    --policies, --modes and --items-per-s); returns the ``--results`` entry of its report."""
    from raycompat.embeddings.gallery import BackfillInputError
    from raycompat.simulator.job import BackfillJobOptions
    from raycompat.simulator.job import run as simulate

    sim = BackfillJobOptions(
        store_input=opts.store_input,
        new_model=opts.new_model,
        policies=opts.policies,
        modes=opts.modes,
        items_per_s_per_gpu=opts.items_per_s,
        out=folder,
        overwrite=opts.output.overwrite,
        reference_cache="none",
        plots=opts.plots,
        quiet=opts.quiet,
    )
    say(f"simulating the gallery of {opts.store_input.store} into {folder}")
    try:
        simulate(sim, say)
    except BackfillInputError as exc:
        raise ConfigError(str(exc)) from None
    return f"{name}={folder}"


def _hardware(opts: PlanUpgradeOptions, sims: list, bundle_training):
    """The :class:`~raycompat.planning.timeline.Hardware` of the plan: the gallery's size, the
    devices and their price, the search load, and the fixed costs (training: given by
    ``--training-hours`` or read from the simulations' bundles by ``bundle_training``)."""
    from raycompat.planning.rates import SearchLoad
    from raycompat.planning.timeline import FixedCosts, Hardware

    search = None
    if opts.queries_per_s is not None:
        search = SearchLoad(opts.queries_per_s, opts.searches_per_s)
    items = opts.items or sims[0].n_items
    by_model, notes = (), ()
    if opts.training_hours is None:
        by_model, notes = bundle_training(sims, opts.device_kind, opts.new_model)
    fixed = FixedCosts(
        training_hours=opts.training_hours or 0.0,
        training_by_model=by_model,
        training_notes=notes,
        index_build_hours=opts.index_build_hours,
        storage_gib=items * (opts.new_dim or 0) * 4 / 2**30,
        storage_price=opts.storage_price_per_gib_hour,
        new_items_per_hour=opts.new_items_per_hour,
    )
    return Hardware(
        items=items,
        devices=opts.devices,
        device_kind=opts.device_kind,
        price=opts.price_per_device_hour,
        search=search,
        store_items_per_s=opts.store_items_per_s,
        fixed=fixed,
    )


def run(opts: PlanUpgradeOptions, log=None, command: str | None = None) -> dict:
    """Read the curves, build and assess every option, write the plan; returns the written
    paths and the plan (``"plan"``). Inputs are checked before the output folder is made."""
    from raycompat.planning.inputs import bundle_training, load_results
    from raycompat.planning.plan import candidates, make_plan, model_rates
    from raycompat.planning.rates import measure_embedding_rate
    from raycompat.planning.recommend import Constraints
    from raycompat.planning.report import write_plan
    from raycompat.upgrade.modes import parse_modes
    from raycompat.upgrade.policies import parse_policies

    say = log or (lambda message: None)
    _check(opts)
    opts = _resolved(opts)
    store_name = _store_candidate(opts)
    sims = load_results(opts.results, opts.quality) if opts.results else []
    size_fracs = _size_fractions(opts.size_fractions)
    policies = _names(parse_policies, opts.policies, "--policies")
    modes = _names(parse_modes, opts.modes, "--modes")
    psi = _psi_rate(opts)
    rate = _given_rate(opts)

    def check_inputs(sims) -> None:
        candidates(sims, policies, modes, psi)
        if rate is None and not opts.rate_model:
            model_rates(sims, None, opts.device_kind if opts.rate_device_check else None)

    if sims:  # every input checked before the output folder (--store: as far as it can be)
        check_inputs(sims)
    output = opts.output.resolve("plan_upgrade", default_out="plan_out", config=opts)
    if store_name is not None:  # the store's simulation, then every candidate read together
        entry = _simulate_store(opts, store_name, output.path("simulation"), say)
        sims = load_results((*opts.results, entry), opts.quality)
        check_inputs(sims)
    if opts.rate_model:
        rate = measure_embedding_rate(
            opts.rate_model, opts.rate_items, output.path("rate_probe"), opts.device_kind, say
        )
    hardware = _hardware(opts, sims, bundle_training)
    constraints = Constraints(
        never_below_old=opts.never_below_old,
        max_nfr=opts.max_nfr,
        deadline_hours=opts.deadline_hours,
        budget=opts.budget,
    )

    def plan_at(simulations):
        return make_plan(
            simulations,
            hardware,
            constraints,
            rate=rate,
            psi=psi,
            policies=policies,
            modes=modes,
            rate_device_check=opts.rate_device_check,
        )

    plan = plan_at(sims)
    if opts.size_check:
        from dataclasses import replace

        from raycompat.planning.size_check import size_check

        plan = replace(plan, size_check=size_check(sims, plan_at, size_fracs, log=say))
    say(f"{len(plan.assessed)} options planned; writing {output.local}")
    written = write_plan(plan, output.local, plots=opts.plots, command=command)
    output.publish()
    return dict(written, plan=plan)


@job_main
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    opts = options_from_args(PlanUpgradeOptions, build_parser().parse_args(argv))

    def log(message: str) -> None:
        if not opts.quiet:
            print(message, file=sys.stderr, flush=True)

    command = "raycompat plan-upgrade " + " ".join(shlex.quote(a) for a in argv)
    paths = run(opts, log, command=command)
    print(f"recommendation: {paths['plan'].recommendation.reason}")
    print(f"plan: {paths['markdown']}")
    print(f"json: {paths['json']}")
    for p in paths["plots"]:
        print(f"plot: {p}")
    return 0
