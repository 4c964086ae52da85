"""``python -m carpool.tools.status``: the same as ``carpool status``."""

import sys

from carpool.tools.status.cli import main

sys.exit(main())
