"""The reproduction report (`raycompat reproduce`).

See `python jobs/reproduce.py --help`; runs embedded or under `ray job submit`."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from raycompat.reproduce.job import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
