"""serve_index job: start the live index (Ray Serve) on a cluster and leave it running.
See `python jobs/serve_index.py --help` and raycompat/serving/job.py."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from raycompat.serving.job import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
