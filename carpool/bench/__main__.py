"""``python -m carpool.bench``: the same as ``carpool bench``."""

import sys

from carpool.bench.cli import main

sys.exit(main())
