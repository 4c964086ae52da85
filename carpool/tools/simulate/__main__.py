"""``python -m carpool.tools.simulate``: the same as ``carpool simulate``."""

import sys

from carpool.tools.simulate.cli import main

sys.exit(main())
