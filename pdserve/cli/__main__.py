"""`python -m pdserve.cli` (how `pdserve launch` starts its processes)."""

import sys

from pdserve.cli import main

sys.exit(main())
