"""``python -m carpool.tools.status``: the same as ``carpool status``, through the same entry point (its
errors, Ctrl-C and SIGTERM end it as they end ``carpool status``)."""

import sys

from carpool.cli import main

sys.exit(main(["status", *sys.argv[1:]]))
