"""The upgrade state machine: one set of states and transitions for backfilling a gallery with a
new model, pausing, resuming (past a canary guard with ``override``), rolling back, and
finalizing (docs/live-index.md, "The upgrade state machine").

Pure Python (no Ray, no numpy).  The live index's backfill controller
(:mod:`raycompat.serving.backfill_controller`) asks :meth:`StateMachine.decide` about every
command and every event of its walk, and a store backfill job is to ask the same,
so that both answer alike.  :data:`TABLE` is the whole table; a cell is

* a :class:`State`: the state after the command;
* a :class:`Refuse`: a 409 whose message names why and what to do (:func:`refusal_message`);
* a :class:`Rule`: the state after depends on a fact (position and total, an unfinished
  rollback, ``override``, the state a finalize began in).

Where the table accepts ``rollback`` or ``finalize``, their checks come after it
(:data:`ROLLBACK_CHECKS`, :data:`FINALIZE_CHECKS`): nothing may be in flight, a rollback cannot
go below a finalize and must have something to return, a finalize cannot drop the old vectors
an unfinished rollback still needs.
"""

from __future__ import annotations

import dataclasses
import enum

__all__ = [
    "Answer",
    "CLI",
    "Command",
    "Facts",
    "FINALIZE_CHECKS",
    "HTTP",
    "LIVE_INDEX",
    "Refuse",
    "ROLLBACK_CHECKS",
    "Rule",
    "State",
    "StateMachine",
    "TABLE",
    "Wording",
    "decide",
    "enter_state",
    "markdown_table",
    "refusal_message",
    "state_of",
]


class State(str, enum.Enum):
    """Where an upgrade is.  :attr:`public` is the name ``/status`` shows as ``state`` (three
    kinds of pause share ``paused``; ``paused_by`` and ``rollback.state`` tell them apart)."""

    IDLE = "idle"  # no backfill started (no order)
    RUNNING = "running"  # the order is walked batch by batch
    PAUSED = "paused"  # by hand, at `until`, or where a rollback ended
    GUARD_PAUSED = "guard_paused"  # by a canary guard: resume needs `override`
    ROLLING_BACK = "rolling_back"  # upgraded items return to their old vectors
    ROLLBACK_PAUSED = "rollback_paused"  # a rollback paused before its end
    DONE = "done"  # every item of the order upgraded
    ERROR = "error"  # a batch, a rollback batch or a checkpoint write failed
    FINALIZING = "finalizing"  # the old vectors are being dropped

    @property
    def public(self) -> str:
        return "paused" if self in (State.GUARD_PAUSED, State.ROLLBACK_PAUSED) else self.value


class Command(str, enum.Enum):
    """What an operator asks (the first seven) and what the walk reports (the rest)."""

    START = "start"
    RESTART = "restart"  # start with "restart": true
    PAUSE = "pause"
    RESUME = "resume"
    RESUME_OVERRIDE = "resume_override"  # resume with "override": true
    ROLLBACK = "rollback"
    FINALIZE = "finalize"
    BATCH_DONE = "batch_done"  # a batch acknowledged by the shards (the position moved)
    END = "end"  # the walk reached `until` or the end of the order
    CANARY_TRIP = "canary_trip"  # a canary point tripped a guard
    ROLLBACK_END = "rollback_end"  # the rollback's last batch acknowledged
    FAILURE = "failure"  # a batch, a rollback batch or a checkpoint write failed
    FINALIZE_END = "finalize_end"  # the finalize ended (dropped, or failed: a 503)

    @property
    def is_event(self) -> bool:
        return self in EVENTS


EVENTS = (
    Command.BATCH_DONE,
    Command.END,
    Command.CANARY_TRIP,
    Command.ROLLBACK_END,
    Command.FAILURE,
    Command.FINALIZE_END,
)


@dataclasses.dataclass(frozen=True)
class Refuse:
    """A table cell: refused with 409; ``why`` names the message (:func:`refusal_message`)."""

    why: str


@dataclasses.dataclass(frozen=True)
class Rule:
    """A table cell whose next state depends on a fact; ``name`` is one of :data:`RULES`."""

    name: str


@dataclasses.dataclass(frozen=True)
class Facts:
    """What a decision may need besides the state; the defaults suit a fresh upgrade.

    ``position``/``total``: the backfill's position in its order and the order's length
    (for ``rollback_end``: the position after the rollback); ``has_order``: a backfill was
    started; ``policy``: its policy (named in a refusal of ``start``); ``paused_by``: the guard
    that paused it (``{"guard", "position", "reason"}``); ``override``: resumed past the guards;
    ``rollback_state``/``rollback_done``/``rollback_total``: the last rollback (``running``,
    ``paused`` or ``done``); ``finalized_at``/``finalized_dropped``: where a finalize ran and
    how many old vectors it dropped; ``in_flight``: a batch sent to the shards and not yet
    acknowledged (its description); ``to``: the rollback's ``to``; ``rollback_items``: how many
    items that rollback would return (``None``: not counted yet); ``before``: the state a
    finalize began in (for ``finalize_end``)."""

    position: int = 0
    total: int = 0
    has_order: bool = False
    policy: str | None = None
    paused_by: dict | None = None
    override: bool = False
    rollback_state: str | None = None
    rollback_done: int = 0
    rollback_total: int = 0
    finalized_at: int | None = None
    finalized_dropped: int = 0
    in_flight: str | None = None
    to: int | None = None
    rollback_items: int | None = None
    before: State | None = None

    @property
    def rollback_unfinished(self) -> bool:
        """A rollback started and not ended (running, paused, or stopped by an error): it
        still has old vectors to return and the position to move back."""
        return self.rollback_state in ("running", "paused")


@dataclasses.dataclass(frozen=True)
class Answer:
    """A decision: ``state`` is the state after it (the current one when refused); a refusal
    has ``status`` 409, ``why`` (its :class:`Refuse` name) and ``error`` (the message)."""

    state: State
    status: int = 200
    why: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def as_error(self) -> dict:
        """``{"error", "status"}``: how the controller answers a refusal over HTTP."""
        return {"error": self.error, "status": self.status}


S, C = State, Command
BUSY = Refuse("busy")  # running or rolling back: pause first
ALREADY = Refuse("already")  # start: a backfill exists; pause/resume it or restart
NO_BACKFILL = Refuse("no_backfill")
GUARD = Refuse("guard")
GUARD_FINALIZE = Refuse("guard_finalize")
UNFINISHED = Refuse("unfinished_rollback")
FINALIZING = Refuse("finalizing")

#: The transitions: ``TABLE[state][command]``.  Read a row as "in this state, this command
#: leads to ...".  Internal events in a state where they cannot happen change nothing.
TABLE: dict[State, dict[Command, State | Refuse | Rule]] = {
    S.IDLE: {
        C.START: S.RUNNING,
        C.RESTART: S.RUNNING,
        C.PAUSE: S.IDLE,
        C.RESUME: NO_BACKFILL,
        C.RESUME_OVERRIDE: NO_BACKFILL,
        C.ROLLBACK: S.ROLLING_BACK,  # items upserted by hand keep their old vectors too
        C.FINALIZE: S.FINALIZING,
        C.BATCH_DONE: S.IDLE,
        C.END: S.IDLE,
        C.CANARY_TRIP: S.IDLE,
        C.ROLLBACK_END: S.IDLE,
        C.FAILURE: S.ERROR,
        C.FINALIZE_END: S.IDLE,
    },
    S.RUNNING: {
        C.START: ALREADY,
        C.RESTART: S.RUNNING,
        C.PAUSE: S.PAUSED,
        C.RESUME: S.RUNNING,  # takes a new `until` / `rate`
        C.RESUME_OVERRIDE: S.RUNNING,
        C.ROLLBACK: BUSY,
        C.FINALIZE: BUSY,
        C.BATCH_DONE: S.RUNNING,
        C.END: Rule("done_or_paused"),
        C.CANARY_TRIP: Rule("guard_pauses"),
        C.ROLLBACK_END: S.RUNNING,
        C.FAILURE: S.ERROR,
        C.FINALIZE_END: S.RUNNING,
    },
    S.PAUSED: {
        C.START: ALREADY,
        C.RESTART: S.RUNNING,
        C.PAUSE: S.PAUSED,
        C.RESUME: S.RUNNING,
        C.RESUME_OVERRIDE: S.RUNNING,
        C.ROLLBACK: S.ROLLING_BACK,
        C.FINALIZE: S.FINALIZING,
        C.BATCH_DONE: S.PAUSED,  # a batch in flight when the pause came
        C.END: S.PAUSED,
        C.CANARY_TRIP: Rule("guard_pauses"),  # measured while it ran, judged after the pause
        C.ROLLBACK_END: S.PAUSED,
        C.FAILURE: S.ERROR,
        C.FINALIZE_END: S.PAUSED,
    },
    S.GUARD_PAUSED: {
        C.START: ALREADY,
        C.RESTART: S.RUNNING,
        C.PAUSE: S.GUARD_PAUSED,
        C.RESUME: GUARD,
        C.RESUME_OVERRIDE: S.RUNNING,
        C.ROLLBACK: S.ROLLING_BACK,
        C.FINALIZE: GUARD_FINALIZE,
        C.BATCH_DONE: S.GUARD_PAUSED,
        C.END: S.GUARD_PAUSED,
        C.CANARY_TRIP: S.GUARD_PAUSED,
        C.ROLLBACK_END: S.GUARD_PAUSED,
        C.FAILURE: S.ERROR,
        C.FINALIZE_END: S.GUARD_PAUSED,
    },
    S.ROLLING_BACK: {
        C.START: ALREADY,
        C.RESTART: S.RUNNING,  # the rollback is abandoned: the new backfill upgrades all
        C.PAUSE: S.ROLLBACK_PAUSED,
        C.RESUME: S.ROLLING_BACK,
        C.RESUME_OVERRIDE: S.ROLLING_BACK,
        C.ROLLBACK: BUSY,
        C.FINALIZE: BUSY,
        C.BATCH_DONE: S.ROLLING_BACK,
        C.END: S.ROLLING_BACK,
        C.CANARY_TRIP: S.ROLLING_BACK,
        C.ROLLBACK_END: Rule("after_rollback"),
        C.FAILURE: S.ERROR,
        C.FINALIZE_END: S.ROLLING_BACK,
    },
    S.ROLLBACK_PAUSED: {
        C.START: ALREADY,
        C.RESTART: S.RUNNING,
        C.PAUSE: S.ROLLBACK_PAUSED,
        C.RESUME: S.ROLLING_BACK,
        C.RESUME_OVERRIDE: S.ROLLING_BACK,
        C.ROLLBACK: S.ROLLING_BACK,  # a new rollback replaces the paused one
        C.FINALIZE: UNFINISHED,
        C.BATCH_DONE: S.ROLLBACK_PAUSED,
        C.END: S.ROLLBACK_PAUSED,
        C.CANARY_TRIP: S.ROLLBACK_PAUSED,
        C.ROLLBACK_END: Rule("after_rollback"),  # its last batch landed after the pause
        C.FAILURE: S.ERROR,
        C.FINALIZE_END: S.ROLLBACK_PAUSED,
    },
    S.DONE: {
        C.START: S.RUNNING,
        C.RESTART: S.RUNNING,
        C.PAUSE: S.DONE,
        C.RESUME: S.DONE,
        C.RESUME_OVERRIDE: S.DONE,
        C.ROLLBACK: S.ROLLING_BACK,
        C.FINALIZE: S.FINALIZING,
        C.BATCH_DONE: S.DONE,
        C.END: S.DONE,
        C.CANARY_TRIP: S.DONE,
        C.ROLLBACK_END: S.DONE,
        C.FAILURE: S.ERROR,
        C.FINALIZE_END: S.DONE,
    },
    S.ERROR: {
        C.START: S.RUNNING,
        C.RESTART: S.RUNNING,
        C.PAUSE: S.ERROR,
        C.RESUME: Rule("retry"),
        C.RESUME_OVERRIDE: Rule("retry"),
        C.ROLLBACK: S.ROLLING_BACK,
        C.FINALIZE: S.FINALIZING,
        C.BATCH_DONE: S.ERROR,
        C.END: S.ERROR,
        C.CANARY_TRIP: S.ERROR,
        C.ROLLBACK_END: S.ERROR,
        C.FAILURE: S.ERROR,
        C.FINALIZE_END: S.ERROR,
    },
    S.FINALIZING: {
        C.START: FINALIZING,
        C.RESTART: FINALIZING,
        C.PAUSE: S.FINALIZING,
        C.RESUME: FINALIZING,
        C.RESUME_OVERRIDE: FINALIZING,
        C.ROLLBACK: FINALIZING,
        C.FINALIZE: FINALIZING,
        C.BATCH_DONE: S.FINALIZING,
        C.END: S.FINALIZING,
        C.CANARY_TRIP: S.FINALIZING,
        C.ROLLBACK_END: S.FINALIZING,
        C.FAILURE: S.ERROR,
        C.FINALIZE_END: Rule("before"),
    },
}

#: What each :class:`Rule` decides.
RULES = {
    "done_or_paused": "done when the position reached the total, else paused (at `until`)",
    "guard_pauses": "guard_paused, unless resumed with override (then the state stays)",
    "after_rollback": "paused at the first position rolled back; done if the position is "
    "still the total (nothing of the order moved); idle without an order",
    "retry": "rolling_back when a rollback is unfinished, else running (idle without an order)",
    "before": "the state the finalize began in",
}

#: The checks of an accepted ``rollback``, in order (each a :class:`Refuse` name).
ROLLBACK_CHECKS = (
    "in_flight",
    "no_order",
    "old_dropped",
    "below_finalized",
    "nothing_to_roll_back",
)
#: The checks of an accepted ``finalize``, in order.
FINALIZE_CHECKS = ("in_flight", "unfinished_rollback", "not_done")


def _rule(name: str, state: State, facts: Facts) -> State:
    if name == "done_or_paused":
        return S.DONE if facts.position >= facts.total else S.PAUSED
    if name == "guard_pauses":
        return state if facts.override else S.GUARD_PAUSED
    if name == "after_rollback":
        if not facts.has_order:
            return S.IDLE
        return S.DONE if facts.position >= facts.total else S.PAUSED
    if name == "retry":
        if facts.rollback_unfinished:
            return S.ROLLING_BACK
        return S.RUNNING if facts.has_order else S.IDLE
    if name == "before":
        if facts.before is None or facts.before is S.FINALIZING:
            raise ValueError("finalize_end needs the state the finalize began in (before)")
        return facts.before
    raise KeyError(name)


def _failed_check(command: Command, facts: Facts, partial_finalize: bool, state: State):
    """The first check of an accepted rollback or finalize that fails (its name), or None."""
    if command is C.ROLLBACK:
        if facts.in_flight:
            return "in_flight"
        if facts.to is not None and not facts.has_order:
            return "no_order"
        if facts.finalized_at is not None and not partial_finalize:
            return "old_dropped"  # a finalize that dropped the old vectors: none to return to
        if (
            facts.finalized_at is not None
            and facts.to is not None
            and facts.to < facts.finalized_at
        ):
            return "below_finalized"
        if facts.rollback_items == 0:
            return "nothing_to_roll_back"
    if command is C.FINALIZE:
        if facts.in_flight:
            return "in_flight"
        if facts.rollback_unfinished:
            return "unfinished_rollback"
        if not partial_finalize and state is not S.DONE:
            return "not_done"
    return None


@dataclasses.dataclass(frozen=True)
class Wording:
    """How a refusal names what it advises: the live index's HTTP bodies and endpoints
    (:data:`HTTP`) or the store job's command-line flags (:data:`CLI`)."""

    override: str
    restart: str
    status: str
    to: str
    #: ``to`` at least a position (``{n}``: the position)
    to_at_least: str
    #: how to start over from the old vectors once a finalize dropped them
    start_over: str = ""


HTTP = Wording("'override': true", "restart=true", "/status", "'to'", "'to' >= {n}")
CLI = Wording(
    "--override",
    "--restart",
    "--status",
    "--to",
    "--to {n} or above",
    "a run with --overwrite starts an upgrade again from the table as it was before this one",
)


def refusal_message(
    why: str, state: State, command: Command, facts: Facts, words: Wording = HTTP
) -> str:
    """The 409's message: why the command is refused in ``state``, and what to do instead,
    in ``words`` (the live index's HTTP, or the store job's flags)."""
    verb = {C.ROLLBACK: "roll back", C.FINALIZE: "finalize"}.get(command, command.value)
    g = facts.paused_by or {}
    guard = f"{g.get('guard')} at position {g.get('position')} ({g.get('reason')})"
    fin = f"the upgrade was finalized at position {facts.finalized_at} " + (
        f"({facts.finalized_dropped} old vector(s) dropped)"
    )
    if why == "busy":
        extra = " (a rollback is in progress)" if state is S.ROLLING_BACK else ""
        return f"cannot {verb} while the backfill is {state.public}: pause it first{extra}"
    if why == "already":
        return (
            f"a backfill is already {state.public} (policy {facts.policy}); "
            f"pause/resume it or pass {words.restart}"
        )
    if why == "no_backfill":
        return "no backfill to resume: start one first"
    if why == "guard":
        return (
            f"the backfill was paused by the canary guard {guard}: resume with "
            f"{words.override} to continue past it, or roll it back"
        )
    if why == "guard_finalize":
        return (
            f"cannot finalize while the backfill is paused by the canary guard {guard}: "
            "finalize drops the old vectors a rollback needs; roll it back, or resume with "
            f"{words.override} and finalize once it is done"
        )
    if why == "unfinished_rollback":
        how = "stopped by an error" if state is S.ERROR else facts.rollback_state
        return (
            f"cannot finalize while a rollback is unfinished ({how} after "
            f"{facts.rollback_done} of {facts.rollback_total} item(s)): resume it to finish "
            "the rollback, then finalize"
        )
    if why == "finalizing":
        return (
            f"cannot {verb} while a finalize is in progress: retry when {words.status} shows "
            "it ended"
        )
    if why == "in_flight":
        return (
            f"cannot {verb} while a batch is still being applied to the shards "
            f"({facts.in_flight}): retry when {words.status} shows no batch in flight"
        )
    if why == "no_order":
        return f"no backfill order: roll back without {words.to}"
    if why == "old_dropped":
        again = f"; {words.start_over}" if words.start_over else ""
        return f"{fin}: the store dropped the old vectors, so nothing can be rolled back{again}"
    if why == "below_finalized":
        return (
            f"{fin}: the items before it keep no old vector; roll back with "
            f"{words.to_at_least.format(n=facts.finalized_at)}, or without {words.to}"
        )
    if why == "nothing_to_roll_back":
        if facts.finalized_at is not None:
            return f"{fin}: no item keeps an old vector to return to"
        where = "" if facts.to is None else f" at or after position {facts.to} of the order"
        return f"nothing to roll back: no item{where} keeps an old vector"
    if why == "not_done":
        return (
            f"cannot finalize before the backfill is done (position {facts.position} of "
            f"{facts.total}): resume it to the end first"
        )
    raise KeyError(why)


@dataclasses.dataclass(frozen=True)
class StateMachine:
    """:data:`TABLE` with its rules and checks.  ``partial_finalize``: a finalize may come
    before the backfill is done (the live index: it drops the old vectors of the items upgraded
    so far, the others still are old); without it only ``done`` finalizes (a store whose
    finalize drops the old column)."""

    partial_finalize: bool = True
    #: how its refusals name what they advise (the live index's HTTP; the store job: CLI)
    words: Wording = HTTP

    def decide(self, state: State, command: Command, facts: Facts | None = None) -> Answer:
        """The answer to ``command`` in ``state``: the next state, or a 409 naming why."""
        facts = facts or Facts()
        state, command = State(state), Command(command)
        cell = TABLE[state][command]
        if isinstance(cell, Refuse):
            return self._refuse(cell.why, state, command, facts, self.words)
        nxt = _rule(cell.name, state, facts) if isinstance(cell, Rule) else cell
        if command in (C.ROLLBACK, C.FINALIZE):
            why = _failed_check(command, facts, self.partial_finalize, state)
            if why:
                return self._refuse(why, state, command, facts, self.words)
        return Answer(nxt)

    @staticmethod
    def _refuse(why: str, state: State, command: Command, facts: Facts, words) -> Answer:
        return Answer(state, 409, why, refusal_message(why, state, command, facts, words))


#: The live index's machine (a finalize may come before the end).
LIVE_INDEX = StateMachine()


def decide(state: State, command: Command, facts: Facts | None = None) -> Answer:
    """:meth:`StateMachine.decide` of :data:`LIVE_INDEX`."""
    return LIVE_INDEX.decide(state, command, facts)


def state_of(public: str, rollback_state: str | None = None, paused_by: bool = False) -> State:
    """The :class:`State` of a checkpoint: its ``state``, its rollback's ``state`` and whether
    a guard paused it (a ``paused`` backfill with an unfinished rollback is
    ``rollback_paused``)."""
    if public == "paused":
        if rollback_state in ("running", "paused"):
            return S.ROLLBACK_PAUSED
        return S.GUARD_PAUSED if paused_by else S.PAUSED
    return State(public)


def enter_state(record: dict, state: State) -> None:
    """Write ``state`` into an upgrade's record (the live index's checkpoint, a store's upgrade
    record; not saved), the inverse of :func:`state_of`: its public name, the rollback's own
    state (``running`` only while rolling back, ``paused`` while it is unfinished otherwise),
    ``paused_by`` only while a guard pauses the backfill."""
    record["state"] = state.public
    rollback = record.get("rollback")
    if rollback and rollback.get("state") in ("running", "paused"):
        rollback["state"] = "running" if state is S.ROLLING_BACK else "paused"
    if state is not S.GUARD_PAUSED:
        record["paused_by"] = None


def markdown_table() -> str:
    """:data:`TABLE` as a markdown table, as docs/live-index.md shows it: commands down,
    states across; ``409 <why>`` for a refusal, ``(<rule>)`` for a rule."""

    def cell(c) -> str:
        if isinstance(c, Refuse):
            return f"409 {c.why}"
        if isinstance(c, Rule):
            return f"({c.name})"
        return c.value

    head = "| command \\ state | " + " | ".join(s.value for s in State) + " |"
    rule = "|---" * (len(State) + 1) + "|"
    rows = [
        f"| {c.value} | " + " | ".join(cell(TABLE[s][c]) for s in State) + " |" for c in Command
    ]
    return "\n".join([head, rule, *rows])
