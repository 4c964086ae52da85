"""``python -m carpool.tools.soak``: the same as ``carpool soak``, through the same entry point (its
errors, Ctrl-C and SIGTERM end it as they end ``carpool soak``)."""

import sys

from carpool.cli import main

sys.exit(main(["soak", *sys.argv[1:]]))
