"""backfill_store job: upgrade a LanceDB table or Milvus collection in place with a new model
(policy order, canary guards, pause / resume / rollback / finalize through the store's own
record). See `python jobs/backfill_store.py --help` and docs/stores.md ("The backfill job").
Runs embedded or under `ray job submit`.

python jobs/backfill_store.py --store lance:///data/db/gallery --new-model models/bct \\
    --new-vectors bct_gallery/ --policy uncertainty:margin --canary canary.json --rate 2000
python jobs/backfill_store.py --store lance:///data/db/gallery --status
python jobs/backfill_store.py --store lance:///data/db/gallery --rollback --to 4000
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from raycompat.backfill_store import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
