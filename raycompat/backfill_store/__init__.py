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
store refused a write, named); 2 bad input (one ``error:`` line naming the column, or the
``--store`` that cannot be reached, opened or written); 3 refused by the state machine (the live
index's 409, one ``error:`` line); 4 paused by a canary guard.
"""

from raycompat.backfill_store.commands import main
from raycompat.backfill_store.options import EXIT, BackfillStoreOptions, build_parser

__all__ = ["EXIT", "BackfillStoreOptions", "build_parser", "main"]
