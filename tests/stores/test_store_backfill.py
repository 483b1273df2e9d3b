"""The store backfill job (``raycompat backfill-store``, docs/stores.md "The backfill job") on
real LanceDB and real Milvus Lite: the upgrade state machine's table through the job's
commands, commands to a running job, the search of the backfilled store against the simulator
at every grid point (and the canary against its offline curve), SIGKILL of the driver
mid-batch, a full disk, bad input, a second upgrade.

Small stores (60 or 240 items, old dim 16, new dim 24), precomputed ``--new-vectors``, the job's
``main(argv)`` in this process (one subprocess per backend: the kill test); the one pipeline
test embeds 12 images on the session's Ray cluster."""

from __future__ import annotations

import dataclasses
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from serving_helpers import labelled_embeddings
from test_stores_behaviour import BACKENDS

from raycompat.backfill_store import main
from raycompat.index.search import l2_normalize
from raycompat.stores import GalleryBlock, StoreQueries, create_store, open_store, search
from raycompat.stores.backfill import BackfillRecords
from raycompat.upgrade.state_machine import TABLE, Command, Refuse, State

REPO = Path(__file__).resolve().parents[2]
SMALL, BIG = 60, 240


# -- data ----------------------------------------------------------------------------------
def _unit_data(n_items, n_queries, classes, seed):
    raw = labelled_embeddings(n_items=n_items, n_queries=n_queries, classes=classes, seed=seed)
    unit = {a: l2_normalize(getattr(raw, a)) for a in ("gallery_old", "gallery_new")}
    return dataclasses.replace(raw, gallery_adapted=None, **unit)


@pytest.fixture(scope="module")
def small():
    return _unit_data(SMALL, 12, 6, 4)


@pytest.fixture(scope="module")
def big():
    return _unit_data(BIG, 40, 12, 2)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    """A new model's bundle: a cosine head over 12 classes (its fingerprint is written with
    every vector; uncertainty:* reads the head). No embedder: the vectors are precomputed."""
    import torch

    from raycompat.models import ClassifierHead, ModelBundle

    torch.manual_seed(0)
    path = str(tmp_path_factory.mktemp("models") / "new")
    return ModelBundle({"head": ClassifierHead(24, 12, "cosface")}, {"method": "test"}).save(path)


def store_uri(backend: str, folder: Path) -> str:
    if backend == "lance":
        return f"lance://{folder}/db/gallery"
    return f"milvus://{folder}/m.db/gallery"


def make_store(backend, folder: Path, data) -> str:
    uri = store_uri(backend, folder)
    block = GalleryBlock(data.gallery_ids, data.gallery_labels, data.gallery_old)
    create_store(uri, block, old_model="m-old", new_dim=24).close()
    return uri


def write_vectors(path: Path, ids, labels, vectors) -> str:
    vectors = np.asarray(vectors, np.float32)
    table = pa.table(
        {
            "item_id": np.asarray(ids, np.int64),
            "label": np.asarray(labels, np.int64),
            "new": pa.FixedSizeListArray.from_arrays(pa.array(vectors.ravel()), vectors.shape[1]),
        }
    )
    pq.write_table(table, path)
    return str(path)


def gallery_vectors(path: Path, data) -> str:
    return write_vectors(path, data.gallery_ids, data.gallery_labels, data.gallery_new)


def write_canary(path: Path, vectors, old_vectors, classes) -> str:
    doc = {
        "vectors": np.asarray(vectors).tolist(),
        "old_vectors": np.asarray(old_vectors).tolist(),
        "classes": [str(c) for c in np.asarray(classes).tolist()],
    }
    path.write_text(json.dumps(doc))
    return str(path)


def run(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def last_json(out: str) -> dict:
    return json.loads([line for line in out.splitlines() if line.startswith("{")][-1])


def status(capsys, uri) -> dict:
    rc, out, err = run(capsys, "--store", uri, "--status")
    assert rc == 0, err
    return last_json(out)


def record(uri) -> dict:
    with open_store(uri) as s:
        return s.read_state()


def put_record(uri, rec) -> None:
    with open_store(uri) as s:
        BackfillRecords(s).save(rec)


def fingerprint(bundle) -> str:
    from raycompat.models.fingerprint import bundle_fingerprint

    return bundle_fingerprint(bundle)


def job_running(job: list, uri: str) -> tuple[threading.Thread, dict]:
    """The job ``job`` running at 8 items/s in a thread of this process, once it has written
    8 items: ``(thread, {"rc": its exit code, once it ends})``."""
    done: dict = {}
    thread = threading.Thread(
        target=lambda: done.setdefault("rc", main([*job, "--rate", "8"])), daemon=True
    )
    thread.start()
    deadline = time.monotonic() + 60
    while (record(uri).get("position") or 0) < 8:
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.1)
    return thread, done


# -- the state machine's table through the commands ------------------------------------------
#: command flags of each operator command
FLAGS = {
    "pause": ["--pause"],
    "resume": ["--resume"],
    "resume_override": ["--resume", "--override"],
    "rollback": ["--rollback", "--to", "20"],
    "finalize": ["--finalize"],
}
#: the key words of each refusal (raycompat.upgrade.state_machine.refusal_message)
WHY = {
    "busy": "pause it first",
    "no_backfill": "no backfill to resume",
    "guard": "paused by the canary guard",
    "guard_finalize": "cannot finalize while the backfill is paused by the canary guard",
    "unfinished_rollback": "cannot finalize while a rollback is unfinished",
    "finalizing": "while a finalize is in progress",
    "not_done": "cannot finalize before the backfill is done",
    "nothing_to_roll_back": "nothing to roll back",
    "no_order": "no backfill order: roll back without --to",
}
#: the state where each accepted command's work leaves a stopped job (rollback: paused at 20)
AFTER_WORK = {"rolling_back": "paused", "finalizing": None}


def expected(state: str, command: str, backend: str) -> tuple[str, str]:
    """``("409", why)`` or ``("ok", decided state)``: the table's cell, with the checks that
    apply to these stores (LanceDB finalizes only when done; an idle store has nothing to roll
    back)."""
    cmd = Command(command)
    cell = TABLE[State(state)][cmd]
    if isinstance(cell, Refuse):
        return "409", cell.why
    if cmd is Command.FINALIZE and backend == "lance" and state != "done":
        return "409", "not_done"
    if cmd is Command.ROLLBACK and state == "idle":
        return "409", "no_order"  # --to without a backfill order
    if command.startswith("resume") and state == "error":
        return "ok", "running"  # the retry rule: no rollback unfinished
    return "ok", cell.value


def build_templates(backend, root: Path, small, bundle, capsys) -> dict[str, Path]:
    """One stopped store per reachable state, built through the job (a crash's records where
    only a kill leaves that state: rolling_back, rollback_paused)."""
    base = root / "base"
    uri = make_store(backend, base, small)
    vec = gallery_vectors(base / "new.parquet", small)
    noise = np.random.default_rng(1).standard_normal((len(small.query_new), 24))
    canary = write_canary(base / "bad.json", noise, small.query_old, small.query_labels)
    job = ["--store", uri, "--new-model", bundle, "--new-vectors", vec, "--batch-size", "20"]
    out = {}

    def keep(name):
        shutil.copytree(base, root / name)
        out[name] = root / name

    keep("idle")
    assert run(capsys, *job, "--until", "40")[0] == 0
    keep("paused")
    rc, _, err = run(capsys, *job, "--canary", canary, "--canary-every", "20")
    assert rc == 4 and record(uri)["paused_by"]["guard"] in ("map", "nfr"), err
    keep("guard_paused")
    shutil.rmtree(base)
    shutil.copytree(out["paused"], base)
    rec = record(uri)
    rb = {"to": 20, "done": 0, "total": 20, "first": 20, "started": 0.0}
    put_record(uri, {**rec, "state": "rolling_back", "rollback": {**rb, "state": "running"}})
    keep("rolling_back")
    put_record(uri, {**rec, "state": "paused", "rollback": {**rb, "state": "paused"}})
    keep("rollback_paused")
    put_record(uri, rec)
    assert run(capsys, "--store", uri, "--resume")[0] == 0
    keep("running")
    shutil.rmtree(base)
    shutil.copytree(out["paused"], base)
    with open_store(uri) as s:
        order = BackfillRecords(s).read_order(rec["order"])
    bad = small.gallery_new.copy()
    bad[np.searchsorted(small.gallery_ids, order[45])] = np.nan
    nan = write_vectors(base / "nan.parquet", small.gallery_ids, small.gallery_labels, bad)
    rc, _, err = run(capsys, *job[:-4], "--new-vectors", nan, "--batch-size", "20")
    assert rc == 2 and "column 'new' has NaN or inf" in err, err
    keep("error")
    shutil.rmtree(base)
    shutil.copytree(out["paused"], base)
    assert run(capsys, *job)[0] == 0
    keep("done")
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_command_in_every_state_of_a_stopped_job(backend, tmp_path, small, bundle, capsys):
    templates = build_templates(backend, tmp_path / "templates", small, bundle, capsys)
    fp = fingerprint(bundle)
    seen = 0
    for state, template in templates.items():
        assert status(capsys, store_uri(backend, template))["machine_state"] == state
        for command, flags in FLAGS.items():
            cell = tmp_path / f"{state}-{command}"
            shutil.copytree(template, cell)
            uri = store_uri(backend, cell)
            before = status(capsys, uri)
            rc, out, err = run(capsys, "--store", uri, *flags)
            kind, want = expected(state, command, backend)
            where = f"{backend}: {command} in {state}"
            after = status(capsys, uri)
            if kind == "409":
                assert rc == 3 and err.startswith("error: ") and WHY[want] in err, (where, err)
                assert after["machine_state"] == state, where  # nothing changed
                assert after["position"] == before["position"], where
            else:
                assert rc == 0, (where, err)
                assert last_json(out)["command"]["state"] == want, (where, out)
                final = AFTER_WORK.get(want, want) or state
                if command == "finalize":
                    final = state
                assert after["machine_state"] == final, (where, after)
                if want == "rolling_back":  # the rollback ran to its end here
                    assert after["position"] == 20 and after["counts"]["new"] == {fp: 20}, where
                    assert after["rollback"]["done"] == after["rollback"]["total"], where
                if command == "finalize":
                    assert after["finalized"]["position"] == before["position"], where
                    assert after["store_finalized"] == (state == "done"), where
            # the store agrees with the record: the items upgraded are the order's first ones
            if after["machine_state"] not in ("rolling_back", "rollback_paused"):
                assert after["counts"]["upgraded"] == after["position"], where
            seen += 1
    assert seen == 8 * 5
    # without --to: every item that keeps an old vector; an idle store has none
    rc, _, err = run(capsys, "--store", store_uri(backend, templates["idle"]), "--rollback")
    assert rc == 3 and "nothing to roll back: no item keeps an old vector" in err, err


# -- commands to a running job ---------------------------------------------------------------
@pytest.mark.timeout(180)
@pytest.mark.parametrize("backend", BACKENDS)
def test_commands_reach_a_running_job_between_batches(backend, tmp_path, small, bundle, capsys):
    uri = make_store(backend, tmp_path, small)
    vec = gallery_vectors(tmp_path / "v.parquet", small)
    job = ["--store", uri, "--new-model", bundle, "--new-vectors", vec, "--batch-size", "4"]
    thread, done = job_running(job, uri)
    rc, out, _ = run(capsys, "--store", uri, "--status")  # one schema, running or not
    running_keys = set(last_json(out)) - {"from"}
    rc, _, err = run(capsys, *job)  # a second job over a running one
    assert rc == 3 and "already running" in err, err
    rc, _, err = run(capsys, "--store", uri, "--rollback", "--to", "4")
    assert rc == 3 and "cannot roll back while the backfill is running: pause it first" in err
    rc, out, err = run(capsys, "--store", uri, "--resume", "--rate", "12", "--until", "56")
    assert rc == 0 and last_json(out)["command"]["state"] == "running", err
    assert record(uri)["rate"] == 12 and record(uri)["until"] == 56
    rc, out, err = run(capsys, "--store", uri, "--pause")
    assert rc == 0 and last_json(out)["command"]["state"] == "paused", err
    thread.join(timeout=30)
    assert done["rc"] == 0
    st = status(capsys, uri)
    assert set(st) == running_keys, set(st) ^ running_keys
    assert st["state"] == "paused" and 8 <= st["position"] < 56
    assert st["counts"]["upgraded"] == st["position"] and st["driver"]["alive"] is False
    # a finalize in progress (a driver of this process, as it would be): every command waits
    from raycompat.stores import backfill

    with open_store(uri) as s:
        rec = s.read_state()
        records = BackfillRecords(s)
        put_record(uri, {**rec, "state": "finalizing", "finalizing_from": "paused"})
        with backfill.Heartbeat(records, rec["order"]["run"], "finalize"):
            for flags in (["--resume"], ["--rollback"], ["--finalize"], ["--restart"]):
                extra = (
                    ["--new-model", bundle, "--new-vectors", vec] if "--restart" in flags else []
                )
                rc, _, err = run(capsys, "--store", uri, *extra, *flags)
                assert rc == 3 and "finalize is in progress" in err, (flags, err)
            rc, out, _ = run(capsys, "--store", uri, "--pause")
            assert rc == 0 and last_json(out)["command"]["state"] == "finalizing"
        put_record(uri, rec)


# -- the simulator ------------------------------------------------------------------------
FRACTIONS = [0.0, 0.3, 0.7, 1.0]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("policy", ["random", "uncertainty:margin"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_backfilled_store_searches_as_the_simulator(
    backend, policy, tmp_path, big, bundle, capsys
):
    """Backfilled by the job to each grid point, ``raycompat.stores.search`` (compatible mode)
    answers as the simulator at that point (mAP@N, revisited mAP, top-1, NFR@1 to 1e-12), and
    the canary's points are the offline canary curve's along the job's order."""
    from raycompat.metrics import correct_at_k
    from raycompat.models import ModelBundle
    from raycompat.models.uncertainty_head import UncertaintyHead
    from raycompat.serving.live_eval import compare_curves, live_metrics
    from raycompat.simulator import simulate_backfill
    from raycompat.upgrade.canary import CanaryOptions, CanarySet, offline_canary_curve
    from raycompat.upgrade.grid import backfill_counts

    data, k = big, big.n_items
    head = UncertaintyHead.from_classifier_head(ModelBundle.load(bundle).head)
    sim = simulate_backfill(
        data, [policy], ["compatible"], fractions=FRACTIONS, k=k, seed=7, head=head
    )
    uri = make_store(backend, tmp_path, data)
    vec = gallery_vectors(tmp_path / "v.parquet", data)
    canary = write_canary(tmp_path / "c.json", data.query_new, data.query_old, data.query_labels)
    job = ["--store", uri, "--new-model", bundle, "--new-vectors", vec, "--policy", policy]
    job += ["--seed", "7", "--batch-size", "50", "--canary", canary, "--canary-every", "24"]
    queries = StoreQueries(new=data.query_new)
    got = {}
    label_of = dict(zip(data.gallery_ids.tolist(), data.gallery_labels.tolist(), strict=True))
    with open_store(uri) as s:
        top = s.search("old", l2_normalize(data.query_old), 1).ids[:, 0]
    hits = [[label_of[t] == q] for t, q in zip(top.tolist(), data.query_labels, strict=True)]
    ref = correct_at_k(np.array(hits), 1)
    for n in backfill_counts(np.asarray(FRACTIONS), data.n_items).tolist():
        rc, _, err = run(capsys, *job, "--until", n)
        assert rc == 0, err
        with open_store(uri) as s:
            assert s.count_upgraded() == n
            res = search(s, queries, k, "compatible")
        for name, value in live_metrics(res.ids, data, k, ref)[0].items():
            got.setdefault(name, []).append(value)
    cmp = compare_curves({"metrics": got}, sim.curve(policy, "compatible"), tol=1e-12)
    assert cmp["equal"] and len(cmp["max_abs_diff"]) == 4, cmp
    assert got[f"mAP@{k}"][0] != got[f"mAP@{k}"][-1]
    # the canary, point for point
    with open_store(uri) as s:
        rec, records = s.read_state(), BackfillRecords(s)
        order = records.read_order(rec["order"])
        points = records.canary_points(rec["order"]["run"])
    rows = np.searchsorted(data.gallery_ids, order)
    np.testing.assert_array_equal(rows, sim.orders[(policy, "compatible")])
    relevant = [data.gallery_ids[data.gallery_labels == c] for c in data.query_labels]
    cs = CanarySet(data.query_new, relevant, [str(c) for c in data.query_labels], data.query_old)
    offline = offline_canary_curve(data, cs, rows, "compatible", CanaryOptions(canary_every=24))
    assert [p["position"] for p in points] == [p["position"] for p in offline["points"]]
    for mine, theirs in zip(points, offline["points"], strict=True):
        for key in ("map", "delta_map", "delta_low", "delta_high", "nfr", "nfr_low", "top1"):
            if theirs[key] is None:
                assert mine[key] is None, key
            else:
                assert mine[key] == pytest.approx(theirs[key], abs=1e-12), key


# -- SIGKILL of the driver mid-batch --------------------------------------------------------
def _progress_lines(proc, wanted: int, timeout_s: float) -> int:
    fd, buf, seen = proc.stdout.fileno(), b"", 0
    deadline = time.monotonic() + timeout_s
    while seen < wanted:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            raise AssertionError(f"the job printed {seen} progress lines in {timeout_s} s")
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        buf += chunk
        *lines, buf = buf.split(b"\n")
        seen += sum(line.startswith(b"[backfill-store]") for line in lines)
    return seen


@pytest.mark.subprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", BACKENDS)
def test_sigkill_of_the_driver_mid_batch_loses_nothing_and_writes_nothing_twice(
    backend, tmp_path, big, bundle
):
    data = big
    uri = make_store(backend, tmp_path, data)
    vec = gallery_vectors(tmp_path / "v.parquet", data)
    if backend == "lance":
        with open_store(uri) as s:
            version0 = int(s._table.version)
    cmd = [sys.executable, str(REPO / "jobs" / "backfill_store.py"), "--store", uri]
    cmd += ["--new-model", bundle, "--new-vectors", vec, "--batch-size", "10"]
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    )
    rng = np.random.default_rng(11)
    kills, positions = 0, []
    for _attempt in range(3):
        with open(tmp_path / "child.err", "ab") as err:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, env=env)
            try:
                _progress_lines(proc, 2, timeout_s=120)
                time.sleep(float(rng.uniform(0.0, 0.05)))
                alive = proc.poll() is None
            finally:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
        if not alive:
            break
        kills += 1
        with open_store(uri) as s:  # whole batches only: written and recorded, or one ahead
            recorded, upgraded = s.read_state()["position"], s.count_upgraded()
        assert upgraded - recorded in (0, 10), (recorded, upgraded)
        positions.append((recorded, upgraded))
    assert kills >= 2, (tmp_path / "child.err").read_text()[-2000:]
    final = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert final.returncode == 0, final.stderr[-2000:]
    fp = fingerprint(bundle)
    with open_store(uri) as s:
        rec = s.read_state()
        order = BackfillRecords(s).read_order(rec["order"])
        (block,) = s.read_blocks(("id", "new", "new_model", "position", "upgraded"), 10**6)
        counts = s.counts_by_model()
        version = int(s._table.version) if backend == "lance" else None
    assert rec["state"] == "done" and rec["position"] == rec["total"] == data.n_items
    assert counts.new == {fp: data.n_items} and counts.upgraded == data.n_items
    # every item once, at its own position of the order, with its own vector
    at = np.searchsorted(block["id"], order)
    np.testing.assert_array_equal(block["position"][at], np.arange(data.n_items))
    assert block["upgraded"].all() and set(block["new_model"]) == {fp}
    rows = np.searchsorted(data.gallery_ids, block["id"])
    np.testing.assert_array_equal(block["new"], l2_normalize(data.gallery_new[rows]))
    if backend == "lance":  # one commit per batch: no batch was written twice
        assert version - version0 == data.n_items // 10, (version, version0)
    ahead = sum(u > r for r, u in positions)
    print(f"{backend}: {kills} kills, (recorded, in the store) {positions}, {ahead} mid-batch")


# -- a full disk ---------------------------------------------------------------------------
@pytest.mark.timeout(180)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_store_that_refuses_a_write_stops_the_job_in_error_naming_it(
    backend, tmp_path, small, bundle, capsys, tiny_fs
):
    from conftest import fill_disk

    disk = Path(tiny_fs(16 * 2**20))
    uri = make_store(backend, disk, small)
    vec = gallery_vectors(tmp_path / "v.parquet", small)
    job = ["--store", uri, "--new-model", bundle, "--new-vectors", vec, "--batch-size", "4"]
    done = {}
    thread = threading.Thread(
        target=lambda: done.setdefault("run", run(capsys, *job, "--rate", "10")), daemon=True
    )
    thread.start()
    deadline = time.monotonic() + 60
    while (record(uri).get("position") or 0) < 8:
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.1)
    fill_disk(str(disk), leave=0)
    thread.join(timeout=60)
    rc, out, err = done["run"]
    assert rc == 1 and "No space left on device" in err and "refused" in err, err
    assert len(err.strip().splitlines()) == 1, err  # (Milvus's tracebacks: the test below)
    assert "error" in out.splitlines()[-1]  # the phase line
    os.remove(disk / "filler")
    st = status(capsys, uri)
    assert st["state"] == "error" and "No space left on device" in st["error"], st
    assert st["counts"]["upgraded"] == st["position"]  # nothing of the refused batch
    rc, _, err = run(capsys, *job)
    assert rc == 0, err
    st = status(capsys, uri)
    assert st["state"] == "done" and st["counts"]["new"] == {fingerprint(bundle): SMALL}


# -- bad input, a second upgrade, the canary guard ------------------------------------------
@pytest.mark.timeout(120)
def test_bad_input_is_one_error_line_naming_the_column(tmp_path, small, bundle, capsys):
    uri = make_store("lance", tmp_path, small)
    ids, labels, new = small.gallery_ids, small.gallery_labels, small.gallery_new
    good = write_vectors(tmp_path / "good.parquet", ids, labels, new)
    short = write_vectors(tmp_path / "short.parquet", ids, labels, new[:, :16])
    relabel = write_vectors(tmp_path / "labels.parquet", ids, (labels + 1) % 6, new)
    some = write_vectors(tmp_path / "some.parquet", ids[:50], labels[:50], new[:50])
    pq.write_table(pa.table({"item_id": ids}), tmp_path / "nocol.parquet")
    canary = tmp_path / "canary.json"
    canary.write_text(json.dumps({"vectors": small.query_new.tolist(), "classes": ["nope"] * 12}))
    base = ["--store", uri, "--new-model", bundle]
    cases = [
        ([*base, "--new-vectors", short], "column 'new' has vectors of dimension 16"),
        ([*base, "--new-vectors", relabel], "column 'label' disagrees with column 'label'"),
        ([*base, "--new-vectors", some], "column 'item_id' lacks 10 item(s)"),
        ([*base, "--new-vectors", tmp_path / "nocol.parquet"], "column 'new' is missing"),
        ([*base, "--new-vectors", good, "--canary", canary], "has class 'nope' (column 'label')"),
        ([*base, "--new-vectors", good, "--policy", "hinge-benefit"], "--policy 'hinge-benefit'"),
        (["--store", uri, "--store-columns", "old=emb"], "column 'emb' (old) missing"),
        ([*base], "maps no image column"),
        (["--store", uri, "--new-vectors", good], "--new-model is required"),
        (["--store", uri, "--to", "3"], "--to goes with --rollback"),
    ]
    for argv, why in cases:
        rc, out, err = run(capsys, *argv)
        lines = err.strip().splitlines()
        assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), (argv, err)
        assert why in lines[0], (why, lines[0])
    # the checks come before any write: the store is untouched
    st = status(capsys, uri)
    assert st["counts"]["upgraded"] == 0


# -- a Milvus store that cannot be reached, opened or written ------------------------------
def _cli_runs(cases: list[tuple[list, list]]) -> list[tuple[int, list[str]]]:
    """``(exit status, non-empty stderr lines)`` of the job's command line for each
    ``(prefix, argv)`` (``prefix``: e.g. ``setpriv ...``), run at once in child processes: what
    a terminal shows, Milvus Lite's and pymilvus's own log lines included."""
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    )
    job = [sys.executable, str(REPO / "jobs" / "backfill_store.py")]
    procs = [
        subprocess.Popen(
            [*prefix, *job, *map(str, argv)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for prefix, argv in cases
    ]
    out = []
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        out.append((proc.returncode, [line for line in err.splitlines() if line.strip()]))
    return out


def _assert_one_error_line(runs, cases, uris, whys) -> None:
    for (rc, lines), (_, argv), uri, why in zip(runs, cases, uris, whys, strict=True):
        assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), (argv, rc, lines)
        assert f"--store {uri}: " in lines[0] and why in lines[0], (why, lines[0])
        assert "another process" not in lines[0], lines[0]


@pytest.mark.subprocess
@pytest.mark.timeout(120)
def test_an_unreachable_milvus_server_or_an_unwritable_lite_file_is_one_error_line(
    tmp_path, small, bundle, tiny_fs
):
    """One ``error:`` line each, exit status 2, none of Milvus Lite's and pymilvus's
    tracebacks (the four runs start together):

    * nothing listening at host:port: refused at once (no wait for pymilvus's 10 s), naming
      host:port;
    * a Milvus Lite file this process may not write (Milvus Lite writes its lock file even to
      read): "permission denied", not "held by another process" (root ignores the permission
      bits: its run drops CAP_DAC_OVERRIDE with setpriv so that they apply);
    * a Milvus Lite file on a file system mounted read-only (what even root cannot write);
    * one on a full disk when the job starts (its first write is the driver's claim)."""
    import socket

    from conftest import fill_disk

    pytest.importorskip("milvus_lite")
    with socket.socket() as sock:  # a free port: nothing listens there
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = f"milvus://127.0.0.1:{port}/gallery"
    locked = make_store("milvus", tmp_path / "locked", small)
    read_only, full = Path(tiny_fs(16 * 2**20, "ro")), Path(tiny_fs(16 * 2**20, "full"))
    on_disks = [make_store("milvus", read_only, small), make_store("milvus", full, small)]
    subprocess.run(["mount", "-o", "remount,ro", str(read_only)], check=True)
    fill_disk(str(full))
    vec = gallery_vectors(tmp_path / "v.parquet", small)
    job = ["--new-model", bundle, "--new-vectors", vec]
    cases = [([], ["--store", uri, *job]) for uri in [server, *on_disks]]
    uris = [server, *on_disks]
    whys = [
        f"cannot reach the Milvus server at 127.0.0.1:{port}: connection refused",
        "cannot be opened: it is on a read-only file system",
        "the disk under it is full",
    ]
    drop = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"]
    if os.geteuid() != 0 or shutil.which("setpriv"):
        cases.append((drop if os.geteuid() == 0 else [], ["--store", locked, *job]))
        uris.append(locked)
        whys.append("cannot be opened: it is read-only to this process: permission denied")
    subprocess.run(["chmod", "-R", "a-w", str(tmp_path / "locked")], check=True)
    try:
        started = time.monotonic()
        runs = _cli_runs(cases)
        took = time.monotonic() - started
    finally:
        subprocess.run(["chmod", "-R", "u+w", str(tmp_path / "locked")], check=True)
    _assert_one_error_line(runs, cases, uris, whys)
    assert took < 45, took


@pytest.mark.timeout(180)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_second_upgrade_needs_overwrite(backend, tmp_path, small, bundle, capsys):
    import torch

    from raycompat.models import ClassifierHead, ModelBundle

    torch.manual_seed(1)
    other = ModelBundle({"head": ClassifierHead(24, 12, "cosface")}, {"method": "other"})
    other = other.save(str(tmp_path / "other"))
    uri = make_store(backend, tmp_path / "s", small)
    vec = gallery_vectors(tmp_path / "v.parquet", small)
    one = ["--store", uri, "--new-model", bundle, "--new-vectors", vec, "--batch-size", "30"]
    two = ["--store", uri, "--new-model", other, "--new-vectors", vec, "--batch-size", "30"]
    assert run(capsys, *one, "--until", "30")[0] == 0
    rc, _, err = run(capsys, *two)
    assert rc == 3 and "holds an upgrade to model" in err and "--overwrite" in err, err
    assert run(capsys, *one)[0] == 0
    rc, out, err = run(capsys, "--store", uri, "--finalize")
    assert rc == 0 and status(capsys, uri)["store_finalized"], err
    for argv in (two, [*one, "--restart"]):
        rc, _, err = run(capsys, *argv)
        assert rc == 3 and "finalized" in err and "--overwrite" in err, err
    rc, _, err = run(capsys, *two, "--overwrite", "--until", "30")
    assert rc == 0, err
    st = status(capsys, uri)
    assert not st["store_finalized"] and st["position"] == 30 and st["finalized"] is None
    assert st["counts"]["new"] == {fingerprint(other): 30} and st["counts"]["upgraded"] == 30
    with open_store(uri) as s:  # the old vectors are back (LanceDB: restored from the mark)
        (block,) = s.read_blocks(("id", "old"), 10**6)
    np.testing.assert_array_equal(block["old"], small.gallery_old)


@pytest.mark.timeout(120)
def test_a_tripped_guard_pauses_and_override_continues(tmp_path, small, bundle, capsys):
    uri = make_store("lance", tmp_path, small)
    vec = gallery_vectors(tmp_path / "v.parquet", small)
    noise = np.random.default_rng(1).standard_normal((len(small.query_new), 24))
    canary = write_canary(tmp_path / "bad.json", noise, small.query_old, small.query_labels)
    job = ["--store", uri, "--new-model", bundle, "--new-vectors", vec, "--batch-size", "20"]
    rc, out, _ = run(capsys, *job, "--canary", canary, "--canary-every", "20")
    assert rc == 4 and "paused by the canary guard" in out
    st = status(capsys, uri)
    assert st["state"] == "paused" and st["machine_state"] == "guard_paused"
    assert st["paused_by"]["guard"] in ("map", "nfr") and st["paused_by"]["position"] == 0
    assert st["canary"]["points"] == 1 and st["canary"]["reference"] == "old-old"
    rc, _, err = run(capsys, *job)  # a run resumes: refused by the guard, as the live index
    assert rc == 3 and "resume with --override to continue past it" in err, err
    rc, out, err = run(capsys, *job, "--override")
    assert rc == 0, err
    st = status(capsys, uri)
    assert st["state"] == "done" and st["override"] and st["canary"]["points"] == 4
    assert [p["position"] for p in st["canary"]["history"]] == [0, 20, 40, 60]


# -- the image pipeline -------------------------------------------------------------------
@dataclasses.dataclass
class _Rec:
    item_id: int
    path: str
    label: int


@pytest.mark.timeout(300)
def test_the_pipeline_embeds_the_store_images(ray_cluster, tmp_path, capsys):
    """No --new-vectors: the store's image_uri column, embedded by the Ray Data pipeline
    with the bundle, L2-normalised, written with the bundle's fingerprint."""
    from PIL import Image

    from raycompat.models import ModelBundle
    from raycompat.pipeline.bundles import make_random_bundles
    from raycompat.stores import ColumnMap

    _, new = make_random_bundles(
        str(tmp_path / "models"), backbone="test_resnet", old_dim=16, new_dim=24,
        num_classes=6, psi_hidden=32, resolution=16, seed=3,
    )  # fmt: skip
    rng = np.random.default_rng(0)
    n = 12
    ids = np.arange(n, dtype=np.int64) * 5 + 1
    uris = []
    for i in ids.tolist():
        path = tmp_path / f"img{i}.png"
        Image.fromarray(rng.integers(0, 255, (16, 16), dtype=np.uint8)).save(path)
        uris.append(str(path))
    columns = ColumnMap(image_uri="uri")
    uri = f"lance://{tmp_path}/db/gallery"
    old = l2_normalize(rng.standard_normal((n, 16)))
    block = GalleryBlock(ids, ids % 3, old, image_uris=uris)
    create_store(uri, block, old_model="m-old", new_dim=24, columns=columns).close()
    rc, out, err = run(
        capsys, "--store", uri, "--store-columns", "image_uri=uri", "--new-model", new,
        "--batch-size", "5", "--cache", tmp_path / "cache", "--model-stages", "tasks",
    )  # fmt: skip
    assert rc == 0, err
    import torch

    from raycompat.models.fingerprint import embedder_info
    from raycompat.pipeline.sources import RecordSource
    from raycompat.pipeline.stages import preprocess

    info = embedder_info(new)
    records = [_Rec(i, u, i % 3) for i, u in zip(ids.tolist(), uris, strict=True)]
    src = RecordSource(records, "x", str(tmp_path), resolution=16, in_chans=info["in_chans"])
    x = torch.from_numpy(preprocess(src.load(ids))["pixels"])
    embedder = ModelBundle.load(new).embedder.eval()
    with torch.inference_mode():
        want = l2_normalize(embedder(x).numpy())
    with open_store(uri, columns) as s:
        (got,) = s.read_blocks(("id", "new", "new_model"), 100)
    assert set(got["new_model"]) == {fingerprint(new)}
    np.testing.assert_allclose(got["new"], want, rtol=1e-4, atol=1e-5)


# -- defects a new user found: refused runs change nothing, inputs are checked -----------------
@pytest.mark.timeout(120)
def test_a_refused_overwrite_changes_nothing_and_inputs_are_checked_on_every_run(
    tmp_path, small, bundle, capsys
):
    """A second run with --overwrite and a bundle of another dimension is refused before any
    write (it used to turn the upgraded items back and delete the order's records first); a
    store whose old vectors are not unit length is refused on every run, not only with
    --canary."""
    import torch

    from raycompat.models import ClassifierHead, ModelBundle

    torch.manual_seed(2)
    wide = ModelBundle({"head": ClassifierHead(64, 12, "cosface")}, {"method": "wide"})
    wide = wide.save(str(tmp_path / "wide"))
    uri = make_store("lance", tmp_path / "s", small)
    vec = gallery_vectors(tmp_path / "v.parquet", small)
    assert run(capsys, "--store", uri, "--new-model", bundle, "--new-vectors", vec,
               "--until", "40")[0] == 0  # fmt: skip
    before = status(capsys, uri)
    rc, _, err = run(capsys, "--store", uri, "--new-model", wide, "--new-vectors", vec,
                     "--overwrite")  # fmt: skip
    assert rc == 2 and "embeds to 64 dims" in err and "holds 24" in err, err
    after = status(capsys, uri)
    before.pop("driver"), after.pop("driver")  # its heartbeat's age moves on
    assert after == before and after["position"] == 40 and after["counts"]["upgraded"] == 40
    for command in ("--status", "--pause", "--resume"):
        assert run(capsys, "--store", uri, command)[0] == 0, command
    # old vectors that are not unit length: refused whatever the flags, naming the column
    from raycompat.stores.lance import _fsl

    raw = make_store("lance", tmp_path / "loose", small)
    with open_store(raw) as s:  # the same table, its old vectors scaled as a team's may be
        table = s._table.to_arrow().sort_by("item_id")
        at = table.schema.get_field_index("old")
        scaled = table.set_column(at, table.schema.field("old"), _fsl(small.gallery_old * 3))
        s._db.create_table("gallery", scaled, mode="overwrite", on_bad_vectors="null")
    rc, _, err = run(capsys, "--store", raw, "--new-model", bundle, "--new-vectors", vec)
    assert rc == 2 and "not unit length" in err and "column 'old'" in err, err
    assert status(capsys, raw)["counts"]["upgraded"] == 0


def _claim_in_a_process(uris: list[str], ready, gos, out) -> None:
    """(a spawned process) For each store of ``uris``: claim its upgrade when its ``gos``
    event is set; put the outcome."""
    from raycompat.stores.backfill import BackfillRecords, Heartbeat

    records = [BackfillRecords(open_store(uri)) for uri in uris]
    ready.release()
    for rec, go in zip(records, gos, strict=True):
        beat = Heartbeat(rec, None, "walk")
        go.wait(60)
        out.put(rec.claim_driver(beat.info) is None)
    time.sleep(1.0)  # alive while the other one looks


@pytest.mark.subprocess
@pytest.mark.timeout(240)
def test_one_driver_at_a_time_arbitrated_by_the_store(tmp_path, small, bundle, capsys):
    """The upgrade is claimed by an atomic swap of the driver record in the store: of two
    processes claiming at the same instant exactly one gets it (4 trials), and a run while
    another driver holds it is refused before it writes anything."""
    import multiprocessing

    from raycompat.stores.backfill import BackfillRecords, Heartbeat

    ctx = multiprocessing.get_context("spawn")
    uris = [make_store("lance", tmp_path / f"s{trial}", small) for trial in range(4)]
    ready, out = ctx.Semaphore(0), ctx.Queue()
    gos = [ctx.Event() for _ in uris]
    procs = [
        ctx.Process(target=_claim_in_a_process, args=(uris, ready, gos, out)) for _ in range(2)
    ]
    for p in procs:
        p.start()
    for _ in procs:
        assert ready.acquire(timeout=120)
    for trial, go in enumerate(gos):
        go.set()
        won = sorted(out.get(timeout=60) for _ in procs)
        assert won == [False, True], (trial, won)
    for p in procs:
        p.join(60)
    uri = make_store("lance", tmp_path / "held", small)
    vec = gallery_vectors(tmp_path / "v.parquet", small)
    with Heartbeat(BackfillRecords(open_store(uri)), None, "walk"):
        rc, _, err = run(capsys, "--store", uri, "--new-model", bundle, "--new-vectors", vec)
    assert rc == 3 and "already running" in err, err
    assert status(capsys, uri)["counts"]["upgraded"] == 0


def _advised(err: str, start: str) -> list[str]:
    """The flags of the command an error or note advises: ``(raycompat backfill-store ...)``."""
    at = err.index(start) + len(start)
    return err[at : err.index(")", at)].split()


@pytest.mark.timeout(180)
def test_every_piece_of_advice_printed_is_accepted_when_typed_back(tmp_path, small, bundle, capsys):
    """A second run over a running job advises --pause (with --store-columns, when given):
    typed back, it pauses the job; the note after --resume with no job running names the run
    that walks on: typed back, it finishes the backfill; after a finalize that dropped the old
    vectors, a rollback is refused saying so and advising --overwrite, which is accepted."""
    uri = make_store("lance", tmp_path, small)
    vec = gallery_vectors(tmp_path / "v.parquet", small)
    cols = "id=item_id,label=label,old=old"
    job = ["--store", uri, "--store-columns", cols, "--new-model", bundle, "--new-vectors", vec,
           "--batch-size", "4"]  # fmt: skip
    thread, done = job_running(job, uri)
    rc, _, err = run(capsys, *job)
    assert rc == 3 and "already running" in err, err
    advice = _advised(err, "pause it (raycompat backfill-store ")
    assert advice == ["--store", uri, "--store-columns", cols, "--pause"], advice
    rc, out, err = run(capsys, *advice)
    assert rc == 0 and last_json(out)["command"]["state"] == "paused", err
    thread.join(timeout=30)
    rc, _, err = run(capsys, "--store", uri, "--store-columns", cols, "--resume")
    assert rc == 0 and "note: no backfill-store job runs" in err, err
    rc, _, err2 = run(capsys, *_advised(err, "(raycompat backfill-store "))
    assert rc == 0, err2
    assert status(capsys, uri)["state"] == "done"
    assert run(capsys, "--store", uri, "--finalize")[0] == 0
    rc, _, err = run(capsys, "--store", uri, "--rollback")
    assert rc == 3 and "the store dropped the old vectors" in err and "--overwrite" in err, err
    rc, _, err = run(capsys, *job, "--overwrite", "--until", "8")
    assert rc == 0, err
    assert status(capsys, uri)["position"] == 8
