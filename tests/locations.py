"""Where the tests find the checkout: the repository root, its jobs and the tests' data files."""

from __future__ import annotations

import os

#: the checkout's root (this file is ``tests/locations.py``)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: the thin job entry points (``jobs/<job>.py``)
JOBS = os.path.join(REPO, "jobs")
#: data files the tests read (``tests/data``)
TEST_DATA = os.path.join(REPO, "tests", "data")
