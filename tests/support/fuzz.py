"""How many cases each fuzzer draws: 1,000 in `make test`, PDMESH_FUZZ_EXAMPLES in
`make test-fuzz` (10,000, a CI stage)."""

from __future__ import annotations

import os

EXAMPLES = int(os.environ.get("PDMESH_FUZZ_EXAMPLES", "1000"))
