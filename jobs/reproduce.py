"""reproduce job: the papers' scenarios with every method, paper-shaped tables and a verdict
on each headline claim (see `python jobs/reproduce.py --help`). Runs embedded or under
`ray job submit`."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from raycompat.cli import reproduce_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(reproduce_main())
