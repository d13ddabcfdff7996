"""`python -m loadtest ...` runs `pdmesh loadtest ...`."""

import sys

from pdmesh.loadtest.cli import main

sys.exit(main(sys.argv[1:]))
