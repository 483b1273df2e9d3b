"""Live sharded index on Ray Serve with hot-refresh backfill (docs/architecture.md, "Serving").

One module per concept:

* :mod:`.placement`      -- item id -> shard (fixed 64-bit hash)
* :mod:`.state`          -- a shard's items: one representation each, an index per
  representation, atomic upserts
* :mod:`.rep_index`      -- one representation's vectors and search index (docs/indexes.md)
* :mod:`.durability`     -- snapshot + append-only log of upserts, rollbacks, finalizes (no pickle)
* :mod:`.shard_content`, :mod:`.kept` -- a shard's content (vectors, their models, the old
  vectors kept for a rollback) as one value; the kept vectors, in memory or memory-mapped
* :mod:`.identity`       -- the fingerprint of the model behind every stored vector
* :mod:`.shared_log`     -- the log shared by a shard's replicas: locks, rotation, catching up
* :mod:`.batching`       -- concurrent searches gathered into one search call
* :mod:`.shard`          -- the shard Serve deployment (recovers from disk on restart)
* :mod:`.scoring`        -- query vectors per representation (the simulator's score sides)
* :mod:`.gallery_source` -- gallery vectors: embeddings parquet, pipeline output, synthetic
* :mod:`.orders`         -- the simulator's backfill policies as item-id orders
* :mod:`.embedder_pool`  -- Ray actors holding the new model; image decoding
* :mod:`.backfill`       -- the backfill controller deployment (rate, pause/resume, checkpoints)
* :mod:`.upgrade`, :mod:`.canary_gate` -- the guarded upgrade: canary and guards, rollback,
  finalize, the stale listing
* :mod:`.schemas`, :mod:`.router`, :mod:`.errors`, :mod:`.auth`, :mod:`.metrics` -- the HTTP API
* :mod:`.config`, :mod:`.plan` -- options, and the frozen plan every deployment receives
  (options + dims, item count, model versions derived once)
* :mod:`.app`, :mod:`.client` -- assembling/starting, an HTTP client
* :mod:`.live_eval`      -- mAP / NFR of a live gallery through HTTP (offline == online)
"""
