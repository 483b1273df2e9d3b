"""reshard_index job: move a stopped live index's items to a new number of shards.
See `python jobs/reshard_index.py --help` and raycompat/serving/reshard.py."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from raycompat.serving.reshard import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
