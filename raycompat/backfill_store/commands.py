"""The commands of ``backfill-store`` (status, pause, resume, rollback, finalize) and its entry
point: answered by the store's record or by a running job (docs/stores.md, "Runs and commands")."""

from __future__ import annotations

import json
import sys
import time

from raycompat.backfill_store.options import (
    COMMANDS,
    EXIT,
    POLICIES,
    BackfillStoreOptions,
    Refused,
    build_parser,
)
from raycompat.backfill_store.walk import one_line, run_upgrade, store_flags
from raycompat.config import ConfigError, options_from_args
from raycompat.console import job_main
from raycompat.upgrade.state_machine import CLI, Command, State, StateMachine
from raycompat.upgrade.store_record import StoreUpgrade, command_of, record_facts, record_state


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
        from raycompat.stores.backfill import is_full_disk

        if is_full_disk(exc):  # nothing of this run can be written: as a store that is read-only
            print(
                f"error: --store {opts.store}: the store cannot be written, the disk under it is "
                "full (No space left on device): free some space and run again",
                file=sys.stderr,
                flush=True,
            )
            return EXIT["bad_input"]
        print(f"error: {one_line(exc)}", file=sys.stderr, flush=True)
        return EXIT["error"]


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
        return run_upgrade(up, opts)


def _print_status(status: dict, command: dict | None = None) -> None:
    if command is not None:
        status = {"command": command, **status}
    print(json.dumps(status), flush=True)


def _command(up: StoreUpgrade, name: str, opts: BackfillStoreOptions) -> int:
    """A command on the upgrade's record: taken by the running driver, else applied here
    (a rollback or finalize it starts runs here to its end or a pause)."""
    from raycompat.stores.backfill import DriverHeld, Heartbeat, driver_alive

    if name == "status":
        _print_status(up.status())
        return EXIT["ok"]
    command = command_of(name, opts.override)
    args = {"to": opts.to, "until": opts.until, "rate": opts.rate, "override": opts.override}
    answer = up.decide(command, **up.command_facts(command, opts.to))
    if not answer.ok:
        raise Refused(answer.error)
    if command is Command.PAUSE and answer.state is up.state():  # nothing to change
        _print_status(up.status(), {"name": command.value, "state": answer.state.value})
        return EXIT["ok"]
    taken_here = None
    driver = up.records.driver()
    if driver_alive(driver) and driver.get("what") == "live index":
        raise Refused(
            f"a live index serving {up.store.where} holds its upgrade (pid {driver.get('pid')} "
            f"on {driver.get('host')}): send --{name} to the index's admin endpoints "
            f"(POST /admin/backfill/{name})"
        )
    if driver_alive(driver):
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
    try:
        beat = Heartbeat(up.records, run, name).__enter__()
    except DriverHeld as exc:
        raise Refused(str(exc)) from None
    with beat:
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
            f"(raycompat backfill-store {store_flags(opts)} --new-model "
            f"{up.rec.get('new_model_path') or 'BUNDLE'}" + _vectors_flag(opts, up.rec) + ")",
            file=sys.stderr,
            flush=True,
        )
    return EXIT["ok"]


def _vectors_flag(opts: BackfillStoreOptions, rec: dict) -> str:
    """`` --new-vectors PATH`` of this command, else of the record's run (where its vectors
    came from a parquet)."""
    if opts.new_vectors:
        return f" --new-vectors {opts.new_vectors}"
    source = str(rec.get("source") or "")
    return f" --{source}" if source.startswith("new-vectors ") else ""


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


def _copy_status(rec: dict, opts: BackfillStoreOptions) -> dict:
    """The status of a running Milvus Lite job's copy of its record: the keys of every
    ``--status`` (what only the store knows is None), and ``from``."""
    from raycompat.stores.uri import parse_store_uri
    from raycompat.upgrade.store_record import record_status

    uri = parse_store_uri(opts.store)
    where = f"Milvus collection {uri.name!r} at {uri.target!r}"
    return {**record_status(rec, opts.store, where, "milvus"), "from": rec.get("from")}


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
        _print_status(_copy_status(rec, opts))
        return EXIT["ok"]
    command = command_of(name, opts.override)
    facts = record_facts(rec, to=opts.to) if command is Command.ROLLBACK else record_facts(rec)
    fin = record_state(rec)
    answer = StateMachine(partial_finalize=True, words=CLI).decide(fin, command, facts)
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
    answered = _copy_status(side.status() or {}, opts)
    _print_status(answered, {"name": command.value, "state": last.get("state")})
    return EXIT["ok"]
