import sys

from carpool.cli import main

sys.exit(main())
