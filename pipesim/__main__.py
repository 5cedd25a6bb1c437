"""``python -m pipesim`` is the ``pipesim`` command."""

import sys

from pipesim.cli import main

sys.exit(main())
