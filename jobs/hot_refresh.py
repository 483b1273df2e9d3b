"""hot_refresh job: serve a gallery on Ray Serve, backfill it live under one policy, and compare
mAP / NFR measured through HTTP with the simulator. See `python jobs/hot_refresh.py --help` and
raycompat/hot_refresh.py."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from raycompat.hot_refresh import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
