"""An upgrade's record kept in the store, and the state machine's view of it
(docs/stores.md, "Where the progress lives")."""

from __future__ import annotations

import time

import numpy as np

from raycompat.upgrade.state_machine import (
    CLI,
    Answer,
    Command,
    Facts,
    State,
    StateMachine,
    enter_state,
    state_of,
)


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


def command_of(name: str, override: bool) -> Command:
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
        self.machine = StateMachine(partial_finalize=not store.capabilities.drop_field, words=CLI)
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
        enter_state(self.rec, state)
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
        """The upgrade's status (:func:`record_status`), with the store's counts, the driver
        and the canary's points read from the store."""
        from raycompat.stores.backfill import driver_alive

        rec, store = self.rec, self.store
        counts = store.counts_by_model()
        driver = self.records.driver()
        run = (rec.get("order") or {}).get("run")
        live = rec.get("canary") or {}  # the live index's keys name its registration's
        points_run, reference_run = live.get("points_run") or run, live.get("reference_run") or run
        points = self.records.canary_points(str(points_run)) if run and live else []
        canary = None
        if live:
            ref = self.records.canary_reference(str(reference_run)) if run else None
            canary = {
                **{k: rec["canary"].get(k) for k in ("file", "every", "k", "guard")},
                "reference": ref and ref.get("kind"),
                "points": len(points),
                "last": points[-1] if points else None,
                "history": [_compact_point(p) for p in points],
            }
        out = record_status(rec, store.uri.raw, store.where, store.backend)
        out["counts"] = {
            "rows": counts.rows,
            "upgraded": counts.upgraded,
            "old": counts.old,
            "new": counts.new,
        }
        out["store_finalized"] = bool(store.finalized)
        out["canary"] = canary
        out["driver"] = None if driver is None else {
            "alive": driver_alive(driver),
            "what": driver.get("what"),
            "pid": driver.get("pid"),
            "host": driver.get("host"),
            "beat_age_s": round(time.time() - float(driver.get("beat", 0)), 1),
            "ended": driver.get("ended"),
        }  # fmt: skip
        return out


def record_status(rec: dict, uri: str, where: str, backend: str) -> dict:
    """The status of an upgrade record: every key of ``--status``, always (``counts``,
    ``canary``, ``driver`` and ``store_finalized`` None where only the record is at hand: a
    running Milvus Lite job's copy of it)."""
    st = record_state(rec)
    keys = ("policy", "seed", "new_model", "until", "rate", "batch_size", "paused_by")
    return {
        "store": uri,
        "where": where,
        "backend": backend,
        "state": st.public,
        "machine_state": st.value,
        "position": int(rec.get("position") or 0),
        "total": int(rec.get("total") or 0),
        **{k: rec.get(k) for k in keys},
        "counts": None,
        "override": bool(rec.get("override")),
        "rollback": rec.get("rollback"),
        "finalized": rec.get("finalized"),
        "store_finalized": None,
        "error": rec.get("error"),
        "canary": None,
        "driver": None,
        "last_command": rec.get("last_command"),
        "recovered": rec.get("recovered"),
    }


def _compact_point(p: dict) -> dict:
    keys = ("position", "map", "delta_low", "delta_high", "nfr", "nfr_low", "guard")
    return {k: (round(p[k], 6) if isinstance(p.get(k), float) else p.get(k)) for k in keys}
