"""Train the old model (`raycompat train-old`).

See `python jobs/train_old.py --help`; runs embedded or under `ray job submit`."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from raycompat.train.old_job import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
