"""The backfill-store job's options, exit codes and parser (docs/stores.md, "Options")."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from raycompat.config import add_options, choices, make_parser, option
from raycompat.pipeline.options import MODEL_STAGES
from raycompat.upgrade.canary import CanaryOptions

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
