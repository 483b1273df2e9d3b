"""train job: see `python jobs/train.py --help`. Runs embedded or under `ray job submit`."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from raycompat.cli import train_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(train_main())
