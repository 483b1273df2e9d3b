"""Backfill a LanceDB table or Milvus collection in place with a new model: the live index's
upgrade (policy order, canary guards, pause, resume, rollback, finalize) on a vector store.

``raycompat backfill-store`` / ``jobs/backfill_store.py`` (``ray job submit -- python
jobs/backfill_store.py ...``); docs/stores.md, "The backfill job".  A run walks a policy's order
of the store's items (random, sequential, uncertainty:*; the simulator's order for a gallery
read from the store) and writes each batch's new vectors with the new model's fingerprint
through the store interface (one atomic ``write_new``: LanceDB ``merge_insert``, Milvus
``upsert``), from precomputed vectors (``--new-vectors``) or from the items' images through the
Ray Data gallery pipeline (the store's ``image_uri`` column).  Every decision is the upgrade
state machine's (:mod:`raycompat.upgrade.state_machine`), so the answers and refusals are the
live index's.  Progress lives in the store (:mod:`raycompat.stores.backfill`): a killed job,
started again, goes on exactly where the store says, no item lost or written twice.

Commands act on the upgrade's record in the store: ``--status`` (JSON), ``--pause``,
``--resume [--override]``, ``--rollback [--to POS]``, ``--finalize``.  A running job takes them
between batches; on a stopped one the command applies them itself (a rollback or a finalize runs
in the command's own process).

Exit status: 0 done or paused (at ``--until``, by ``--pause``); 1 stopped in ``error`` (the
store refused a write, named); 2 bad input (one ``error:`` line naming the column); 3 refused by
the state machine (the live index's 409, one ``error:`` line); 4 paused by a canary guard.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass

import numpy as np

from raycompat.config import (
    ConfigError,
    add_options,
    choices,
    make_parser,
    option,
    options_from_args,
)
from raycompat.console import Progress, job_main, phase
from raycompat.pipeline.options import MODEL_STAGES
from raycompat.upgrade.canary import CanaryOptions
from raycompat.upgrade.state_machine import (
    Answer,
    Command,
    Facts,
    State,
    StateMachine,
    state_of,
)

__all__ = ["BackfillStoreOptions", "build_parser", "main", "EXIT"]

#: Exit statuses (module docstring).
EXIT = {"ok": 0, "error": 1, "bad_input": 2, "refused": 3, "guard": 4}
#: The policies a store backfill can compute (what a store holds: N, ids, old vectors; the
#: new model's head for uncertainty).
POLICIES = (
    "random",
    "sequential",
    "uncertainty:least_confidence",
    "uncertainty:margin",
    "uncertainty:entropy",
)
COMMANDS = ("status", "pause", "resume", "rollback", "finalize")
#: Batches between two compactions of the store's files (:meth:`VectorStore.compact`).
COMPACT_EVERY = 64


@dataclass(frozen=True)
class PipelineFlags:
    """How the Ray Data pipeline embeds images (no ``--new-vectors``)."""

    cache: str | None = option(
        None,
        help="folder for the pipeline's embeddings (a cache: parquet shards per segment of "
        "the order, resumable); default: a folder under the system's temp folder",
    )
    embed_chunk: int = option(
        8192, min=1, help="items of the order embedded per pipeline run (a segment)"
    )
    address: str | None = option(None, help="Ray address (none: an embedded local cluster)")
    num_cpus: int | None = option(None, min=1, help="CPUs of the embedded local cluster")
    model_stages: str = choices(
        *MODEL_STAGES,
        default="actors",
        help="the model as an actor (loaded per segment) or Ray tasks (kept by each worker "
        "across segments): docs/simulator.md, 'Actors or tasks'",
    )


@dataclass(frozen=True)
class BackfillStoreOptions:
    """Every flag of ``raycompat backfill-store``."""

    store: str | None = option(
        None,
        help="the store to upgrade: lance://<database>/<table> or "
        "milvus://<file.db or host:port>/<collection> (docs/stores.md)",
    )
    store_columns: str | None = option(
        None,
        help="comma-separated LOGICAL=COLUMN where the store's columns are not raycompat's "
        "defaults (id, label, old, new, old_model, new_model, upgraded, position, image_uri)",
    )
    new_model: str | None = option(
        None,
        help="the new model's bundle folder: its fingerprint is written with every vector; it "
        "embeds the images (no --new-vectors) and gives uncertainty:* its head",
    )
    new_vectors: str | None = option(
        None,
        help="precomputed new vectors: a parquet file or folder with item_id and new (the "
        "output of embed-gallery --columns new); label/class_name are checked against the "
        "store's; without it the images of the store's image_uri column are embedded",
    )
    policy: str | None = option(
        None,
        help=f"the order: one of {', '.join(POLICIES)} (default random; a run that "
        "continues a backfill keeps its own)",
    )
    seed: int | None = option(None, min=0, help="the random policy's seed (default 0)")
    batch_size: int = option(256, min=1, help="items per write (one atomic store write)")
    rate: float | None = option(
        None, min=1e-9, help="at most this many items per second (a batch holds one second)"
    )
    until: int | None = option(
        None, min=0, help="pause at this position of the order (a job run; --resume: the new one)"
    )
    canary: str | None = option(
        None,
        help="canary queries with their relevance: the live index's registration JSON "
        "(vectors, old_vectors, classes or relevant_ids) or a canary parquet",
    )
    guard: CanaryOptions = option(CanaryOptions(), help="the canary and its guards")
    restart: bool = option(
        False,
        help="start a new backfill (policy, seed) over the current one; what is upgraded stays "
        "(the start of the new order)",
    )
    overwrite: bool = option(
        False,
        help="start over a finalized or another model's upgrade: every item back to its old "
        "vector first",
    )
    status: bool = option(False, help="print the upgrade's state as JSON")
    pause: bool = option(False, help="pause the running backfill or rollback")
    resume: bool = option(
        False,
        help="resume (with --until/--rate: new ones); a stopped job's backfill is then "
        "continued by the next run of the job, a rollback by this command",
    )
    override: bool = option(False, help="with --resume or a run: continue past a canary guard")
    rollback: bool = option(False, help="turn upgraded items back to their old vectors")
    to: int | None = option(
        None, min=0, help="with --rollback: the items upgraded at or after this position"
    )
    finalize: bool = option(
        False, help="end the upgrade: the old vectors go out of use (LanceDB drops them)"
    )
    wait_s: float = option(
        30.0, min=0.0, help="how long a command waits for a running job to take it"
    )
    verbose: bool = option(False, help="keep Ray's and the pipeline's own lines")
    pipeline: PipelineFlags = option(PipelineFlags(), help="the image pipeline")


class Refused(Exception):
    """The state machine refused a command (the live index's 409)."""


def build_parser() -> argparse.ArgumentParser:
    parser = make_parser(
        "backfill-store",
        description="Backfill a LanceDB table or Milvus collection in place with a new model "
        "(policy order, canary guards, pause/resume/rollback/finalize through the store's "
        "own record; docs/stores.md).",
    )
    add_options(parser, BackfillStoreOptions)
    return parser


@job_main
def main(argv: list[str] | None = None) -> int:
    opts = options_from_args(BackfillStoreOptions, build_parser().parse_args(argv))
    try:
        return _run(opts)
    except Refused as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return EXIT["refused"]
    except ConfigError:
        raise
    except Exception as exc:  # a store that refuses a read or a write outside a batch
        if opts.verbose:
            raise
        print(f"error: {_one_line(exc)}", file=sys.stderr, flush=True)
        return EXIT["error"]


# -- the record and the state machine ------------------------------------------------------
def record_state(rec: dict) -> State:
    """The state machine's state of a backfill record (``idle`` without one)."""
    if not rec or not rec.get("state"):
        return State.IDLE
    if rec["state"] == State.FINALIZING.value:
        return State.FINALIZING
    rb = rec.get("rollback") or {}
    return state_of(rec["state"], rb.get("state"), bool(rec.get("paused_by")))


def record_facts(rec: dict, **extra) -> Facts:
    """What the state machine is told about a backfill record (and the command's own input)."""
    rb = rec.get("rollback") or {}
    fin = rec.get("finalized") or {}
    facts = {
        "position": int(rec.get("position") or 0),
        "total": int(rec.get("total") or 0),
        "has_order": bool(rec.get("order")),
        "policy": rec.get("policy"),
        "paused_by": rec.get("paused_by"),
        "override": bool(rec.get("override")),
        "rollback_state": rb.get("state"),
        "rollback_done": int(rb.get("done") or 0),
        "rollback_total": int(rb.get("total") or 0),
        "finalized_at": fin.get("position"),
        "finalized_dropped": int(fin.get("dropped") or 0),
        "in_flight": None,  # a batch is written between two looks at the commands
    }
    return Facts(**{**facts, **extra})


def _command_of(name: str, override: bool) -> Command:
    if name == "resume":
        return Command.RESUME_OVERRIDE if override else Command.RESUME
    return Command(name)


class StoreUpgrade:
    """One store's upgrade, as this process sees it: the store, its backfill record, the
    state machine (LanceDB drops the old column at finalize, so it finalizes only when done;
    Milvus finalizes by a record, so it may finalize part of the order, as the live index)."""

    def __init__(self, store, *, overwrite: bool = False):
        from raycompat.stores.backfill import BackfillRecords, Ballast, SidecarChannel

        self.store = store
        self.records = BackfillRecords(store)
        self.machine = StateMachine(partial_finalize=not store.capabilities.drop_field)
        try:
            self.rec = self.records.load()
        except Exception:
            if not overwrite:
                raise
            self.rec = {}
        self._order: np.ndarray | None = None
        self.sidecar = (
            SidecarChannel(store.uri.target, store.uri.name) if store.uri.is_local_file else None
        )
        self.ballast = Ballast(store)

    # -- state ----------------------------------------------------------------------------
    def state(self) -> State:
        return record_state(self.rec)

    def decide(self, command: Command, **extra) -> Answer:
        return self.machine.decide(self.state(), command, record_facts(self.rec, **extra))

    def enter(self, state: State) -> None:
        """Write ``state`` into the record (not saved), as the live index's controller does:
        its public name, the rollback's own state, ``paused_by`` only while a guard pauses."""
        self.rec["state"] = state.public
        rb = self.rec.get("rollback")
        if rb and rb.get("state") in ("running", "paused"):
            rb["state"] = "running" if state is State.ROLLING_BACK else "paused"
        if state is not State.GUARD_PAUSED:
            self.rec["paused_by"] = None
        if state is not State.FINALIZING:
            self.rec["finalizing_from"] = None

    def save(self) -> None:
        self.records.save(self.rec)
        if self.sidecar is not None:
            try:
                self.sidecar.write_status({**self.rec, "from": "the driver's copy"})
            except OSError:  # a cache only
                pass

    @property
    def order(self) -> np.ndarray:
        if self._order is None:
            self._order = self.records.read_order(self.rec["order"])
        return self._order

    def count_from(self, position: int) -> int:
        col = self.store.columns.position
        return int(self.store.count(f"{col} >= {int(position)}"))

    # -- recovery of a stopped driver -----------------------------------------------------
    def recover(self) -> None:
        """Finish what a killed driver left half done: a finalize (idempotent) and the
        position (batches written after the last record: the store's positions say so)."""
        from raycompat.stores.backfill import driver_alive, reconciled_position

        if not self.rec or driver_alive(self.records.driver()):
            return
        st = self.state()
        if st is State.FINALIZING:
            self.finalize_work()
            return
        if self.rec.get("order") and st not in (State.ROLLING_BACK, State.ROLLBACK_PAUSED):
            pos = int(self.rec.get("position") or 0)
            new = reconciled_position(self.store, self.order, pos, self.rec["new_model"])
            if new != pos:
                self.rec["position"] = new
                self.rec["recovered"] = {"from": pos, "to": new, "at": round(time.time(), 3)}
                self.save()

    # -- commands -------------------------------------------------------------------------
    def command_facts(self, command: Command, to: int | None) -> dict:
        """The facts a rollback needs: ``to`` and how many items it would return."""
        if command is not Command.ROLLBACK:
            return {}
        fin = (self.rec.get("finalized") or {}).get("position")
        start = to if to is not None else (fin or 0)
        items = 0 if self.store.finalized else self.count_from(start)
        return {"to": to, "rollback_items": items}

    def apply(self, command: Command, args: dict) -> Answer:
        """Decide ``command`` now and, if accepted, enter its state (saved); the work that
        follows (a walk, a rollback, a finalize) is the caller's."""
        before = self.state()
        answer = self.decide(command, **self.command_facts(command, args.get("to")))
        if not answer.ok:
            return answer
        rec = self.rec
        if command in (Command.RESUME, Command.RESUME_OVERRIDE):
            if command is Command.RESUME_OVERRIDE:
                rec["override"] = True
            if args.get("until") is not None:
                rec["until"] = int(args["until"])
            elif args.get("clear_until"):
                rec["until"] = None
            if args.get("rate") is not None:
                rec["rate"] = float(args["rate"])
            if answer.state in (State.RUNNING, State.ROLLING_BACK):
                rec["error"] = None
                rec["error_input"] = None
        elif command is Command.ROLLBACK:
            fin = (rec.get("finalized") or {}).get("position")
            to = args.get("to")
            to = int(to) if to is not None else int(fin or 0)
            total = self.count_from(to)
            rec["rollback"] = {
                "state": "running",
                "to": to,
                "done": 0,
                "total": total,
                "first": to,
                "started": round(time.time(), 3),
            }
            if not rec.get("order"):  # items written by hand: an idle upgrade's record
                rec.setdefault("position", 0)
                rec.setdefault("total", int(self.store.count()))
        elif command is Command.FINALIZE:
            rec["finalizing_from"] = before.value
        self.enter(answer.state)
        self.save()
        return answer

    def poll_command(self) -> None:
        """(a driver, between batches) Apply the last posted command if it is new."""
        posted = [self.records.command()]
        if self.sidecar is not None:
            posted.append(self.sidecar.command())
        seen = int(self.rec.get("command_seq") or 0)
        fresh = [c for c in posted if c and int(c.get("seq", 0)) > seen]
        if not fresh:
            return
        cmd = max(fresh, key=lambda c: int(c["seq"]))
        command = Command(cmd["command"])
        answer = self.apply(command, cmd)
        self.rec["command_seq"] = int(cmd["seq"])
        self.rec["last_command"] = {
            "seq": int(cmd["seq"]),
            "command": command.value,
            "ok": answer.ok,
            "error": answer.error,
            "state": answer.state.value,
        }
        self.save()

    # -- rollback and finalize ------------------------------------------------------------
    def rollback_work(self, batch: int) -> None:
        """Turn items back from the end of the order, ``batch`` positions per atomic store
        call, until ``to`` (or a pause); then the state machine's ``rollback_end``."""
        from raycompat.stores.backfill import rollback_in_batches

        rb = self.rec["rollback"]
        to = int(rb["to"])

        def between(_done: int) -> bool:
            rb["done"] = int(rb["total"]) - self.count_from(to)
            self.save()
            self.poll_command()
            return self.state() is State.ROLLING_BACK

        rollback_in_batches(self.store, to, batch, between)
        if self.state() is not State.ROLLING_BACK:
            return
        rb["done"] = int(rb["total"]) - self.count_from(to)
        rb["state"] = "done"
        if self.rec.get("order"):
            self.rec["position"] = min(to, int(self.rec.get("position") or 0))
        self.rec["canary_last"] = None
        answer = self.decide(Command.ROLLBACK_END, position=int(self.rec.get("position") or 0))
        self.enter(answer.state)
        self.save()

    def finalize_work(self) -> None:
        """Finalize: LanceDB drops the old column (only when done); Milvus records the
        position (its old vectors keep their space) and writes the store's finalize marker
        once every item is upgraded.  Then ``finalize_end``: back to the state it began in."""
        before = State(self.rec.get("finalizing_from") or State.PAUSED.value)
        pos = int(self.rec.get("position") or 0)
        store = self.store
        if store.capabilities.drop_field or store.count_upgraded() == store.count():
            store.finalize()
        prev = (self.rec.get("finalized") or {}).get("position") or 0
        dropped = max(0, pos - int(prev))
        self.rec["finalized"] = {
            "position": pos,
            "dropped": dropped,
            "store": bool(store.finalized),
            "at": round(time.time(), 3),
        }
        answer = self.decide(Command.FINALIZE_END, before=before)
        self.enter(answer.state)
        self.save()

    # -- status ---------------------------------------------------------------------------
    def status(self) -> dict:
        from raycompat.stores.backfill import driver_alive

        rec, store = self.rec, self.store
        counts = store.counts_by_model()
        driver = self.records.driver()
        st = self.state()
        run = (rec.get("order") or {}).get("run")
        points = self.records.canary_points(run) if run and rec.get("canary") else []
        canary = None
        if rec.get("canary"):
            ref = self.records.canary_reference(run) if run else None
            canary = {
                **{k: rec["canary"].get(k) for k in ("file", "every", "k", "guard")},
                "reference": ref and ref.get("kind"),
                "points": len(points),
                "last": points[-1] if points else None,
                "history": [_compact_point(p) for p in points],
            }
        alive = driver_alive(driver)
        return {
            "store": store.uri.raw,
            "where": store.where,
            "backend": store.backend,
            "state": st.public,
            "machine_state": st.value,
            "position": int(rec.get("position") or 0),
            "total": int(rec.get("total") or 0),
            "policy": rec.get("policy"),
            "seed": rec.get("seed"),
            "new_model": rec.get("new_model"),
            "until": rec.get("until"),
            "rate": rec.get("rate"),
            "batch_size": rec.get("batch_size"),
            "counts": {
                "rows": counts.rows,
                "upgraded": counts.upgraded,
                "old": counts.old,
                "new": counts.new,
            },
            "paused_by": rec.get("paused_by"),
            "override": bool(rec.get("override")),
            "rollback": rec.get("rollback"),
            "finalized": rec.get("finalized"),
            "store_finalized": bool(store.finalized),
            "error": rec.get("error"),
            "canary": canary,
            "driver": None
            if driver is None
            else {
                "alive": alive,
                "what": driver.get("what"),
                "pid": driver.get("pid"),
                "host": driver.get("host"),
                "beat_age_s": round(time.time() - float(driver.get("beat", 0)), 1),
                "ended": driver.get("ended"),
            },
            "last_command": rec.get("last_command"),
            "recovered": rec.get("recovered"),
        }


def _compact_point(p: dict) -> dict:
    keys = ("position", "map", "delta_low", "delta_high", "nfr", "nfr_low", "guard")
    return {k: (round(p[k], 6) if isinstance(p.get(k), float) else p.get(k)) for k in keys}


# -- running ---------------------------------------------------------------------------------
def _open(opts: BackfillStoreOptions):
    from raycompat.simulator.store_inputs import parse_store_columns
    from raycompat.stores import StoreError, open_store

    if not opts.store:
        raise ConfigError("--store is required (lance://<database>/<table> or milvus://...)")
    columns = parse_store_columns(opts.store_columns)
    try:
        return open_store(opts.store, columns)
    except StoreError as exc:
        held = "another process holds it" in str(exc)
        if held:
            return None
        raise ConfigError(f"--store {opts.store}: {exc}".splitlines()[0]) from None


def _check_flags(opts: BackfillStoreOptions) -> str | None:
    given = [name for name in COMMANDS if getattr(opts, name)]
    if len(given) > 1:
        raise ConfigError(f"give one command at a time, got {', '.join('--' + g for g in given)}")
    name = given[0] if given else None
    if opts.to is not None and name != "rollback":
        raise ConfigError("--to goes with --rollback")
    if opts.override and name not in (None, "resume"):
        raise ConfigError("--override goes with --resume (or a run of the job)")
    if name is not None and (opts.restart or opts.overwrite):
        raise ConfigError("--restart and --overwrite go with a run of the job, not a command")
    if opts.policy is not None and opts.policy not in POLICIES:
        raise ConfigError(
            f"--policy {opts.policy!r}: a store backfill computes {', '.join(POLICIES)} "
            "(the others need the gallery's new vectors and queries, or a query log)"
        )
    return name


def _run(opts: BackfillStoreOptions) -> int:
    name = _check_flags(opts)
    store = _open(opts)
    if store is None:  # a Milvus Lite file another process holds
        return _sidecar_command(opts, name)
    with store:
        up = StoreUpgrade(store, overwrite=opts.overwrite and name is None)
        up.recover()
        if name is not None:
            return _command(up, name, opts)
        return _job(up, opts)


def _print_status(status: dict, command: dict | None = None) -> None:
    if command is not None:
        status = {"command": command, **status}
    print(json.dumps(status), flush=True)


def _command(up: StoreUpgrade, name: str, opts: BackfillStoreOptions) -> int:
    """A command on the upgrade's record: taken by the running driver, else applied here
    (a rollback or finalize it starts runs here to its end or a pause)."""
    from raycompat.stores.backfill import Heartbeat, driver_alive

    if name == "status":
        _print_status(up.status())
        return EXIT["ok"]
    command = _command_of(name, opts.override)
    args = {"to": opts.to, "until": opts.until, "rate": opts.rate, "override": opts.override}
    answer = up.decide(command, **up.command_facts(command, opts.to))
    if not answer.ok:
        raise Refused(answer.error)
    if command is Command.PAUSE and answer.state is up.state():  # nothing to change
        _print_status(up.status(), {"name": command.value, "state": answer.state.value})
        return EXIT["ok"]
    taken_here = None
    if driver_alive(up.records.driver()):
        seq = up.records.post_command({"command": command.value, **args})
        last = _await_answer(
            up.records.load,
            seq,
            opts.wait_s,
            up.store.where,
            lambda: driver_alive(up.records.driver()),
        )
        up.rec = up.records.load()
        if last is not None:
            if not last.get("ok"):
                raise Refused(last.get("error"))
            _print_status(up.status(), {"name": command.value, "state": last.get("state")})
            return EXIT["ok"]
        # the job stopped before it took the command: this process applies it
        up.recover()
        taken_here = seq
    run = (up.rec.get("order") or {}).get("run")
    with Heartbeat(up.records, run, name):
        answer = up.apply(command, args)
        if not answer.ok:
            raise Refused(answer.error)
        if taken_here is not None:
            up.rec["command_seq"] = max(int(up.rec.get("command_seq") or 0), taken_here)
            up.save()
        batch = int(up.rec.get("batch_size") or opts.batch_size)
        while up.state() in (State.ROLLING_BACK, State.FINALIZING):
            if up.state() is State.ROLLING_BACK:
                up.rollback_work(batch)
            else:
                up.finalize_work()
    status = up.status()
    _print_status(status, {"name": command.value, "state": answer.state.value})
    if up.state() is State.RUNNING:
        print(
            f"note: no backfill-store job runs on {up.store.where}: run the job to walk on "
            f"(raycompat backfill-store --store {up.store.uri.raw} --new-model ...)",
            file=sys.stderr,
            flush=True,
        )
    return EXIT["ok"]


def _await_answer(read, seq: int, wait_s: float, where: str, alive) -> dict | None:
    """The running job's answer to command ``seq`` (``None``: the job stopped without it);
    the record is read every 0.1 s, the job's liveness looked at every second."""
    end = time.monotonic() + wait_s
    next_look = time.monotonic() + 1.0
    while True:
        rec = read() or {}
        last = rec.get("last_command") or {}
        if int(rec.get("command_seq") or 0) >= seq and int(last.get("seq", 0)) >= seq:
            return last
        if time.monotonic() >= next_look:
            next_look = time.monotonic() + 1.0
            if not alive():
                rec = read() or {}  # it may have taken it as it stopped
                last = rec.get("last_command") or {}
                return last if int(last.get("seq", 0)) >= seq else None
        if time.monotonic() > end:
            raise ConfigError(
                f"the backfill-store job running on {where} did not take the command within "
                f"{wait_s:g} s (it looks between batches); --status shows where it is"
            )
        time.sleep(0.1)


def _held(opts: BackfillStoreOptions) -> bool:
    """Whether another process still holds the Milvus Lite file."""
    from raycompat.simulator.store_inputs import parse_store_columns
    from raycompat.stores import StoreError, open_store

    try:
        open_store(opts.store, parse_store_columns(opts.store_columns)).close()
    except StoreError as exc:
        return "another process holds it" in str(exc)
    return False


def _sidecar_command(opts: BackfillStoreOptions, name: str | None) -> int:
    """Milvus Lite held by a running job: the command goes through the files beside the
    ``.db`` file, decided on the driver's copy of the record, answered by the driver."""
    from raycompat.stores.backfill import SidecarChannel
    from raycompat.stores.uri import parse_store_uri

    uri = parse_store_uri(opts.store)
    if name is None:
        raise Refused(
            f"the Milvus Lite file {uri.target!r} is held by another process (a backfill-store "
            "job runs on it?): one process at a time; --status shows the running job's copy"
        )
    side = SidecarChannel(uri.target, uri.name)
    rec = side.status()
    if rec is None:
        raise ConfigError(
            f"--store {opts.store}: the Milvus Lite file is held by another process and no "
            "backfill-store job's copy of the record is beside it"
        )
    if name == "status":
        _print_status(rec)
        return EXIT["ok"]
    command = _command_of(name, opts.override)
    facts = record_facts(rec, to=opts.to) if command is Command.ROLLBACK else record_facts(rec)
    fin = record_state(rec)
    answer = StateMachine(partial_finalize=True).decide(fin, command, facts)
    if not answer.ok:
        raise Refused(answer.error)
    args = {"to": opts.to, "until": opts.until, "rate": opts.rate, "override": opts.override}
    seq = side.post_command({"command": command.value, **args})
    where = f"Milvus Lite file {uri.target!r}"
    last = _await_answer(side.status, seq, opts.wait_s, where, lambda: _held(opts))
    if last is None:
        raise ConfigError(
            f"the backfill-store job on {where} stopped before it took the command: run the "
            "command again"
        )
    if not last.get("ok"):
        raise Refused(last.get("error"))
    _print_status(side.status() or {}, {"name": command.value, "state": last.get("state")})
    return EXIT["ok"]


# -- the job: start, continue, walk ----------------------------------------------------------
def _fingerprint(opts: BackfillStoreOptions) -> str:
    from raycompat.models.fingerprint import bundle_fingerprint

    if not opts.new_model:
        raise ConfigError(
            "--new-model is required: the new model's bundle (its fingerprint is written with "
            "every vector)"
        )
    return bundle_fingerprint(opts.new_model)


def _describe_upgrade(rec: dict) -> str:
    st = record_state(rec).public
    return (
        f"an upgrade to model {rec.get('new_model')} ({st}, position {rec.get('position')} of "
        f"{rec.get('total')}" + (", finalized" if rec.get("finalized") else "") + ")"
    )


def _job(up: StoreUpgrade, opts: BackfillStoreOptions) -> int:
    """A run of the job: start a backfill, or go on with the one in the store (the state
    machine's ``start``, ``restart``, or ``resume``); every input is checked before the first
    write, then the driver walks."""
    from raycompat.stores.backfill import driver_alive

    driver = up.records.driver()
    if driver_alive(driver):
        answer = up.decide(Command.RESTART if opts.restart else Command.START)
        raise Refused(
            answer.error
            or f"a backfill-store job is already running on {up.store.where} (pid "
            f"{driver.get('pid')} on {driver.get('host')}): pause it, or wait for it"
        )
    fp = _fingerprint(opts)
    rec, store = up.rec, up.store
    other = bool(rec) and rec.get("new_model") not in (None, fp)
    over = False
    if other or (store.finalized and (opts.restart or not rec)):
        if not opts.overwrite:
            what = _describe_upgrade(rec) if rec else "a finalized upgrade"
            why = "" if other else ": its old vectors are out of use"
            raise Refused(
                f"{store.where} holds {what}{why}; pass --overwrite to start an upgrade to "
                f"model {fp} from the old vectors (every upgraded item is turned back first)"
            )
        over = True
    elif opts.overwrite:
        over = bool(rec) or store.count_upgraded() > 0
    st = State.IDLE if over else up.state()
    if opts.restart or st is State.IDLE:
        command = Command.RESTART if opts.restart else Command.START
    else:
        _check_same(up.rec, opts)
        command = Command.RESUME_OVERRIDE if opts.override else Command.RESUME
    facts = record_facts({} if over else up.rec)
    answer = up.machine.decide(st, command, facts)
    if not answer.ok:
        raise Refused(answer.error)
    started = time.perf_counter()
    if over:  # asked for: every item back to its old vector (the old vectors are needed)
        _start_over(up)
    # every check before the first write of this run
    fresh = command in (Command.START, Command.RESTART)
    plan = _plan(up, opts, fp, empty=over) if fresh else None
    order = plan.order if fresh else up.order
    position = plan.position if fresh else int(up.rec.get("position") or 0)
    source = None
    if answer.state is State.RUNNING:
        source = _vector_source(store, opts, order, position, fp)
    canary_path = opts.canary or (up.rec.get("canary") or {}).get("file")
    canary = read_canary(canary_path, store) if canary_path else None
    # the writes
    if fresh:
        _begin(up, opts, fp, command, plan)
    else:
        args = {"until": opts.until, "clear_until": opts.until is None, "rate": opts.rate}
        answer = up.apply(command, args)
        if not answer.ok:
            raise Refused(answer.error)
        up.rec["batch_size"] = int(opts.batch_size)
        up.rec["rate"] = opts.rate
    # commands posted before this run began are void (their job stopped without them)
    posted = [up.records.command()] + ([up.sidecar.command()] if up.sidecar else [])
    last = max([int((c or {}).get("seq", 0)) for c in posted] + [0])
    up.rec["command_seq"] = max(int(up.rec.get("command_seq") or 0), last)
    up.save()
    guard = _attach_canary(up, opts, canary, canary_path) if canary is not None else None
    return _drive(up, opts, started, source, guard)


def _check_same(rec: dict, opts: BackfillStoreOptions) -> None:
    for name in ("policy", "seed"):
        given = getattr(opts, name)
        if given is not None and given != rec.get(name):
            raise ConfigError(
                f"--{name} {given}: the backfill of this store walks policy {rec.get('policy')} "
                f"seed {rec.get('seed')} (position {rec.get('position')} of {rec.get('total')}); "
                f"run without --{name}, or with --restart to order what is left by another"
            )


def _start_over(up: StoreUpgrade) -> None:
    """``--overwrite``: every item back to its old vector, the old records gone."""
    from raycompat.stores.base import FINALIZED_KEY

    store, rec = up.store, up.rec
    if store.finalized:
        mark = rec.get("start_mark")
        if store.capabilities.drop_field:
            if not mark or mark not in store.marks():
                raise ConfigError(
                    f"--overwrite: {store.where} was finalized, its old vectors are dropped, and "
                    "no mark from before that upgrade is known to bring them back"
                )
            store.rollback(mark)
        else:
            store._delete_record(FINALIZED_KEY)
    store.rollback_to_position(0)
    up.records.drop_orders()
    up.rec = {}
    up._order = None


def _policy_order(up: StoreUpgrade, opts: BackfillStoreOptions, policy: str, seed: int):
    """The order of every item (ascending id order: the store's, the simulator's gallery
    order) by ``policy`` (:func:`raycompat.upgrade.policies.policy_order`)."""
    from raycompat.upgrade.policies import PolicyInputs, policy_order

    store = up.store
    ids = store.read_ids()
    data, head = None, None
    if policy.startswith("uncertainty:"):
        from raycompat.embeddings.gallery import GalleryEmbeddings
        from raycompat.models import ModelBundle
        from raycompat.models.uncertainty_head import UncertaintyHead

        bundle = ModelBundle.load(opts.new_model)
        if not bundle.has_head:
            raise ConfigError(f"--policy {policy}: the new model {opts.new_model} has no head")
        head = UncertaintyHead.from_classifier_head(bundle.head)
        old = np.concatenate([b["old"] for b in store.read_blocks(("id", "old"), 65536)])
        # the policy reads the gallery's old vectors only; one placeholder query row
        data = GalleryEmbeddings(
            gallery_labels=np.zeros(len(ids), np.int64),
            gallery_old=old,
            query_labels=np.zeros(1, np.int64),
            gallery_ids=ids,
        )
    inputs = PolicyInputs(n_items=len(ids), data=data, head=head, seed=int(seed))
    try:
        rows = policy_order(policy, inputs)
    except ValueError as exc:
        raise ConfigError(f"--policy {policy}: {exc}") from None
    return ids[rows]


@dataclass
class _Plan:
    """A new backfill's order: what this model has upgraded already (positions 0..kept-1)
    first, the rest in the policy's order; ``gap_at``: where the positions have a hole (a
    rollback cut short), from which the items are turned back first."""

    order: np.ndarray
    position: int
    gap_at: int | None
    policy: str
    seed: int


def _plan(up: StoreUpgrade, opts: BackfillStoreOptions, fp: str, empty: bool) -> _Plan:
    from raycompat.stores.backfill import kept_prefix

    store = up.store
    policy = opts.policy or "random"
    seed = 0 if opts.seed is None else int(opts.seed)
    if empty:  # --overwrite: every item is turned back first
        kept_ids, gap_at = np.zeros(0, np.int64), None
    else:
        kept = kept_prefix(store, fp)
        if kept.others:
            raise Refused(
                f"{store.where} holds items upgraded by other models {kept.others}; pass "
                f"--overwrite to turn them back and start an upgrade to model {fp}"
            )
        kept_ids, gap_at = kept.ids, kept.gap_at
    full = _policy_order(up, opts, policy, seed)
    rest = full[~np.isin(full, kept_ids)]
    order = np.concatenate([kept_ids, rest]).astype(np.int64)
    return _Plan(order, int(len(kept_ids)), gap_at, policy, seed)


def _begin(
    up: StoreUpgrade, opts: BackfillStoreOptions, fp: str, command: Command, plan: _Plan
) -> None:
    """A new backfill (start or restart): the order goes into the store, then the record;
    a mark is taken first (LanceDB: the table as it was, which ``--overwrite`` of a
    finalized upgrade restores)."""
    from raycompat.stores.backfill import new_run_id

    store = up.store
    if plan.gap_at is not None:
        store.rollback_to_position(int(plan.gap_at))
    run = new_run_id()
    mark = f"backfill-{run}"
    store.mark(mark)
    meta = up.records.write_order(run, plan.order)
    up.records.drop_orders(keep_run=run)
    previous = up.rec
    up.rec = {
        "state": State.RUNNING.value,
        "run": run,
        "policy": plan.policy,
        "seed": plan.seed,
        "new_model": fp,
        "new_model_path": os.path.abspath(opts.new_model),
        "source": (
            f"new-vectors {opts.new_vectors}" if opts.new_vectors else "pipeline (image_uri)"
        ),
        "position": plan.position,
        "total": int(len(plan.order)),
        "kept": plan.position,
        "until": opts.until,
        "rate": opts.rate,
        "batch_size": int(opts.batch_size),
        "paused_by": None,
        "override": False,
        "rollback": None,
        "finalized": previous.get("finalized") if previous.get("new_model") == fp else None,
        "error": None,
        "order": meta,
        "start_mark": mark,
        "canary": None,
        "canary_last": None,
        "command_seq": int(previous.get("command_seq") or 0),
        "last_command": None,
        "started": round(time.time(), 3),
    }
    up._order = plan.order
    answer = up.decide(command)
    up.enter(answer.state)
    up.save()


def _drive(up: StoreUpgrade, opts: BackfillStoreOptions, started: float, source, canary) -> int:
    """The driver: walk, roll back or finalize until the upgrade leaves those states."""
    from raycompat.stores.backfill import Heartbeat

    run = (up.rec.get("order") or {}).get("run")
    up.ballast.fill()
    with Heartbeat(up.records, run, "walk"):
        while True:
            st = up.state()
            if st is State.ROLLING_BACK:
                up.rollback_work(int(up.rec.get("batch_size") or opts.batch_size))
                continue
            if st is State.FINALIZING:
                up.finalize_work()
                continue
            if st is not State.RUNNING:
                break
            if source is None:  # a rollback that ended in a resumed walk
                source = _vector_source(up.store, opts, up.order, up.rec["position"], None)
            _walk(up, source, canary, opts)
    return _finish(up, started)


def _finish(up: StoreUpgrade, started: float) -> int:
    st = up.state()
    rec = up.rec
    summary = (
        f"{st.public} at position {rec.get('position')} of {rec.get('total')}, model "
        f"{rec.get('new_model')}, policy {rec.get('policy')}"
    )
    if rec.get("paused_by"):
        g = rec["paused_by"]
        summary += f"; paused by the canary guard {g.get('guard')}: {g.get('reason')}"
    if rec.get("error"):
        summary += f"; error: {rec['error']}"
    phase("backfill-store", summary, time.perf_counter() - started)
    if st is State.ERROR:
        print(f"error: {rec.get('error')}", file=sys.stderr, flush=True)
        return EXIT["bad_input"] if rec.get("error_input") else EXIT["error"]
    if st is State.GUARD_PAUSED:
        return EXIT["guard"]
    return EXIT["ok"]


def _unit(x: np.ndarray) -> np.ndarray:
    from raycompat.index.search import l2_normalize

    return l2_normalize(np.asarray(x, np.float32))


def _walk(up: StoreUpgrade, source, canary, opts: BackfillStoreOptions) -> None:
    """Write batches of the order until the state leaves ``running``: the commands are
    looked at, the canary measured where due, before every batch."""
    from raycompat.stores.backfill import is_full_disk

    store, rec = up.store, up.rec
    order, fp = up.order, rec["new_model"]
    total = int(rec["total"])
    rate_t0, rate_p0 = time.monotonic(), int(rec["position"])
    target = min(total, rec["until"]) if rec.get("until") is not None else total
    progress = Progress("backfill-store", target, done=min(rate_p0, target))
    batches = 0
    while True:
        up.poll_command()
        rec = up.rec
        if up.state() is not State.RUNNING:
            return
        pos = int(rec["position"])
        if canary is not None and canary.due(pos, total, rec):
            point = canary.measure(pos)
            _judge(up, canary, point)
            if up.state() is not State.RUNNING:
                return
        end = min(total, rec["until"]) if rec.get("until") is not None else total
        if pos >= end:
            up.enter(up.decide(Command.END).state)
            up.save()
            return
        stop = min(end, pos + int(rec.get("batch_size") or opts.batch_size))
        if rec.get("rate"):
            stop = min(stop, pos + max(1, int(rec["rate"])))
        if canary is not None:
            stop = min(stop, canary.next_stop(pos, total))
        ids = order[pos:stop]
        try:
            vectors = _unit(source.vectors(ids))
        except Exception as exc:  # a vector the source cannot give: named, the job stops
            rec["error"] = f"new vectors of items {pos}..{stop - 1} of the order: {exc}"
            rec["error_input"] = True
            up.enter(up.decide(Command.FAILURE).state)
            _try_save(up)
            return
        try:
            store.write_new(ids, vectors, fp, np.arange(pos, stop, dtype=np.int64))
        except Exception as exc:  # the store refused the write (a full disk, ...)
            rec["error"] = (
                f"{store.where} refused the write of items {pos}..{stop - 1} of the order "
                f"(nothing of it was written): {_one_line(exc)}"
            )
            up.enter(up.decide(Command.FAILURE).state)
            if is_full_disk(exc):
                up.ballast.release()
            _try_save(up)
            return
        rec["position"] = stop
        up.enter(up.decide(Command.BATCH_DONE).state)
        try:
            up.save()
        except Exception as exc:  # the batch is in the store: a restart finds it there
            rec["error"] = f"the batch {pos}..{stop - 1} is written, the record is not: {exc}"
            up.enter(up.decide(Command.FAILURE).state)
            _try_save(up)
            return
        batches += 1
        if batches % COMPACT_EVERY == 0:
            _compact(store)
        moved = stop - rate_p0
        speed = moved / max(time.monotonic() - rate_t0, 1e-9)
        progress.step(min(stop, progress.total), batch=f"{pos}..{stop - 1}", items_per_s=speed)
        if rec.get("rate"):
            _sleep_for_rate(up, rate_t0, moved, float(rec["rate"]))


def _compact(store) -> None:
    """Merge the small files the batches left (LanceDB; Milvus compacts by itself)."""
    try:
        store.compact()
    except Exception:  # a full disk or a concurrent writer: the next time
        pass


def _one_line(exc: Exception) -> str:
    """The first line of an error, without the engine's source location."""
    text = str(exc).strip().splitlines()
    line = re.sub(r", /\S+\.rs:\d+:\d+", "", text[0] if text else "")
    return f"{type(exc).__name__}: {line}"


def _try_save(up: StoreUpgrade) -> None:
    """Save the record after a failure; on a full disk the ballast beside a local store is
    given up first, so that the record can say why the job stopped."""
    from raycompat.stores.backfill import is_full_disk

    for attempt in (0, 1):
        try:
            up.save()
            return
        except Exception as exc:  # the store refuses every write: say so
            if attempt == 0 and is_full_disk(exc) and up.ballast.release():
                up.rec["error"] = f"{up.rec.get('error')} (the ballast file was given up)"
                continue
            up.rec["error"] = (
                f"{up.rec.get('error')} (the record could not be saved either: {_one_line(exc)})"
            )
            return


def _sleep_for_rate(up: StoreUpgrade, t0: float, moved: int, rate: float) -> None:
    """Wait until ``moved`` items fit ``rate`` items/s since ``t0``, looking at the commands
    every 0.2 s."""
    due = t0 + moved / rate
    while (left := due - time.monotonic()) > 0:
        time.sleep(min(0.2, left))
        up.poll_command()
        if up.state() is not State.RUNNING:
            return


# -- sources of new vectors -----------------------------------------------------------------
def _store_labels(store) -> tuple[np.ndarray, np.ndarray]:
    ids, labels = [], []
    for block in store.read_blocks(("id", "label"), 65536):
        ids.append(block["id"])
        labels.append(block["label"])
    return np.concatenate(ids), np.concatenate(labels)


def _vector_source(store, opts: BackfillStoreOptions, order, position: int, fp: str | None):
    """``--new-vectors`` (checked: columns, dimension, labels, every item of the order left),
    or the pipeline over the store's images."""
    info = store.describe()
    left = np.asarray(order)[int(position) :]
    if opts.new_vectors:
        return _parquet_source(store, info, opts.new_vectors, left)
    return PipelineVectors(store, opts, info, np.asarray(order), fp or "")


def _parquet_source(store, info, path: str, left: np.ndarray):
    from raycompat.stores import StoreError
    from raycompat.stores.backfill import NewVectorsParquet

    try:
        src = NewVectorsParquet(path)
    except StoreError as exc:
        raise ConfigError(str(exc)) from None
    cols = store.columns
    if src.dim != info.new_dim:
        raise ConfigError(
            f"--new-vectors {path}: column 'new' has vectors of dimension {src.dim}, but "
            f"column {cols.new!r} of {store.where} has dimension {info.new_dim}"
        )
    missing = src.missing(left)
    if missing.size:
        raise ConfigError(
            f"--new-vectors {path}: column 'item_id' lacks {missing.size} item(s) of "
            f"{store.where} still to upgrade, e.g. {missing[:5].tolist()}"
        )
    ids, labels = _store_labels(store)
    theirs, name = None, None
    if info.label_type == "int64" and src.labels is not None:
        theirs, name = src.labels, "label"
    elif info.label_type == "string" and src.class_names is not None:
        theirs, name = src.class_names, "class_name"
    elif info.label_type == "string" and src.labels is not None:
        theirs, name = src.labels, "label"
    if theirs is not None:
        at = np.searchsorted(src.ids, ids)
        inside = (at < len(src.ids)) & (src.ids[np.minimum(at, len(src.ids) - 1)] == ids)
        mine = np.asarray([str(v) for v in labels[inside]], object)
        other = np.asarray([str(v) for v in theirs[at[inside]]], object)
        differ = ids[inside][mine != other]
        if differ.size:
            raise ConfigError(
                f"--new-vectors {path}: column {name!r} disagrees with column {cols.label!r} "
                f"of {store.where} for {differ.size} item(s), e.g. ids {differ[:5].tolist()}"
            )
    return src


@dataclass
class _Record:
    item_id: int
    path: str
    label: int


class PipelineVectors:
    """New vectors from the store's images: the Ray Data gallery pipeline
    (:func:`raycompat.pipeline.embed_gallery`, column ``new``) runs on one segment of the order
    at a time (``--embed-chunk`` items) into a cache folder (resumable shards), and batches
    are read from it."""

    def __init__(self, store, opts: BackfillStoreOptions, info, order: np.ndarray, fp: str):
        from raycompat.cluster import connect
        from raycompat.console import quiet_ray
        from raycompat.models.fingerprint import embedder_info
        from raycompat.pipeline.sources import RecordSource

        if store.columns.image_uri is None:
            raise ConfigError(
                f"{store.where} maps no image column: give --new-vectors PARQUET, or map the "
                "images' URIs with --store-columns image_uri=COLUMN"
            )
        emb = embedder_info(opts.new_model)
        if int(emb["embed_dim"]) != int(info.new_dim):
            raise ConfigError(
                f"--new-model {opts.new_model} embeds {emb['embed_dim']} dims, but column "
                f"{store.columns.new!r} of {store.where} has dimension {info.new_dim}"
            )
        ids, uris, labels = [], [], []
        for block in store.read_blocks(("id", "image_uri", "label"), 65536):
            ids.append(block["id"])
            uris.extend(block["image_uri"].tolist())
            labels.append(block["label"])
        ids = np.concatenate(ids)
        labels = np.concatenate(labels)
        if labels.dtype.kind not in "iu":
            labels = np.unique(labels.astype(str), return_inverse=True)[1]
        records = [
            _Record(int(i), str(u), int(lab))
            for i, u, lab in zip(ids.tolist(), uris, labels.tolist(), strict=True)
        ]
        self.order = order
        self.chunk = int(opts.pipeline.embed_chunk)
        key = hashlib.sha256(np.ascontiguousarray(order, "<i8").tobytes()).hexdigest()
        digest = hashlib.sha256(f"{store.uri.raw}|{key}|{fp}".encode()).hexdigest()[:16]
        self.cache = opts.pipeline.cache or os.path.join(
            tempfile.gettempdir(), "raycompat-backfill-store", digest
        )
        self.source = RecordSource(
            records,
            "store_images",
            self.cache,
            split="gallery",
            resolution=int(emb.get("resolution") or 32),
            in_chans=int(emb.get("in_chans") or 1),
        )
        self.new_model = opts.new_model
        self.model_stages = opts.pipeline.model_stages
        self.verbose = opts.verbose
        self.segment: tuple[int, dict] | None = None
        quiet_ray(opts.verbose)
        connect(opts.pipeline.address, num_cpus=opts.pipeline.num_cpus)
        self._pos = {int(i): p for p, i in enumerate(self.order.tolist())}

    def _embed(self, seg: int) -> dict:
        from raycompat.pipeline import PipelineOptions, embed_gallery

        ids = self.order[seg * self.chunk : (seg + 1) * self.chunk]
        out = os.path.join(self.cache, f"segment-{seg:06d}")
        log = print if self.verbose else (lambda _m: None)
        run = embed_gallery(
            out,
            self.source,
            new_model=self.new_model,
            columns=("new",),
            ids=ids,
            options=PipelineOptions(progress_every_s=30.0, model_stages=self.model_stages),
            log=log,
        )
        table = run.table(columns=["item_id", "new"])
        got = table.column("item_id").to_numpy()
        vecs = np.asarray(table.column("new").to_pylist(), np.float32)
        return dict(zip(got.tolist(), vecs, strict=True))

    def vectors(self, ids: np.ndarray) -> np.ndarray:
        out = []
        for i in np.asarray(ids).tolist():
            seg = self._pos[int(i)] // self.chunk
            if self.segment is None or self.segment[0] != seg:
                self.segment = (seg, self._embed(seg))
            out.append(self.segment[1][int(i)])
        return np.stack(out).astype(np.float32)


# -- the canary -------------------------------------------------------------------------------
class StoreCanary:
    """The canary measured on the store (``raycompat.stores.search`` in the compatible mode)
    at position 0, every ``every`` items and at the end, with the guards of
    :mod:`raycompat.upgrade.canary`; its reference and points are records in the store."""

    def __init__(self, up: StoreUpgrade, canary, opts: CanaryOptions, run: str):
        self.up, self.canary, self.opts, self.run = up, canary, opts, run
        self.every = opts.every(int(up.rec["total"]))

    def due(self, pos: int, total: int, rec: dict) -> bool:
        if rec.get("canary_last") == pos:
            return False
        return pos in (0, total) or pos % self.every == 0

    def next_stop(self, pos: int, total: int) -> int:
        return min(total, (pos // self.every + 1) * self.every)

    def _reference(self):
        from raycompat.stores import search, search_field
        from raycompat.stores.mode_search import StoreQueries
        from raycompat.upgrade.canary import CanaryReference, canary_terms

        found = self.up.records.canary_reference(self.run)
        if found is not None:
            return CanaryReference(
                found["kind"], np.asarray(found["ap"], np.float64), np.asarray(found["correct"])
            )
        k, c = self.opts.canary_k, self.canary
        if c.old_vectors is not None:
            ids = search_field(self.up.store, "old", c.old_vectors, k).ids
            kind = "old-old"
        else:
            queries = StoreQueries(new=c.vectors)
            ids = search(self.up.store, queries, k, "compatible").ids
            kind = "first point"
        ap, correct = canary_terms(ids, c, k)
        doc = {"kind": kind, "ap": ap.tolist(), "correct": correct.astype(bool).tolist()}
        self.up.records.put_canary_reference(self.run, doc)
        return CanaryReference(kind, ap, correct)

    def measure(self, pos: int) -> dict:
        from raycompat.stores import search
        from raycompat.stores.mode_search import StoreQueries
        from raycompat.upgrade.canary import canary_point

        reference = self._reference()
        c = self.canary
        ids = search(self.up.store, StoreQueries(new=c.vectors), self.opts.canary_k).ids
        point = canary_point(pos, ids, c, reference, self.opts)
        points = self.up.records.canary_points(self.run)
        self.up.records.add_canary_point(self.run, len(points), point)
        self.up.rec["canary_last"] = pos
        return point


def _judge(up: StoreUpgrade, canary: StoreCanary, point: dict) -> None:
    """A tripped guard is the state machine's ``canary_trip``: it pauses the backfill
    (``paused_by`` names it) unless it was resumed with ``override``."""
    rec = up.rec
    if point["guard"] is None or not canary.opts.canary_guard:
        up.save()
        return
    answer = up.decide(Command.CANARY_TRIP)
    up.enter(answer.state)
    if answer.state is State.GUARD_PAUSED:
        rec["paused_by"] = {
            "guard": point["guard"],
            "position": int(point["position"]),
            "reason": point["reason"],
        }
    up.save()


def _attach_canary(up: StoreUpgrade, opts: BackfillStoreOptions, canary, path: str):
    """Record the canary (its file, digest and options) in the upgrade's record; a run that
    continues with the default canary options keeps the recorded ones."""
    digest = _file_digest(path)
    saved = up.rec.get("canary") or {}
    if saved and saved.get("sha256") not in (None, digest):
        up.rec["canary_last"] = None  # another canary: measure again where the walk is
    guard = opts.guard
    if guard == CanaryOptions() and saved.get("options"):  # a run that continues: as before
        guard = CanaryOptions(**saved["options"])
    up.rec["canary"] = {
        "file": os.path.abspath(path),
        "sha256": digest,
        "every": guard.every(int(up.rec["total"])),
        "k": guard.canary_k,
        "guard": guard.canary_guard,
        "options": dataclasses.asdict(guard),
    }
    up.save()
    return StoreCanary(up, canary, guard, up.rec["order"]["run"])


def _file_digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]


def read_canary(path: str, store):
    """The canary of ``--canary``: a canary parquet (:meth:`CanarySet.read`) or the live
    index's registration JSON (``vectors``, optional ``old_vectors``, and ``classes`` or
    ``relevant_ids`` per query), checked against the store (dimensions, classes, ids)."""
    from raycompat.upgrade.canary import CanarySet

    if not os.path.isfile(path):
        raise ConfigError(f"--canary {path}: no such file")
    try:
        if path.endswith(".parquet"):
            canary = CanarySet.read(path)
        else:
            canary = _canary_json(path, store)
    except ValueError as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"--canary {path}: {exc}") from None
    info = store.describe()
    cols = store.columns
    if canary.vectors.shape[1] != info.new_dim:
        raise ConfigError(
            f"--canary {path}: 'vectors' have dimension {canary.vectors.shape[1]}, but column "
            f"{cols.new!r} of {store.where} has dimension {info.new_dim}"
        )
    if canary.old_vectors is not None and canary.old_vectors.shape[1] != info.old_dim:
        raise ConfigError(
            f"--canary {path}: 'old_vectors' have dimension {canary.old_vectors.shape[1]}, but "
            f"column {cols.old!r} of {store.where} has dimension {info.old_dim}"
        )
    _check_unit_sample(store, path)
    known = store.read_ids()
    flat = np.unique(np.concatenate(canary.relevant))
    unknown = flat[~np.isin(flat, known)]
    if unknown.size:
        raise ConfigError(
            f"--canary {path}: relevant item id(s) {unknown[:5].tolist()} are not in column "
            f"{cols.id!r} of {store.where}"
        )
    return canary


def _check_unit_sample(store, path: str, rows: int = 4096) -> None:
    """The canary scores through the store's searches, by inner product: the cosine only for
    unit vectors. The first ``rows`` old vectors must be unit length (a table raycompat did not
    create may hold others), or its numbers would not be the simulator's."""
    from raycompat.stores.checks import not_unit_rows

    block = next(iter(store.read_blocks(("id", "old"), block_rows=rows)), None)
    if block is None or not len(block["id"]):
        return
    bad = not_unit_rows(block["old"])
    if bad.any():
        raise ConfigError(
            f"--canary {path}: column {store.columns.old!r} of {store.where} holds vectors that "
            f"are not unit length ({int(bad.sum())} of its first {len(bad)}, e.g. item ids "
            f"{block['id'][bad][:5].tolist()}): the canary's searches score by inner product, "
            "the cosine only for L2-normalised vectors; store those (create_store does)"
        )


def _canary_json(path: str, store):
    from raycompat.upgrade.canary import CanarySet

    with open(path) as fh:
        try:
            doc = json.load(fh)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--canary {path}: not JSON: {exc}") from None
    if not isinstance(doc, dict) or "vectors" not in doc:
        raise ConfigError(f"--canary {path}: expected a JSON object with 'vectors'")
    if ("classes" in doc) == ("relevant_ids" in doc):
        raise ConfigError(f"--canary {path}: give exactly one of 'relevant_ids' or 'classes'")
    vectors = np.asarray(doc["vectors"], np.float32)
    old = doc.get("old_vectors")
    old = None if old is None else np.asarray(old, np.float32)
    if "classes" in doc:
        ids, labels = _store_labels(store)
        names = np.asarray([str(v) for v in labels.tolist()], object)
        relevant = [ids[names == str(c)] for c in doc["classes"]]
        missing = [str(c) for c, r in zip(doc["classes"], relevant, strict=True) if not r.size]
        if missing:
            raise ConfigError(
                f"--canary {path}: no item of {store.where} has class {missing[0]!r} (column "
                f"{store.columns.label!r})"
            )
        groups = [str(c) for c in doc["classes"]]
    else:
        relevant = [np.asarray(r, np.int64) for r in doc["relevant_ids"]]
        groups = [
            hashlib.sha256(np.unique(np.asarray(r, np.int64)).tobytes()).hexdigest()[:12]
            for r in doc["relevant_ids"]
        ]
    return CanarySet(vectors, relevant, groups, old)
