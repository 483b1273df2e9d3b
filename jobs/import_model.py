"""Import a model you already have as a model bundle (`raycompat import-model`).

See `python jobs/import_model.py --help`."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from raycompat.import_model import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
