"""`python -m pdserve.cli` (how `pdserve launch` starts its processes)."""

import sys

from pdserve.lifetime import adopt

adopt()  # started by a launcher: die with it (pdserve/lifetime.py)

from pdserve.cli import main  # noqa: E402

sys.exit(main())
