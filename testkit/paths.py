"""Where the repository and the tests' data files are, for tests at any depth."""

import os

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEST_DATA = os.path.join(REPO_ROOT, "tests", "data")
