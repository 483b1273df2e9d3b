"""The upgrade state machine without Ray: every state x command of the table with the answer
and the state after it, the rules and the checks of rollback and finalize, the refusals'
messages, and the table docs/live-index.md shows."""

import dataclasses
import os

import locations
import pytest

from raycompat.upgrade.state_machine import (
    CLI,
    LIVE_INDEX,
    TABLE,
    Answer,
    Command,
    Facts,
    State,
    StateMachine,
    decide,
    enter_state,
    markdown_table,
    state_of,
)

S, C = State, Command
GUARD = {"guard": "map", "position": 0, "reason": "mAP@10 fell"}

#: the facts each state is judged with in the grid below: a backfill of 100 at position 10
FACTS = {
    S.IDLE: Facts(),
    S.RUNNING: Facts(position=10, total=100, has_order=True, policy="random"),
    S.PAUSED: Facts(position=10, total=100, has_order=True, policy="random"),
    S.GUARD_PAUSED: Facts(position=10, total=100, has_order=True, paused_by=GUARD),
    S.ROLLING_BACK: Facts(
        position=10, total=100, has_order=True, rollback_state="running", rollback_total=7
    ),
    S.ROLLBACK_PAUSED: Facts(
        position=10,
        total=100,
        has_order=True,
        rollback_state="paused",
        rollback_done=3,
        rollback_total=7,
    ),
    S.DONE: Facts(position=100, total=100, has_order=True),
    S.ERROR: Facts(position=10, total=100, has_order=True),
    S.FINALIZING: Facts(position=10, total=100, has_order=True, before=S.PAUSED),
}

#: the expected answer of every state (rows) to every command (columns, in this order);
#: written out by hand, not read from the module's table
COMMANDS = "start restart pause resume resume_override rollback finalize batch_done end canary_trip rollback_end failure finalize_end"  # noqa: E501
GRID = """
idle            running running idle 409:no_backfill 409:no_backfill rolling_back finalizing idle idle idle idle error idle
running         409:already running paused running running 409:busy 409:busy running paused guard_paused running error running
paused          409:already running paused running running rolling_back finalizing paused paused guard_paused paused error paused
guard_paused    409:already running guard_paused 409:guard running rolling_back 409:guard_finalize guard_paused guard_paused guard_paused guard_paused error guard_paused
rolling_back    409:already running rollback_paused rolling_back rolling_back 409:busy 409:busy rolling_back rolling_back rolling_back paused error rolling_back
rollback_paused 409:already running rollback_paused rolling_back rolling_back rolling_back 409:unfinished_rollback rollback_paused rollback_paused rollback_paused paused error rollback_paused
done            running running done done done rolling_back finalizing done done done done error done
error           running running error running running rolling_back finalizing error error error error error error
finalizing      409:finalizing 409:finalizing finalizing 409:finalizing 409:finalizing 409:finalizing 409:finalizing finalizing finalizing finalizing finalizing error paused
"""  # noqa: E501


def _grid():
    rows = [line.split() for line in GRID.strip().splitlines()]
    commands = COMMANDS.split()
    return [
        pytest.param(S(row[0]), C(cmd), cell, id=f"{row[0]}-{cmd}")
        for row in rows
        for cmd, cell in zip(commands, row[1:], strict=True)
    ]


def test_the_grid_covers_every_state_and_command():
    assert {p.values[0] for p in _grid()} == set(State) and len(_grid()) == 9 * 13
    assert COMMANDS.split() == [c.value for c in Command]
    assert all(set(TABLE[s]) == set(Command) for s in State) and set(TABLE) == set(State)


@pytest.mark.parametrize("state,command,expected", _grid())
def test_every_state_and_command(state, command, expected):
    answer = decide(state, command, FACTS[state])
    if expected.startswith("409:"):
        assert (answer.status, answer.why, answer.state) == (409, expected[4:], state)
        assert not answer.ok and answer.error and answer.as_error()["status"] == 409
    else:
        assert answer == Answer(S(expected)), answer
        assert answer.ok and answer.status == 200


# ----------------------------------------------------------------------------- the rules
@pytest.mark.parametrize(
    "state,command,facts,expected",
    [
        (S.RUNNING, C.END, Facts(position=100, total=100, has_order=True), S.DONE),
        (S.RUNNING, C.END, Facts(position=40, total=100, has_order=True), S.PAUSED),  # until
        (S.RUNNING, C.CANARY_TRIP, Facts(override=True), S.RUNNING),
        (S.PAUSED, C.CANARY_TRIP, Facts(override=True), S.PAUSED),
        # a rollback that moved nothing of the order leaves a done backfill done (it used to
        # turn it into paused); without an order it ends idle
        (S.ROLLING_BACK, C.ROLLBACK_END, Facts(position=100, total=100, has_order=True), S.DONE),
        (S.ROLLING_BACK, C.ROLLBACK_END, Facts(), S.IDLE),
        (S.ROLLBACK_PAUSED, C.ROLLBACK_END, Facts(position=0, total=9, has_order=True), S.PAUSED),
        (S.ERROR, C.RESUME, Facts(has_order=True, rollback_state="paused"), S.ROLLING_BACK),
        (S.ERROR, C.RESUME_OVERRIDE, Facts(rollback_state="paused"), S.ROLLING_BACK),
        (S.ERROR, C.RESUME, Facts(has_order=True, rollback_state="done"), S.RUNNING),
        (S.ERROR, C.RESUME, Facts(), S.IDLE),
        (S.FINALIZING, C.FINALIZE_END, Facts(before=S.DONE), S.DONE),
        (S.FINALIZING, C.FINALIZE_END, Facts(before=S.ERROR), S.ERROR),
    ],
)
def test_rules(state, command, facts, expected):
    assert decide(state, command, facts) == Answer(expected)


def test_finalize_end_needs_the_state_before():
    with pytest.raises(ValueError, match="before"):
        decide(S.FINALIZING, C.FINALIZE_END, Facts())


# ----------------------------------------------------------------------------- the checks
FIN = Facts(position=100, total=100, has_order=True, finalized_at=100, finalized_dropped=100)


@pytest.mark.parametrize(
    "state,command,facts,why,named",
    [
        (S.PAUSED, C.ROLLBACK, Facts(in_flight="backfill batch of 8"), "in_flight", "batch of 8"),
        (S.IDLE, C.ROLLBACK, Facts(to=5), "no_order", "roll back without 'to'"),
        (S.PAUSED, C.ROLLBACK, dataclasses.replace(FIN, to=40), "below_finalized", "'to' >= 100"),
        # after a finalize with nothing upgraded since: 409 naming the finalize
        (
            S.DONE,
            C.ROLLBACK,
            dataclasses.replace(FIN, rollback_items=0),
            "nothing_to_roll_back",
            "the upgrade was finalized at position 100 (100 old vector(s) dropped): no item "
            "keeps an old vector to return to",
        ),
        (
            S.DONE,
            C.ROLLBACK,
            Facts(has_order=True, to=60, rollback_items=0),
            "nothing_to_roll_back",
            "no item at or after position 60 of the order keeps an old vector",
        ),
        (S.DONE, C.FINALIZE, Facts(in_flight="rollback batch"), "in_flight", "rollback batch"),
        # a rollback stopped by an error is unfinished too
        (
            S.ERROR,
            C.FINALIZE,
            Facts(rollback_state="paused", rollback_done=70, rollback_total=200),
            "unfinished_rollback",
            "stopped by an error after 70 of 200",
        ),
        # its last batch acknowledged after the pause: still unfinished until it ends (the
        # position has yet to move back), so a finalize cannot drop it
        (
            S.ROLLBACK_PAUSED,
            C.FINALIZE,
            Facts(rollback_state="paused", rollback_done=200, rollback_total=200),
            "unfinished_rollback",
            "paused after 200 of 200",
        ),
    ],
)
def test_checks_of_rollback_and_finalize(state, command, facts, why, named):
    answer = decide(state, command, facts)
    assert (answer.status, answer.why, answer.state) == (409, why, state)
    assert named in answer.error, answer.error


def test_a_rollback_after_a_finalize_returns_what_was_upgraded_since():
    facts = dataclasses.replace(FIN, position=150, total=300, to=100, rollback_items=50)
    assert decide(S.PAUSED, C.ROLLBACK, facts) == Answer(S.ROLLING_BACK)
    assert decide(S.PAUSED, C.ROLLBACK, dataclasses.replace(facts, to=None)).ok


@pytest.mark.parametrize(
    "why,state,command,facts,named",
    [
        ("busy", S.RUNNING, C.ROLLBACK, Facts(), "cannot roll back while the backfill is running"),
        ("busy", S.ROLLING_BACK, C.FINALIZE, Facts(), "(a rollback is in progress)"),
        ("already", S.GUARD_PAUSED, C.START, Facts(policy="random"), "already paused"),
        ("no_backfill", S.IDLE, C.RESUME, Facts(), "start one first"),
        ("guard", S.GUARD_PAUSED, C.RESUME, Facts(paused_by=GUARD), "'override': true"),
        ("guard_finalize", S.GUARD_PAUSED, C.FINALIZE, Facts(paused_by=GUARD), "roll it back"),
        ("finalizing", S.FINALIZING, C.ROLLBACK, Facts(), "a finalize is in progress"),
    ],
)
def test_refusals_name_why_and_what_to_do(why, state, command, facts, named):
    answer = decide(state, command, facts)
    assert answer.why == why and named in answer.error, answer.error


def test_a_machine_that_finalizes_only_when_done():
    strict = StateMachine(partial_finalize=False)
    paused = Facts(position=40, total=100, has_order=True)
    answer = strict.decide(S.PAUSED, C.FINALIZE, paused)
    assert answer.why == "not_done" and "position 40 of 100" in answer.error
    assert strict.decide(S.DONE, C.FINALIZE, Facts(position=100, total=100)).ok
    assert LIVE_INDEX.decide(S.PAUSED, C.FINALIZE, paused) == Answer(S.FINALIZING)


def test_state_of_a_checkpoint_and_public_names():
    assert state_of("paused") is S.PAUSED
    assert state_of("paused", paused_by=True) is S.GUARD_PAUSED
    assert state_of("paused", "paused", paused_by=True) is S.ROLLBACK_PAUSED
    assert state_of("paused", "running") is S.ROLLBACK_PAUSED  # an older checkpoint
    assert state_of("paused", "done") is S.PAUSED
    assert state_of("rolling_back", "running") is S.ROLLING_BACK
    assert {s.public for s in State} == {
        "idle", "running", "paused", "rolling_back", "done", "error", "finalizing"
    }  # fmt: skip
    assert all(C(c).is_event == (c in COMMANDS.split()[7:]) for c in COMMANDS.split())


def test_the_docs_show_the_table_and_the_package_exports_it():
    import raycompat.upgrade as up

    with open(os.path.join(locations.REPO, "docs", "live-index.md")) as fh:
        assert markdown_table() in fh.read()
    assert up.UpgradeState is S and up.UpgradeCommand is C and up.StateMachine is StateMachine


@pytest.mark.parametrize("state", list(State))
def test_a_state_written_into_a_record_reads_back(state):
    """``enter_state`` (what the live index's controller and the store job both write) and
    ``state_of`` (what both read) are inverse: every state survives a record round trip; a
    rollback's own state and ``paused_by`` follow the state entered."""
    rolling = state in (State.ROLLING_BACK, State.ROLLBACK_PAUSED)
    record = {"rollback": {"state": "paused"} if rolling else None, "paused_by": {"guard": "map"}}
    enter_state(record, state)
    rollback = (record["rollback"] or {}).get("state")
    assert state_of(record["state"], rollback, bool(record["paused_by"])) is state
    assert bool(record["paused_by"]) is (state is State.GUARD_PAUSED)
    if rolling:
        assert rollback == ("running" if state is State.ROLLING_BACK else "paused")


def test_the_store_job_advises_flags_where_the_live_index_advises_request_bodies():
    """The same refusals in the store job's words: flags, not HTTP bodies or endpoints."""
    cli = StateMachine(words=CLI)
    guard = Facts(paused_by={"guard": "map", "position": 0, "reason": "fell"})
    said = cli.decide(S.GUARD_PAUSED, C.RESUME, guard).error
    assert "resume with --override to continue" in said
    said = LIVE_INDEX.decide(S.GUARD_PAUSED, C.RESUME, guard).error
    assert "resume with 'override': true" in said
    said = cli.decide(S.PAUSED, C.ROLLBACK, dataclasses.replace(FIN, to=40)).error
    assert "with --to 100 or above, or without --to" in said
    for state in State:
        for command in Command:
            try:
                error = cli.decide(state, command, Facts(policy="random")).error or ""
            except ValueError:  # a rule that needs facts this loop does not give
                continue
            assert "'override'" not in error and "/status" not in error and "'to'" not in error
            assert "restart=true" not in error
