"""Build a scenario of your images (`raycompat scenario`).

See `python jobs/scenario.py --help`; runs embedded or under `ray job submit`."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from raycompat.scenario_job import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
