"""quickstart job: see `python jobs/quickstart.py --help`. Runs embedded or under `ray job submit`."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from raycompat.cli import quickstart_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(quickstart_main())
