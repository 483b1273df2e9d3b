"""A run of ``backfill-store``: the policy's order walked batch by batch into the store,
rate-limited, resumable, compacted (docs/stores.md, "The backfill job")."""

from __future__ import annotations

import os
import re
import sys
import time
from dataclasses import dataclass

import numpy as np

from raycompat.backfill_store.canary import attach_canary, judge_point, read_canary
from raycompat.backfill_store.options import COMPACT_EVERY, EXIT, BackfillStoreOptions, Refused
from raycompat.backfill_store.sources import vector_source
from raycompat.config import ConfigError
from raycompat.console import Progress, phase
from raycompat.upgrade.state_machine import Command, State
from raycompat.upgrade.store_record import StoreUpgrade, record_facts, record_state


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


def run_upgrade(up: StoreUpgrade, opts: BackfillStoreOptions) -> int:
    """A run of the job: start a backfill, or go on with the one in the store (the state
    machine's ``start``, ``restart``, or ``resume``); every input is checked before the first
    write, then the driver walks."""
    from raycompat.stores.backfill import driver_alive

    driver = up.records.driver()
    if driver_alive(driver):
        answer = up.decide(Command.RESTART if opts.restart else Command.START)
        if driver.get("what") == "live index":
            raise Refused(
                f"a live index serving {up.store.where} holds its upgrade (pid "
                f"{driver.get('pid')} on {driver.get('host')}): backfill it through the "
                "index's admin endpoints (POST /admin/backfill/start)"
            )
        if not answer.ok and answer.why != "already":  # e.g. a finalize in progress
            raise Refused(answer.error)
        raise Refused(  # its advice is the one a running job takes: --pause
            f"a backfill-store job is already running on {up.store.where} (pid "
            f"{driver.get('pid')} on {driver.get('host')}): pause it (raycompat backfill-store "
            f"{store_flags(opts)} --pause), or wait for it"
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
    # every check before the first write of this run (a refused run changes nothing)
    check_unit_old(store)
    check_bundle_dimension(opts, store)
    fresh = command in (Command.START, Command.RESTART)
    plan = _plan(up, opts, fp, empty=over) if fresh else None
    order = plan.order if fresh else up.order
    position = plan.position if fresh else int(up.rec.get("position") or 0)
    source = None
    if answer.state is State.RUNNING:
        source = vector_source(store, opts, order, position, fp)
    canary_path = opts.canary or (up.rec.get("canary") or {}).get("file")
    canary = read_canary(canary_path, store) if canary_path else None
    # the writes, by the one driver: the upgrade is claimed in the store first
    with _claim(up) as beat:
        how = (over, fresh, fp, command, plan)
        return _write_and_drive(up, opts, how, started, source, canary, canary_path, beat)


def _claim(up: StoreUpgrade):
    """The driver's heartbeat, entered: the upgrade claimed atomically in the store
    (:class:`~raycompat.stores.backfill.DriverHeld`, refused, while another driver holds it)."""
    from raycompat.stores.backfill import DriverHeld, Heartbeat

    beat = Heartbeat(up.records, (up.rec.get("order") or {}).get("run"), "walk")
    try:
        beat.__enter__()
    except DriverHeld as exc:
        raise Refused(str(exc)) from None
    return beat


def _write_and_drive(up, opts, how, started, source, canary, canary_path, beat) -> int:
    """(the upgrade claimed by ``beat``) A run's writes, then the walk."""
    over, fresh, fp, command, plan = how
    if over:  # asked for: every item back to its old vector (the old vectors are needed)
        _start_over(up)
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
    guard = attach_canary(up, opts, canary, canary_path) if canary is not None else None
    beat.info["run"] = (up.rec.get("order") or {}).get("run")
    return _drive(up, opts, started, source, guard)


def check_unit_old(store, rows: int = 4096) -> None:
    """The store's old vectors are unit length (its first ``rows``; a table raycompat did not
    create may hold others): compatible search scores by inner product, which is the cosine
    only for unit vectors, and an upgraded item's unit new vector would rank below every
    longer old one. Checked on every run."""
    from raycompat.stores.checks import not_unit_rows

    if store.finalized:
        return
    block = next(iter(store.read_blocks(("id", "old"), block_rows=rows)), None)
    if block is None or not len(block["id"]):
        return
    bad = not_unit_rows(block["old"])
    if bad.any():
        norms = np.linalg.norm(block["old"][bad].astype(np.float64), axis=1)
        raise ConfigError(
            f"column {store.columns.old!r} of {store.where} holds vectors that are not unit "
            f"length ({int(bad.sum())} of its first {len(bad)}, norms {norms.min():.3g} to "
            f"{norms.max():.3g}, e.g. item ids {block['id'][bad][:5].tolist()}): a store scores "
            "by inner product, the cosine only for L2-normalised vectors; store those "
            "(create_store does)"
        )


def check_bundle_dimension(opts: BackfillStoreOptions, store) -> None:
    """The new model's embedding dimension (its embedder's, else its head's input, else its
    manifest's ``embed_dim``) is the store's new column's: vectors of another model are not
    written under this one's fingerprint."""
    from raycompat.models import ModelBundle

    if not opts.new_model:
        return
    bundle = ModelBundle.load(opts.new_model)
    if "embedder" in bundle.modules:
        dim = bundle.embed_dim
    elif bundle.has_head:
        dim = bundle.head.spec["embed_dim"]
    else:
        dim = bundle.manifest.get("embed_dim")
    new_dim = store.describe().new_dim
    if dim is not None and int(dim) != new_dim:
        raise ConfigError(
            f"--new-model {opts.new_model}: the model embeds to {int(dim)} dims, column "
            f"{store.columns.new!r} of {store.where} holds {new_dim}"
        )


def store_flags(opts: BackfillStoreOptions) -> str:
    """``--store URI`` (and ``--store-columns``, when given): what advice repeats."""
    flags = f"--store {opts.store}"
    return flags + (f" --store-columns {opts.store_columns}" if opts.store_columns else "")


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
    """The driver (the upgrade claimed): walk, roll back or finalize until the upgrade leaves
    those states."""
    up.ballast.fill()
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
            source = vector_source(up.store, opts, up.order, up.rec["position"], None)
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
            judge_point(up, canary, point)
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
                f"(nothing of it was written): {one_line(exc)}"
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


def one_line(exc: Exception) -> str:
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
                f"{up.rec.get('error')} (the record could not be saved either: {one_line(exc)})"
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
