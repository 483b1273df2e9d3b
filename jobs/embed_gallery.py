"""embed_gallery job: see `python jobs/embed_gallery.py --help`. Runs embedded or under
`ray job submit`.

python jobs/embed_gallery.py --random-init /tmp/models --items 100000 --out gallery_out
python jobs/embed_gallery.py --old-model M/old --new-model M/dmu --columns old,new,adapted \\
    --uncertainty
python jobs/embed_gallery.py --old-model M/old --new-model M/new --columns new --ids ids.txt \\
    --out batch_7
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from raycompat.pipeline.job import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
