"""The old-old reference computed once: stored beside the results, reused by a later run on the
same inputs (in memory and on Ray), another key for any changed input, a damaged file named
and recomputed."""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
from serving_helpers import labelled_embeddings
from simulator_inputs import assert_same, write_dataset

from raycompat.embeddings.dataset import ParquetGallery
from raycompat.embeddings.gallery import load_parquet
from raycompat.simulator.memory_engine import memory_reference_key, simulate_backfill
from raycompat.simulator.ray_engine import simulate_backfill_dataset
from raycompat.simulator.reference_cache import ReferenceCache

POLICIES, MODES = ("random", "sequential"), ("compatible", "cold")


def _same_report(a, b) -> None:
    """Every number of two results equal (their stats aside: timings, the cache's outcome)."""
    da, db = a.to_dict(), b.to_dict()
    da.pop("stats"), db.pop("stats")
    assert json.dumps(da, default=str) == json.dumps(db, default=str)


def _sides_scored(result) -> list[str]:
    return sorted(result.stats["engine"]["sides"])


def test_a_second_run_reuses_the_reference_and_gives_the_same_report(tmp_path):
    data = labelled_embeddings()
    plain = simulate_backfill(data, POLICIES, MODES, k=10, bootstrap=None)
    said: list[str] = []
    cache = ReferenceCache(str(tmp_path / "cache"), said.append)
    first = simulate_backfill(data, POLICIES, MODES, k=10, reference_cache=cache)
    second = simulate_backfill(data, POLICIES, MODES, k=10, reference_cache=cache)
    assert first.stats["reference_cache"]["state"] == "miss"
    assert second.stats["reference_cache"]["state"] == "hit"
    path = second.stats["reference_cache"]["path"]
    assert os.path.dirname(path) == str(tmp_path / "cache")
    assert said == [f"old-old reference stored in {path}", f"old-old reference reused from {path}"]
    assert "old-old" in _sides_scored(first) and "old-old" not in _sides_scored(second)
    _same_report(plain, first)
    _same_report(plain, second)
    assert second.references["old-old"] == plain.references["old-old"]


def test_any_changed_input_gives_another_key():
    data = labelled_embeddings()
    base = memory_reference_key(data, 10)
    assert memory_reference_key(labelled_embeddings(), 10) == base  # same content, same key
    old = data.gallery_old.copy()
    old[5, 0] = np.nextafter(old[5, 0], np.float32(np.inf))  # one ulp of one value
    labels = data.gallery_labels.copy()
    labels[[0, 1]] = labels[[1, 0]] if labels[0] != labels[1] else (labels[0] + 1, labels[1])
    query_old = data.query_old.copy()
    query_old[0] *= 2
    changed = [
        dataclasses.replace(data, gallery_old=old),
        dataclasses.replace(data, gallery_labels=labels),
        dataclasses.replace(data, query_old=query_old),
        dataclasses.replace(data, query_labels=np.roll(data.query_labels, 1)),
    ]
    keys = [memory_reference_key(d, 10) for d in changed] + [memory_reference_key(data, 11)]
    assert base not in keys and len(set(keys)) == len(keys)


def test_a_damaged_cache_file_is_named_recomputed_and_replaced(tmp_path):
    data = labelled_embeddings()
    cache = ReferenceCache(str(tmp_path / "cache"))
    plain = simulate_backfill(data, POLICIES, MODES, k=10, reference_cache=cache)
    path = plain.stats["reference_cache"]["path"]
    good = open(path, "rb").read()
    damages = {
        "truncated": good[: len(good) // 2],
        "bytes changed": good[:200] + bytes(b ^ 0xFF for b in good[200:260]) + good[260:],
        "not a cache file": b"hello",
    }
    for what, content in damages.items():
        with open(path, "wb") as fh:
            fh.write(content)
        said: list[str] = []
        again = simulate_backfill(
            data,
            POLICIES,
            MODES,
            k=10,
            reference_cache=ReferenceCache(cache.directory, said.append),
        )
        assert again.stats["reference_cache"]["state"] == "damaged", what
        assert said[0].startswith(f"reference cache {path} is damaged ("), (what, said)
        assert said[0].endswith("recomputing the old-old reference"), said
        assert "old-old" in _sides_scored(again), what
        _same_report(plain, again)
        hit = simulate_backfill(data, POLICIES, MODES, k=10, reference_cache=cache)
        assert hit.stats["reference_cache"]["state"] == "hit", what  # the file was replaced
    # another run's reference under this key's name: its recorded key differs
    other = dataclasses.replace(data, query_labels=np.roll(data.query_labels, 1))
    moved = simulate_backfill(other, POLICIES, MODES, k=10, reference_cache=cache)
    os.replace(moved.stats["reference_cache"]["path"], path)
    said = []
    again = simulate_backfill(
        data, POLICIES, MODES, k=10, reference_cache=ReferenceCache(cache.directory, said.append)
    )
    assert again.stats["reference_cache"]["state"] == "damaged"
    assert "its recorded key is not the key of these inputs" in said[0], said
    _same_report(plain, again)


def test_the_distributed_engine_reuses_its_reference(tmp_path, ray_cluster):
    root = write_dataset(tmp_path / "a", adapted=False, stored_uncertainty=False)
    mem = simulate_backfill(load_parquet(root), POLICIES, MODES, k=10)
    cache = ReferenceCache(str(tmp_path / "cache"))
    runs = [
        simulate_backfill_dataset(
            ParquetGallery.open(root), POLICIES, MODES, k=10, reference_cache=cache
        )  # fmt: skip
        for _ in range(2)
    ]
    assert [r.stats["reference_cache"]["state"] for r in runs] == ["miss", "hit"]
    for r in runs:
        assert_same(mem, r)
    assert "reference key" in runs[1].stats["distributed"]["steps"]
    # the same content written again under another path: the same key
    other = write_dataset(tmp_path / "b", adapted=False, stored_uncertainty=False)
    again = simulate_backfill_dataset(
        ParquetGallery.open(other), POLICIES, MODES, k=10, reference_cache=cache
    )
    assert again.stats["reference_cache"]["state"] == "hit"
    assert_same(mem, again)


def test_the_job_keeps_the_cache_beside_its_reports(tmp_path):
    """Two simulate-backfill runs into sibling folders: the second reuses the first's
    reference from ``reference_cache`` beside them; ``--reference-cache none`` stores nothing."""
    from simulator_inputs import run_job, write_parquet

    emb = write_parquet(tmp_path / "emb.parquet", adapted=False)
    flags = ["--embeddings", emb, "--items-per-s-per-gpu", 100, "--k", 10, "--no-plots"]
    reports = {}
    for run in ("bct", "ract"):
        r = run_job(*flags, "--out", tmp_path / "runs" / run)
        assert r.returncode == 0, r.stderr
        reports[run] = json.loads((tmp_path / "runs" / run / "curves.json").read_text())
    cache = tmp_path / "runs" / "reference_cache"
    (path,) = cache.glob("old-old-*.npz")
    assert f"old-old reference reused from {path}" in r.stderr
    assert reports["ract"]["stats"]["reference_cache"] == {"state": "hit", "path": str(path)}
    assert reports["bct"]["references"] == reports["ract"]["references"]
    assert reports["bct"]["rows"] == reports["ract"]["rows"]
    off = tmp_path / "off"
    r = run_job(*flags, "--reference-cache", "none", "--out", off / "run")
    assert r.returncode == 0, r.stderr
    assert "reference_cache" not in json.loads((off / "run" / "curves.json").read_text())["stats"]
    assert sorted(p.name for p in off.iterdir()) == ["run"]
