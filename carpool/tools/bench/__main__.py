"""``python -m carpool.tools.bench``: the same as ``carpool bench``."""

import sys

from carpool.tools.bench.cli import main

sys.exit(main())
