"""`python -m specstand.cli`: the same command as `specstand` (torchrun launches training this way)."""

import sys

from specstand.cli import main

sys.exit(main())
