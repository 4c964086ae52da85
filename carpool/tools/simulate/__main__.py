"""``python -m carpool.tools.simulate``: the same as ``carpool simulate``, through the same entry point (its
errors, Ctrl-C and SIGTERM end it as they end ``carpool simulate``)."""

import sys

from carpool.cli import main

sys.exit(main(["simulate", *sys.argv[1:]]))
