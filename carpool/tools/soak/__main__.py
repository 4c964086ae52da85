"""``python -m carpool.tools.soak``: the same as ``carpool soak``."""

import sys

from carpool.tools.soak.cli import main

sys.exit(main())
