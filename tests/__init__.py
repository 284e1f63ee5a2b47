"""fdcore's tests, grouped as the package is (ipc/, checkpoint/, core/, models/, server/, tree/ for the actor tree as
a whole); the repository-wide checks (layers, sizes, the environment, logging) at this level."""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
DATA = os.path.join(ROOT, "tests", "data")  # reference outputs and fixtures
