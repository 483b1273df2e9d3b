"""plan_upgrade job: which new model, query mode and backfill order, how long, how much, and
how good at every hour, from simulated backfill curves.

    python jobs/plan_upgrade.py --results quickstart_out --items 200000000 --devices 8 \
        --device-kind gpu --items-per-s 2000 --price-per-device-hour 2.5 [--deadline-hours 6] \
        [--budget 100] [--never-below-old] [--max-nfr 0.05] --out plan_out

--results takes simulate-backfill report folders or main-job report folders (comma-separated;
NAME=PATH names a candidate). Writes plan.md, plan.json and PNG plots to --out (see
docs/planning.md). A bad input prints one line naming it and exits with status 2. See `--help`.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from raycompat.planning.job import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
