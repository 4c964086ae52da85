"""``python -m carpool.tools.bench``: the same as ``carpool bench``, through the same entry point (its
errors, Ctrl-C and SIGTERM end it as they end ``carpool bench``)."""

import sys

from carpool.cli import main

sys.exit(main(["bench", *sys.argv[1:]]))
