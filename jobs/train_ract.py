"""Train RACT, and its old model first without --old-model (`raycompat train-ract`).

See `python jobs/train_ract.py --help`; runs embedded or under `ray job submit`."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from raycompat.train.ract_job import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
