"""Live sharded index on Ray Serve with hot-refresh backfill (docs/architecture.md, "Serving").

One module per concept:

* :mod:`.placement`      -- item id -> shard (fixed 64-bit hash)
* :mod:`.served_store`   -- the store the index serves (the gallery's one home): its URI,
  created from the gallery on the first start
* :mod:`.shard_cache`    -- a shard's cache of the store: one representation per item, an
  index per representation, following the store's commits
* :mod:`.rep_index`      -- one representation's vectors and search index (docs/indexes.md)
* :mod:`.identity`       -- the fingerprint of the model behind every stored vector
* :mod:`.batching`       -- concurrent searches gathered into one search call
* :mod:`.shard`          -- the shard Serve deployment (loads its rows from the store)
* :mod:`.scoring`        -- query vectors per representation (the simulator's score sides)
* :mod:`.gallery_source` -- gallery vectors: embeddings parquet, pipeline output, synthetic
* :mod:`.orders`         -- the simulator's backfill policies as item-id orders
* :mod:`.embedder_pool`  -- Ray actors holding the new model; image decoding
* :mod:`.backfill_controller` -- the backfill controller deployment (rate, pause/resume,
  its record in the store; the store's one writer, upserts grouped into one commit)
* :mod:`.upgrade`, :mod:`.canary_gate` -- the guarded upgrade: canary and guards (kept in the
  store), rollback, finalize, the stale listing
* :mod:`.schemas`, :mod:`.router`, :mod:`.errors`, :mod:`.auth`, :mod:`.metrics` -- the HTTP API
* :mod:`.config`, :mod:`.plan` -- options, and the frozen plan every deployment receives
  (options + dims, item count, model versions derived once)
* :mod:`.app`, :mod:`.client` -- assembling/starting, an HTTP client
* :mod:`.live_eval`      -- mAP / NFR of a live gallery through HTTP (offline == online)
"""
