"""``python -m fdcore.supervisor --config FILE.toml [--check]``."""

import sys

from fdcore.supervisor.cli import main

sys.exit(main())
